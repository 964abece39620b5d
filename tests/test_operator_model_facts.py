"""The operator reads a model's facts from the Hub once, pins them in status, and plans from the pin.

The real operator on the emulated API server, and huggingface_hub's real code
path against the loopback Hub of tests/hub_server.py (HF_ENDPOINT). The Hub
serves copies of stored configs under names the built-in catalog does not know
(`acme/...`), and one the catalog knows.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
from conftest import ROOT, existing_isvc, isvc_doc, present, sim_doc
from hub_server import FakeHub, commit_of, fake_hub

from tensorfleet import contract, modelinfo
from tensorfleet.api import load_inference_service
from tensorfleet.catalog.facts import facts_from_json
from tensorfleet.catalog.models import catalog_facts
from tensorfleet.controller import webhook
from tensorfleet.controller.modelfacts import REFRESH_ANNOTATION, ModelFactsConfig, pin
from tensorfleet.controller.operator import Operator
from tensorfleet.planner import make_plan
from tensorfleet.testing.operator_harness import Cluster, cluster, running_operator
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio

DATA = ROOT / "tests" / "data" / "models"
HOUSE_LLAMA = "acme/house-llama-8b"      # Llama 3.1 8B's config.json, gated
HOUSE_QWEN = "acme/house-qwen-8b"        # Qwen3 8B's
CATALOG_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TOKEN = "hf_operator_token"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The loopback Hub, online, and the operator's token in HF_TOKEN (as the chart's hub.tokenSecret sets it)."""
    root = tmp_path / "hub"
    for repo, stored in ((HOUSE_LLAMA, CATALOG_MODEL), (HOUSE_QWEN, "Qwen/Qwen3-8B"), (CATALOG_MODEL, CATALOG_MODEL)):
        shutil.copytree(DATA / stored, root / repo)
    assert catalog_facts(HOUSE_LLAMA) is None and catalog_facts(HOUSE_QWEN) is None
    assert catalog_facts(CATALOG_MODEL) is not None
    modelinfo.clear_cache()
    # conftest turns the suite offline, and huggingface_hub reads that at import.
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with fake_hub(root=root, gated={HOUSE_LLAMA: TOKEN}) as served:
        monkeypatch.setenv("HF_ENDPOINT", served.url)
        yield served
    modelinfo.clear_cache()


@pytest.fixture
def facts_config(tmp_path: Path) -> ModelFactsConfig:
    return ModelFactsConfig(cache_dir=str(tmp_path / "hf-cache"), timeout_seconds=5.0, retry_seconds=0.2)


def _asked(hub: FakeHub, repo: str) -> list[tuple[str, str]]:
    return [(method, path) for method, path, _ in hub.requests if path.startswith(f"/{repo}/")]


def _status(c: Cluster) -> dict[str, Any]:
    return (c.isvc("demo") or {}).get("status") or {}


def _planned(c: Cluster, source: str, model: str | None = None) -> bool:
    status = _status(c)
    facts = status.get("modelFacts") or {}
    return ((status.get("plan") or {}).get("modelSource") == source and facts.get("source") == source
            and (model is None or facts.get("model") == model)
            and status.get("observedGeneration") == existing_isvc(c, "demo")["metadata"]["generation"])


async def _settle(op: Operator) -> None:
    assert op.queue is not None
    op.queue.add(("default", "demo"))
    await op.queue.wait_idle()


async def test_a_model_only_the_hub_knows_is_planned_from_its_config_json(
        hub: FakeHub, facts_config: ModelFactsConfig) -> None:
    async with cluster() as c, c.workloads(), running_operator(c, model_facts=facts_config):
        await c.create(sim_doc(model={"name": HOUSE_LLAMA}))
        await eventually(lambda: _planned(c, "hub"), message="planned from the Hub")
        status = _status(c)
        pinned = status["modelFacts"]
        assert (pinned["model"], pinned["commit"]) == (HOUSE_LLAMA, commit_of(HOUSE_LLAMA))
        assert "hubError" not in pinned and "revision" not in pinned
        # The plan is the one config.json gives, and the pin holds exactly those facts.
        read = modelinfo.read_model_config(DATA / CATALOG_MODEL, HOUSE_LLAMA)
        expected = make_plan(load_inference_service(sim_doc(model={"name": HOUSE_LLAMA})).spec, read)
        assert status["plan"]["kvCacheTokens"] == expected.kv_cache_tokens
        assert facts_from_json(pinned["facts"]).weight_bytes() == read.weight_bytes()
        condition = present(c.condition("demo", "PlanValid"), "the PlanValid condition")
        assert condition["status"] == "True" and condition["reason"] == "PlanAccepted"
        assert f"model facts: hub (config.json at {commit_of(HOUSE_LLAMA)[:12]})" in condition["message"]
        # A gated repository: the operator's token (HF_TOKEN) opened it.
        assert all(auth == f"Bearer {TOKEN}" for _, path, auth in hub.requests if path.startswith(f"/{HOUSE_LLAMA}/"))
        await eventually(lambda: c.get("apps/v1", "statefulsets", "demo-stage-0"), message="engines rendered")


