"""The router as a real server in front of real simulators, all on loopback."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest

from tensorfleet import contract
from tensorfleet.testing.loopback import MODEL, RunningSim, chat, metric_value, router, sim, sse_events
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio


async def fleet(stack: AsyncExitStack, n: int, **sim_options: Any) -> list[RunningSim]:
    return [await stack.enter_async_context(sim(**sim_options)) for _ in range(n)]


async def post(client: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, Any]]:
    async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, resp.headers.get(contract.BACKEND_HEADER, ""), await resp.json()


async def test_round_robin_spreads_requests_evenly() -> None:
    async with AsyncExitStack() as stack:
        sims = await fleet(stack, 3)
        r = await stack.enter_async_context(router([s.url for s in sims], strategy="round-robin"))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        results = [await post(client, r.url, chat(f"q{i}", max_tokens=2)) for i in range(9)]
        assert {status for status, _, _ in results} == {200}
        assert Counter(backend for _, backend, _ in results) == {s.url: 3 for s in sims}


async def test_least_pending_avoids_the_busy_engine() -> None:
    async with AsyncExitStack() as stack:
        slow, idle = await fleet(stack, 2, time_scale=0.2)
        r = await stack.enter_async_context(router([slow.url, idle.url], strategy="least-pending"))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        # Two long streams occupy the engines one each; then whichever holds
        # two requests is avoided while the other is free.
        busy = await client.post(r.url + "/v1/chat/completions", json=chat("long", max_tokens=2000, stream=True))
        await busy.content.readany()
        busy_url = busy.headers[contract.BACKEND_HEADER]
        for i in range(4):
            status, backend, _ = await post(client, r.url, chat(f"short {i}", max_tokens=2))
            assert status == 200 and backend != busy_url
        busy.close()


async def test_session_header_and_user_field_keep_a_conversation_on_one_engine() -> None:
    async with AsyncExitStack() as stack:
        sims = await fleet(stack, 3)
        r = await stack.enter_async_context(router([s.url for s in sims], strategy="session"))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        for key in ("alice", "bob", "carol"):
            seen = {(await post(client, r.url, chat(f"turn {i}", max_tokens=2),
                                {contract.SESSION_HEADER: key}))[1] for i in range(4)}
            assert len(seen) == 1
            by_user = {(await post(client, r.url, chat(f"turn {i}", max_tokens=2, user=key)))[1] for i in range(3)}
            assert by_user == seen


async def test_prefix_aware_sends_a_growing_conversation_to_its_cache() -> None:
    async with AsyncExitStack() as stack:
        sims = await fleet(stack, 3, prompt_tokens_details=True)  # answers name their prefix-cache hits
        r = await stack.enter_async_context(router([s.url for s in sims], strategy="prefix-aware"))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        messages = [{"role": "system", "content": "You answer questions about this contract. " * 30}]
        backends = set()
        for turn in range(4):
            messages.append({"role": "user", "content": f"question {turn}?"})
            status, backend, body = await post(client, r.url, {"model": MODEL, "messages": messages, "max_tokens": 4})
            assert status == 200
            backends.add(backend)
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            if turn:
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 200
        assert len(backends) == 1


async def test_streaming_passes_through_incrementally() -> None:
    async with AsyncExitStack() as stack:
        (s,) = await fleet(stack, 1, time_scale=0.3)
        r = await stack.enter_async_context(router([s.url]))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        async with client.post(r.url + "/v1/completions",
                               json={"model": MODEL, "prompt": "count", "max_tokens": 10, "stream": True}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            events = [(t, data) async for t, data in sse_events(resp)]
        assert events[-1][1] == "[DONE]"
        texts = [json.loads(d)["choices"][0]["text"] for _, d in events[:-1]]
        assert len([t for t in texts if t]) == 10
        # Each token left the router as the engine produced it (~21 ms apart),
        # not in one buffered burst at the end.
        assert events[-2][0] - events[0][0] > 0.1
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(events[:-2])]
        assert sum(1 for g in gaps if g > 0.005) >= 5


async def test_models_are_aggregated_and_health_and_metrics_answer() -> None:
    async with AsyncExitStack() as stack:
        sims = await fleet(stack, 2)
        r = await stack.enter_async_context(router([s.url for s in sims]))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        async with client.get(r.url + "/v1/models") as resp:
            body = await resp.json()
        assert [m["id"] for m in body["data"]] == [MODEL]
        async with client.get(r.url + "/health") as resp:
            assert resp.status == 200 and (await resp.json())["backends"] == 2
        await post(client, r.url, chat("x", max_tokens=2))
        await post(client, r.url, {"model": "nope", "messages": []})
        async with client.get(r.url + "/metrics") as resp:
            text = await resp.text()
        for name in (contract.ROUTER_METRIC_PENDING, contract.ROUTER_METRIC_IN_FLIGHT,
                     contract.ROUTER_METRIC_BACKEND_HEALTHY, contract.ROUTER_METRIC_REQUESTS + "_total",
                     contract.ROUTER_METRIC_DURATION + "_bucket"):
            assert metric_value(text, name) is not None, name
        assert metric_value(text, contract.ROUTER_METRIC_REQUESTS + "_total", backend="none", code="404") == 1
        assert sum(metric_value(text, contract.ROUTER_METRIC_REQUESTS + "_total", backend=s.url, code="200") or 0
                   for s in sims) == 1
        assert metric_value(text, contract.ROUTER_METRIC_BACKEND_HEALTHY, backend=sims[0].url) == 1


async def test_bad_requests_get_openai_errors_from_the_router() -> None:
    async with AsyncExitStack() as stack:
        (s,) = await fleet(stack, 1)
        r = await stack.enter_async_context(router([s.url], max_body_bytes=1024))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        cases = [
            ("POST", "/v1/chat/completions", b"{oops", 400),
            ("POST", "/v1/chat/completions", b'"a string"', 400),
            ("POST", "/v1/chat/completions", json.dumps({"model": "gpt-4", "messages": []}).encode(), 404),
            ("POST", "/v1/chat/completions", json.dumps(chat("x" * 4000)).encode(), 413),
            ("GET", "/v2/anything", b"", 404),
            ("DELETE", "/v1/models", b"", 405),
            ("POST", "/v1/load_lora_adapter", b"{}", 404),
        ]
        for method, path, data, status in cases:
            async with client.request(method, r.url + path, data=data,
                                      headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == status, (path, data[:30])
                error = (await resp.json())["error"]
                assert error["code"] == status and error["message"] and error["type"]
        # The engine's own 4xx pass through unchanged (the engine's very answer), and are not retried.
        async with client.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": []}) as resp:
            own = (resp.status, await resp.json())
        assert own[0] == 400 and own[1]["error"]["message"].startswith("Cannot apply chat template to an empty")
        async with client.post(r.url + "/v1/chat/completions", json={"model": MODEL, "messages": []}) as resp:
            assert (resp.status, await resp.json()) == own
        assert s.engine.stats.prompt_tokens == 0


async def test_overload_answers_429_fast_with_retry_after() -> None:
    async with AsyncExitStack() as stack:
        (s,) = await fleet(stack, 1, time_scale=0.2)
        r = await stack.enter_async_context(router([s.url], max_concurrency_per_backend=1, max_queue=2))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        results = await asyncio.gather(*(post(client, r.url, chat(f"q{i}", max_tokens=5)) for i in range(8)),
                                       return_exceptions=False)
        statuses = Counter(status for status, _, _ in results)
        assert statuses == {200: 3, 429: 5}  # one running, two queued, the rest refused
        refused = next(body for status, _, body in results if status == 429)
        assert refused["error"]["type"] == "RateLimitError"
        async with client.post(r.url + "/v1/chat/completions", json=chat("hold", max_tokens=200, stream=True)) as held:
            await held.content.readany()
            queued = [asyncio.create_task(post(client, r.url, chat("q", max_tokens=1))) for _ in range(2)]
            await eventually(lambda: r.router.dispatcher.pending == 2)
            async with client.post(r.url + "/v1/chat/completions", json=chat("q", max_tokens=1)) as resp:
                assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        assert [status for status, _, _ in await asyncio.gather(*queued)] == [200, 200]
        assert s.engine.stats.max_running == 1
        async with client.get(r.url + "/metrics") as resp:
            text = await resp.text()
        assert metric_value(text, contract.ROUTER_METRIC_REQUESTS + "_total", backend="none", code="429") == 6


async def test_requests_queued_past_the_deadline_get_503() -> None:
    async with AsyncExitStack() as stack:
        (s,) = await fleet(stack, 1, time_scale=0.2)
        r = await stack.enter_async_context(router([s.url], max_concurrency_per_backend=1, queue_timeout=0.2))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        hold = await client.post(r.url + "/v1/chat/completions", json=chat("hold", max_tokens=2000, stream=True))
        await hold.content.readany()
        async with client.post(r.url + "/v1/chat/completions", json=chat("late", max_tokens=1)) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"]
            assert "within 0.2s" in (await resp.json())["error"]["message"]
        hold.close()
        await eventually(lambda: r.router.dispatcher.pending == 0 and s.engine.num_running == 0)


async def test_client_disconnect_cancels_the_engine_request_and_counters_return_to_zero() -> None:
    async with AsyncExitStack() as stack:
        (s,) = await fleet(stack, 1, time_scale=0.2)
        r = await stack.enter_async_context(router([s.url], max_concurrency_per_backend=1))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        backend = r.router.pool.backends[s.url]
        stream = await client.post(r.url + "/v1/chat/completions", json=chat("endless", max_tokens=3000, stream=True))
        await stream.content.readany()
        queued = asyncio.create_task(client.post(r.url + "/v1/chat/completions", json=chat("queued", max_tokens=3000)))
        await eventually(lambda: r.router.dispatcher.pending == 1)
        assert backend.in_flight == 1 and s.engine.num_running == 1
        stream.close()
        # The queued request gets the slot; then it disconnects too.
        await eventually(lambda: r.router.dispatcher.pending == 0 and s.engine.stats.aborted == 1)
        await eventually(lambda: s.engine.num_running == 1)
        queued.cancel()
        await eventually(lambda: backend.in_flight == 0 and s.engine.num_running == 0 and s.engine.stats.aborted == 2)
        assert s.engine.pool.used == 0
        async with client.get(r.url + "/metrics") as resp:
            text = await resp.text()
        assert metric_value(text, contract.ROUTER_METRIC_IN_FLIGHT, backend=s.url) == 0
        assert metric_value(text, contract.ROUTER_METRIC_PENDING) == 0
