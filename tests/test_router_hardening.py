"""The router against clients and engines that misbehave, on loopback: what a client controls never ejects an
engine, the router's own timeouts, bounded memory, and a graceful shutdown. Every timeout is configured small and
every wait is for an outcome, never for a duration."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import signal
import zlib
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tensorfleet import contract
from tensorfleet.httpapi import RateLimitedLog
from tensorfleet.router.app import CLIENT_LOG
from tensorfleet.testing.loopback import (
    MODEL,
    chat,
    engine_error,
    fake_engine,
    free_port,
    metric_value,
    post_chat,
    raw_exchange,
    router,
    sim,
    sim_process,
    spawn_router,
    sse_events,
    wait_healthy,
)
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio

CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=20)  # only ever reached when a test fails


async def never_answer(_: web.Request) -> web.StreamResponse:
    """A `fake_engine` handler: takes the request and never answers."""
    await asyncio.sleep(3600)
    return web.Response()


async def drop_connection(request: web.Request) -> web.StreamResponse:
    """A `fake_engine` handler: drops the connection."""
    assert request.transport is not None
    request.transport.abort()
    return await never_answer(request)


async def stall_stream(request: web.Request) -> web.StreamResponse:
    """A `fake_engine` handler: starts an SSE stream, sends one event, then nothing more."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices":[{"index":0,"text":" first"}]}\n\n')
    await asyncio.sleep(3600)
    return response


def raw_post(body: bytes, *, target: str = "/v1/chat/completions", extra: bytes = b"") -> bytes:
    """A complete HTTP/1.1 POST with BODY, as bytes; `target` as the request line has it."""
    return (b"POST %s HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (target.encode(), len(body), extra)) + body


async def metrics_text(client: aiohttp.ClientSession, url: str) -> str:
    async with client.get(url + "/metrics") as resp:
        return await resp.text()


# --- 1. health accounting: only the engine's faults ----------------------------------------------------------

async def test_requests_the_router_can_refuse_never_count_against_engines() -> None:
    async with AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(sim()) for _ in range(3)]
        # Health checks only at start-up: whatever happens to the breakers comes from these requests.
        r = await stack.enter_async_context(router([s.url for s in sims], strategy="round-robin", health_interval=60))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        body = json.dumps(chat("hello", max_tokens=2)).encode()
        for _ in range(3):  # the breaker's threshold, on every engine
            async with client.post(r.url + "/v1/chat/completions", data=gzip.compress(body),
                                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as resp:
                assert resp.status == 415 and (await resp.json())["error"]["code"] == 415
            # Absolute form, which HTTP/1.1 servers must accept: served, the engine gets the route's path.
            answer = await raw_exchange(r.url, raw_post(body, target="http://example.com/v1/chat/completions",
                                                        extra=b"Connection: close\r\n"))
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            for method, path, status in (("POST", "/v1/load_lora_adapter", 404), ("POST", "/v1/responses", 404),
                                         ("DELETE", "/v1/chat/completions", 405), ("GET", "/v1/chat/completions", 405)):
                async with client.request(method, r.url + path, data=body) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == status and error["code"] == status, (method, path)
            # The engine's own 4xx: the client's mistake, passed through, neutral for the engine.
            assert (await post_chat(client, r.url, {"model": MODEL, "messages": []})).status == 400
        assert [(b.state, b.breaker.failures) for b in r.router.pool] == [("closed", 0)] * 3
        assert sum(s.engine.stats.prompt_tokens for s in sims) > 0  # the absolute-form requests were served
        assert {(await post_chat(client, r.url, chat(f"after {i}", max_tokens=2))).status for i in range(3)} == {200}


async def test_a_request_that_fails_on_every_engine_counts_against_none_and_no_message_names_one() -> None:
    async with AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(fake_engine(engine_error)) for _ in range(3)]
        r = await stack.enter_async_context(router([url for url, _ in engines], strategy="round-robin",
                                                   health_interval=60))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        for i in range(3):
            async with client.post(r.url + "/v1/chat/completions", json=chat(f"q{i}")) as resp:
                assert resp.status == 500 and "CUDA error" in (await resp.json())["error"]["message"]
        # Each request was tried on all three engines and failed on all: likelier the request's fault than all
        # three engines', so none is charged (nine 500s, no failure counted, no ejection).
        assert sum(len(calls) for _, calls in engines) == 9
        assert [(b.healthy, b.breaker.failures) for b in r.router.pool] == [(True, 0)] * 3
        # Engines that drop the connection: the router's 502 says what happened, not where.
        resetting = [await stack.enter_async_context(fake_engine(drop_connection)) for _ in range(2)]
        broken = await stack.enter_async_context(router([url for url, _ in resetting], health_interval=60))
        async with client.post(broken.url + "/v1/chat/completions", json=chat("x")) as resp:
            message = (await resp.json())["error"]["message"]
        assert resp.status == 502 and "2 tried" in message
        assert "127.0.0.1" not in message and not any(url.rsplit(":", 1)[1] in message for url, _ in resetting)


