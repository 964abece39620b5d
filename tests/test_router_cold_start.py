"""No engine to wait for (503 at once, Retry-After) versus a cold start (queue): real router and simulators on
loopback, and EndpointSlices from kmock's API emulator.

Every request here has a queue timeout of 30 s and a client timeout of 3 s: an answer that comes at all came
from the router knowing, not from the queue giving up.
"""

from __future__ import annotations

import asyncio
import signal
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest

from tensorfleet import contract
from tensorfleet.kube.connection import Connection
from tensorfleet.kube.endpoints import SliceEndpoints, slice_endpoints
from tensorfleet.router import NO_ENGINE_RETRY_SECONDS
from tensorfleet.router.backends import CLOSED, JOINING, OPEN, Backend, BackendPool, Breaker, BreakerPolicy
from tensorfleet.router.dispatch import Dispatcher, Unavailable
from tensorfleet.router.scheduling import RequestInfo, make_profile
from tensorfleet.testing.loopback import (
    Reply,
    chat,
    free_port,
    metric_value,
    post_chat,
    router,
    sim,
    sim_process,
)
from tensorfleet.testing.wait import eventually

QUEUE_TIMEOUT = 30.0
CLIENT = aiohttp.ClientTimeout(total=3)
# Ejections long enough that no request in a test lands on the half-open probe of a dead engine.
LONG_EJECTION = BreakerPolicy(failure_threshold=3, ejection_seconds=5.0, max_ejection_seconds=5.0)

RESOURCE = "discovery.k8s.io/v1/endpointslices"
NAMESPACE = "serving"
SERVICE = contract.engine_service_name("llama")
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


async def ask(client: aiohttp.ClientSession, url: str, content: str = "x") -> Reply:
    return await post_chat(client, url, chat(content, max_tokens=2))


def refused_at_once(reply: Reply, *, most: int) -> int:
    """Assert an OpenAI-style 503 from the router saying no engine is available; its Retry-After."""
    assert reply.status == 503, reply.body
    error = reply.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert "no engine is available" in error["message"]
    assert "127.0.0.1" not in error["message"]
    retry = int(reply.headers["Retry-After"])
    assert 1 <= retry <= most, retry
    return retry


# --- no engine: 503 at once -----------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_an_engine_that_was_up_and_is_gone_gets_503_at_once_with_the_ejection_as_retry_after() -> None:
    async with AsyncExitStack() as stack:
        engine = sim()
        s = await engine.__aenter__()
        r = await stack.enter_async_context(router([s.url], queue_timeout=QUEUE_TIMEOUT, breaker=LONG_EJECTION))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))
        assert (await ask(client, r.url)).status == 200
        await engine.__aexit__(None, None, None)
        backend = r.router.pool.backends[s.url]
        await eventually(lambda: backend.state == OPEN)  # a health check found the port closed
        refused_at_once(await ask(client, r.url), most=5)
        assert r.router.dispatcher.pending == 0
        async with client.get(r.url + "/health") as resp:
            health = await resp.json()
        assert health["healthy"] == 0 and health["cold_start"] is None
        async with client.get(r.url + "/metrics") as resp:
            text = await resp.text()
        assert metric_value(text, contract.ROUTER_METRIC_REQUESTS + "_total", backend="none", code="503") == 1


@pytest.mark.asyncio
async def test_queued_requests_are_refused_the_moment_the_last_engine_is_ejected() -> None:
    async with sim_process("--time-scale", "0.2") as (url, process), AsyncExitStack() as stack:
        r = await stack.enter_async_context(router([url], queue_timeout=QUEUE_TIMEOUT, breaker=LONG_EJECTION,
                                                   max_concurrency_per_backend=1, health_timeout=0.5))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))
        holder = await client.post(r.url + "/v1/chat/completions", json=chat("hold", max_tokens=2000, stream=True))
        await holder.content.readany()
        queued = asyncio.create_task(ask(client, r.url, "queued"))
        await eventually(lambda: r.router.dispatcher.pending == 1)
        process.send_signal(signal.SIGSTOP)  # hung: its next health check goes unanswered
        try:
            # Ejected as unresponsive: back after the ejection and the health check that probes it.
            refused_at_once(await queued, most=6)
            assert r.router.pool.backends[url].breaker.unresponsive
        finally:
            holder.close()
            process.send_signal(signal.SIGCONT)


@pytest.mark.asyncio
async def test_a_request_that_failed_on_one_engine_with_no_other_available_says_when_to_retry() -> None:
    async with AsyncExitStack() as stack:
        doomed_context = sim()
        doomed = await doomed_context.__aenter__()
        gone = await stack.enter_async_context(sim())
        # Health checks only at start-up: the ejections below come from requests.
        r = await stack.enter_async_context(router([doomed.url, gone.url], strategy="round-robin",
                                                   queue_timeout=QUEUE_TIMEOUT, breaker=LONG_EJECTION,
                                                   health_interval=60))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))
        r.router.pool.record_failure(r.router.pool.backends[gone.url], fatal=True)  # ejected earlier
        await doomed_context.__aexit__(None, None, None)
        reply = await ask(client, r.url)
        # Tried on the one engine left, which refused the connection; nothing else to wait for.
        assert reply.status == 502 and "1 tried" in reply.json()["error"]["message"]
        assert 1 <= int(reply.headers["Retry-After"]) <= 5


