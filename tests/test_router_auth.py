"""API keys and per-key limits at the router (spec.router.auth): real routers in front of simulators or fake
engines on loopback, keys in a directory laid out as the kubelet mounts a Secret. The limits run on a clock the
test moves, and the fairness test watches the order in which requests reach the engine: no assertion depends on
how long anything takes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tensorfleet import contract
from tensorfleet.router.backends import Backend, BackendPool
from tensorfleet.router.dispatch import Dispatcher
from tensorfleet.router.scheduling import RequestInfo, make_profile
from tensorfleet.router.tenants import MAX_KEY_BYTES, KeyRing, KeysError, Limits, UsageMeter, read_keys
from tensorfleet.router.waitqueue import QueueFull
from tensorfleet.testing.loopback import (
    MODEL,
    chat,
    fake_engine,
    metric_value,
    post_chat,
    router,
    sim,
    sse_events,
)
from tensorfleet.testing.wait import eventually

KEYS = {"team-a": "sk-team-a-6f0c2b1e9d8a4c7f", "team-b": "sk-team-b-0a9e8d7c6b5a4f3e"}
CLIENT = aiohttp.ClientTimeout(total=20)  # only ever reached when a test fails


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class SecretVolume:
    """A directory laid out as the kubelet mounts a Secret: the files in a timestamped directory, `..data` a link
    to it, and one link per key into `..data`. An update writes a new timestamped directory and swaps `..data`
    in one rename, as the kubelet's AtomicWriter does."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.version = 0

    def write(self, data: dict[str, str]) -> None:
        self.version += 1
        version = f"..2025_01_01_00_00_00.{self.version}"
        (self.path / version).mkdir()
        for name, value in data.items():
            (self.path / version / name).write_text(value + "\n")  # `echo KEY > file` leaves a newline
        data_link = self.path / "..data"
        old = os.readlink(data_link) if data_link.is_symlink() else None
        (self.path / "..data_tmp").symlink_to(version)
        os.replace(self.path / "..data_tmp", data_link)
        for name in data:
            if not (self.path / name).is_symlink():
                (self.path / name).symlink_to(f"..data/{name}")
        for entry in self.path.iterdir():
            if not entry.name.startswith(".") and entry.name not in data:
                entry.unlink()
        if old is not None:
            shutil.rmtree(self.path / old)