# --- 2. timeouts the router owns ---------------------------------------------------------------------------------

async def test_a_hung_engine_is_ejected_by_one_unanswered_health_check_and_its_waiting_request_moves() -> None:
    async with sim_process("--time-scale", "0.01") as (hung_url, process), AsyncExitStack() as stack:
        live = await stack.enter_async_context(sim())
        # Health checks only at start-up, and a first-byte bound far away: the test runs the one check that
        # finds the hang, and only that check can free the request stuck on it.
        r = await stack.enter_async_context(router([hung_url, live.url], strategy="round-robin",
                                                   health_interval=60, health_timeout=0.5,
                                                   first_byte_timeout=60))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        warm = [await post_chat(client, r.url, chat(f"warm {i}", max_tokens=2)) for i in range(2)]
        assert [(a.status, a.backend) for a in warm] == [(200, hung_url), (200, live.url)]
        hung = r.router.pool.backends[hung_url]
        process.send_signal(signal.SIGSTOP)
        try:
            stuck = asyncio.create_task(post_chat(client, r.url, chat("stuck", max_tokens=2)))
            await eventually(lambda: hung.in_flight == 1)
            await r.router.fleet.check(hung)
            assert not hung.healthy and hung.breaker.unresponsive
            moved = await stuck
            assert (moved.status, moved.backend) == (200, live.url)
            # Ejected as unresponsive: no client request is sent to probe it, only health checks may.
            hung.breaker.open_until = 0.0
            results = [await post_chat(client, r.url, chat(f"after {i}", max_tokens=2)) for i in range(4)]
            assert [(a.status, a.backend) for a in results] == [(200, live.url)] * 4
            text = await metrics_text(client, r.url)
            assert metric_value(text, contract.ROUTER_METRIC_RETRIES + "_total", reason="unresponsive") == 1
        finally:
            process.send_signal(signal.SIGCONT)


