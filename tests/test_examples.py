"""Every example plans, renders through the CLI, and every object validates
against the official Kubernetes schemas (strict) of the oldest and newest
supported versions; every pod template meets Pod Security `restricted` and
NetworkPolicies isolate every example."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from conftest import EXAMPLES
from pod_security import pod_templates, violations

from tensorfleet import contract
from tensorfleet.cli import main

K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
EXAMPLE_IDS = [p.name for p in EXAMPLES]


def _render(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> list[dict]:
    assert main(["render", "-f", str(path), *extra]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return [doc for doc in yaml.safe_load_all(captured.out) if doc is not None]


def test_examples_cover_the_required_shapes() -> None:
    docs = {p.name: yaml.safe_load(p.read_text()) for p in EXAMPLES}
    specs = list(docs.values())
    assert any(s["spec"].get("parallelism", {}).get("tensor") == 1 and "8B" in s["spec"]["model"]["name"] for s in specs)
    assert any("70B" in s["spec"]["model"]["name"] and s["spec"].get("parallelism", {}).get("tensor") == 4
               and s["spec"]["accelerator"]["type"] == "A100-80GB" for s in specs)
    assert any("405B" in s["spec"]["model"]["name"] and s["spec"].get("parallelism") == {"tensor": 8, "pipeline": 2}
               and s["spec"]["accelerator"]["type"] == "H100-80GB" for s in specs)
    assert any("Mixtral" in s["spec"]["model"]["name"] for s in specs)
    assert any(s["spec"].get("engine", {}).get("kind") == "simulator" for s in specs)


@pytest.mark.parametrize("path", EXAMPLES, ids=EXAMPLE_IDS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_examples_validate_strictly(path: Path, version: str, capsys: pytest.CaptureFixture[str]) -> None:
    objects = _render(path, capsys)
    assert objects, "nothing rendered"
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=EXAMPLE_IDS)
def test_rendered_examples_meet_pod_security_restricted(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    templates = pod_templates(_render(path, capsys))
    assert len(templates) >= 2, "engine StatefulSets and the router Deployment"
    for name, pod, pod_annotations in templates:
        assert violations(pod, pod_annotations) == [], f"{path.name}: {name}"


@pytest.mark.parametrize("path", EXAMPLES, ids=EXAMPLE_IDS)
def test_rendered_examples_are_isolated(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    objects = _render(path, capsys)
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}
    assert set(policies) == {f"{name}-engine", f"{name}-router"}
    selected = [p["spec"]["podSelector"]["matchLabels"] for p in policies.values()]
    for template in (o["spec"]["template"] for o in objects if o["kind"] in ("StatefulSet", "Deployment")):
        labels = template["metadata"]["labels"]
        assert sum(all(labels.get(k) == v for k, v in s.items()) for s in selected) == 1, "each pod under one policy"


@pytest.mark.parametrize("path", EXAMPLES, ids=EXAMPLE_IDS)
def test_plan_json_is_one_object(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", str(path), "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # vLLM's CPU backend (accelerator CPU) takes no GPU.
    gpus = 0 if plan["accelerator"] == contract.CPU_ACCELERATOR else plan["tensor"] * plan["pipeline"]
    assert plan["gpusPerReplica"] == gpus
    assert plan["kvCacheTokens"] >= plan["maxModelLen"]
    assert plan["totalGPUs"] == plan["replicas"] * plan["gpusPerReplica"]


def test_render_namespace_and_standalone(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    source = yaml.safe_load((EXAMPLES[0]).read_text())
    source["metadata"]["uid"] = "0b4f3c3e-1d6a-4c1e-9a55-1f0c2f1e9d01"
    path = tmp_path / "with-uid.yaml"
    path.write_text(yaml.safe_dump(source))

    owned = _render(path, capsys, "--namespace", "team-a")
    assert {o["metadata"]["namespace"] for o in owned} == {"team-a"}
    for obj in owned:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "name": source["metadata"]["name"],
                       "uid": source["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}

    # --standalone is gone: it only ever mattered for input carrying a uid, and the objects need the
    # operator whatever their ownerReferences. Without the uid, render writes none.
    assert main(["render", "-f", str(path), "--standalone"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("error: --standalone was removed: ") and "metadata.uid" in captured.err
    del source["metadata"]["uid"]
    path.write_text(yaml.safe_dump(source))
    unowned = _render(path, capsys)
    assert all("ownerReferences" not in o["metadata"] for o in unowned)
    assert {o["metadata"]["namespace"] for o in unowned} == {source["metadata"]["namespace"]}


def test_render_reads_stdin_and_multiple_documents(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    text = "\n---\n".join(p.read_text() for p in EXAMPLES[:2])
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert main(["render", "-f", "-"]) == 0
    objects = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    instances = {o["metadata"]["labels"][contract.LABEL_INSTANCE] for o in objects}
    assert len(instances) == 2


@pytest.mark.parametrize("path", EXAMPLES, ids=EXAMPLE_IDS)
def test_example_header_says_how_to_create_what_it_needs(path: Path) -> None:
    """The header comment gives the commands for the namespace and the Secret the spec names, then applies it."""
    text = path.read_text()
    header = text[: text.index("apiVersion:")]
    doc = yaml.safe_load(text)
    namespace = doc["metadata"]["namespace"]
    if namespace != "default":
        assert f"kubectl create namespace {namespace}\n" in header
    ref = doc["spec"].get("hfTokenSecretRef")
    if ref:
        key = ref.get("key", "token")
        assert f"kubectl create secret generic {ref['name']} -n {namespace} --from-literal={key}=" in header
    assert f"kubectl apply -f examples/{path.name}\n" in header