# --- cold start: queue ---------------------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_a_static_engine_still_loading_is_waited_for_not_forwarded_to() -> None:
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim(startup_delay=1.0))
        r = await stack.enter_async_context(router([s.url], queue_timeout=QUEUE_TIMEOUT))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)))
        backend = r.router.pool.backends[s.url]
        assert backend.state == JOINING  # its first health check said "loading"
        async with client.get(r.url + "/health") as resp:
            assert (await resp.json())["cold_start"] == "1 engine(s) not up yet"
        answer = asyncio.create_task(ask(client, r.url))
        await eventually(lambda: r.router.dispatcher.pending == 1)
        reply = await answer
        assert reply.status == 200, reply.body
        assert backend.state == CLOSED and backend.breaker.ejections == 0
        async with client.get(r.url + "/health") as resp:
            assert (await resp.json())["cold_start"] is None


@pytest.mark.asyncio
async def test_a_static_engine_refusing_connections_is_not_starting_503_at_once_then_taken_once_up() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with AsyncExitStack() as stack:
        r = await stack.enter_async_context(router([url], queue_timeout=QUEUE_TIMEOUT, cold_start_timeout=600))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))
        backend = r.router.pool.backends[url]
        await eventually(lambda: backend.breaker.checked and backend.breaker.unreachable)
        assert r.router.fleet.cold_start() is None  # nothing listens there: down or misnamed, not loading
        reply = await ask(client, r.url)
        refused_at_once(reply, most=1)  # the next health check may find it up
        assert "1 not accepting connections" in reply.json()["error"]["message"]
        assert r.router.dispatcher.pending == 0
        await asyncio.sleep(0.5)  # several refused health checks: a joining engine is not ejected over and over
        assert backend.state == JOINING and backend.breaker.ejections == 0
        await stack.enter_async_context(sim(port=port))
        await eventually(lambda: backend.state == CLOSED)
        reply = await ask(client, r.url)
        assert reply.status == 200, reply.body
        assert not backend.breaker.unreachable
        async with client.get(r.url + "/metrics") as resp:
            text = await resp.text()
        assert metric_value(text, contract.ROUTER_METRIC_EJECTIONS + "_total", backend=url) is None


@pytest.mark.asyncio
async def test_a_request_waiting_for_a_loading_static_engine_is_refused_once_the_engine_stops_listening() -> None:
    async with AsyncExitStack() as stack:
        loading = sim(startup_delay=60.0)  # its /health says 503 ("loading") throughout
        s = await loading.__aenter__()
        r = await stack.enter_async_context(router([s.url], queue_timeout=QUEUE_TIMEOUT, cold_start_timeout=600))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))
        assert r.router.fleet.cold_start() == "1 engine(s) not up yet"
        waiting = asyncio.create_task(ask(client, r.url))
        await eventually(lambda: r.router.dispatcher.pending == 1)
        await loading.__aexit__(None, None, None)  # it died while loading: its port closes
        refused_at_once(await waiting, most=1)
        assert r.router.pool.backends[s.url].breaker.unreachable and r.router.fleet.cold_start() is None


# --- discovery: starting pods --------------------------------------------------------------------------------------

def endpoint_slice(name: str, port: int, conditions: dict[str, bool] | None) -> dict[str, Any]:
    endpoint: dict[str, Any] = {"addresses": ["127.0.0.1"]}
    if conditions is not None:
        endpoint["conditions"] = conditions
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {contract.ENDPOINTSLICE_SERVICE_LABEL: SERVICE}},
        "addressType": "IPv4",
        "ports": [{"name": contract.PORT_NAME_HTTP, "port": port, "protocol": "TCP"}],
        "endpoints": [endpoint],
    }


def test_endpoints_are_ready_starting_or_neither() -> None:
    def classify(conditions: dict[str, bool] | None) -> SliceEndpoints:
        return slice_endpoints(endpoint_slice("s", 8000, conditions))

    url = ("http://127.0.0.1:8000",)
    assert classify(None) == SliceEndpoints(ready=url)  # an absent condition means ready
    assert classify({"ready": True, "serving": True}) == SliceEndpoints(ready=url)
    assert classify({"ready": False}) == SliceEndpoints(starting=url)
    assert classify({"ready": False, "serving": False, "terminating": False}) == SliceEndpoints(starting=url)
    assert classify({"ready": False, "serving": True, "terminating": True}) == SliceEndpoints()  # draining
    assert classify({"ready": False, "serving": False, "terminating": True}) == SliceEndpoints()