class Clock:
    """The router's limits clock (`Limits.clock`), moved by the test."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


async def metrics_text(client: aiohttp.ClientSession, url: str) -> str:
    async with client.get(url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def completion(content: str) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


# --- authentication --------------------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_every_request_needs_a_key_in_force_but_health_and_metrics_do_not(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    SecretVolume(tmp_path).write(KEYS)
    headers_seen: list[dict[str, str]] = []

    async def answer(request: web.Request) -> web.Response:
        headers_seen.append(dict(request.headers))
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        return web.json_response(completion("hello"))

    async with AsyncExitStack() as stack:
        engine_url, calls = await stack.enter_async_context(fake_engine(answer))
        r = await stack.enter_async_context(router([engine_url], api_keys=str(tmp_path)))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))
        refusals = [({}, "missing"), (bearer("sk-team-a-wrong"), "invalid"), ({"Authorization": "Bearer"}, "invalid"),
                    ({"Authorization": KEYS["team-a"]}, "invalid"),  # no scheme
                    ({"Authorization": f"Basic {KEYS['team-a']}"}, "invalid"),
                    (bearer(KEYS["team-a"] + KEYS["team-b"]), "invalid")]
        for headers, _ in refusals:
            reply = await post_chat(client, r.url, chat("x"), headers=headers)
            assert reply.status == 401, headers
            assert reply.headers["WWW-Authenticate"] == "Bearer"
            error = reply.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
            assert not any(key in error["message"] for key in KEYS.values())
        async with client.get(r.url + "/v1/models") as resp:
            assert resp.status == 401
        assert calls == []  # nothing reached the engine
        # The probes and Prometheus need no key.
        async with client.get(r.url + "/health") as resp:
            assert resp.status == 200
        # A key in force: served, and the key stays at the router (the engine never sees a tenant's key).
        reply = await post_chat(client, r.url, chat("x"), headers=bearer(KEYS["team-a"]))
        assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == "hello"
        assert "Authorization" not in headers_seen[-1] and "authorization" not in headers_seen[-1]
        # The scheme is case-insensitive (RFC 9110); spaces around the key do not count.
        reply = await post_chat(client, r.url, chat("x"), headers={"Authorization": f"bearer   {KEYS['team-b']}"})
        assert reply.status == 200
        async with client.get(r.url + "/v1/models", headers=bearer(KEYS["team-b"])) as resp:
            assert resp.status == 200 and (await resp.json())["data"][0]["id"] == MODEL
        text = await metrics_text(client, r.url)
    failures = contract.ROUTER_METRIC_AUTH_FAILURES + "_total"
    assert metric_value(text, failures, reason="missing") == 2  # one chat, one /v1/models
    assert metric_value(text, failures, reason="invalid") == len(refusals) - 1
    requests = contract.ROUTER_METRIC_TENANT_REQUESTS + "_total"
    assert metric_value(text, requests, tenant="team-a", code="200") == 1
    assert metric_value(text, requests, tenant="team-b", code="200") == 1
    assert metric_value(text, contract.ROUTER_METRIC_API_KEYS) == 2
    # Tenants are named; keys never are, in the metrics or the log.
    for key in KEYS.values():
        assert key not in text and key not in caplog.text
    assert "refused a request from 127.0.0.1: missing API key" in caplog.text


@pytest.mark.asyncio
async def test_keys_are_read_again_when_the_secret_changes_without_a_restart(tmp_path: Path) -> None:
    volume = SecretVolume(tmp_path)
    first, rotated = "sk-team-a-first-0000000000", "sk-team-a-rotated-111111111"
    volume.write({"team-a": first})
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([s.url], api_keys=str(tmp_path), api_keys_reload_interval=0.05))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))

        async def status(key: str) -> int:
            return (await post_chat(client, r.url, chat("x", max_tokens=1), headers=bearer(key))).status

        assert await status(first) == 200
        assert await status(KEYS["team-b"]) == 401
        # The kubelet brings the edited Secret: team-a's key rotated, team-b added.
        volume.write({"team-a": rotated, "team-b": KEYS["team-b"]})
        await eventually(lambda: r.router.keys is not None and r.router.keys.tenants == {"team-a", "team-b"})
        assert [await status(key) for key in (rotated, KEYS["team-b"], first)] == [200, 200, 401]
        # team-a removed: its key stops working, and its series leave /metrics.
        volume.write({"team-b": KEYS["team-b"]})
        await eventually(lambda: r.router.keys is not None and r.router.keys.tenants == {"team-b"})
        assert [await status(key) for key in (rotated, KEYS["team-b"])] == [401, 200]
        text = await metrics_text(client, r.url)
    requests = contract.ROUTER_METRIC_TENANT_REQUESTS + "_total"
    assert metric_value(text, requests, tenant="team-a", code="200") is None
    assert metric_value(text, requests, tenant="team-b", code="200") == 2
    assert metric_value(text, contract.ROUTER_METRIC_API_KEYS) == 1


@pytest.mark.parametrize(("flags", "says"), [
    (["--api-keys", "/nonexistent/api-keys"], "error: --api-keys: cannot read /nonexistent/api-keys"),
    (["--requests-per-minute", "60"], "are per API key: give --api-keys"),
    (["--tokens-per-minute", "1000"], "are per API key: give --api-keys"),
])
def test_the_router_does_not_start_without_its_keys(flags: list[str], says: str) -> None:
    result = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "router", "--backend", "http://127.0.0.1:1",
                             *flags], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and says in result.stderr and "Traceback" not in result.stderr


# --- limits ----------------------------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_a_key_over_its_request_limit_gets_429_with_retry_after_while_another_key_is_served(
        tmp_path: Path) -> None:
    SecretVolume(tmp_path).write(KEYS)
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([s.url], api_keys=str(tmp_path), requests_per_minute=3))
        clock = r.router.key_limits.clock = Clock()
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))

        async def ask(tenant: str) -> Any:
            return await post_chat(client, r.url, chat("x", max_tokens=1), headers=bearer(KEYS[tenant]))

        assert [(await ask("team-a")).status for _ in range(3)] == [200, 200, 200]  # the burst: a minute's worth
        refused = await ask("team-a")
        assert refused.status == 429
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert "3 requests per minute" in error["message"]
        assert refused.headers["Retry-After"] == "20"  # one request back every 20 s
        served_before = s.engine.stats.prompt_tokens
        # The other key is not affected at all.
        assert [(await ask("team-b")).status for _ in range(3)] == [200, 200, 200]
        clock.now += 10
        assert (await ask("team-a")).headers["Retry-After"] == "10"
        clock.now += 10
        assert (await ask("team-a")).status == 200
        text = await metrics_text(client, r.url)
    assert s.engine.stats.prompt_tokens > served_before  # team-b's requests, and team-a's last one
    rejections = contract.ROUTER_METRIC_TENANT_REJECTIONS + "_total"
    assert metric_value(text, rejections, tenant="team-a", reason="requests") == 2
    assert metric_value(text, rejections, tenant="team-b", reason="requests") is None
    assert metric_value(text, contract.ROUTER_METRIC_TENANT_REQUESTS + "_total", tenant="team-a", code="429") == 2


@pytest.mark.asyncio
async def test_tokens_are_charged_at_admission_and_settled_to_what_was_used(tmp_path: Path) -> None:
    SecretVolume(tmp_path).write(KEYS)
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([s.url], api_keys=str(tmp_path), tokens_per_minute=120,
                                                   default_max_tokens=50))
        limits = r.router.key_limits
        clock = limits.clock = Clock()
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))

        async def ask(body: dict[str, Any], tenant: str = "team-a") -> Any:
            return await post_chat(client, r.url, body, headers=bearer(KEYS[tenant]))

        # Whole answers: the engine's usage is what counts.
        first = await ask(chat("hi", max_tokens=5))
        assert first.status == 200
        used = first.json()["usage"]["total_tokens"]
        assert limits.tokens_left("team-a") == 120 - used
        # Up to 200 more tokens: more than the bucket holds, so it needs a full one (120), 2 tokens a second.
        refused = await ask(chat("hi", max_tokens=200))
        assert refused.status == 429
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        assert refused.headers["Retry-After"] == str(-(-used // 2))
        assert (await ask(chat("hi", max_tokens=200), tenant="team-b")).status == 200  # its own bucket
        # No max_tokens: --default-max-tokens (50) is charged at admission, then settled.
        clock.now += 3600  # a full bucket, whatever debt there was
        unbounded = await ask({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": None})
        assert unbounded.status == 200
        assert limits.tokens_left("team-a") == 120 - unbounded.json()["usage"]["total_tokens"]
        # A stream whose client asked for no usage: the engine's own counts all the same (the router asks the
        # engine for them), which the client does not get.
        clock.now += 3600
        async with client.post(r.url + "/v1/chat/completions", json=chat("hi", max_tokens=10, stream=True),
                               headers=bearer(KEYS["team-a"])) as resp:
            events = [data async for _, data in sse_events(resp)]
        assert events[-1] == "[DONE]" and not any("usage" in json.loads(e) for e in events[:-1])
        counted = (await post_chat(client, s.url, chat("hi", max_tokens=10))).json()["usage"]["total_tokens"]
        await eventually(lambda: limits.tokens_left("team-a") != 120)  # settled once the handler ends
        assert limits.tokens_left("team-a") == 120 - counted
        # A stream with usage: the usage.
        clock.now += 3600
        body = chat("hi", max_tokens=10, stream=True, stream_options={"include_usage": True})
        async with client.post(r.url + "/v1/chat/completions", json=body, headers=bearer(KEYS["team-a"])) as resp:
            events = [data async for _, data in sse_events(resp)]
        total = json.loads(events[-2])["usage"]["total_tokens"]
        await eventually(lambda: limits.tokens_left("team-a") == 120 - total)
        # What the engine refuses costs nothing.
        clock.now += 3600
        assert (await ask({"model": MODEL, "messages": [], "max_tokens": 30})).status == 400
        await eventually(lambda: limits.tokens_left("team-a") == 120)
        # A request larger than a minute's tokens passes on a full bucket and leaves a debt the refill pays first.
        big = await ask(chat("hi", max_tokens=150))
        assert big.status == 200
        debt = big.json()["usage"]["total_tokens"] - 120
        assert limits.tokens_left("team-a") == -debt
        again = await ask(chat("hi", max_tokens=5))
        assert again.status == 429 and again.headers["Retry-After"] == str(-(-(debt + 6) // 2))
        text = await metrics_text(client, r.url)
    tokens = contract.ROUTER_METRIC_TENANT_TOKENS + "_total"
    assert metric_value(text, tokens, tenant="team-b") is not None
    assert metric_value(text, contract.ROUTER_METRIC_TENANT_REJECTIONS + "_total", tenant="team-a",
                        reason="tokens") == 2


# --- fairness --------------------------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_a_flooding_key_neither_fails_nor_delays_another_keys_request(tmp_path: Path) -> None:
    """One engine slot, a queue of 4. team-a holds the slot and floods the queue; team-b's one request still gets
    in (team-a's newest waiter makes room) and takes the very next free slot, ahead of team-a's queue."""
    SecretVolume(tmp_path).write(KEYS)
    arrived: list[str] = []  # what reached the engine, in order
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        content = (await request.json())["messages"][0]["content"]
        arrived.append(content)
        if content == "hold":
            await release.wait()
        return web.json_response(completion(content))

    async with AsyncExitStack() as stack:
        engine_url, _ = await stack.enter_async_context(fake_engine(answer))
        r = await stack.enter_async_context(router([engine_url], api_keys=str(tmp_path),
                                                   max_concurrency_per_backend=1, max_queue=4))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))
        dispatcher = r.router.dispatcher

        def send(tenant: str, content: str) -> asyncio.Task[Any]:
            return asyncio.create_task(post_chat(client, r.url, chat(content), headers=bearer(KEYS[tenant])))

        holder = send("team-a", "hold")
        await eventually(lambda: arrived == ["hold"])
        flood = [send("team-a", f"a{i}") for i in range(6)]
        # Four queue; the queue is full for the other two, and team-a has the most waiting: 429.
        await eventually(lambda: dispatcher.pending == 4 and sum(t.done() for t in flood) == 2)
        other = send("team-b", "b")
        # team-b gets in: team-a's newest waiter is refused to make room.
        await eventually(lambda: sum(t.done() for t in flood) == 3)
        assert dispatcher.pending_by_tenant() == {"team-a": 3, "team-b": 1}
        release.set()
        reply = await other
        replies = [await t for t in flood]
        assert (await holder).status == 200
        text = await metrics_text(client, r.url)
    assert reply.status == 200
    assert arrived[:2] == ["hold", "b"]  # the first slot to free went to team-b
    assert sorted(a.status for a in replies) == [200, 200, 200, 429, 429, 429]
    assert all("queue is full" in a.json()["error"]["message"] for a in replies if a.status == 429)
    rejections = contract.ROUTER_METRIC_TENANT_REJECTIONS + "_total"
    assert metric_value(text, rejections, tenant="team-a", reason="queue") == 3
    assert metric_value(text, rejections, tenant="team-b", reason="queue") is None


def test_free_slots_go_to_the_tenant_served_least_recently_each_tenant_in_arrival_order() -> None:
    async def scenario() -> list[str]:
        pool = BackendPool()
        pool.set_urls(["http://e"])
        dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=1, max_queue=10)
        holder = RequestInfo()
        held = await dispatcher.acquire(holder, tenant="a")
        order: list[str] = []

        async def wait(tenant: str, name: str) -> None:
            info = RequestInfo()
            backend = await dispatcher.acquire(info, tenant=tenant)
            order.append(name)
            await asyncio.sleep(0)
            dispatcher.release(backend, info)

        tasks = [asyncio.create_task(wait(t, n)) for t, n in
                 [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"), ("b", "b2")]]
        await asyncio.sleep(0)
        assert dispatcher.pending_by_tenant() == {"a": 3, "b": 2, "c": 1}
        dispatcher.release(held, holder)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["b1", "c1", "a1", "b2", "a2", "a3"]


def test_a_full_queue_makes_room_for_a_tenant_with_fewer_waiting() -> None:
    async def scenario() -> None:
        pool = BackendPool()
        pool.set_urls(["http://e"])
        dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=1, max_queue=3)
        holder = RequestInfo()
        held: Backend = await dispatcher.acquire(holder, tenant="a")
        a = [asyncio.create_task(dispatcher.acquire(RequestInfo(), tenant="a")) for _ in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as own:  # the queue is full of its own: refused, nothing displaced
            await dispatcher.acquire(RequestInfo(), tenant="a")
        assert not own.value.displaced
        b = asyncio.create_task(dispatcher.acquire(RequestInfo(), tenant="b"))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as displaced:
            await a[2]  # the newest of the tenant with the most
        assert displaced.value.displaced
        assert dispatcher.pending_by_tenant() == {"a": 2, "b": 1}
        # Two each would be even: b's second request does not displace a's.
        c = asyncio.create_task(dispatcher.acquire(RequestInfo(), tenant="b"))
        with pytest.raises(QueueFull):
            await c
        dispatcher.release(held, holder)
        assert await b is held  # b was never served: first
        for task in a[:2]:
            task.cancel()

    asyncio.run(scenario())


# --- the pieces, without sockets -------------------------------------------------------------------------------

def test_keys_files_one_per_tenant_or_tenant_colon_key_lines(tmp_path: Path) -> None:
    directory = tmp_path / "mounted"
    directory.mkdir()
    volume = SecretVolume(directory)
    volume.write({**KEYS, "team-c": "  sk-c  ", "bad name": "sk-bad", "team-d": "", "team-e": KEYS["team-a"]})
    keys, problems = read_keys(directory)
    assert keys == {"team-b": KEYS["team-b"].encode(), "team-c": b"sk-c"}
    assert problems == [
        "file bad name: tenant name 'bad name' is not 1-253 of -._a-zA-Z0-9",
        "file team-d: tenant team-d has an empty key",
        "tenants team-a, team-e have the same key: refused for all of them",
    ]
    lines = tmp_path / "keys"
    lines.write_text(f"# tenant:key\n\nteam-a: {KEYS['team-a']}\nteam-b:{KEYS['team-b']}\nteam-a:sk-again\n"
                     f"just-a-key\nteam-x:{'k' * (MAX_KEY_BYTES + 1)}\n")
    keys, problems = read_keys(lines)
    assert keys == {"team-a": KEYS["team-a"].encode(), "team-b": KEYS["team-b"].encode()}
    assert problems == ["line 6: not `tenant:key`", "line 5: tenant team-a is listed again; the first key counts",
                        f"line 7: tenant team-x's key is longer than {MAX_KEY_BYTES} bytes"]
    assert not any(key in problem for problem in problems for key in (*KEYS.values(), "sk-again"))
    with pytest.raises(KeysError):
        read_keys(tmp_path / "absent")


def test_key_ring_matches_bearer_keys_and_holds_only_salted_digests(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "keys").write_text("".join(f"{tenant}:{key}\n" for tenant, key in KEYS.items()))
    ring = KeyRing(tmp_path / "keys")
    ring.load()
    assert ring.tenant(f"Bearer {KEYS['team-a']}") == "team-a"
    assert ring.tenant(f"BEARER {KEYS['team-b']}") == "team-b"
    for header in (None, "", "Bearer ", f"Token {KEYS['team-a']}", f"Bearer {KEYS['team-a'][:-1]}", "Bearer \udcff"):
        assert ring.tenant(header) is None, header
    held = repr(vars(ring)).encode()
    assert not any(key.encode() in held for key in KEYS.values())
    assert not ring.refresh()  # nothing changed
    (tmp_path / "keys").write_text(f"team-a:{KEYS['team-a']}\n")
    assert ring.refresh() and ring.tenants == {"team-a"}
    (tmp_path / "keys").unlink()
    with caplog.at_level(logging.ERROR, logger="tensorfleet.router.auth"):
        assert not ring.refresh() and not ring.refresh()
    assert ring.tenants == {"team-a"}  # unreadable: the keys in force stay
    assert [r.getMessage().split(";")[1] for r in caplog.records] == [" the keys already loaded stay in force"]


def test_buckets_refill_evenly_say_when_and_carry_debts() -> None:
    clock = Clock()
    limits = Limits(requests_per_minute=60, tokens_per_minute=600, clock=clock)
    assert [limits.admit_request("t") for _ in range(60)] == [None] * 60
    refusal = limits.admit_request("t")
    assert refusal is not None and (refusal.limit, refusal.retry_after) == ("requests", 1)
    clock.now += 0.5
    refusal = limits.admit_request("t")
    assert refusal is not None and refusal.retry_after == 1  # at least 1 s, never 0
    clock.now += 0.5
    assert limits.admit_request("t") is None
    assert limits.admit_tokens("t", 500) is None
    refusal = limits.admit_tokens("t", 200)
    assert refusal is not None and (refusal.limit, refusal.retry_after) == ("tokens", 10)  # 100 more at 10/s
    limits.settle("t", 500, 50)  # it used 50: 450 back
    assert limits.tokens_left("t") == 550
    assert limits.admit_tokens("t", 5000) is not None  # more than a minute's worth needs a full bucket
    clock.now += 5
    assert limits.admit_tokens("t", 5000) is None
    limits.settle("t", 5000, 6000)
    assert limits.tokens_left("t") == -5400
    refusal = limits.admit_tokens("t", 1)
    assert refusal is not None and refusal.retry_after == 541
    limits.retain(frozenset({"u"}))
    assert limits.tokens_left("t") == 600  # forgotten: a tenant that comes back starts full


def test_usage_meter_reads_usage_or_takes_a_streams_counts() -> None:
    whole = UsageMeter(prompt=7)
    whole.answer(200, json.dumps({"choices": [{"text": '"total_tokens": 99'}],
                                  "usage": {"prompt_tokens": 5, "total_tokens": 12}}).encode())
    assert whole.used() == 12
    no_usage = UsageMeter(prompt=7)
    no_usage.answer(200, b'{"tokens": [1, 2]}')
    assert no_usage.used() is None  # answered, nothing said: the estimate stands
    failed = UsageMeter(prompt=7)
    failed.answer(400, b'{"error": {}, "usage": {"total_tokens": 3}}')
    assert failed.used() == 0
    assert UsageMeter(prompt=7).used() == 0  # never answered
    # A stream: the counts the router kept (resume.StreamState), its prompt estimate where no engine counted it.
    stream = UsageMeter(prompt=7)
    stream.stream(5, 3)
    assert stream.used() == 8
    uncounted = UsageMeter(prompt=7)
    uncounted.stream(None, 3)
    assert uncounted.used() == 7 + 3
