"""EndpointSlice discovery against kmock's Kubernetes API emulator on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tensorfleet import contract
from tensorfleet.kube.connection import Connection
from tensorfleet.kube.endpoints import slice_urls
from tensorfleet.router.discovery import EndpointSliceWatcher
from tensorfleet.testing.wait import eventually

RESOURCE = "discovery.k8s.io/v1/endpointslices"
NAMESPACE = "serving"
SERVICE = contract.engine_service_name("llama")
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def endpoint_slice(name: str, service: str, endpoints: list[tuple[str, bool | None]], port: int = 8000,
                   address_type: str = "IPv4") -> dict[str, Any]:
    def endpoint(ip: str, ready: bool | None) -> dict[str, Any]:
        out: dict[str, Any] = {"addresses": [ip]}
        if ready is not None:
            out["conditions"] = {"ready": ready}
        return out

    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": {contract.ENDPOINTSLICE_SERVICE_LABEL: service}},
        "addressType": address_type,
        "ports": [{"name": contract.PORT_NAME_HTTP, "port": port, "protocol": "TCP"}],
        "endpoints": [endpoint(ip, ready) for ip, ready in endpoints],
    }


def test_slice_urls_keeps_ready_endpoints_only() -> None:
    s = endpoint_slice("a", SERVICE, [("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None)])
    assert slice_urls(s) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]  # absent condition = ready
    v6 = endpoint_slice("b", SERVICE, [("fd00::1", True)], address_type="IPv6")
    assert slice_urls(v6) == ["http://[fd00::1]:8000"]
    unnamed = {**s, "ports": [{"port": 9000}]}
    assert slice_urls(unnamed)[0] == "http://10.0.0.1:9000"


@pytest.mark.asyncio
async def test_watch_follows_slices_of_the_engine_service(kmock: Any) -> None:
    kmock.resources[RESOURCE] = {"kind": "EndpointSlice", "namespaced": True}
    published: list[list[str]] = []

    async def create(body: dict[str, Any]) -> None:
        async with kmock.post(PATH, json=body) as resp:
            assert resp.status < 300, await resp.text()

    await create(endpoint_slice("llama-engine-abc", SERVICE, [("10.0.0.1", True), ("10.0.0.2", False)]))
    await create(endpoint_slice("other-engine-xyz", "other-engine", [("10.9.9.9", True)]))
    watcher = EndpointSliceWatcher(SERVICE, NAMESPACE, published.append, connection=Connection.for_url(str(kmock.url)))
    task = asyncio.create_task(watcher.run())
    try:
        await eventually(lambda: published and published[-1] == ["http://10.0.0.1:8000"])
        # The second pod becomes ready.
        async with kmock.patch(f"{PATH}/llama-engine-abc", json={"endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": True}}]}) as resp:
            assert resp.status < 300
        await eventually(lambda: published[-1] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        # A second slice of the same Service (large Services are split).
        await create(endpoint_slice("llama-engine-def", SERVICE, [("10.0.0.3", True)]))
        await eventually(lambda: len(published[-1]) == 3)
        # Deleting a slice drops its endpoints; other Services never appear.
        async with kmock.delete(f"{PATH}/llama-engine-abc") as resp:
            assert resp.status < 300
        await eventually(lambda: published[-1] == ["http://10.0.0.3:8000"])
        assert all("10.9.9.9" not in url for urls in published for url in urls)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_watch_survives_an_unreachable_api_and_backs_off() -> None:
    published: list[list[str]] = []
    watcher = EndpointSliceWatcher(SERVICE, NAMESPACE, published.append, connection=Connection.for_url("http://127.0.0.1:9"))
    task = asyncio.create_task(watcher.run())
    await asyncio.sleep(0.3)
    assert not task.done() and published == []
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_router_routes_to_the_engines_the_service_lists(kmock: Any) -> None:
    from contextlib import AsyncExitStack

    import aiohttp

    from tensorfleet.testing.loopback import chat, router, sim

    kmock.resources[RESOURCE] = {"kind": "EndpointSlice", "namespaced": True}
    async with AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(sim()) for _ in range(2)]
        ports = [int(s.url.rsplit(":", 1)[1]) for s in sims]
        for i, port in enumerate(ports):
            body = endpoint_slice(f"llama-engine-{i}", SERVICE, [("127.0.0.1", True)], port=port)
            async with kmock.post(PATH, json=body) as resp:
                assert resp.status < 300
        r = await stack.enter_async_context(router([], service=SERVICE, namespace=NAMESPACE, kube=Connection.for_url(str(kmock.url)),
                                                   strategy="round-robin"))
        await eventually(lambda: len(r.router.pool) == 2)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        seen = set()
        for i in range(4):
            async with client.post(r.url + "/v1/chat/completions", json=chat(f"q{i}", max_tokens=2)) as resp:
                assert resp.status == 200
                seen.add(resp.headers[contract.BACKEND_HEADER])
        assert seen == {s.url for s in sims}
        # The first engine's pod goes unready: it leaves the pool.
        async with kmock.patch(f"{PATH}/llama-engine-0", json={"endpoints": [
                {"addresses": ["127.0.0.1"], "conditions": {"ready": False}}]}) as resp:
            assert resp.status < 300
        await eventually(lambda: list(r.router.pool.backends) == [sims[1].url])
        for i in range(3):
            async with client.post(r.url + "/v1/chat/completions", json=chat(f"r{i}", max_tokens=2)) as resp:
                assert resp.headers[contract.BACKEND_HEADER] == sims[1].url