async def test_the_hub_going_down_after_pinning_changes_nothing(hub: FakeHub, facts_config: ModelFactsConfig) -> None:
    async with cluster() as c, c.workloads():
        async with running_operator(c, model_facts=facts_config) as op:
            await c.create(sim_doc(model={"name": HOUSE_LLAMA}))
            await eventually(lambda: _planned(c, "hub") and (c.condition("demo", "Ready") or {}).get("status") == "True",
                             message="serving")
            await _settle(op)
            status, asked = _status(c), len(hub.requests)
            hub.fail_with = 503
            modelinfo.clear_cache()  # nothing kept in process either
            writes = sum(op.kube.writes.values())
            for _ in range(3):
                await _settle(op)
            # An unrelated metadata change makes a reconcile too.
            await c.patch("demo", {"metadata": {"labels": {"team": "search"}}})
            await _settle(op)
            assert sum(op.kube.writes.values()) == writes, op.kube.writes
        # A restarted operator, with nothing in memory, plans from the pin as well.
        async with running_operator(c, model_facts=facts_config) as fresh:
            await _settle(fresh)
            assert sum(fresh.kube.writes.values()) == 0, fresh.kube.writes
        assert len(hub.requests) == asked, hub.requests[asked:]
        assert {k: v for k, v in _status(c).items() if k != "conditions"} == \
            {k: v for k, v in status.items() if k != "conditions"}


async def test_a_hub_that_is_down_for_a_catalog_model_falls_back_and_says_why(
        hub: FakeHub, facts_config: ModelFactsConfig) -> None:
    hub.fail_with = 503
    async with cluster() as c, c.workloads(), running_operator(c, model_facts=facts_config) as op:
        await c.create(sim_doc())
        await eventually(lambda: _planned(c, "catalog"), message="planned from the catalog")
        condition = present(c.condition("demo", "PlanValid"), "the PlanValid condition")
        assert condition["status"] == "True" and condition["reason"] == "PlanAcceptedWithWarnings"
        assert (f"warning: model facts from the built-in catalog: {CATALOG_MODEL}: config.json not read: "
                "the Hub answered 503") in condition["message"]
        assert "the Hub answered 503" in condition["message"] and REFRESH_ANNOTATION in condition["message"]
        assert "the Hub answered 503" in _status(c)["modelFacts"]["hubError"]
        # The Hub is back: the catalog's facts stay pinned, and the Hub is not asked.
        hub.fail_with = None
        modelinfo.clear_cache()
        asked = len(hub.requests)
        await _settle(op)
        assert _planned(c, "catalog") and len(hub.requests) == asked
        # Until the user asks for a re-read with a new annotation value.
        await c.patch("demo", {"metadata": {"annotations": {REFRESH_ANNOTATION: "1"}}})
        await eventually(lambda: _planned(c, "hub"), message="read again from the Hub")
        pinned = _status(c)["modelFacts"]
        assert (pinned["refresh"], pinned["commit"]) == ("1", commit_of(CATALOG_MODEL)) and "hubError" not in pinned
        assert present(c.condition("demo", "PlanValid"), "the PlanValid condition")["reason"] == "PlanAccepted"


async def test_a_hub_that_hangs_is_waited_for_only_so_long(hub: FakeHub, tmp_path: Path) -> None:
    hub.delay_seconds = 3.0
    config = ModelFactsConfig(cache_dir=str(tmp_path / "hf-cache"), timeout_seconds=0.5)
    async with cluster() as c, c.workloads(), running_operator(c, model_facts=config):
        await c.create(sim_doc())
        await eventually(lambda: _planned(c, "catalog"), message="planned from the catalog")
        assert "the Hub did not answer within 0.5 s" in _status(c)["modelFacts"]["hubError"]