async def test_an_engine_that_sends_nothing_within_the_first_byte_bound_is_left_for_another() -> None:
    async with AsyncExitStack() as stack:
        silent_url, calls = await stack.enter_async_context(fake_engine(never_answer))
        live = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([silent_url, live.url], strategy="round-robin", health_interval=60,
                                                   first_byte_timeout=1.0))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        answer = await post_chat(client, r.url, chat("q", max_tokens=2, stream=True))
        assert (answer.status, answer.backend) == (200, live.url)
        await eventually(lambda: calls == ["/v1/chat/completions", "closed"])  # the router hung up: it aborts
        silent = r.router.pool.backends[silent_url]
        assert silent.healthy and silent.breaker.failures == 0  # slow is not sick: its health checks say which
        text = await metrics_text(client, r.url)
        assert metric_value(text, contract.ROUTER_METRIC_RETRIES + "_total", reason="timeout") == 1
        # The bound: the base, plus the prompt's prefill, plus a whole answer when it is not streamed.
        bound = r.router.first_byte_bound
        assert bound("/v1/chat/completions", chat("x", stream=True)) == pytest.approx(1.0 + 1 / 1000)
        assert bound("/v1/chat/completions", chat("x" * 30_000, stream=True)) == pytest.approx(1.0 + 10_001 / 1000)
        assert bound("/v1/chat/completions", chat("x", max_tokens=100)) == pytest.approx(1.0 + 1 / 1000 + 100 / 5)
        assert bound("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}) is None
        assert bound("/v1/completions", {"prompt": [1, 2, 3], "stream": True}) == pytest.approx(1.0 + 3 / 1000)
        assert bound("/v1/embeddings", {"input": "x" * 300}) == pytest.approx(1.0 + 101 / 1000)


async def test_a_stream_that_stalls_ends_with_an_sse_error_event() -> None:
    async with AsyncExitStack() as stack:
        stall_url, calls = await stack.enter_async_context(fake_engine(stall_stream))
        r = await stack.enter_async_context(router([stall_url], health_interval=60, stream_idle_timeout=0.3))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        async with client.post(r.url + "/v1/completions",
                               json={"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}) as resp:
            assert resp.status == 200
            events = [data async for _, data in sse_events(resp)]
        assert json.loads(events[0])["choices"][0]["text"] == " first"
        error = json.loads(events[-1])["error"]
        assert error["code"] == 504 and "sent nothing for 0.3s" in error["message"]
        assert "127.0.0.1" not in error["message"] and "[DONE]" not in events
        await eventually(lambda: calls[-1:] == ["closed"])
        assert r.router.pool.backends[stall_url].healthy
        text = await metrics_text(client, r.url)
        assert metric_value(text, contract.ROUTER_METRIC_STREAM_ERRORS + "_total", backend=stall_url) == 1


async def test_slow_senders_and_idle_connections_are_cut() -> None:
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([s.url], header_timeout=0.3, body_timeout=0.3, idle_timeout=0.6))
        # A head that never ends, a connection that never starts one: 408, closed.
        for sent in (b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Le", b""):
            answer = await raw_exchange(r.url, sent, timeout=5)
            assert answer.startswith(b"HTTP/1.1 408") and not answer.endswith(b"<open>"), answer[:100]
        # A body that never ends.
        answer = await raw_exchange(r.url, raw_post(b"x" * 1000)[:-900], timeout=5)
        assert answer.startswith(b"HTTP/1.1 408") and b"request body did not arrive" in answer
        assert not answer.endswith(b"<open>")
        assert r.router.body_budget.used == 0
        # A complete request is answered; the idle keep-alive connection is then closed.
        answer = await raw_exchange(r.url, raw_post(json.dumps(chat("x", max_tokens=2)).encode()), timeout=5)
        assert answer.startswith(b"HTTP/1.1 200") and not answer.endswith(b"<open>")


# --- 3. bounded memory ----------------------------------------------------------------------------------------

async def test_compressed_bodies_are_refused_unread() -> None:
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([s.url], max_body_bytes=1024 * 1024))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        body = json.dumps(chat("hello", max_tokens=2)).encode()
        bomb = gzip.compress(b"\0" * (32 * 1024 * 1024))  # 32 KiB that would inflate 1000-fold
        for encoding, data in (("gzip", bomb), ("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                               ("br", b"\x8b\x02\x80hello\x03"), ("GZIP, identity", gzip.compress(body))):
            async with client.post(r.url + "/v1/chat/completions", data=data,
                                   headers={"Content-Type": "application/json", "Content-Encoding": encoding}) as resp:
                assert resp.status == 415, encoding
                assert (await resp.json())["error"]["type"] == "BadRequestError"
                assert resp.headers["Connection"] == "close"
        assert r.router.body_budget.peak == 0  # not one byte of them was read
        assert s.engine.stats.prompt_tokens == 0
        async with client.post(r.url + "/v1/chat/completions", data=body,
                               headers={"Content-Type": "application/json", "Content-Encoding": "identity"}) as resp:
            assert resp.status == 200


async def test_a_cookie_an_engine_sets_is_neither_kept_nor_sent_on_with_other_clients_requests() -> None:
    # The router's upstream session is shared by every client: a cookie an engine (or a proxy in front of it)
    # sets on one answer must not ride on the next client's request, nor reach the client.
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Cookie"))
        response = web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})
        response.set_cookie("session", f"client-{len(seen)}", path="/")
        return response

    async with AsyncExitStack() as stack:
        engine_url, calls = await stack.enter_async_context(fake_engine(answer))
        # By a host name, as a Service's DNS name would be: aiohttp's default jar keeps no cookie of an IP address.
        named = engine_url.replace("127.0.0.1", "localhost")
        r = await stack.enter_async_context(router([named], health_interval=60))
        for i in range(3):
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client:  # three different clients
                reply = await post_chat(client, r.url, chat(f"q{i}"))
            assert reply.status == 200 and "Set-Cookie" not in reply.headers
        assert len(calls) == 3 and seen == [None, None, None]


async def test_request_bodies_in_flight_are_capped_and_the_excess_gets_503() -> None:
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        cap = 1_000_000
        r = await stack.enter_async_context(router([s.url], max_body_bytes=512 * 1024, max_body_bytes_in_flight=cap))
        budget = r.router.body_budget
        request = raw_post(json.dumps({**chat("x", max_tokens=1), "padding": "x" * 300_000}).encode())
        # Three whole bodies fit under the cap; three 250 kB parts and a fourth whole body do not.
        part = 250_000
        held = []
        for i in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", int(r.url.rsplit(":", 1)[1]))
            writer.write(request[:part])
            held.append((reader, writer))
            await eventually(lambda: budget.used >= len(held) * (part - 200))
        answer = await raw_exchange(r.url, request)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer and b"Connection: close" in answer
        assert budget.peak <= cap and budget.refused == 1
        # The held ones complete and are answered; their bytes are given back.
        for reader, writer in held:
            writer.write(request[part:])
        for reader, writer in held:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
            assert head.startswith(b"HTTP/1.1 200"), head
            writer.close()
        await eventually(lambda: budget.used == 0)
        assert s.engine.stats.prompt_tokens > 0


async def test_json_nesting_and_size_limits_answer_400_before_any_engine() -> None:
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([s.url], max_json_depth=16, max_json_values=150_000))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))

        def nested(depth: int) -> object:
            value: object = "leaf"
            for _ in range(depth):
                value = {"a": [value]}
            return value

        cases = [
            (b"[" * 100_000 + b"]" * 100_000, "deeper than 16"),            # past Python's recursion limit
            (json.dumps({**chat("x"), "extra": nested(8)}).encode(), "deeper than 16"),
            (json.dumps({**chat("x"), "extra": [0] * 200_000}).encode(), "more than 150000 JSON values"),
        ]
        for data, message in cases:
            async with client.post(r.url + "/v1/chat/completions", data=data) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and message in error["message"], error
        assert s.engine.stats.prompt_tokens == 0
        async with client.post(r.url + "/v1/chat/completions", json={**chat("x", max_tokens=2), "extra": nested(7)}
                               ) as resp:
            assert resp.status == 200


