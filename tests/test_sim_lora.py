"""LoRA adapters on the simulator: served by name, at most max_loras per batch, load time charged, vLLM's
runtime load and unload endpoints, /v1/models and vllm:lora_requests_info."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tensorfleet import contract
from tensorfleet.httpapi import start_site
from tensorfleet.sim.lora import LOAD_PATH, UNLOAD_PATH, LoraConfig, LoraError, parse_module
from tensorfleet.sim.profile import make_profile
from tensorfleet.sim.server import SimConfig, SimServer
from tensorfleet.testing.loopback import MODEL, metric_value


@asynccontextmanager
async def lora_sim(config: LoraConfig, modules: tuple[tuple[str, str], ...] = (), *, runtime: bool = True,
                   time_scale: float = 0.01) -> AsyncIterator[tuple[str, SimServer]]:
    server = SimServer(make_profile(), SimConfig(served_model_name=MODEL, model="meta-llama/Llama-3.1-8B",
                                                 time_scale=time_scale, lora=config, lora_modules=modules,
                                                 runtime_lora_updating=runtime))
    runner = await start_site(server.app(), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", server
    finally:
        await runner.cleanup()


def completion(model: str, max_tokens: int = 4, prompt: str = "Summarise the incident report.") -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens}


async def answer(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with client.post(url + "/v1/completions", json=body) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data


@pytest.mark.asyncio
async def test_adapters_are_served_by_name_and_listed_under_the_base_model() -> None:
    modules = (("support-bot", "org/support-lora"), ("sql-writer", "org/sql-lora"))
    async with lora_sim(LoraConfig(max_loras=2), modules) as (url, _), aiohttp.ClientSession() as client:
        async with client.get(url + "/v1/models") as resp:
            models = (await resp.json())["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in models] == [
            (MODEL, None, "meta-llama/Llama-3.1-8B"), ("support-bot", MODEL, "org/support-lora"),
            ("sql-writer", MODEL, "org/sql-lora")]
        base = await answer(client, url, completion(MODEL, 12))
        tuned = await answer(client, url, completion("support-bot", 12))
        assert tuned["usage"]["completion_tokens"] == 12 and tuned["model"] == "support-bot" and base["model"] == MODEL
        assert tuned["choices"][0]["text"] != base["choices"][0]["text"]  # a fine-tune answers differently
        async with client.post(url + "/v1/completions", json=completion("not-loaded")) as resp:
            assert resp.status == 404 and "not-loaded" in (await resp.json())["error"]["message"]


@pytest.mark.asyncio
async def test_no_batch_holds_more_adapters_than_max_loras_and_each_load_is_charged() -> None:
    config = LoraConfig(max_loras=1, max_cpu_loras=2, load_seconds=20.0, swap_seconds=2.0)
    modules = (("a", "org/a"), ("b", "org/b"))
    async with lora_sim(config, modules) as (url, server), aiohttp.ClientSession() as client:
        engine = server.engine
        assert engine is not None and engine.lora is not None
        seen: list[set[str]] = []
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                seen.append({r.lora for r in engine.running if r.lora})
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        started = time.perf_counter()
        order = ["a", "b", "a", "b", "a"]
        answers = await asyncio.gather(*(answer(client, url, completion(m, 6, f"question {i}"))
                                         for i, m in enumerate(order)))
        # The scheduler ran every "a" it could before any "b" (a waiting "b" lets the "a"s behind it go), so the
        # slot switched once; "a" again now comes back from the CPU cache.
        assert (engine.lora.loads, engine.lora.swaps) == (2, 0)
        answers.append(await answer(client, url, completion("a", 6, "question 5")))
        elapsed = time.perf_counter() - started
        done.set()
        await watcher
        assert [a["usage"]["completion_tokens"] for a in answers] == [6] * 6
        assert max(len(s) for s in seen) == 1 and {"a"} in seen and {"b"} in seen
        # Each switch of the one slot brings the other adapter in: from disk the first time, then from the CPU
        # cache; every bringing-in costs its step (20 or 2 simulated seconds at time scale 0.01).
        loads, swaps = engine.lora.loads, engine.lora.swaps
        assert (loads, swaps) == (2, 1)
        assert elapsed >= (loads * config.load_seconds + swaps * config.swap_seconds) * 0.01
        async with client.get(url + "/metrics") as resp:
            text = await resp.text()
        assert metric_value(text, contract.SIM_METRIC_LORA_LOADS + "_total", tier="disk") == 2
        assert metric_value(text, contract.VLLM_METRIC_LORA_INFO, max_lora="1", running_lora_adapters="",
                            waiting_lora_adapters="") is not None


@pytest.mark.asyncio
async def test_the_info_gauge_names_the_adapters_of_running_and_waiting_requests() -> None:
    async with lora_sim(LoraConfig(max_loras=1), (("a", "org/a"), ("b", "org/b")), time_scale=1.0) as (url, _), \
            aiohttp.ClientSession() as client:
        load = [asyncio.create_task(answer(client, url, completion(m, 30))) for m in ("a", "b")]
        text = ""

        async def both_listed() -> bool:
            nonlocal text
            async with client.get(url + "/metrics") as resp:
                text = await resp.text()
            return metric_value(text, contract.VLLM_METRIC_LORA_INFO, max_lora="1", running_lora_adapters="a",
                                waiting_lora_adapters="b") is not None

        deadline = time.monotonic() + 10
        while not await both_listed():
            assert time.monotonic() < deadline, text
            await asyncio.sleep(0.01)
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)


@pytest.mark.asyncio
async def test_adapters_load_and_unload_at_runtime_as_vllms_endpoints_do(tmp_path: Path) -> None:
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "adapter_config.json").write_text(json.dumps({"r": 64, "target_modules": ["q_proj"]}))
    async with lora_sim(LoraConfig(max_loras=2, max_rank=16)) as (url, _), aiohttp.ClientSession() as client:
        async def post(path: str, body: dict[str, Any]) -> tuple[int, str]:
            async with client.post(url + path, json=body) as resp:
                return resp.status, await resp.text()

        status, text = await post(LOAD_PATH, {"lora_name": "legal", "lora_path": "org/legal-lora"})
        assert (status, text) == (200, "Success: LoRA adapter 'legal' added successfully.")
        assert (await answer(client, url, completion("legal")))["usage"]["completion_tokens"] == 4
        assert (await post(LOAD_PATH, {"lora_name": "legal", "lora_path": "x"}))[0] == 400  # already loaded
        assert (await post(LOAD_PATH, {"lora_name": MODEL, "lora_path": "x"}))[0] == 400  # the base's name
        status, text = await post(LOAD_PATH, {"lora_name": "wide", "lora_path": str(wide)})
        # vLLM's engine refuses it as it adds it; its API server answers that with 500.
        assert status == 500 and "LoRA rank 64 is greater than max_lora_rank 16." in text
        assert (await post(LOAD_PATH, {"lora_name": "legal"}))[0] == 400  # no path
        assert (await post(UNLOAD_PATH, {"lora_name": "legal"})) == (
            200, "Success: LoRA adapter 'legal' removed successfully.")
        status, text = await post(UNLOAD_PATH, {"lora_name": "legal"})
        assert status == 404 and "cannot be found" in text
        async with client.post(url + "/v1/completions", json=completion("legal")) as resp:
            assert resp.status == 404
    async with lora_sim(LoraConfig(), runtime=False) as (url, _), aiohttp.ClientSession() as client, \
            client.post(url + LOAD_PATH, json={"lora_name": "x", "lora_path": "y"}) as resp:
        assert resp.status == 404  # without VLLM_ALLOW_RUNTIME_LORA_UPDATING there is no such endpoint


def test_lora_modules_take_vllms_two_forms() -> None:
    assert parse_module("support=org/support-lora") == ("support", "org/support-lora")
    assert parse_module('{"name": "sql", "path": "/models/sql", "base_model_name": "x"}') == ("sql", "/models/sql")
    for bad in ("support", "=path", "name=", '{"name": "x"}', "{nope"):
        with pytest.raises(LoraError):
            parse_module(bad)



@pytest.mark.asyncio
async def test_an_answer_names_the_adapter_it_used_as_vllm_does() -> None:
    async with lora_sim(LoraConfig(max_loras=1), (("support-bot", "org/support-lora"),)) as (url, _), \
            aiohttp.ClientSession() as client:
        for model in ("support-bot", MODEL):
            async with client.post(url + "/v1/completions", json={**completion(model), "stream": True}) as resp:
                events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                          if line.startswith("data: {")]
            assert resp.status == 200 and events and {e["model"] for e in events} == {model}