async def test_a_model_no_source_gives_is_not_planned_and_is_retried(
        hub: FakeHub, facts_config: ModelFactsConfig) -> None:
    hub.fail_with = 503
    async with cluster() as c, c.workloads(), running_operator(c, model_facts=facts_config) as op:
        await c.create(sim_doc(model={"name": HOUSE_LLAMA}))
        await eventually(lambda: (c.condition("demo", "PlanValid") or {}).get("reason") == "ModelFactsUnavailable",
                         message="PlanValid=False")
        condition = present(c.condition("demo", "PlanValid"), "the PlanValid condition")
        assert condition["status"] == "False"
        assert condition["message"].startswith(f"spec.model.name: no facts for model {HOUSE_LLAMA}: ")
        assert "the Hub answered 503" in condition["message"] and "spec.model.architecture" in condition["message"]
        # The event is posted after the condition is written: it may land a moment later.
        await eventually(lambda: [e for e in c.events("demo") if e["reason"] == "ModelFactsUnavailable"],
                         message="the ModelFactsUnavailable event")
        # Retried with backoff, with nothing rendered meanwhile.
        await eventually(lambda: len(_asked(hub, HOUSE_LLAMA)) >= 3, message="retries")
        assert not c.children("demo") and {kind for _, kind in op.kube.writes} <= {contract.KIND, "Event"}
        assert "modelFacts" not in _status(c)
        # The Hub comes back: the next retry plans it, with no event needed.
        hub.fail_with = None
        await eventually(lambda: _planned(c, "hub"), message="planned once the Hub answered")
        await eventually(lambda: c.get("apps/v1", "statefulsets", "demo-stage-0"), message="engines rendered")
        assert present(c.condition("demo", "PlanValid"), "the PlanValid condition")["status"] == "True"


async def test_changing_the_model_reads_it_again(hub: FakeHub, facts_config: ModelFactsConfig) -> None:
    async with cluster() as c, c.workloads(), running_operator(c, model_facts=facts_config):
        await c.create(sim_doc(model={"name": HOUSE_LLAMA}))
        await eventually(lambda: _planned(c, "hub", HOUSE_LLAMA), message="the first model")
        first = _status(c)["modelFacts"]
        assert not _asked(hub, HOUSE_QWEN)
        await c.patch("demo", {"spec": {"model": {"name": HOUSE_QWEN}}})
        await eventually(lambda: _planned(c, "hub", HOUSE_QWEN), message="the second model")
        second = _status(c)["modelFacts"]
        assert second["commit"] == commit_of(HOUSE_QWEN) and second["digest"] != first["digest"]
        assert ("HEAD", f"/{HOUSE_QWEN}/resolve/main/config.json") in _asked(hub, HOUSE_QWEN)
        # A revision names another model too.
        await c.patch("demo", {"spec": {"model": {"revision": commit_of(HOUSE_QWEN)}}})
        await eventually(lambda: (_status(c)["modelFacts"].get("revision") == commit_of(HOUSE_QWEN)
                                  and _planned(c, "hub")), message="the revision")
        assert ("HEAD", f"/{HOUSE_QWEN}/resolve/{commit_of(HOUSE_QWEN)}/config.json") in _asked(hub, HOUSE_QWEN)


async def test_a_plan_made_before_pins_is_kept_on_upgrade(hub: FakeHub, facts_config: ModelFactsConfig) -> None:
    """An InferenceService an operator without pins planned from the catalog: the upgrade rolls nothing."""
    async with cluster() as c, c.workloads():
        async with running_operator(c, model_facts=ModelFactsConfig(hub=False)) as old:
            await c.create(sim_doc())
            await eventually(lambda: _planned(c, "catalog")
                             and present(c.condition("demo", "Progressing"), "the Progressing condition")["status"] == "False",
                             message="rolled out from the catalog")
            await _settle(old)
        # What an operator without pins left: the plan, and no status.modelFacts.
        path = f"/apis/{contract.API_VERSION}/namespaces/default/{contract.PLURAL}/demo/status"
        await c.request("PATCH", path, {"status": {"modelFacts": None}}, "application/merge-patch+json")
        assert "modelFacts" not in _status(c)
        async with running_operator(c, model_facts=facts_config) as new:
            await eventually(lambda: _planned(c, "catalog"), message="the catalog's facts pinned")
            await _settle(new)
            assert not hub.requests
            assert set(new.kube.writes) == {("PATCH", contract.KIND)}, (new.kube.writes, [(e["reason"], e["message"]) for e in c.events("demo")])


