"""Generate the InferenceService CRD from the pydantic models: `structural()` turns pydantic's JSON Schema into the
structural schema Kubernetes requires (failing here on what it cannot translate), and the schema carries no defaults
but `spec.replicas`. Design: docs/api.md#generating-the-crd."""

from __future__ import annotations

from typing import Any

from tensorfleet import contract
from tensorfleet.api.base import MAX_NAME_LENGTH
from tensorfleet.api.models import InferenceServiceSpec
from tensorfleet.api.status import InferenceServiceStatus
from tensorfleet.engine_settings import WORKER_ENV_VARS

# Keys of a Kubernetes JSONSchemaProps that this generator may emit.
_KEEP = {
    "type", "format", "description", "properties", "required", "items", "additionalProperties",
    "enum", "pattern", "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems",
}
# Defaults are dropped: the API server would write them into every stored object (spec_schema adds back the one
# default the HPA needs).
_DROP = {"title", "default", "$defs", "examples"}


class SchemaError(ValueError):
    pass


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            merged = {**_resolve(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}
            return merged
        return {k: _resolve(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    return node


def _structural(node: dict[str, Any], path: str) -> dict[str, Any]:
    node = dict(node)
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise SchemaError(f"{path}: a union of several types cannot be a structural schema")
        node = {**options[0], **node}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key.startswith("x-kubernetes-"):
            out[key] = value
        elif key == "properties":
            out[key] = {name: _structural(child, f"{path}.{name}") for name, child in value.items()}
        elif key == "items":
            out[key] = _structural(value, f"{path}[]")
        elif key == "additionalProperties":
            if isinstance(value, dict) and "properties" not in node:
                out[key] = _structural(value, f"{path}{{}}")
            # `false` (extra=forbid) and `true` (free-form maps) have no structural
            # form: unknown fields are pruned by the API server, and free-form
            # maps carry x-kubernetes-preserve-unknown-fields instead.
        elif key in _KEEP:
            out[key] = value
        else:
            raise SchemaError(f"{path}: JSON Schema keyword {key!r} has no Kubernetes equivalent")
    if "type" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        raise SchemaError(f"{path}: every structural schema node needs a type")
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("additionalProperties", None)
    return out


def structural(schema: dict[str, Any], path: str = "") -> dict[str, Any]:
    """Translate a pydantic JSON Schema into a Kubernetes structural schema: every node typed, everything inlined,
    no `anyOf` around types, `additionalProperties` never beside `properties`; SchemaError for what it cannot."""
    defs = schema.get("$defs", {})
    return _structural(_resolve({k: v for k, v in schema.items() if k != "$defs"}, defs), path)


def _set(schema: dict[str, Any], dotted: str, **extra: Any) -> None:
    node = schema
    for part in dotted.split("."):
        node = node["items"] if part == "[]" else node["properties"][part]
    node.update(extra)


def spec_schema() -> dict[str, Any]:
    schema = structural(InferenceServiceSpec.model_json_schema(by_alias=True), "spec")
    schema["description"] = "Desired state: the model, engine, parallel layout, GPUs, scaling and routing."
    # The one default in the schema: the HPA reads spec.replicas through /scale
    # and treats a missing (0) value as "scaling disabled", so the API server
    # must write one even when a GitOps manifest leaves it out.
    _set(schema, "replicas", default=1)
    _set(schema, "autoscaling", **{"x-kubernetes-validations": [{
        "rule": "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
        "message": "minReplicas must not be greater than maxReplicas",
    }]})
    _set(schema, "engine.env", **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    _set(schema, "engine.args", **{"x-kubernetes-list-type": "atomic"})
    reserved = ", ".join(f"'{name}'" for name in WORKER_ENV_VARS)
    _set(schema, "engine.env", **{"x-kubernetes-validations": [{
        "rule": f"self.all(e, !(e.name in [{reserved}]))",
        "message": "TF_* variables are set by the operator and cannot be overridden",
    }]})
    return schema


def status_schema() -> dict[str, Any]:
    schema = structural(InferenceServiceStatus.model_json_schema(by_alias=True), "status")
    schema["description"] = "Observed state, written by the operator."
    # Before the operator's first write the API server shows observedGeneration 0 (defaulted on read), so kstatus
    # (Flux's health checks) sees a generation not yet observed, InProgress, instead of a status-less object it
    # would call Current the moment it is applied.
    schema["default"] = {"observedGeneration": 0}
    _set(schema, "conditions", **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    return schema


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
     "description": "Why Ready is what it is: Serving, or the worst pod's cause (ImagePullBackOff, Unschedulable, ...)"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas", "description": "Model replicas (groups)"},
    {"name": "Available", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Groups whose every pod is ready"},
    {"name": "GPU", "type": "string", "jsonPath": ".spec.accelerator.type"},
    {"name": "TP", "type": "integer", "jsonPath": ".status.plan.tensor", "description": "Tensor-parallel size in use"},
    {"name": "PP", "type": "integer", "jsonPath": ".status.plan.pipeline", "description": "Pipeline-parallel size in use"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "priority": 1},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object for InferenceService."""
    root = {
        "type": "object",
        "description": "An LLM served by vLLM on a GPU fleet, with a load-aware router and autoscaling.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "Versioned schema of this object."},
            "kind": {"type": "string", "description": "Type of this object."},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": [{
            "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
            "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters so generated pod and revision names stay valid",
        }],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": contract.CRD_NAME,
            "labels": {contract.LABEL_NAME: contract.APP_NAME, contract.LABEL_MANAGED_BY: "tensorfleet-crd-generator"},
        },
        "spec": {
            "group": contract.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": contract.KIND,
                "listKind": f"{contract.KIND}List",
                "plural": contract.PLURAL,
                "singular": contract.SINGULAR,
                "shortNames": list(contract.SHORT_NAMES),
                "categories": list(contract.CATEGORIES),
            },
            "versions": [{
                "name": contract.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": root},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }
