"""A router in front of a fleet at zero: it holds requests, wakes the fleet through its demand Lease, and
answers each once an engine is Ready, or 503 with Retry-After after --cold-start-timeout.

Real router and simulator on loopback; the Lease and the EndpointSlices live in the API emulator the
operator tests use.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import aiohttp
import pytest

from tensorfleet import contract
from tensorfleet.controller.idle import parse_time
from tensorfleet.kube.connection import Connection
from tensorfleet.testing.loopback import chat, post_chat, router, sim
from tensorfleet.testing.operator_harness import Cluster, cluster
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio

SERVICE = contract.engine_service_name("llama")
LEASE = contract.demand_lease_name("llama")
LEASES = ("coordination.k8s.io/v1", "leases")


async def _lease(c: Cluster) -> None:
    await c.upsert(*LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                             "metadata": {"name": LEASE, "namespace": "default"}})


def _slice(port: int) -> dict[str, object]:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "llama-engine-abc", "namespace": "default",
                     "labels": {contract.ENDPOINTSLICE_SERVICE_LABEL: SERVICE}},
        "addressType": "IPv4",
        "ports": [{"name": contract.PORT_NAME_HTTP, "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
    }


async def test_a_request_at_zero_wakes_the_fleet_and_is_answered_once_an_engine_is_ready() -> None:
    async with cluster() as c, AsyncExitStack() as stack:
        await _lease(c)
        r = await stack.enter_async_context(router([], service=SERVICE, namespace="default",
                                                   kube=Connection(server=c.url), demand_lease=LEASE,
                                                   queue_timeout=1.0, cold_start_timeout=30.0))
        await eventually(lambda: r.router.fleet.cold_start() == "the fleet is scaled to zero; waking it")
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)))
        before = time.time()
        answer = asyncio.create_task(post_chat(client, r.url, chat("wake up", max_tokens=2)))
        await eventually(lambda: r.router.dispatcher.pending == 1)
        # The router renewed the Lease at once (the operator wakes the fleet on that write).
        renewed = parse_time(await eventually(lambda: ((c.get(*LEASES, LEASE) or {}).get("spec") or {}).get("renewTime")))
        assert renewed is not None and renewed.timestamp() >= before - 1
        # Longer than --queue-timeout: a cold start from zero waits --cold-start-timeout.
        await asyncio.sleep(1.5)
        assert not answer.done()
        # An engine becomes Ready: the held request is served.
        s = await stack.enter_async_context(sim())
        await c.upsert("discovery.k8s.io/v1", "endpointslices", _slice(int(s.url.rsplit(":", 1)[1])))
        reply = await answer
        assert reply.status == 200, reply.body
        async with client.get(r.url + "/metrics") as resp:
            text = await resp.text()
        assert f"{contract.ROUTER_METRIC_PENDING} 0.0" in text


async def test_a_fleet_that_does_not_wake_within_the_cold_start_timeout_gets_503_with_retry_after() -> None:
    async with cluster() as c, AsyncExitStack() as stack:
        await _lease(c)
        r = await stack.enter_async_context(router([], service=SERVICE, namespace="default",
                                                   kube=Connection(server=c.url), demand_lease=LEASE,
                                                   queue_timeout=0.5, cold_start_timeout=2.0))
        await eventually(lambda: r.router.fleet.cold_start() is not None)
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)))
        started = time.monotonic()
        reply = await post_chat(client, r.url, chat("anyone?", max_tokens=2))
        waited = time.monotonic() - started
        assert reply.status == 503 and int(reply.headers["Retry-After"]) >= 1
        assert "within 2s" in reply.json()["error"]["message"]
        assert waited >= 1.9


async def test_without_a_demand_lease_no_engine_means_503_at_once() -> None:
    async with cluster() as c, AsyncExitStack() as stack:
        r = await stack.enter_async_context(router([], service=SERVICE, namespace="default",
                                                   kube=Connection(server=c.url), queue_timeout=30.0,
                                                   cold_start_timeout=30.0))
        await eventually(lambda: r.router.fleet.watcher is not None and r.router.fleet.watcher.listed)
        assert r.router.fleet.cold_start() is None
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)))
        reply = await post_chat(client, r.url, chat("anyone?", max_tokens=2))
        assert reply.status == 503 and "no engine is available" in reply.json()["error"]["message"]
