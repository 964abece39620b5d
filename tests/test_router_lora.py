"""LoRA adapters through the router: listed, accepted by name, kept on the engines that hold them, counted."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest

from tensorfleet import contract
from tensorfleet.httpapi import start_site
from tensorfleet.sim.lora import LOAD_PATH, LoraConfig
from tensorfleet.sim.profile import make_profile
from tensorfleet.sim.server import SimConfig, SimServer
from tensorfleet.testing.loopback import MODEL, metric_value, router, sse_events
from tensorfleet.testing.wait import eventually

# An adapter's home engine is a rendezvous hash over the engines' URLs, whose ports are random here: with 24
# adapters on 4 engines, the chance that their homes cover fewer than 3 engines is about 4e-7 (with 8 it was 2%).
ADAPTERS = tuple((f"tenant-{i}", f"org/tenant-{i}-lora") for i in range(24))


@asynccontextmanager
async def lora_engine(modules: tuple[tuple[str, str], ...] = ADAPTERS, *, seed: int = 0,
                      time_scale: float = 0.01, startup_delay: float = 0.0, port: int = 0) -> AsyncIterator[str]:
    server = SimServer(make_profile(), SimConfig(served_model_name=MODEL, model="meta-llama/Llama-3.1-8B",
                                                 time_scale=time_scale, seed=seed, runtime_lora_updating=True,
                                                 startup_delay=startup_delay,
                                                 lora=LoraConfig(max_loras=2, max_cpu_loras=4), lora_modules=modules))
    runner = await start_site(server.app(), "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def fleet(stack: AsyncExitStack, engines: int, **options: Any) -> tuple[list[str], str]:
    urls = [await stack.enter_async_context(lora_engine(seed=i)) for i in range(engines)]
    r = await stack.enter_async_context(router(urls, strategy="cache-aware", **options))
    return urls, r.url


async def served_by(client: aiohttp.ClientSession, url: str, model: str, prompt: str = "hello",
                    max_tokens: int = 3) -> tuple[int, str | None]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    async with client.post(url + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get(contract.BACKEND_HEADER)


@pytest.mark.asyncio
async def test_the_router_lists_accepts_and_learns_adapters() -> None:
    async with AsyncExitStack() as stack:
        engines, url = await fleet(stack, 2)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        async with client.get(url + "/v1/models") as resp:
            listed = {m["id"]: m["parent"] for m in (await resp.json())["data"]}
        assert listed == {MODEL: None, **{name: MODEL for name, _ in ADAPTERS}}
        assert (await served_by(client, url, "tenant-3"))[0] == 200
        async with client.post(url + "/v1/completions", json={"model": "tenant-99", "prompt": "x"}) as resp:
            error = (await resp.json())["error"]
        assert resp.status == 404 and error["param"] == "model" and "tenant-99" in error["message"]
        # An adapter loaded on the engines a moment after a 404 (within the router's ask-again interval) is found
        # by the next request that names it: a name not known waits for lists asked after it came, never refused
        # from lists older than the load (the operator says Loaded, the user sends at once).
        for engine in engines:
            async with client.post(engine + LOAD_PATH, json={"lora_name": "tenant-99", "lora_path": "org/x"}) as resp:
                assert resp.status == 200
        assert (await served_by(client, url, "tenant-99"))[0] == 200
        # Names nobody serves, sent at once, share one round of asking and are refused within about a second.
        started = asyncio.get_running_loop().time()
        statuses = await asyncio.gather(*(served_by(client, url, f"nobody-{i}") for i in range(20)))
        assert {status for status, _ in statuses} == {404}
        assert asyncio.get_running_loop().time() - started < 3.0


@pytest.mark.asyncio
async def test_an_adapter_stays_on_its_engines_and_a_hot_one_spreads() -> None:
    async with AsyncExitStack() as stack:
        _, url = await fleet(stack, 4)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        homes: dict[str, set[str | None]] = {}
        for round_ in range(3):
            for name, _ in ADAPTERS:
                status, backend = await served_by(client, url, name, prompt=f"round {round_} of {name}")
                assert status == 200
                homes.setdefault(name, set()).add(backend)
        # One at a time (no load): each adapter always went to one engine, and the adapters spread over engines.
        assert all(len(where) == 1 for where in homes.values()), homes
        assert len({next(iter(where)) for where in homes.values()}) >= 3
        # Many at once for one adapter: past the load bound it spills to the next engines in its order.
        hot = await asyncio.gather(*(served_by(client, url, "tenant-0", prompt=f"burst {i}", max_tokens=40)
                                     for i in range(24)))
        assert all(status == 200 for status, _ in hot)
        spread = Counter(backend for _, backend in hot)
        assert len(spread) >= 2 and spread.most_common(1)[0][0] in homes["tenant-0"], spread


@pytest.mark.asyncio
async def test_requests_and_first_bytes_are_counted_per_adapter() -> None:
    async with AsyncExitStack() as stack:
        _, url = await fleet(stack, 1)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        body = {"model": "tenant-1", "prompt": "hi", "max_tokens": 3, "stream": True}
        async with client.post(url + "/v1/completions", json=body) as resp:
            assert [data async for _, data in sse_events(resp)][-1] == "[DONE]"
        assert (await served_by(client, url, "tenant-2"))[0] == 200
        assert (await served_by(client, url, MODEL))[0] == 200
        async with client.get(url + "/metrics") as resp:
            text = await resp.text()
    requests = contract.ROUTER_METRIC_ADAPTER_REQUESTS + "_total"
    assert metric_value(text, requests, adapter="tenant-1", code="200") == 1
    assert metric_value(text, requests, adapter="tenant-2", code="200") == 1
    assert metric_value(text, requests, adapter=MODEL, code="200") is None  # the base model is not an adapter
    assert metric_value(text, contract.ROUTER_METRIC_ADAPTER_TTFT + "_count", adapter="tenant-1") == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("strategy", ["cache-aware", "least-pending", "round-robin"])
async def test_an_adapter_goes_only_to_the_engines_that_list_it(strategy: str) -> None:
    """An engine that does not list an adapter (one just started, before the operator loaded its adapters) gets
    none of its requests while one that lists it is routable, whatever the strategy; once it lists the adapter
    (the next refresh), it takes its share."""
    async with AsyncExitStack() as stack:
        have = await stack.enter_async_context(lora_engine(seed=0))
        lacking = await stack.enter_async_context(lora_engine((), seed=1))
        r = await stack.enter_async_context(router([have, lacking], strategy=strategy))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        sent = [await served_by(client, r.url, "tenant-1", prompt=f"request {i}") for i in range(12)]
        assert {status for status, _ in sent} == {200}
        assert {backend for _, backend in sent} == {have}
        async with client.post(lacking + LOAD_PATH, json={"lora_name": "tenant-1", "lora_path": "org/x"}) as resp:
            assert resp.status == 200
        # The router asks the engines again when one it has not heard from lists something new: an unknown name.
        await asyncio.sleep(1.1)
        await served_by(client, r.url, "not-an-adapter")
        results = await asyncio.gather(*(served_by(client, r.url, "tenant-1", prompt=f"again {i}", max_tokens=20)
                                         for i in range(16)))
        assert {status for status, _ in results} == {200}
        if strategy != "cache-aware":  # cache-aware keeps a cold adapter on its home engine, by design
            assert {backend for _, backend in results} == {have, lacking}


# --- no engine's list yet: an adapter waits like the base model ------------------------------------------------

@pytest.mark.asyncio
async def test_an_adapter_request_during_a_cold_start_waits_for_the_engine_and_is_served() -> None:
    """The router has heard no engine's model list (its one engine is loading), so a name that is not the served
    model may be an adapter: it waits for an engine as the base model's requests do, and is served by it; a name
    the engine turns out not to list gets the 404 then, not before."""
    async with AsyncExitStack() as stack:
        engine = await stack.enter_async_context(lora_engine(startup_delay=1.0))
        r = await stack.enter_async_context(router([engine], queue_timeout=30.0))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)))
        assert r.router.fleet.cold_start() == "1 engine(s) not up yet" and not r.router.fleet.adapters.names
        adapter = asyncio.create_task(served_by(client, r.url, "tenant-3"))
        missing = asyncio.create_task(client.post(r.url + "/v1/completions",
                                                  json={"model": "tenant-99", "prompt": "x", "max_tokens": 2}))
        base = asyncio.create_task(served_by(client, r.url, MODEL))
        await eventually(lambda: r.router.dispatcher.pending == 3)  # all three queued, none refused
        assert await adapter == (200, engine) and await base == (200, engine)
        async with await missing as resp:
            error = (await resp.json())["error"]
        assert resp.status == 404 and error["param"] == "model" and "tenant-99" in error["message"]
        async with client.get(r.url + "/metrics") as resp:
            text = await resp.text()
        requests = contract.ROUTER_METRIC_ADAPTER_REQUESTS + "_total"
        assert metric_value(text, requests, adapter="tenant-3", code="200") == 1
        # Now that the router holds a healthy engine's list, a name it lacks is refused at once.
        async with client.post(r.url + "/v1/completions", json={"model": "tenant-98", "prompt": "x"}) as resp:
            assert resp.status == 404 and r.router.dispatcher.pending == 0


@pytest.mark.asyncio
async def test_an_adapter_request_with_no_engine_up_within_the_bound_gets_503_not_404() -> None:
    async with AsyncExitStack() as stack:
        engine = await stack.enter_async_context(lora_engine(startup_delay=60.0))
        r = await stack.enter_async_context(router([engine], queue_timeout=0.5, cold_start_timeout=0.5))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)))
        for model in ("tenant-3", MODEL):
            async with client.post(r.url + "/v1/completions",
                                   json={"model": model, "prompt": "x", "max_tokens": 2}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 503, (model, error)
                assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
                assert "within 0.5s" in error["message"] and resp.headers["Retry-After"]
