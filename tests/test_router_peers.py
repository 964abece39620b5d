"""Router replicas share their placements (router/peers.py): a conversation's later turns find its engine
whichever replica they reach; the placements endpoint takes well-formed posts from peers only."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tensorfleet import contract
from tensorfleet.router import peers as peers_module
from tensorfleet.router.backends import Load
from tensorfleet.router.peers import MAX_OUTBOX, MAX_PLACEMENTS, PEER_HEARTBEAT, PEER_STALE, PeerMessageError, Peers
from tensorfleet.router.scheduling.request import UNSTATED_ANSWER_TOKENS
from tensorfleet.testing.loopback import MODEL, fake_engine, free_port, metric_value, router, router_pair, sim
from tensorfleet.testing.wait import eventually

CONVERSATIONS = 12   # all on one of 4 engines by chance, without the peers' placements: (1/4)^12, about 6e-8


def turn(index: int, *later: str) -> dict[str, Any]:
    """Conversation INDEX's chat: its opening (a system prompt and a first question long enough for several
    prompt blocks), then LATER messages (assistant and user alternating)."""
    messages = [{"role": "system", "content": f"You are assistant {index}. " + "Be brief and exact. " * 20},
                {"role": "user", "content": f"Question {index}: " + "what does this document say? " * 30}]
    for i, content in enumerate(later):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": content})
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


async def served_by(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with client.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers[contract.BACKEND_HEADER]


@pytest.mark.asyncio
@pytest.mark.parametrize("shared", [True, False])
async def test_a_later_turn_follows_the_conversation_to_the_engine_another_replica_chose(shared: bool) -> None:
    # Replica A knows one engine only, so every first turn it routes goes there, wherever the conversation's
    # home is; replica B knows all four. B's later turns follow the conversations to that engine only if A
    # told it where they went (shared=False: the control, where B guesses by each conversation's home).
    async with AsyncExitStack() as stack:
        engines = [(await stack.enter_async_context(sim(seed=i))).url for i in range(4)]
        port_a, port_b = free_port(), free_port()
        peers_a = (f"http://127.0.0.1:{port_b}",) if shared else ()
        peers_b = (f"http://127.0.0.1:{port_a}",) if shared else ()
        a = await stack.enter_async_context(router(engines[:1], strategy="cache-aware", port=port_a, peers=peers_a))
        b = await stack.enter_async_context(router(engines, strategy="cache-aware", port=port_b, peers=peers_b))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        for i in range(CONVERSATIONS):
            assert await served_by(client, a.url, turn(i)) == engines[0]
        if shared:
            async def received() -> bool:
                async with client.get(b.url + contract.METRICS_PATH) as resp:
                    value = metric_value(await resp.text(), contract.ROUTER_METRIC_PEER_PLACEMENTS + "_total",
                                         outcome="received")
                return value == CONVERSATIONS
            await eventually(received, timeout=5)
        later = [await served_by(client, b.url, turn(i, "An answer.", "And then?")) for i in range(CONVERSATIONS)]
    if shared:
        assert later == [engines[0]] * CONVERSATIONS
    else:
        assert set(later) != {engines[0]}


@pytest.mark.asyncio
async def test_the_placements_endpoint_takes_well_formed_posts_from_peers_only() -> None:
    async with AsyncExitStack() as stack:
        engine = (await stack.enter_async_context(sim())).url
        peer = await stack.enter_async_context(router([engine], strategy="cache-aware",
                                                      peers=("http://127.0.0.1:9",)))
        stranger = await stack.enter_async_context(router([engine], strategy="cache-aware",
                                                          peers=("http://127.0.0.2:9",)))
        plain = await stack.enter_async_context(router([engine], strategy="least-pending",
                                                       peers=("http://127.0.0.1:9",)))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        block_chars = peer.router.strategy.block_chars
        good = {"from": "another", "blockChars": block_chars, "placements": [[engine, 7, [1, 2, 3]]]}

        async def post(url: str, body: Any) -> tuple[int, Any]:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with client.post(url + contract.ROUTER_PEER_PATH, data=data) as resp:
                text = await resp.text()
                return resp.status, json.loads(text) if text else None

        assert (await post(peer.url, good))[0] == 204
        strategy: Any = peer.router.strategy
        assert strategy.prefixes.matched(peer.router.pool.backends[engine], [1, 2, 3]) == 3
        # Not from a peer's address: refused, and nothing learned.
        status, error = await post(stranger.url, good)
        assert status == 403 and "peers only" in error["error"]["message"]
        stranger_strategy: Any = stranger.router.strategy
        assert stranger_strategy.prefixes.matched(stranger.router.pool.backends[engine], [1, 2, 3]) == 0
        # Malformed: 400 with the reason.
        for body in (b"{", {"placements": "no"}, {**good, "placements": [[engine, -1, []]]},
                     {**good, "placements": [[engine, None, ["x"]]]}):
            status, error = await post(peer.url, body)
            assert status == 400 and error["error"]["message"].startswith("not a placements message"), body
        # Another block size (the replicas disagree until their next scrape), or an engine not in the pool:
        # accepted, ignored.
        for body in ({**good, "blockChars": block_chars * 2, "placements": [[engine, 8, [4]]]},
                     {**good, "placements": [["http://127.0.0.1:1", 8, [4]]]}):
            assert (await post(peer.url, body))[0] == 204
            assert strategy.prefixes.matched(peer.router.pool.backends[engine], [4]) == 0
        # A strategy that indexes no prompts has no peers, nor the endpoint.
        assert plain.router.peers is None
        assert (await post(plain.url, good))[0] == 404


def test_peers_leave_out_their_own_address_and_bound_their_outbox() -> None:
    counted: list[tuple[str, int]] = []
    peers = Peers(static=("http://10.0.0.5:8080/",), own_address="10.0.0.7",
                  on_outcome=lambda outcome, count: counted.append((outcome, count)))
    peers.set_discovered(["http://10.0.0.6:8080", "http://10.0.0.7:8080"])
    assert peers.urls == ("http://10.0.0.5:8080", "http://10.0.0.6:8080")
    assert peers.allowed("10.0.0.6") and not peers.allowed("10.0.0.7") and not peers.allowed(None)
    for i in range(MAX_OUTBOX + 5):
        peers.share("http://engine:8000", [i, i + 1], None)
    peers.share("http://engine:8000", [], 3)   # no whole block: nothing to tell
    load = {"http://engine:8000": Load(requests=3, prefilling=1, prefill_chars=1200.0, context_chars=9000.0,
                                       queued_prompt_chars=700.0, exposure=0.25)}
    body = peers.message(256, load, now=10.0)
    assert body is not None
    doc = json.loads(body)
    assert len(doc["placements"]) == MAX_OUTBOX and doc["placements"][0] == ["http://engine:8000", None, [5, 6]]
    assert doc["load"] == {"http://engine:8000": [3, 1200, 9000, 700, 1]}
    # The decodes at risk go apart from the load, in millionths: a replica before them refuses a longer load.
    assert doc["exposure"] == {"http://engine:8000": 250_000}
    assert ("dropped", 5) in counted
    # Nothing new: no message until the load changes or the heartbeat is due.
    assert peers.message(256, dict(load), now=10.1) is None
    assert peers.message(256, {"http://engine:8000": Load(requests=2)}, now=10.2) is not None
    assert peers.message(256, {"http://engine:8000": Load(requests=2)}, now=10.2 + PEER_HEARTBEAT) is not None
    # The ledger moves a Load in place: a change to the very object last sent is news, sent at once.
    own = {"http://engine:8000": Load(requests=2)}
    assert peers.message(256, own, now=20.0) is not None and peers.message(256, own, now=20.1) is None
    own["http://engine:8000"].queued_prompt_chars = 700.0
    sent = peers.message(256, own, now=20.2)
    assert sent is not None and json.loads(sent)["load"] == {"http://engine:8000": [2, 0, 0, 700, 0]}
    # A message of this process's own (come back through the Service) is taken as nothing.
    assert peers.decode(body, 256, now=10.0) == [] and not peers.heard
    other = Peers(static=("http://10.0.0.7:8080",))
    assert len(other.decode(body, 256, now=10.0)) == MAX_OUTBOX
    assert other.load(10.0) == load
    # Another block size: the load counts, the placements do not; a peer not heard from for PEER_STALE counts no
    # more.
    assert other.decode(body, 512, now=11.0) == [] and other.load(11.0 + PEER_STALE) == load
    assert other.load(11.1 + PEER_STALE) == {} and not other.heard
    # Replicas of the versions before prompt characters in flight, then queued prompt characters, then requests
    # with no first byte back, were told (a rolling upgrade): their load counts, with none of what they leave
    # out; the sum is over every peer.
    oldest = {"from": "oldest", "blockChars": 256, "placements": [], "load": {"http://engine:8000": [2, 300]}}
    older = {"from": "older", "blockChars": 256, "placements": [], "load": {"http://engine:8000": [1, 50, 400]}}
    assert other.decode(json.dumps(oldest).encode(), 256, now=12.0) == []
    assert other.load(12.0) == {"http://engine:8000": Load(requests=2, prefill_chars=300.0)}
    assert other.decode(json.dumps(older).encode(), 256, now=12.0) == []
    assert other.load(12.0) == {"http://engine:8000": Load(requests=3, prefill_chars=350.0, context_chars=400.0)}
    assert other.load(12.0)["http://engine:8000"].prefilling == 0
    newer = {"from": "newer", "blockChars": 256, "placements": [], "load": {"http://engine:8000": [4, 0, 0, 0, 9]}}
    assert other.decode(json.dumps(newer).encode(), 256, now=12.0) == []
    assert other.load(12.0)["http://engine:8000"] == Load(requests=7, prefilling=4, prefill_chars=350.0,
                                                          context_chars=400.0)
    for bad, says in (({"from": "x", "blockChars": 256, "placements": [["e", None, []]] * (MAX_PLACEMENTS + 1)},
                       "more than"),
                      ({"blockChars": 256, "placements": []}, "'from'"),
                      ({"from": "x", "blockChars": 256, "placements": [], "load": {"e": [1.5, 0]}}, "'load'"),
                      ({"from": "x", "blockChars": 256, "placements": [], "load": {"e": [1]}}, "'load'"),
                      ({"from": "x", "blockChars": 256, "placements": [], "load": {"e": [1, 0]}, "exposure": {"e": 0.5}},
                       "'exposure'"),
                      ({"from": "x", "blockChars": 256, "placements": [], "exposure": []}, "'exposure'"),
                      ({"from": "x", "blockChars": 256, "placements": [], "load": {"e": [1, 0, 0, 0, 0, 0]}}, "'load'")):
        with pytest.raises(PeerMessageError, match=says):
            other.decode(json.dumps(bad).encode(), 256, now=12.0)
    # No peers: nothing is kept to send.
    alone = Peers()
    alone.share("http://engine:8000", [1], None)
    assert json.loads(alone.message(256, {}, now=0.0) or b"")["placements"] == []


@pytest.mark.asyncio
async def test_news_goes_to_the_peers_without_waiting_for_the_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    # With the heartbeat an hour away, only news sends a message: a placement, then a change of load alone.
    monkeypatch.setattr(peers_module, "PEER_HEARTBEAT", 3600.0)
    got: list[dict[str, Any]] = []

    async def take(request: web.Request) -> web.StreamResponse:
        got.append(json.loads(await request.read()))
        return web.Response(status=204)

    engine = "http://engine:8000"
    load = {engine: Load(requests=1, prefilling=1, prefill_chars=500.0, context_chars=800.0, queued_prompt_chars=500.0)}
    async with fake_engine(take) as (url, _calls), aiohttp.ClientSession() as session:
        peers = Peers(static=(url,))
        task = asyncio.create_task(peers.run(session, lambda: 256, lambda: dict(load),
                                             asyncio.get_running_loop().time))
        try:
            peers.share(engine, [1, 2], 7)
            peers.nudge()
            await eventually(lambda: len(got) == 1, timeout=5)
            assert got[0]["placements"] == [[engine, 7, [1, 2]]] and got[0]["load"] == {engine: [1, 500, 800, 500, 1]}
            load[engine] = Load()
            peers.nudge()
            await eventually(lambda: len(got) == 2, timeout=5)
            assert got[1]["placements"] == [] and got[1]["load"] == {engine: [0, 0, 0, 0, 0]}
            # A nudge with nothing new (no placements, the load as last sent) sends nothing.
            peers.nudge()
            await asyncio.sleep(0.05)
            assert len(got) == 2
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_a_replica_counts_the_requests_prompt_work_and_prompts_its_peer_has_on_an_engine() -> None:
    release = asyncio.Event()

    async def hold(request: web.Request) -> web.StreamResponse:
        await request.read()
        await release.wait()   # no first byte until released: the prompt stays work to do
        return web.json_response({"choices": []})

    async with AsyncExitStack() as stack:
        engine, _calls = await stack.enter_async_context(fake_engine(hold))
        a, b = await stack.enter_async_context(router_pair([engine], strategy="cache-aware"))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        seen = b.router.pool.backends[engine]
        # Answers of 9 tokens, of unstated length and of 2 tokens: each request's decodes at risk is one over
        # the gaps between its tokens (an unstated one counts as UNSTATED_ANSWER_TOKENS).
        bodies = [{**turn(0), "max_tokens": 9}, {k: v for k, v in turn(1).items() if k != "max_tokens"},
                  {**turn(2), "max_completion_tokens": 2}]
        held = [asyncio.create_task(client.post(a.url + "/v1/chat/completions", json=body)) for body in bodies]
        told = a.router.pool.backends[engine]
        at_risk = 1 / 8 + 1 / (UNSTATED_ANSWER_TOKENS - 1) + 1
        await eventually(lambda: told.own.prefill_chars > 0 and seen.others == 3 and seen.peers.prefilling == 3
                         and seen.peers.prefill_chars == round(told.own.prefill_chars)
                         and seen.peers.context_chars == round(told.own.context_chars)
                         and seen.peers.exposure > 0, timeout=5)
        assert seen.in_flight == 0 and seen.estimated_load() >= 3 and told.own.context_chars >= told.own.prefill_chars
        assert told.own.exposure == pytest.approx(at_risk) and seen.peers.exposure == pytest.approx(at_risk, abs=1e-6)
        release.set()
        for response in await asyncio.gather(*held):
            assert response.status == 200
            response.release()
        await eventually(lambda: seen.others == 0 and seen.peers.prefill_chars == 0 and seen.peers.context_chars == 0
                         and seen.peers.exposure == 0, timeout=5)
        assert told.own.context_chars == 0 and told.own.exposure == 0


@pytest.mark.asyncio
async def test_replicas_share_one_ceiling_per_engine() -> None:
    release = asyncio.Event()

    async def hold(request: web.Request) -> web.StreamResponse:
        await request.read()
        await release.wait()
        return web.json_response({"choices": []})

    async with AsyncExitStack() as stack:
        engine, calls = await stack.enter_async_context(fake_engine(hold))
        a, b = await stack.enter_async_context(router_pair([engine], strategy="cache-aware",
                                                           max_concurrency_per_backend=2))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        first = [asyncio.create_task(client.post(a.url + "/v1/chat/completions", json=turn(i))) for i in range(2)]
        seen = b.router.pool.backends[engine]
        await eventually(lambda: seen.peers.requests == 2, timeout=5)
        # The engine holds the ceiling, all of it A's: B's request waits at B instead of going there too.
        later = asyncio.create_task(client.post(b.url + "/v1/chat/completions", json=turn(9)))
        await eventually(lambda: b.router.dispatcher.pending == 1, timeout=5)
        await asyncio.sleep(0.3)
        assert len(calls) == 2 and b.router.dispatcher.pending == 1
        # A's requests end: B hears of it and sends its own.
        release.set()
        for response in [*await asyncio.gather(*first), await later]:
            assert response.status == 200
            response.release()
        assert len(calls) == 3


@pytest.mark.asyncio
async def test_replicas_share_one_prompt_bound_per_engine() -> None:
    # Under the prompt bound (router/dispatch.py) an engine takes a prompt while none is queued there or it fits
    # beside those that are. A's streamed prompt, with no first token yet, counts at B too: B's holds back, and
    # goes once A's first token comes back and A tells B its queue cleared.
    release = asyncio.Event()

    async def hold(request: web.Request) -> web.StreamResponse:
        await request.read()
        await release.wait()   # no first byte until released: the prompt stays queued
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response

    async with AsyncExitStack() as stack:
        engine, calls = await stack.enter_async_context(fake_engine(hold))
        # A bound below one prompt of turn().
        a, b = await stack.enter_async_context(router_pair([engine], strategy="cache-aware", prompt_queue_tokens=100))
        client = await stack.enter_async_context(aiohttp.ClientSession())
        told, seen = a.router.pool.backends[engine], b.router.pool.backends[engine]
        first = asyncio.create_task(client.post(a.url + "/v1/chat/completions", json={**turn(0), "stream": True}))
        await eventually(lambda: told.own.queued_prompt_chars > a.router.dispatcher.prompt_queue_chars
                         and seen.peers.queued_prompt_chars == round(told.own.queued_prompt_chars), timeout=5)
        later = asyncio.create_task(client.post(b.url + "/v1/chat/completions", json={**turn(1), "stream": True}))
        await eventually(lambda: b.router.dispatcher.pending == 1, timeout=5)
        await asyncio.sleep(0.3)
        assert len(calls) == 1 and b.router.dispatcher.pending == 1 and seen.in_flight == 0
        # A's first token: its prompt is computed, A says so, and B's goes.
        release.set()
        for response in await asyncio.gather(first, later):
            assert response.status == 200
            await response.read()
            response.release()
        assert len(calls) == 2 and seen.peers.queued_prompt_chars == 0
