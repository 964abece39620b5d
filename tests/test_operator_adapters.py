"""controller/adapters.py: spec.adapters loaded into and unloaded from running (simulated) engines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tensorfleet import contract
from tensorfleet.api.models import AdapterSpec
from tensorfleet.controller.adapters import (
    RETRY_SECONDS,
    Engine,
    EngineClient,
    EngineResult,
    adapter_status,
    ready_engines,
    sync,
)
from tensorfleet.controller.observe import pod_ready
from tensorfleet.httpapi import start_site
from tensorfleet.sim.lora import LOAD_PATH, LoraConfig
from tensorfleet.sim.profile import make_profile
from tensorfleet.sim.server import SimConfig, SimServer
from tensorfleet.testing.loopback import MODEL


@asynccontextmanager
async def engine(pod: str, modules: tuple[tuple[str, str], ...] = ()) -> AsyncIterator[Engine]:
    server = SimServer(make_profile(), SimConfig(served_model_name=MODEL, model="meta-llama/Llama-3.1-8B",
                                                 time_scale=0.01, runtime_lora_updating=True,
                                                 lora=LoraConfig(max_loras=2, max_cpu_loras=4), lora_modules=modules))
    runner = await start_site(server.app(), "127.0.0.1", 0)
    try:
        yield Engine(pod, f"http://127.0.0.1:{runner.addresses[0][1]}")
    finally:
        await runner.cleanup()


async def listed(client: aiohttp.ClientSession, e: Engine) -> dict[str, Any]:
    async with client.get(e.url + "/v1/models") as resp:
        return {m["id"]: m["parent"] for m in (await resp.json())["data"]}


def adapters(*names: str, source: str = "org/{}") -> list[AdapterSpec]:
    return [AdapterSpec(name=n, source=source.format(n)) for n in names]


@pytest.mark.asyncio
async def test_missing_adapters_are_loaded_and_unlisted_ones_unloaded() -> None:
    async with AsyncExitStack() as stack:
        fresh = await stack.enter_async_context(engine("isvc-stage-0-0"))
        stale = await stack.enter_async_context(engine("isvc-stage-0-1", (("old", "org/old"), ("b", "org/b"))))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        wanted = adapters("a", "b", "c")
        results = await sync([fresh, stale], wanted)
        for e in (fresh, stale):
            assert await listed(client, e) == {MODEL: None, "a": MODEL, "b": MODEL, "c": MODEL}
            assert results[e.pod].served == {"a", "b", "c"} and not results[e.pod].failures
        outcome = adapter_status(wanted, results)
        assert [(a["name"], a["state"], a["engines"], a["readyEngines"]) for a in outcome.status] == [
            ("a", "Loaded", 2, 2), ("b", "Loaded", 2, 2), ("c", "Loaded", 2, 2)]
        assert outcome.requeue is None and outcome.warnings == []
        # A second sync changes nothing; dropping one from the spec unloads it everywhere.
        assert (await sync([fresh, stale], wanted))[fresh.pod].served == {"a", "b", "c"}
        await sync([fresh, stale], adapters("a", "c"))
        for e in (fresh, stale):
            assert await listed(client, e) == {MODEL: None, "a": MODEL, "c": MODEL}


@pytest.mark.asyncio
async def test_an_adapter_an_engine_refuses_is_failed_with_its_reason_and_retried(tmp_path: Path) -> None:
    wide = tmp_path / "wide"  # rank 64, above the engines' --max-lora-rank (16)
    wide.mkdir()
    (wide / "adapter_config.json").write_text(json.dumps({"r": 64, "target_modules": ["q_proj"]}))
    async with AsyncExitStack() as stack:
        one = await stack.enter_async_context(engine("isvc-stage-0-0"))
        two = await stack.enter_async_context(engine("isvc-stage-0-1"))
        wanted = [AdapterSpec(name="good", source="org/good"),
                  AdapterSpec(name="missing", source="/models/adapters/not-there"),
                  AdapterSpec(name="wide", source=str(wide))]
        outcome = adapter_status(wanted, await sync([one, two], wanted))
        good, missing, too_wide = outcome.status
        assert good["state"] == "Loaded" and good["engines"] == 2
        # vLLM's codes (tests/test_sim_vs_vllm.py holds the simulator to them): 404 for no adapter at the path,
        # 500 for one the engine cannot take.
        assert missing["state"] == "Failed" and missing["engines"] == 0
        assert missing["message"] == ("engine pod isvc-stage-0-0: 404: Loading lora missing failed: No adapter found "
                                      "for /models/adapters/not-there")
        assert too_wide["state"] == "Failed" and too_wide["engines"] == 0
        assert too_wide["message"] == ("engine pod isvc-stage-0-0: 500: Call to add_lora method failed: LoRA rank 64 "
                                       "is greater than max_lora_rank 16.")
        assert [reason for reason, _ in outcome.warnings] == ["AdapterLoadFailed"] * 4
        assert "missing" in outcome.warnings[0][1] and outcome.requeue == RETRY_SECONDS


@pytest.mark.asyncio
async def test_an_engine_that_does_not_answer_is_reported_and_retried() -> None:
    async with AsyncExitStack() as stack:
        up = await stack.enter_async_context(engine("isvc-stage-0-0"))
        down = Engine("isvc-stage-0-1", "http://127.0.0.1:9")  # nothing listens on the discard port
        wanted = adapters("a")
        results = await sync([up, down], wanted)
        assert results[down.pod].served is None and results[down.pod].error
        outcome = adapter_status(wanted, results)
        assert outcome.status[0]["state"] == "Loading" and outcome.status[0]["engines"] == 1
        assert outcome.warnings[0][0] == "AdapterSyncFailed" and "isvc-stage-0-1" in outcome.warnings[0][1]
        assert outcome.requeue == RETRY_SECONDS


@pytest.mark.asyncio
async def test_an_adapter_already_loaded_by_another_party_counts_as_loaded() -> None:
    async with AsyncExitStack() as stack:
        e = await stack.enter_async_context(engine("isvc-stage-0-0"))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        async with client.post(e.url + LOAD_PATH, json={"lora_name": "a", "lora_path": "org/a"}) as resp:
            assert resp.status == 200
        # Loading it again is what a reconcile racing another (or a timed-out load) does: vLLM says 400 "already".
        assert await EngineClient(client).load(e, adapters("a")[0]) is None


def test_states_without_engines_and_with_some_loading() -> None:
    wanted = adapters("a", "b")
    assert [a["state"] for a in adapter_status(wanted, {}).status] == ["Pending", "Pending"]
    results = {"p0": EngineResult(served={"a", "b"}), "p1": EngineResult(served={"a"})}
    outcome = adapter_status(wanted, results)
    assert [(a["state"], a["engines"]) for a in outcome.status] == [("Loaded", 2), ("Loading", 1)]
    assert outcome.requeue == RETRY_SECONDS


def pod(name: str, *, role: str = contract.ROLE_LEADER, ip: str | None = "10.0.0.5", ready: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {contract.LABEL_ROLE: role}},
            "status": {**({"podIP": ip} if ip else {}),
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_only_ready_leaders_with_an_address_are_engines() -> None:
    pods = [pod("s-stage-0-1"), pod("s-stage-0-0", ip="fd00::7"), pod("s-stage-1-0", role=contract.ROLE_WORKER),
            pod("s-stage-0-2", ready=False), pod("s-stage-0-3", ip=None)]
    assert ready_engines(pods, pod_ready) == [
        Engine("s-stage-0-0", f"http://[fd00::7]:{contract.ENGINE_PORT}"),
        Engine("s-stage-0-1", f"http://10.0.0.5:{contract.ENGINE_PORT}"),
    ]
