"""The gateway (`tensorfleet gateway`): its model table and traffic split on their own, then a real gateway in front
of real routers in front of simulators, on loopback, with the official openai SDK as one of its clients."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from tensorfleet import contract
from tensorfleet.api.traffic import shares
from tensorfleet.gateway.app import Gateway
from tensorfleet.gateway.split import conversation, pick
from tensorfleet.gateway.table import Ambiguous, Group, ModelTable, service_of
from tensorfleet.gateway.watch import Changes, ClusterView
from tensorfleet.kube.connection import Connection
from tensorfleet.testing.loopback import fake_engine, free_port, gateway, metric_value, router, sim, sse_events
from tensorfleet.testing.wait import eventually

NS = "ml"
CLIENT = aiohttp.ClientTimeout(total=30)  # only ever reached when a test fails


def isvc(name: str, model: str, *, served: str | None = None, weight: int | None = None,
         adapters: tuple[str, ...] = (), ready: bool = True, namespace: str = NS) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": model, **({"servedName": served} if served else {})}}
    if weight is not None:
        spec["traffic"] = {"weight": weight}
    if adapters:
        spec["adapters"] = [{"name": a, "source": f"hf://org/{a}"} for a in adapters]
    return {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": "2026-12-01T10:00:00Z"},
            "spec": spec,
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "plan": {"maxModelLen": 8192}}}


def opening_chat(model: str, opening: str, *later: str, max_tokens: int = 2) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": opening}]
    for text in later:
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens}


# --- the rule and the hash ------------------------------------------------------------------------------------


def test_shares_give_the_weighted_their_weight_and_the_rest_to_the_others() -> None:
    assert shares({"stable": None, "canary": 10}) == {"stable": 90.0, "canary": 10.0}
    assert shares({"a": None, "b": None, "c": 20}) == {"a": 40.0, "b": 40.0, "c": 20.0}
    assert shares({"a": 60, "b": 60}) == {"a": 50.0, "b": 50.0}      # past 100: scaled down together
    assert shares({"a": 30, "b": 20}) == {"a": 60.0, "b": 40.0}      # every member weighted: scaled to 100
    assert shares({"a": 70, "b": 50, "c": None}) == pytest.approx({"a": 100 * 70 / 120, "b": 100 * 50 / 120, "c": 0.0})
    assert shares({"a": 0, "b": None}) == {"a": 0.0, "b": 100.0}
    assert shares({"a": 0, "b": 0}) == {"a": 0.0, "b": 0.0}
    assert shares({"only": None}) == {"only": 100.0}


def test_the_split_follows_the_shares_and_moves_only_what_a_new_weight_must() -> None:
    keys = [f"conversation {i}".encode() for i in range(20_000)]
    before = [pick(k, [("stable", 90.0), ("canary", 10.0)]) for k in keys]
    assert abs(before.count("canary") / len(keys) - 0.10) < 0.01
    three = collections.Counter(pick(k, [("a", 50.0), ("b", 25.0), ("c", 25.0)]) for k in keys)
    assert all(abs(three[n] / len(keys) - share) < 0.015 for n, share in (("a", 0.5), ("b", 0.25), ("c", 0.25)))
    after = [pick(k, [("stable", 70.0), ("canary", 30.0)]) for k in keys]
    moved = collections.Counter((b, a) for b, a in zip(before, after, strict=True) if b != a)
    assert set(moved) == {("stable", "canary")}  # the canary's conversations all stay on it
    assert abs(sum(moved.values()) / len(keys) - 0.20) < 0.015
    assert pick(b"x", [("a", 0.0), ("b", 0.0)]) is None
    assert {pick(b"y", [("a", 0.0), ("b", 5.0)]) for _ in range(5)} == {"b"}


def test_every_turn_of_a_conversation_has_its_first_turns_key() -> None:
    first_key, first = conversation({}, opening_chat("m", "plan a trip"))
    later_key, later = conversation({}, opening_chat("m", "plan a trip", "to Oslo", "in May"))
    other_key, _ = conversation({}, opening_chat("m", "plan a party"))
    assert first and not later and first_key == later_key != other_key
    session, _ = conversation({contract.SESSION_HEADER: "s-1"}, opening_chat("m", "anything"))
    assert session == conversation({}, {**opening_chat("m", "else"), "user": "s-1"})[0]
    assert conversation({}, {"model": "m", "prompt": "Once upon a time"})[0] is not None
    assert conversation({}, {"model": "m", "input": ""}) == (None, True)


# --- the table -----------------------------------------------------------------------------------------------


def test_the_table_groups_by_namespace_and_name_with_adapters_under_their_parent() -> None:
    table = ModelTable()
    table.replace_services([
        isvc("llama-v1", "meta/llama", served="llama", adapters=("sql",)),
        isvc("llama-v2", "meta/llama-2", served="llama", weight=10, adapters=("sql",)),
        isvc("qwen", "qwen/qwen"),
        isvc("mistral", "mistral/m", ready=False),
        isvc("llama-elsewhere", "meta/llama", served="dup", namespace="a"),
        isvc("dup-too", "x/y", served="dup", namespace="b"),
        isvc("clash", "x/z", served="sql", namespace=NS),
    ])
    llama = table.lookup("llama")
    assert isinstance(llama, Group) and [m.name for m in llama.members] == ["llama-v1", "llama-v2"]
    assert llama.shares == {(NS, "llama-v1"): 90.0, (NS, "llama-v2"): 10.0}
    assert isinstance(table.lookup("qwen/qwen"), Group)  # no servedName: model.name
    assert isinstance(table.lookup("dup"), Ambiguous) and "a/llama-elsewhere" in table.lookup("dup").message  # type: ignore[union-attr]
    assert isinstance(table.lookup("sql"), Ambiguous)  # an adapter here, a model's name there
    assert table.lookup("nothing") is None
    listed = {m["id"]: m for m in table.listing()}
    assert set(listed) == {"llama", "qwen/qwen"}  # mistral is not Ready; ambiguous names are not served
    assert listed["llama"]["max_model_len"] == 8192 and listed["llama"]["parent"] is None
    table.drop_service(isvc("clash", "x/z", served="sql"))
    sql = table.lookup("sql")
    assert isinstance(sql, Group) and sql.parent == "llama"
    assert {m["id"]: m["parent"] for m in table.listing()}["sql"] == "llama"


def test_a_new_conversation_skips_members_that_are_not_ready_while_another_is() -> None:
    table = ModelTable()
    table.replace_services([isvc("a", "m", served="x"), isvc("b", "m", served="x", ready=False)])
    group = table.lookup("x")
    assert isinstance(group, Group) and group.candidates() == [("a", 50.0)]
    table.put_service(isvc("a", "m", served="x", ready=False))
    group = table.lookup("x")
    assert isinstance(group, Group) and group.candidates() == [("a", 50.0), ("b", 50.0)]


def test_odd_objects_are_read_with_defaults_or_skipped() -> None:
    assert service_of({"metadata": {"name": "x"}, "spec": {"model": {"name": "m"}}}) is None  # no namespace
    odd = isvc("x", "m")
    odd["spec"]["traffic"] = {"weight": "ten"}
    odd["spec"]["adapters"] = [{"name": ""}, "junk", {"name": "ok"}]
    odd["status"] = {"conditions": "junk"}
    service = service_of(odd)
    assert service is not None and service.weight is None and service.adapters == ("ok",) and not service.ready


# --- a gateway over routers over simulators -----------------------------------------------------------------


@dataclass
class Fleet:
    url: str                 # the gateway's
    routers: dict[str, str]  # each InferenceService's router
    table: ModelTable
    gateway: Gateway


@asynccontextmanager
async def fleet(**gateway_options: Any) -> AsyncIterator[Fleet]:
    """Three InferenceServices (alpha, beta, and alpha-canary serving alpha with weight 10), each a router over a
    simulator, and a gateway over them."""
    async with AsyncExitStack() as stack:
        routers: dict[str, str] = {}
        table = ModelTable()
        services = [isvc("alpha", "org/alpha", served="alpha"), isvc("beta", "org/beta", served="beta"),
                    isvc("alpha-canary", "org/alpha-2", served="alpha", weight=10)]
        for obj in services:
            name, served = obj["metadata"]["name"], obj["spec"]["model"]["servedName"]
            engine = await stack.enter_async_context(sim(served_name=served))
            routers[name] = (await stack.enter_async_context(router([engine.url], model=served))).url
        table.replace_services(services)
        table.set_routers({(NS, name): (url,) for name, url in routers.items()})
        running = await stack.enter_async_context(gateway(table, **gateway_options))
        yield Fleet(running.url, routers, table, running.gateway)


@pytest.mark.asyncio
async def test_the_openai_sdk_sees_one_endpoint_for_every_model() -> None:
    async with fleet() as f:
        client = openai.AsyncOpenAI(base_url=f.url + "/v1", api_key="unused", max_retries=0)
        listed = await client.models.list()
        assert sorted(m.id for m in listed.data) == ["alpha", "beta"]
        for model in ("alpha", "beta"):
            answer = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"hello {model}"}], max_tokens=4)
            assert answer.model == model and answer.choices[0].message.content
            assert answer.usage is not None and answer.usage.completion_tokens == 4
        stream = await client.chat.completions.create(
            model="beta", messages=[{"role": "user", "content": "count"}], max_tokens=5, stream=True)
        pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        assert len("".join(p or "" for p in pieces)) > 0
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}])
        assert missing.value.code == "model_not_found" and "gamma" in missing.value.message


@pytest.mark.asyncio
async def test_new_conversations_split_by_weight_and_later_turns_stay() -> None:
    async with fleet() as f, aiohttp.ClientSession(timeout=CLIENT) as http:
        url = f.url
        semaphore = asyncio.Semaphore(16)

        async def turn(body: dict[str, Any]) -> str:
            async with semaphore, http.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return resp.headers[contract.BACKEND_HEADER]

        firsts = await asyncio.gather(*(turn(opening_chat("alpha", f"question number {i}")) for i in range(500)))
        canary = sum(1 for where in firsts if where == f"{NS}/alpha-canary")
        assert abs(canary / 500 - 0.10) <= 0.04, canary
        assert set(firsts) == {f"{NS}/alpha", f"{NS}/alpha-canary"}
        seconds = await asyncio.gather(*(turn(opening_chat("alpha", f"question number {i}", "and then?"))
                                         for i in range(0, 500, 5)))
        assert seconds == firsts[::5]
        async with http.get(url + contract.METRICS_PATH) as resp:
            text = await resp.text()
        counted = metric_value(text, contract.GATEWAY_METRIC_CONVERSATIONS + "_total",
                               inferenceservice="alpha-canary", group="alpha")
        assert counted == canary  # later turns are not new conversations


@pytest.mark.asyncio
async def test_a_key_over_its_limit_is_refused_for_every_model(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("team-a:sk-a-0123456789\nteam-b:sk-b-9876543210\n")
    async with fleet(api_keys=str(keys), requests_per_minute=2) as f, aiohttp.ClientSession(timeout=CLIENT) as http:
        url = f.url

        async def status(model: str, key: str) -> tuple[int, Any]:
            async with http.post(url + "/v1/chat/completions", json=opening_chat(model, "hi"),
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
                return resp.status, json.loads(await resp.read())

        assert (await status("alpha", "sk-a-0123456789"))[0] == 200
        assert (await status("beta", "sk-a-0123456789"))[0] == 200
        for model in ("alpha", "beta", "gamma"):
            code, body = await status(model, "sk-a-0123456789")
            assert code == 429 and body["error"]["code"] == "rate_limit_exceeded"
        assert (await status("beta", "sk-b-9876543210"))[0] == 200  # another tenant's bucket
        code, body = await status("alpha", "sk-wrong")
        assert code == 401 and body["error"]["code"] == "invalid_api_key"


@pytest.mark.asyncio
async def test_a_request_waits_for_its_routers_first_endpoint() -> None:
    async with fleet(cold_start_timeout=20) as f, aiohttp.ClientSession(timeout=CLIENT) as http:
        f.table.set_routers({(NS, "beta"): (f.routers["beta"],)})  # alpha's and its canary's routers are starting
        f.gateway.changes.changed()
        waiting = asyncio.create_task(http.post(f.url + "/v1/chat/completions", json=opening_chat("alpha", "early")))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        f.table.set_routers({(NS, name): (url,) for name, url in f.routers.items()})
        f.gateway.changes.changed()
        async with await asyncio.wait_for(waiting, 10) as resp:
            assert resp.status == 200, await resp.text()


@pytest.mark.asyncio
async def test_no_router_within_the_cold_start_timeout_is_a_503() -> None:
    async with fleet(cold_start_timeout=0.3) as f, aiohttp.ClientSession(timeout=CLIENT) as http:
        f.table.set_routers({})
        f.gateway.changes.changed()
        async with http.post(f.url + "/v1/chat/completions", json=opening_chat("beta", "x")) as resp:
            body = await resp.json()
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert f"{NS}/beta" in body["error"]["message"]


# --- the table from the API (kmock's emulator) -----------------------------------------------------------------


def router_slice(name: str, service: str, namespace: str, ips: list[tuple[str, bool]]) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": namespace, "labels": {
                contract.ENDPOINTSLICE_SERVICE_LABEL: service, contract.LABEL_COMPONENT: contract.COMPONENT_ROUTER,
                contract.LABEL_MANAGED_BY: contract.APP_NAME}},
            "addressType": "IPv4", "ports": [{"name": contract.PORT_NAME_HTTP, "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in ips]}


@pytest.mark.asyncio
async def test_the_cluster_view_follows_inference_services_and_their_routers(kmock: Any) -> None:
    isvcs = f"{contract.GROUP}/{contract.VERSION}/{contract.PLURAL}"
    kmock.resources[isvcs] = {"kind": contract.KIND, "namespaced": True}
    kmock.resources["discovery.k8s.io/v1/endpointslices"] = {"kind": "EndpointSlice", "namespaced": True}

    async def create(path: str, body: dict[str, Any]) -> None:
        async with kmock.post(path, json=body) as resp:
            assert resp.status < 300, await resp.text()

    def isvc_path(namespace: str) -> str:
        return f"/apis/{contract.GROUP}/{contract.VERSION}/namespaces/{namespace}/{contract.PLURAL}"

    slices = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
    await create(isvc_path(NS), isvc("alpha", "org/alpha", served="alpha"))
    await create(isvc_path("other"), isvc("beta", "org/beta", served="beta", namespace="other"))
    await create(slices, router_slice("alpha-x1", "alpha", NS, [("10.1.0.1", True), ("10.1.0.2", False)]))
    # An engine Service's slice: no router label, never a router.
    engine = router_slice("alpha-engine-x1", "alpha-engine", NS, [("10.2.0.1", True)])
    engine["metadata"]["labels"][contract.LABEL_COMPONENT] = contract.COMPONENT_ENGINE
    await create(slices, engine)
    async def follow(namespaces: tuple[str, ...]) -> None:
        table = ModelTable()
        view = ClusterView(table, Connection.for_url(str(kmock.url)), namespaces, Changes())
        task = asyncio.create_task(view.run())
        try:
            await eventually(lambda: view.listed and table.router_urls((NS, "alpha")) == ("http://10.1.0.1:8080",))
            assert ("beta" in table.models) == (not namespaces)
            async with kmock.patch(f"{isvc_path(NS)}/alpha", json={"spec": {"traffic": {"weight": 20}}}) as resp:
                assert resp.status < 300
            await eventually(lambda: isinstance(g := table.lookup("alpha"), Group) and g.members[0].weight == 20)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        async with kmock.patch(f"{isvc_path(NS)}/alpha", json={"spec": {"traffic": None}}) as resp:
            assert resp.status < 300

    await follow(())  # every namespace
    await follow((NS,))

    deleted: list[tuple[str, str]] = []
    table = ModelTable()
    view = ClusterView(table, Connection.for_url(str(kmock.url)), (), Changes(),
                       on_deleted=lambda ns, name: deleted.append((ns, name)))
    task = asyncio.create_task(view.run())
    try:
        await eventually(lambda: "beta" in table.models)
        async with kmock.delete(f"{isvc_path('other')}/beta") as resp:
            assert resp.status < 300
        await eventually(lambda: "beta" not in table.models and deleted == [("other", "beta")])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# --- forwarding faults, with stand-in routers -----------------------------------------------------------------


def one_model(*urls: str) -> ModelTable:
    table = ModelTable()
    table.replace_services([isvc("m", "org/m", served="m")])
    table.set_routers({(NS, "m"): urls})
    return table


@pytest.mark.asyncio
async def test_a_router_refusing_connections_is_skipped_for_the_next() -> None:
    async def answer(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with fake_engine(answer) as (url, calls), gateway(one_model(closed, url)) as g, \
            aiohttp.ClientSession(timeout=CLIENT) as http:
        for _ in range(3):
            async with http.post(g.url + "/v1/chat/completions", json=opening_chat("m", "hi")) as resp:
                assert resp.status == 200 and await resp.json() == {"ok": True}
        assert calls == ["/v1/chat/completions"] * 3
    async with gateway(one_model(closed)) as g, aiohttp.ClientSession(timeout=CLIENT) as http, \
            http.post(g.url + "/v1/chat/completions", json=opening_chat("m", "hi")) as resp:
        body = await resp.json()
        assert resp.status == 503 and resp.headers["Retry-After"] == "1" and f"{NS}/m" in body["error"]["message"]


@pytest.mark.asyncio
async def test_a_stream_the_router_breaks_or_leaves_quiet_ends_with_an_error_event() -> None:
    async def breaks(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
        if request.headers.get("x-case") == "quiet":
            await asyncio.sleep(30)
        assert request.transport is not None
        request.transport.abort()
        return response

    async with fake_engine(breaks) as (url, _), gateway(one_model(url), stream_idle_timeout=0.5) as g, \
            aiohttp.ClientSession(timeout=CLIENT) as http:
        for case in ("broken", "quiet"):
            async with http.post(g.url + "/v1/chat/completions", json={**opening_chat("m", case), "stream": True},
                                 headers={"x-case": case}) as resp:
                assert resp.status == 200
                events = [data async for _, data in sse_events(resp)]
            assert json.loads(events[0])["choices"][0]["delta"]["content"] == "a"
            assert "error" in json.loads(events[-1]), (case, events)


@pytest.mark.asyncio
async def test_a_client_that_reads_nothing_is_dropped_and_the_router_request_ends() -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = b"data: " + b"x" * 65536 + b"\n\n"
        for _ in range(10_000):  # far more than socket buffers hold: the gateway must stop reading
            await response.write(chunk)
        return response

    async with fake_engine(endless) as (url, calls), gateway(one_model(url), stream_idle_timeout=0.5) as g:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(g.url.rsplit(":", 1)[1]))
        body = json.dumps({**opening_chat("m", "x"), "stream": True}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        await reader.read(100)  # the head, then nothing more is read
        await eventually(lambda: "closed" in calls, timeout=10)  # the gateway hung up on the router
        assert g.gateway.requests.requests == 0
        writer.close()


@pytest.mark.asyncio
async def test_a_streams_tokens_count_against_the_key_from_the_routers_usage(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("team:sk-team-0123456789\n")
    async with sim(served_name="m") as engine, router([engine.url], model="m") as r, \
            gateway(one_model(r.url), api_keys=str(keys), tokens_per_minute=100_000) as g, \
            aiohttp.ClientSession(timeout=CLIENT) as http:
        body = {**opening_chat("m", "count", max_tokens=6), "stream": True}
        async with http.post(g.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": "Bearer sk-team-0123456789"}) as resp:
            assert resp.status == 200
            events = [data async for _, data in sse_events(resp)]
        assert events[-1] == "[DONE]"
        # The client asked for no usage: none reaches it, yet the tenant is charged what the router reported.
        assert not any('"usage"' in e and json.loads(e).get("usage") for e in events[:-1])
        async with http.get(g.url + contract.METRICS_PATH) as resp:
            charged = metric_value(await resp.text(), contract.GATEWAY_CLIENT_METRICS.tenant_tokens + "_total",
                                   tenant="team")
        prompt = json.loads(await (await http.post(engine.url + "/tokenize", json={
            "model": "m", "messages": body["messages"]})).read())["count"]
        assert charged == prompt + 6