# --- the webhook -------------------------------------------------------------------


def _review(operation: str, obj: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {"uid": "u1", "operation": operation, "namespace": "default", "object": obj}
    if old is not None:
        request["oldObject"] = old
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


async def _answer(review: dict[str, Any], config: ModelFactsConfig) -> dict[str, Any]:
    return (await webhook.review(review, model_facts=config))["response"]


async def test_admission_plans_a_new_model_from_the_hub(hub: FakeHub, facts_config: ModelFactsConfig) -> None:
    good = await _answer(_review("CREATE", sim_doc(model={"name": HOUSE_LLAMA})), facts_config)
    assert good["allowed"] is True and "warnings" not in good
    # config.json says 8 KV heads: a tensor size of 3 cannot divide them, and the webhook knows.
    bad = await _answer(_review("CREATE", sim_doc(model={"name": HOUSE_LLAMA}, parallelism={"tensor": 3})),
                        facts_config)
    assert bad["allowed"] is False and bad["status"]["message"].startswith("spec.parallelism.tensor")


async def test_admission_never_refuses_because_the_hub_is_down_or_slow(hub: FakeHub, tmp_path: Path) -> None:
    config = ModelFactsConfig(cache_dir=str(tmp_path / "hf-cache"), admission_timeout_seconds=0.3)
    outages: tuple[dict[str, Any], ...] = ({"fail_with": 503}, {"delay_seconds": 2.0})
    for broken in outages:
        modelinfo.clear_cache()
        hub.fail_with, hub.delay_seconds = broken.get("fail_with"), broken.get("delay_seconds", 0.0)
        answer = await _answer(_review("CREATE", sim_doc(model={"name": HOUSE_LLAMA}, parallelism={"tensor": 3})),
                               config)
        assert answer["allowed"] is True, (broken, answer)
        (warning,) = answer["warnings"]
        assert warning.startswith(f"spec.model.name: no facts for model {HOUSE_LLAMA} yet") and "PlanValid" in warning
        # A model the catalog knows is still checked, from the catalog.
        catalog = await _answer(_review("CREATE", sim_doc(parallelism={"tensor": 3})), config)
        assert catalog["allowed"] is False and catalog["status"]["message"].startswith("spec.parallelism.tensor")
        # So is what needs no model facts.
        gpu = await _answer(_review("CREATE", sim_doc(model={"name": HOUSE_LLAMA}, accelerator={"type": "B100"})),
                            config)
        assert gpu["allowed"] is False and gpu["status"]["message"].startswith("spec.accelerator.type")


async def test_admission_of_an_update_plans_from_the_pinned_facts(hub: FakeHub, facts_config: ModelFactsConfig) -> None:
    hub.fail_with = 503
    stored = sim_doc(model={"name": HOUSE_LLAMA})
    read = modelinfo.read_model_config(DATA / CATALOG_MODEL, HOUSE_LLAMA)
    pinned = pin(load_inference_service(stored), read).pin
    assert pinned is not None
    stored["status"] = {"modelFacts": pinned.model_dump(by_alias=True, exclude_unset=True)}
    changed = {**stored, "spec": {**stored["spec"], "parallelism": {"tensor": 3}}}
    # The API server gives the update the stored status; the old object has it too.
    for obj, old in ((changed, stored), ({k: v for k, v in changed.items() if k != "status"}, stored)):
        answer = await _answer(_review("UPDATE", obj, old), facts_config)
        assert answer["allowed"] is False and answer["status"]["message"].startswith("spec.parallelism.tensor"), answer
        fine = await _answer(_review("UPDATE", {**obj, "spec": {**stored["spec"], "replicas": 3}}, old), facts_config)
        assert fine["allowed"] is True and "warnings" not in fine, fine
    assert not hub.requests, "the pinned facts answered"
    # Another model: those facts are not its own.
    other = await _answer(_review("UPDATE", {**changed, "spec": {**changed["spec"], "model": {"name": HOUSE_QWEN}}},
                                  stored), facts_config)
    assert other["allowed"] is True and other["warnings"]


async def test_without_the_hub_the_catalog_decides_as_before() -> None:
    answer = await _answer(_review("CREATE", isvc_doc({"model": {"name": HOUSE_LLAMA}})), ModelFactsConfig(hub=False))
    assert answer["allowed"] is False and "not in the catalog" in answer["status"]["message"]
