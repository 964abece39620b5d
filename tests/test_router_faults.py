"""Engines failing under the router: ejection, recovery, retries, broken streams."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from contextlib import AsyncExitStack

import aiohttp
import pytest
from aiohttp import web

from tensorfleet import contract
from tensorfleet.testing.loopback import (
    MODEL,
    chat,
    engine_error,
    fake_engine,
    free_port,
    metric_value,
    post_chat,
    router,
    sim,
    sim_process,
    sse_events,
)
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio


class Clock:
    """The router's breaker clock (`BackendPool.clock`), moved by the test: an ejection ends when the test says."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


async def cut_stream(request: web.Request) -> web.StreamResponse:
    """A `fake_engine` handler: starts an SSE stream, sends one event and part of the next, then drops the
    connection, as a process killed mid-generation does."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices":[{"index":0,"text":" first"}]}\n\ndata: {"choi')
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.abort()
    return response


async def test_engine_that_dies_is_retried_around_ejected_and_probed_back() -> None:
    port = free_port()
    async with AsyncExitStack() as stack:
        live = await stack.enter_async_context(sim())
        doomed_context = sim(port=port)
        doomed = await doomed_context.__aenter__()
        # Health checks only at start-up: ejection and recovery come from traffic.
        r = await stack.enter_async_context(router([doomed.url, live.url], strategy="round-robin", health_interval=60))
        clock = r.router.pool.clock = Clock()
        client = await stack.enter_async_context(aiohttp.ClientSession())
        assert (await post_chat(client, r.url, chat("warm", max_tokens=2))).status == 200
        assert (await post_chat(client, r.url, chat("warm", max_tokens=2))).status == 200
        backend = r.router.pool.backends[doomed.url]
        assert backend.healthy and doomed.engine.stats.prompt_tokens > 0
        await doomed_context.__aexit__(None, None, None)
        # It is gone: connection refused, nothing was sent, so the request is
        # retried on the live engine and the client never notices.
        results = [await post_chat(client, r.url, chat(f"q{i}", max_tokens=2)) for i in range(6)]
        assert [(a.status, a.backend) for a in results] == [(200, live.url)] * 6
        assert not backend.healthy
        async with client.get(r.url + "/metrics") as resp:
            text = await resp.text()
        assert metric_value(text, contract.ROUTER_METRIC_BACKEND_HEALTHY, backend=backend.url) == 0
        assert metric_value(text, contract.ROUTER_METRIC_RETRIES + "_total", reason="connect") == 1
        assert metric_value(text, contract.ROUTER_METRIC_EJECTIONS + "_total", backend=backend.url) == 1
        # Back on the same address: once the clock reaches the ejection time one
        # request probes it (half-open), succeeds, and the breaker closes.
        revived = await stack.enter_async_context(sim(port=port))
        clock.now = backend.breaker.open_until
        results = [await post_chat(client, r.url, chat(f"again {i}", max_tokens=2)) for i in range(6)]
        assert backend.healthy
        assert Counter(a.backend for a in results)[revived.url] >= 2


async def test_engine_down_at_start_is_ejected_by_health_checks_and_recovers() -> None:
    port = free_port()
    dead_url = f"http://127.0.0.1:{port}"
    async with AsyncExitStack() as stack:
        live = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([dead_url, live.url], strategy="round-robin"))
        clock = r.router.pool.clock = Clock()
        client = await stack.enter_async_context(aiohttp.ClientSession())
        dead = r.router.pool.backends[dead_url]
        await eventually(lambda: not dead.healthy)
        results = [await post_chat(client, r.url, chat(f"q{i}", max_tokens=2)) for i in range(4)]
        assert [(a.status, a.backend) for a in results] == [(200, live.url)] * 4
        revived = await stack.enter_async_context(sim(port=port))

        def recovered() -> bool:
            # Ejected until the clock passes its ejection time; then the next health check probes it back.
            clock.now = max(clock.now, dead.breaker.open_until)
            return dead.healthy
        await eventually(recovered, timeout=5)
        results = [await post_chat(client, r.url, chat(f"again {i}", max_tokens=2)) for i in range(6)]
        assert Counter(a.backend for a in results) == {revived.url: 3, live.url: 3}


async def test_5xx_is_retried_on_another_engine_then_ejected() -> None:
    async with AsyncExitStack() as stack:
        bad_url, calls = await stack.enter_async_context(fake_engine(engine_error))
        live = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([bad_url, live.url], strategy="round-robin", health_interval=60))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        results = [await post_chat(client, r.url, chat(f"q{i}", max_tokens=2)) for i in range(8)]
        assert [(a.status, a.backend) for a in results] == [(200, live.url)] * 8
        assert calls == ["/v1/chat/completions"] * 3  # the threshold: then ejected, no more traffic
        assert not r.router.pool.backends[bad_url].healthy


async def test_an_engine_hanging_up_before_answering_gets_the_request_once_more_on_a_new_connection() -> None:
    """A pooled connection the engine closes as a request is sent on it (its keep-alive ran out first) is no engine
    fault: the request goes to it once more, with no retries left to spend, and counts as closed_idle. An engine that
    hangs up on that one too fails the request and counts a fault."""
    hang_ups = [1]

    async def flaky(request: web.Request) -> web.StreamResponse:
        if hang_ups[0]:
            hang_ups[0] -= 1
            assert request.transport is not None
            request.transport.abort()
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})

    async with AsyncExitStack() as stack:
        url, calls = await stack.enter_async_context(fake_engine(flaky))
        r = await stack.enter_async_context(router([url], retries=0, health_interval=60))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        backend = r.router.pool.backends[url]
        async with client.post(r.url + "/v1/chat/completions", json=chat("x")) as resp:
            assert (resp.status, await resp.json()) == (200, {"choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}}]})
        assert calls.count("/v1/chat/completions") == 2 and backend.healthy and backend.breaker.failures == 0
        async with client.get(r.url + "/metrics") as answer:
            assert metric_value(await answer.text(), contract.ROUTER_METRIC_RETRIES + "_total",
                                reason="closed_idle") == 1
        hang_ups[0] = 2
        async with client.post(r.url + "/v1/chat/completions", json=chat("x")) as resp:
            assert resp.status == 502
        assert calls.count("/v1/chat/completions") == 4 and backend.breaker.failures == 1


async def test_when_every_engine_fails_the_client_gets_the_engine_error() -> None:
    async with AsyncExitStack() as stack:
        bad_url, _ = await stack.enter_async_context(fake_engine(engine_error))
        r = await stack.enter_async_context(router([bad_url], health_interval=60))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        async with client.post(r.url + "/v1/chat/completions", json=chat("x")) as resp:
            assert resp.status == 500
            assert "CUDA error" in (await resp.json())["error"]["message"]


async def test_failure_after_the_first_byte_of_a_stream_that_cannot_resume_ends_with_an_error_event() -> None:
    async with AsyncExitStack() as stack:
        cut_url, _calls = await stack.enter_async_context(fake_engine(cut_stream))
        live = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([cut_url, live.url], strategy="round-robin", health_interval=60))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        # With logprobs a continuation could not give the client the tokens' logprobs it already has: not
        # resumable (test_router_resume.py has the streams that are).
        async with client.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5,
                                                                "logprobs": 1, "stream": True}) as resp:
            assert resp.status == 200 and resp.headers[contract.BACKEND_HEADER] == cut_url
            events = [data async for _, data in sse_events(resp)]
        assert json.loads(events[0])["choices"][0]["text"] == " first"
        error = json.loads(events[-1])["error"]
        assert error["code"] == 502 and "mid-stream" in error["message"]
        assert "[DONE]" not in events
        # Not retried: the live engine never saw it.
        assert live.engine.stats.prompt_tokens == 0
        assert r.router.pool.backends[cut_url].in_flight == 0
        async with client.get(r.url + "/metrics") as m:
            text = await m.text()
        assert metric_value(text, contract.ROUTER_METRIC_STREAM_ERRORS + "_total", backend=cut_url) == 1


async def test_killed_engine_process_mid_stream_surfaces_an_error_and_the_next_request_succeeds() -> None:
    async with sim_process("--time-scale", "0.2") as (engine_url, process), AsyncExitStack() as stack:
        live = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([engine_url, live.url], strategy="round-robin"))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        # n=2: not resumable (test_router_resume.py resumes the streams that are).
        async with client.post(r.url + "/v1/chat/completions",
                               json=chat("long", max_tokens=1000, stream=True, n=2)) as resp:
            assert resp.headers[contract.BACKEND_HEADER] == engine_url
            events = []
            async for _, data in sse_events(resp):
                events.append(data)
                if len(events) == 3:
                    process.send_signal(signal.SIGKILL)
        assert "error" in json.loads(events[-1])
        assert all("error" not in json.loads(e) for e in events[:3])
        # Killed: the next requests go to the live engine, no client error.
        for i in range(4):
            answer = await post_chat(client, r.url, chat(f"after {i}", max_tokens=2))
            assert (answer.status, answer.backend) == (200, live.url)
