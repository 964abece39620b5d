"""Shared fixtures: example manifests, a builder for InferenceService documents, and CRD schema walkers."""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

# `tensorfleet plan` reads a model's config.json from the Hugging Face Hub, else the local cache
# (tensorfleet.modelinfo). The suite reaches neither the real Hub nor a developer's cache, in this
# process and the ones it starts; the tests of that path serve their own Hub (tests/hub_server.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="tensorfleet-test-hf-cache-")
atexit.register(shutil.rmtree, os.environ["HF_HUB_CACHE"], True)


def schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from schema_nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{}}")


def strict_schema(node: dict[str, Any]) -> dict[str, Any]:
    """The schema as `kubectl apply --validate=strict` applies it: unknown fields are errors."""
    node = copy.deepcopy(node)
    for _, child in schema_nodes(node):
        if child.get("type") == "object" and "properties" in child and not child.get("x-kubernetes-preserve-unknown-fields"):
            child["additionalProperties"] = False
    return node


def example_documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def isvc_doc(spec: dict[str, Any] | None = None, name: str = "demo", **metadata: Any) -> dict[str, Any]:
    """A minimal valid InferenceService document with `spec` merged over it."""
    base: dict[str, Any] = {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
        "accelerator": {"type": "H100-80GB"},
    }
    for key, value in (spec or {}).items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return {
        "apiVersion": "tensorfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, **metadata},
        "spec": copy.deepcopy(base),
    }


def sim_doc(name: str = "demo", **spec: Any) -> dict[str, Any]:
    """A simulator InferenceService on L4 (2 groups, 1 router) with `spec` merged over it, for operator tests."""
    base: dict[str, Any] = {"engine": {"kind": "simulator"}, "parallelism": {"tensor": 1},
                            "accelerator": {"type": "L4"}, "replicas": 2, "router": {"replicas": 1}}
    for key, value in spec.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return isvc_doc(base, name=name)


def rollout_completed(c: Any, name: str = "demo") -> bool:
    """Whether the operator posted a RolloutComplete event for the InferenceService's current generation."""
    generation = c.isvc(name)["metadata"]["generation"]
    return any(e["reason"] == "RolloutComplete" and e["message"].startswith(f"generation {generation}:")
               for e in c.events(name))


@pytest.fixture(params=[name for name, _ in example_documents()] or ["<none>"])
def example(request: pytest.FixtureRequest) -> dict[str, Any]:
    docs = dict(example_documents())
    assert docs, "examples/ holds no manifests"
    return copy.deepcopy(docs[request.param])


class ReadyGate:
    """Pods become Ready only once the test opens them (a model load that takes a while)."""

    def __init__(self) -> None:
        self.opened: set[str] = set()
        self.auto = True

    def __call__(self, pod: dict[str, Any]) -> bool:
        if self.auto:
            self.opened.add(pod["metadata"]["uid"])
        return pod["metadata"]["uid"] in self.opened
