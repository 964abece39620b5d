"""The router's two phases over simulated prefill and decode engines (router/prefill.py, sim/kvtransfer.py)."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest

from tensorfleet import contract
from tensorfleet.router.prefill import OUTCOMES, prefill_body
from tensorfleet.sim import kvtransfer
from tensorfleet.sim.kvtransfer import TransferConfig
from tensorfleet.testing.loopback import (
    MODEL,
    RunningRouter,
    RunningSim,
    chat,
    free_port,
    metric_value,
    router,
    sim,
    sse_events,
)
from tensorfleet.testing.wait import eventually

SYSTEM = "You answer questions about GPU clusters, briefly and exactly. " * 6


def transfer() -> TransferConfig:
    return TransferConfig(connector=kvtransfer.CONNECTOR, role="kv_both", side_channel_host="127.0.0.1",
                          side_channel_port=free_port(), link_bytes_per_s=100e9 / 8)


async def engines(stack: AsyncExitStack, count: int, *, kv: bool = True, time_scale: float = 0.01) -> list[RunningSim]:
    return [await stack.enter_async_context(sim(kv_transfer=transfer() if kv else None, time_scale=time_scale,
                                                seed=i))
            for i in range(count)]


async def disaggregated(stack: AsyncExitStack, prefill: list[RunningSim], decode: list[RunningSim],
                        **options: Any) -> RunningRouter:
    r = await stack.enter_async_context(router([d.url for d in decode],
                                               prefill_backends=tuple(p.url for p in prefill), **options))
    stage = r.router.prefill
    assert stage is not None
    await eventually(lambda: all(b.breaker.checked for b in stage.pool), timeout=10)
    return r


async def text_of(client: aiohttp.ClientSession, url: str) -> str:
    async with client.get(url + "/metrics") as resp:
        return await resp.text()


async def total(client: aiohttp.ClientSession, engines: list[RunningSim], name: str) -> float:
    texts = [await text_of(client, e.url) for e in engines]
    return sum(metric_value(text, name) or 0.0 for text in texts)


async def ask(client: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of one request's answer, streamed or not; the tokens counted as they
    arrived for a stream."""
    async with client.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not body.get("stream"):
            answer = await resp.json()
            return answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
        events = [json.loads(data) async for _, data in sse_events(resp) if data != "[DONE]"]
    key = "delta" if path.endswith("chat/completions") else None
    tokens = [e for e in events if e["choices"] and (e["choices"][0][key].get("content") if key
                                                      else e["choices"][0].get("text"))]
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == len(tokens)
    return usage["prompt_tokens"], len(tokens)


def requests(count: int) -> list[tuple[str, dict[str, Any]]]:
    """Chat and completions, streamed and not, each with its own prompt and max_tokens."""
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(count):
        max_tokens = 5 + i % 7
        stream = i % 2 == 1
        options = {"stream_options": {"include_usage": True}} if stream else {}
        if i % 4 < 2:
            body = chat(f"question {i}: how many GPUs does tenant {i} need?", max_tokens=max_tokens, stream=stream,
                        **options)
            body["messages"].insert(0, {"role": "system", "content": SYSTEM})
            out.append(("/v1/chat/completions", body))
        else:
            out.append(("/v1/completions", {"model": MODEL, "prompt": SYSTEM + f"Question {i}.",
                                            "max_tokens": max_tokens, "stream": stream, **options}))
    return out


@pytest.mark.asyncio
async def test_prefill_engines_compute_the_prompts_and_decode_engines_only_the_answers() -> None:
    async with AsyncExitStack() as stack:
        prefill, decode = await engines(stack, 2), await engines(stack, 2)
        r = await disaggregated(stack, prefill, decode)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        asked = requests(12)
        answers = await asyncio.gather(*(ask(client, r.url, path, body) for path, body in asked))
        for (path, body), (_, completion) in zip(asked, answers, strict=True):
            assert completion == body["max_tokens"], (path, body)
        prompts = sum(p for p, _ in answers)
        # The prefill engines computed every prompt and generated one token each (the answer they threw away) ...
        assert await total(client, prefill, contract.VLLM_METRIC_PROMPT_TOKENS + "_total") == prompts
        assert await total(client, prefill, contract.VLLM_METRIC_GENERATION_TOKENS + "_total") == len(asked)
        # ... the decode engines generated every answer, and computed no transferred prompt: one token a request,
        # the prompt's last (for its logits).
        assert await total(client, decode, contract.VLLM_METRIC_GENERATION_TOKENS + "_total") == sum(
            b["max_tokens"] for _, b in asked)
        assert await total(client, decode, contract.VLLM_METRIC_PREFILL_KV_COMPUTED + "_sum") == len(asked)
        assert await total(client, decode, contract.VLLM_METRIC_EXTERNAL_PREFIX_CACHE_HITS + "_total") == \
            prompts - len(asked)
        router_text = await text_of(client, r.url)
        assert metric_value(router_text, contract.ROUTER_METRIC_PREFILL + "_total", outcome="remote") == len(asked)
        assert all(not p.engine.held for p in prefill)  # every held KV was read