async def test_malformed_requests_log_rate_limited_lines_without_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    limiter = next(f for f in logging.getLogger(CLIENT_LOG).filters if isinstance(f, RateLimitedLog))
    limiter.tokens, limiter.suppressed = float(limiter.burst), 0
    caplog.set_level(logging.INFO)
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([s.url]))
        for _ in range(40):
            answer = await raw_exchange(r.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nBad Header\r\n\r\n",
                                        timeout=5)
            assert b" 400 " in answer.split(b"\r\n", 1)[0]
    lines = [rec for rec in caplog.records if "Error handling request" in rec.getMessage() or rec.exc_info]
    assert 1 <= len(lines) <= limiter.burst + 3  # 40 bad requests; a burst, then about one a second
    assert all(rec.exc_info is None and rec.levelno == logging.INFO for rec in lines)
    assert all("Traceback" not in rec.getMessage() and "\n" not in rec.getMessage() for rec in lines)


# --- 4. graceful shutdown ---------------------------------------------------------------------------------------

async def test_sigterm_keeps_serving_through_the_drain_delay_then_lets_streams_finish_or_ends_them(
        tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim(time_scale=0.2))  # ~14 ms a token
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = stack.enter_context((tmp_path / "router.log").open("wb"))
        process = stack.enter_context(spawn_router(port, [s.url], "--drain-delay", "1.5", "--shutdown-grace", "3.5",
                                                   "--log-level", "info", log=log))
        await wait_healthy(url)
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))

        async def stream(max_tokens: int, started: asyncio.Event) -> list[str]:
            body = {"model": MODEL, "prompt": "count", "max_tokens": max_tokens, "stream": True}
            async with client.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                events = []
                async for _, data in sse_events(resp):
                    events.append(data)
                    started.set()
                return events

        # ~2 s, so it outlives the drain delay and finishes within the grace; and one that would never finish.
        short_started, long_started = asyncio.Event(), asyncio.Event()
        short = asyncio.create_task(stream(150, short_started))
        endless = asyncio.create_task(stream(4000, long_started))  # ~1 min
        await asyncio.wait_for(asyncio.gather(short_started.wait(), long_started.wait()), 20)
        process.send_signal(signal.SIGTERM)
        # Still accepting while the endpoints go: a new connection is served, and told not to come back.
        async with (aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                          timeout=CLIENT_TIMEOUT) as fresh,
                    fresh.post(url + "/v1/chat/completions", json=chat("during the drain", max_tokens=2)) as resp):
            assert resp.status == 200 and resp.headers["Connection"] == "close"

        async def refused() -> bool:
            try:
                await asyncio.open_connection("127.0.0.1", port)
            except ConnectionRefusedError:
                return True
            return False
        await eventually(refused, timeout=15, interval=0.05)
        finished = await short
        assert finished[-1] == "[DONE]" and all("error" not in e for e in finished[:-1])
        cut = await endless
        error = json.loads(cut[-1])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        assert await asyncio.to_thread(process.wait, 20) == 0
