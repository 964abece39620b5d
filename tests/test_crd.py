"""The CRD: generated from the models, checked in, structural, valid, and a schema the examples pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import ROOT, example_documents, isvc_doc, schema_nodes, strict_schema

from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.api.crd import crd
from tensorfleet.cli import main
from tensorfleet.engine_settings import WORKER_ENV_VARS

CRD_FILE = ROOT / "crds" / "tensorfleet.dev_inferenceservices.yaml"
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def _schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_checked_in_crd_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    printed = capsys.readouterr().out
    assert CRD_FILE.read_text() == printed, "crds/ is stale: run `tensorfleet crd > crds/tensorfleet.dev_inferenceservices.yaml`"
    assert len(list(yaml.safe_load_all(printed))) == 1


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_validates_against_kubernetes_schema(version: str) -> None:
    kubernetes_validate.validate(crd(), version, strict=True)


def test_crd_is_structural() -> None:
    """The rules of a structural schema (Kubernetes docs, 'Specifying a structural schema')."""
    for path, node in schema_nodes(_schema()):
        assert "$ref" not in node and "definitions" not in node and "$defs" not in node, path
        for forbidden in ("anyOf", "oneOf", "allOf", "not", "const", "title"):
            assert forbidden not in node, f"{path}: {forbidden}"
        if not node.get("x-kubernetes-preserve-unknown-fields") and not node.get("x-kubernetes-int-or-string"):
            assert "type" in node, f"{path}: untyped node"
        if "properties" in node:
            assert "additionalProperties" not in node, f"{path}: additionalProperties beside properties"
        if "additionalProperties" in node:
            assert isinstance(node["additionalProperties"], dict), f"{path}: boolean additionalProperties"
        if node.get("type") == "array":
            assert isinstance(node.get("items"), dict), f"{path}: array without one items schema"
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(key, False), bool), f"{path}: {key} must be boolean in OpenAPI v3.0"
    assert _schema()["properties"]["metadata"] == {"type": "object"}


def test_every_spec_and_status_field_is_described() -> None:
    schema = _schema()
    for root in ("spec", "status"):
        for path, node in schema_nodes(schema["properties"][root], root):
            if path.endswith(("[]", "}")):
                continue
            assert node.get("description"), f"{path} has no description"


def test_crd_names_subresources_and_columns() -> None:
    spec = crd()["spec"]
    assert spec["group"] == "tensorfleet.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["shortNames"] == ["infsvc"]
    assert "tensorfleet" in spec["names"]["categories"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    for name in ("Ready", "Reason", "Replicas", "GPU", "TP", "PP", "Endpoint", "Age"):
        assert name in columns
    assert columns["TP"] == ".status.plan.tensor" and columns["PP"] == ".status.plan.pipeline"
    # Why not Ready, in one look: the Ready condition's reason, next to its status (a default column).
    assert columns["Reason"] == '.status.conditions[?(@.type=="Ready")].reason'
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names.index("Reason") == names.index("Ready") + 1
    assert "priority" not in version["additionalPrinterColumns"][names.index("Reason")]


def test_crd_sets_only_the_replicas_and_the_unobserved_status_defaults() -> None:
    """Defaults stay in the models so stored objects keep what users wrote. Two exceptions: spec.replicas,
    because the HPA reads it through /scale and a missing value disables scaling; and status.observedGeneration 0
    until the operator's first write, because kstatus (Flux's health checks) calls an object with no status
    Current."""
    defaults = {path: node["default"] for path, node in schema_nodes(_schema()) if "default" in node}
    assert defaults == {".spec.replicas": 1, ".status": {"observedGeneration": 0}}


def _cel_rules(node: dict[str, Any], value: Any) -> Iterator[tuple[str, Any]]:
    """(rule, value it applies to) for every x-kubernetes-validations rule reachable in `value`."""
    for rule in node.get("x-kubernetes-validations", []):
        yield rule["rule"], value
    if isinstance(value, dict):
        for name, child in node.get("properties", {}).items():
            if name in value:
                yield from _cel_rules(child, value[name])
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            yield from _cel_rules(node["items"], item)


def _cel_ok(document: dict[str, Any]) -> bool:
    env = celpy.Environment()
    for rule, value in _cel_rules(_schema(), document):
        program = env.program(env.compile(rule))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            return False
    return True


@pytest.mark.parametrize("name,document", example_documents(), ids=[n for n, _ in example_documents()])
def test_examples_validate_against_the_crd_schema(name: str, document: dict[str, Any]) -> None:
    jsonschema.validate(document, strict_schema(_schema()))
    assert _cel_ok(document), name


def test_schema_rejects_what_models_reject() -> None:
    strict = strict_schema(_schema())
    bad = [
        isvc_doc({"replicas": -1}),
        isvc_doc({"model": {"name": "m", "nmae": "typo"}}),
        isvc_doc({"engine": {"args": "--enable-prefix-caching --foo"}}),
        isvc_doc({"engine": {"gpuMemoryUtilization": 1.5}}),
        isvc_doc({"router": {"strategy": "random"}}),
        isvc_doc({"cache": {"size": "lots"}}),
        isvc_doc({"networkPolicy": {"clientNamespaces": ["Ingress_NGINX"]}}),
        isvc_doc({"networkPolicy": {"enabled": "yes"}}),
        isvc_doc({"networkPolicy": {"monitoringNamespace": ["monitoring"]}}),
    ]
    for document in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(document, strict)


def test_cel_rules_reject_cross_field_mistakes() -> None:
    assert _cel_ok(isvc_doc({"autoscaling": {"minReplicas": 2, "maxReplicas": 4}}))
    assert not _cel_ok(isvc_doc({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}))
    assert not _cel_ok(isvc_doc({"engine": {"env": [{"name": "TF_MODEL", "value": "x"}]}}))
    assert _cel_ok(isvc_doc({"engine": {"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]}}))
    assert not _cel_ok(isvc_doc(name="n" * 44))
    assert _cel_ok(isvc_doc(name="n" * 43))


# Every CEL rule of the CRD, by the schema node that carries it, with documents on both sides
# of it. `tensorfleet plan`, the webhook and the operator evaluate no CEL: the models carry a
# twin of each rule, and must refuse exactly the documents the rule refuses. A rule added to the
# CRD without cases here fails test_every_cel_rule_has_a_model_twin.
CEL_TWINS: dict[str, list[dict[str, Any]]] = {
    "": [isvc_doc(name="n" * 43), isvc_doc(name="n" * 44), isvc_doc(name="n")],
    ".spec.autoscaling": [
        isvc_doc({"autoscaling": {"minReplicas": 2, "maxReplicas": 4}}),
        isvc_doc({"autoscaling": {"minReplicas": 4, "maxReplicas": 4}}),
        isvc_doc({"autoscaling": {"minReplicas": 5, "maxReplicas": 4}}),
        isvc_doc({"autoscaling": {"maxReplicas": 1}}),
    ],
    ".spec.engine.env": [
        *(isvc_doc({"engine": {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": name, "value": "x"}]}})
          for name in WORKER_ENV_VARS),
        isvc_doc({"engine": {"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]}}),
        isvc_doc({"engine": {"env": [{"name": "TF_OTHER", "value": "1"}]}}),
    ],
}


def _models_accept(document: dict[str, Any]) -> bool:
    try:
        load_inference_service(document, strict=True)
    except SpecError:
        return False
    return True


def test_every_cel_rule_has_a_model_twin() -> None:
    with_rules = {path for path, node in schema_nodes(_schema()) if node.get("x-kubernetes-validations")}
    assert with_rules == set(CEL_TWINS), "a CEL rule without a twin in the models (or cases here)"
    for path, documents in CEL_TWINS.items():
        verdicts = []
        for document in documents:
            cel = _cel_ok(document)
            assert _models_accept(document) == cel, (path, document["metadata"], document["spec"])
            verdicts.append(cel)
        assert set(verdicts) == {True, False}, f"{path}: cases on both sides of the rule"