@pytest.mark.asyncio
async def test_a_starting_pod_makes_requests_wait_and_none_left_makes_them_fail_at_once(kmock: Any) -> None:
    kmock.resources[RESOURCE] = {"kind": "EndpointSlice", "namespaced": True}
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        port = int(s.url.rsplit(":", 1)[1])
        name = "llama-engine-abc"

        async def endpoint(conditions: dict[str, bool]) -> None:
            async with kmock.patch(f"{PATH}/{name}", json={"endpoints": [
                    {"addresses": ["127.0.0.1"], "conditions": conditions}]}) as resp:
                assert resp.status < 300

        async with kmock.post(PATH, json=endpoint_slice(name, port, {"ready": False})) as resp:
            assert resp.status < 300
        r = await stack.enter_async_context(router([], service=SERVICE, namespace=NAMESPACE,
                                                   kube=Connection.for_url(str(kmock.url)),
                                                   queue_timeout=QUEUE_TIMEOUT))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))
        await eventually(lambda: r.router.fleet.cold_start() == "1 engine pod(s) starting")
        # The pod is loading its model: the request waits for it, and is served once it is ready.
        waiting = asyncio.create_task(ask(client, r.url, "first"))
        await eventually(lambda: r.router.dispatcher.pending == 1)
        await endpoint({"ready": True})
        reply = await waiting
        assert reply.status == 200 and reply.backend == s.url
        # Terminating, and nothing else: nothing to wait for.
        await endpoint({"ready": False, "serving": True, "terminating": True})
        await eventually(lambda: len(r.router.pool) == 0)
        retry = refused_at_once(await ask(client, r.url), most=NO_ENGINE_RETRY_SECONDS)
        assert retry == NO_ENGINE_RETRY_SECONDS
        # A new pod starts; a request waits for it; the pod is deleted before it is ready: the wait ends at once.
        await endpoint({"ready": False})
        waiting = asyncio.create_task(ask(client, r.url, "second"))
        await eventually(lambda: r.router.dispatcher.pending == 1)
        async with kmock.delete(f"{PATH}/{name}") as resp:
            assert resp.status < 300
        refused_at_once(await waiting, most=NO_ENGINE_RETRY_SECONDS)


@pytest.mark.asyncio
async def test_a_ready_pod_the_router_cannot_reach_is_a_fault_not_a_start(kmock: Any) -> None:
    kmock.resources[RESOURCE] = {"kind": "EndpointSlice", "namespaced": True}
    closed_port = free_port()  # Ready in Kubernetes, but nothing answers the router there (a NetworkPolicy, say)
    async with kmock.post(PATH, json=endpoint_slice("llama-engine-abc", closed_port, {"ready": True})) as resp:
        assert resp.status < 300
    async with AsyncExitStack() as stack:
        r = await stack.enter_async_context(router([], service=SERVICE, namespace=NAMESPACE,
                                                   kube=Connection.for_url(str(kmock.url)),
                                                   queue_timeout=QUEUE_TIMEOUT))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT))
        await eventually(lambda: [b.breaker.checked for b in r.router.pool] == [True])
        assert r.router.fleet.cold_start() is None
        refused = await ask(client, r.url)
        refused_at_once(refused, most=1)  # its next health check is a health interval away
        assert "1 ready but not answering the router's health checks" in refused.json()["error"]["message"]


# --- the pieces, without sockets -------------------------------------------------------------------------------

def test_back_in_is_the_time_until_an_engine_may_serve_again() -> None:
    now = 100.0
    assert Backend("a").breaker.back_in(now, 2.0) == 0.0
    assert Backend("a", breaker=Breaker(JOINING)).breaker.back_in(now, 2.0) == 2.0
    assert Backend("a", breaker=Breaker(OPEN, open_until=103.5)).breaker.back_in(now, 2.0) == 3.5
    assert Backend("a", breaker=Breaker(OPEN, open_until=103.5, unresponsive=True)).breaker.back_in(now, 2.0) == 5.5
    assert Backend("a", breaker=Breaker(OPEN, open_until=99.0)).breaker.back_in(now, 2.0) == 0.0


@pytest.mark.asyncio
async def test_dispatcher_refuses_instead_of_queueing_when_told_and_refuses_its_waiters_later() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    verdict: list[Unavailable | None] = [None]
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=1, queue_timeout=30, unavailable=lambda _: verdict[0])
    holder = RequestInfo()
    held = await dispatcher.acquire(holder)
    waiter = asyncio.create_task(dispatcher.acquire(RequestInfo()))
    await eventually(lambda: dispatcher.pending == 1)
    verdict[0] = Unavailable("no engine is available", 4)
    with pytest.raises(Unavailable):
        await dispatcher.acquire(RequestInfo())
    dispatcher.reevaluate()
    with pytest.raises(Unavailable) as refused:
        await waiter
    assert refused.value.retry_after == 4 and dispatcher.pending == 0
    dispatcher.release(held, holder)