@pytest.mark.asyncio
async def test_killing_a_prefill_engine_under_load_fails_no_request() -> None:
    async with AsyncExitStack() as stack:
        # Time scale 0.2: prefills take tens of milliseconds, so the kill lands while requests are on it.
        prefill, decode = await engines(stack, 2, time_scale=0.2), await engines(stack, 2, time_scale=0.05)
        r = await disaggregated(stack, prefill, decode, health_interval=0.2)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        asked = requests(60)

        async def one(index: int, path: str, body: dict[str, Any]) -> tuple[int, int]:
            await asyncio.sleep(index * 0.02)
            return await ask(client, r.url, path, body)

        load = asyncio.gather(*(one(i, path, body) for i, (path, body) in enumerate(asked)))
        doomed = prefill[0].engine
        # Killed while it computes prompts or holds KV a decode engine is yet to read.
        await eventually(lambda: doomed.num_running > 0 or bool(doomed.held), timeout=10, interval=0.005)
        await prefill[0].runner.cleanup()  # the engine and its side channel are gone, mid-load
        answers = await asyncio.wait_for(load, timeout=60)
        assert [c for _, c in answers] == [b["max_tokens"] for _, b in asked]  # every one answered whole
        router_text = await text_of(client, r.url)
    outcomes = {o: metric_value(router_text, contract.ROUTER_METRIC_PREFILL + "_total", outcome=o) or 0.0
                for o in OUTCOMES}
    assert sum(outcomes.values()) == len(asked)
    assert outcomes["remote"] > 0, outcomes  # the other prefill engine went on serving


@pytest.mark.asyncio
async def test_a_request_the_prefill_pool_cannot_take_goes_to_a_decode_engine_whole() -> None:
    async with AsyncExitStack() as stack:
        plain = await engines(stack, 1, kv=False)  # no KV connector: answers without kv_transfer_params
        decode = await engines(stack, 1)
        r = await disaggregated(stack, plain, decode)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        assert (await ask(client, r.url, "/v1/completions", {"model": MODEL, "prompt": SYSTEM, "max_tokens": 4}))[1] == 4
        several = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 3, "n": 2}
        async with client.post(r.url + "/v1/completions", json=several) as resp:
            assert resp.status == 200 and len((await resp.json())["choices"]) == 2
        router_text = await text_of(client, r.url)
        assert metric_value(router_text, contract.ROUTER_METRIC_PREFILL + "_total", outcome="no-params") == 1
        assert metric_value(router_text, contract.ROUTER_METRIC_PREFILL + "_total", outcome="unsupported") == 1
        # The decode engine computed those prompts itself.
        assert (await total(client, decode, contract.VLLM_METRIC_PREFILL_KV_COMPUTED + "_sum")) > len(SYSTEM.split())


@pytest.mark.asyncio
async def test_a_saturated_or_absent_prefill_pool_never_makes_a_request_wait() -> None:
    async with AsyncExitStack() as stack:
        slow = await engines(stack, 1, time_scale=1.0)  # real time: a prefill takes a visible while
        decode = await engines(stack, 1)
        r = await disaggregated(stack, slow, decode, prefill_max_concurrency_per_backend=1)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        body = {"model": MODEL, "prompt": SYSTEM * 4, "max_tokens": 2}
        answers = await asyncio.gather(*(ask(client, r.url, "/v1/completions", body) for _ in range(4)))
        assert [c for _, c in answers] == [2] * 4
        router_text = await text_of(client, r.url)
        assert metric_value(router_text, contract.ROUTER_METRIC_PREFILL + "_total", outcome="saturated") == 3
        assert metric_value(router_text, contract.ROUTER_METRIC_PREFILL + "_total", outcome="remote") == 1
        await slow[0].runner.cleanup()
        stage = r.router.prefill
        assert stage is not None
        await eventually(lambda: not any(b.healthy for b in stage.pool), timeout=10)
        assert (await ask(client, r.url, "/v1/completions", body))[1] == 2
        router_text = await text_of(client, r.url)
        assert metric_value(router_text, contract.ROUTER_METRIC_PREFILL + "_total", outcome="unavailable") == 1


def test_the_prefill_half_is_the_request_with_one_token_unstreamed_and_its_params() -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50,
            "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 10,
            "temperature": 0.3}
    half = prefill_body(body)
    assert half is not None
    assert half["max_tokens"] == half["max_completion_tokens"] == 1 and half["stream"] is False
    assert "stream_options" not in half and "min_tokens" not in half and half["temperature"] == 0.3
    assert half["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # the client's request is untouched
    for refused in ({"n": 2}, {"best_of": 3}, {"echo": True}, {"prompt_logprobs": 1},
                    {"kv_transfer_params": {"do_remote_prefill": True}}):
        assert prefill_body({**body, **refused}) is None, refused
