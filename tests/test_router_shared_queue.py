"""Router replicas order one queue between them (router/dispatch.py, router/peers.py): each tells its peers the
cheapest waiter it has for each engine, and a replica leaves a freed slot, for a bounded time, to a peer whose waiter
would compute less prompt there, so the slot goes to the cheapest waiter of all, as with one router."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tensorfleet import contract
from tensorfleet.router import yielding
from tensorfleet.router.backends import BackendPool, Load
from tensorfleet.router.dispatch import Dispatcher
from tensorfleet.router.peers import PEER_STALE, PeerMessageError, Peers
from tensorfleet.router.scheduling import CacheAware, RequestInfo, make_profile
from tensorfleet.router.yielding import YIELD_SECONDS
from tensorfleet.testing.loopback import MODEL, fake_engine, metric_value, router_pair
from tensorfleet.testing.wait import eventually

ENGINE = "http://a"


def one_engine(**options: Any) -> tuple[Dispatcher, dict[str, float]]:
    """A cache-aware dispatcher over one engine with a ceiling of 1, and the peers' queue heads it reads (a dict the
    test fills)."""
    pool = BackendPool()
    pool.set_urls([ENGINE])
    dispatcher = Dispatcher(pool, CacheAware(), ceiling=1, queue_timeout=30, **options)
    heads: dict[str, float] = {}
    dispatcher.yielding.peer_queue = lambda: heads
    return dispatcher, heads


def prompt(chars: int) -> RequestInfo:
    return RequestInfo(prompt_chars=chars)   # no prefix hashes: it computes all of its prompt on any engine


@pytest.mark.asyncio
async def test_a_freed_slot_waits_for_a_peers_cheaper_waiter_and_only_so_long() -> None:
    dispatcher, heads = one_engine()
    ended: list[str] = []
    dispatcher.yielding.on_end = ended.append
    holder = prompt(100)
    engine = await dispatcher.acquire(holder)
    mine = asyncio.create_task(dispatcher.acquire(prompt(5000)))
    await asyncio.sleep(0)
    block = dispatcher.strategy.block_chars

    # A peer's waiter would compute a block less there: the freed slot is left to it...
    heads[ENGINE] = 5000 - block
    dispatcher.release(engine, holder)
    await asyncio.sleep(0)
    assert not mine.done() and engine.in_flight == 0
    # ...which takes it (its message says so): the engine is full, and nothing is left to anyone.
    engine.peers = Load(requests=1)
    dispatcher.yielding.end(engine.url, "taken")
    dispatcher.drain()
    await asyncio.sleep(YIELD_SECONDS * 2)
    assert not mine.done() and ended == ["taken"]
    # The peer's request ends and its queue is empty: the next slot goes to this router's waiter at once.
    engine.peers = Load()
    heads.clear()
    dispatcher.drain()
    assert await asyncio.wait_for(mine, 1) is engine

    # A peer that does not come for the slot loses it after YIELD_SECONDS.
    dispatcher, heads = one_engine()
    dispatcher.yielding.on_end = ended.append
    engine = await dispatcher.acquire(holder)
    mine = asyncio.create_task(dispatcher.acquire(prompt(5000)))
    await asyncio.sleep(0)
    heads[ENGINE] = 0
    loop = asyncio.get_running_loop()
    freed = loop.time()
    dispatcher.release(engine, holder)
    assert await asyncio.wait_for(mine, 1) is engine
    assert loop.time() - freed >= YIELD_SECONDS and ended == ["taken", "reclaimed"]


@pytest.mark.asyncio
async def test_a_slot_is_not_left_to_a_peer_whose_waiter_is_no_cheaper_or_to_one_that_waited_less() -> None:
    block = CacheAware().block_chars
    # Less than a block cheaper, or dearer: not worth the wait.
    for theirs in (5000 - block + 1, 5000, 9000):
        dispatcher, heads = one_engine()
        holder = prompt(100)
        engine = await dispatcher.acquire(holder)
        mine = asyncio.create_task(dispatcher.acquire(prompt(5000)))
        await asyncio.sleep(0)
        heads[ENGINE] = theirs
        dispatcher.release(engine, holder)
        await asyncio.sleep(0)
        assert mine.done() and mine.result() is engine, theirs
    # A waiter here that has waited the order age goes first whatever the peers hold, as it does in one queue.
    dispatcher, heads = one_engine(order_age=0.05)
    holder = prompt(100)
    engine = await dispatcher.acquire(holder)
    mine = asyncio.create_task(dispatcher.acquire(prompt(5000)))
    await asyncio.sleep(0.1)
    heads[ENGINE] = 0
    dispatcher.release(engine, holder)
    await asyncio.sleep(0)
    assert mine.done() and mine.result() is engine
    # A request with nowhere to wait (try_acquire) never leaves a slot to a peer.
    dispatcher, heads = one_engine()
    heads[ENGINE] = 0
    assert dispatcher.try_acquire(prompt(5000)) is not None


@pytest.mark.asyncio
async def test_a_new_request_does_not_take_a_slot_a_peers_cheaper_waiter_is_due() -> None:
    # With nothing queued here, a request that arrives as a slot frees would take it before the peer hears of it:
    # it waits like a queued one.
    dispatcher, heads = one_engine()
    heads[ENGINE] = 0
    task = asyncio.create_task(dispatcher.acquire(prompt(5000)))
    await asyncio.sleep(0)
    assert not task.done() and dispatcher.pending == 1
    assert await asyncio.wait_for(task, 1) is dispatcher.pool.backends[ENGINE]


@pytest.mark.asyncio
async def test_the_queue_heads_are_the_cheapest_waiter_each_engine_could_take() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    dispatcher = Dispatcher(pool, CacheAware(), ceiling=1, queue_timeout=30, order_age=0.2)
    a, b = pool.backends["http://a"], pool.backends["http://b"]
    told: list[int] = []
    dispatcher.on_load = lambda: told.append(1)
    assert dispatcher.queue_heads() == {}
    for _ in range(2):
        await dispatcher.acquire(prompt(10))
    told.clear()
    # The dearer waiter may use either engine; the cheaper one already failed on b.
    dear = asyncio.create_task(dispatcher.acquire(prompt(3000)))
    cheap = asyncio.create_task(dispatcher.acquire(prompt(700), exclude=frozenset({"http://b"})))
    await asyncio.sleep(0)
    assert dispatcher.queue_heads() == {"http://a": 700, "http://b": 3000}
    assert len(told) == 2   # each waiter that joined the queue was news to the peers
    # Past the order age a waiter counts as free work: it goes before any peer's cheaper one.
    await asyncio.sleep(0.25)
    assert dispatcher.queue_heads() == {"http://a": 0, "http://b": 0}
    for task in (dear, cheap):
        task.cancel()
    await asyncio.gather(dear, cheap, return_exceptions=True)
    assert dispatcher.queue_heads() == {} and len(told) == 4
    assert a.own.requests == b.own.requests == 1

    # Under the prompt bound a waiter whose prompt does not fit beside the prompt queued on an engine could not go
    # there if a slot freed: it is no head there.
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    bounded = Dispatcher(pool, CacheAware(), ceiling=1, queue_timeout=30, prompt_queue_chars=1000)
    for _ in range(2):
        assert bounded.try_acquire(RequestInfo(prompt_chars=900, queues_prompt=True)) is not None
    waiters = [asyncio.create_task(bounded.acquire(prompt(chars))) for chars in (800, 50)]
    await asyncio.sleep(0)
    assert bounded.pending == 2 and bounded.queue_heads() == {"http://a": 50, "http://b": 50}
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)

    # A strategy that serves its queue in arrival order tells no heads.
    pool = BackendPool()
    pool.set_urls(["http://a"])
    plain = Dispatcher(pool, make_profile("prefix-aware"), ceiling=1, queue_timeout=30)
    assert plain.try_acquire(prompt(10)) is not None
    waiter = asyncio.create_task(plain.acquire(prompt(10)))
    await asyncio.sleep(0)
    assert plain.pending == 1 and plain.queue_heads() == {}
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


def test_the_heads_travel_in_the_peers_messages() -> None:
    heads = {"http://a": 700, "http://b": 3000}
    sender, receiver = Peers(static=("http://peer",)), Peers(static=("http://peer",))
    sender.queue_heads_source = lambda: dict(heads)
    body = sender.message(64, {}, now=0.0)
    assert body is not None and json.loads(body)["queue"] == heads
    receiver.decode(body, 64, now=0.0)
    assert receiver.queue_heads(0.0) == heads
    # Of two peers, the cheaper per engine.
    other = Peers(static=("http://peer",))
    other.queue_heads_source = lambda: {"http://a": 900, "http://b": 100}
    other_body = other.message(64, {}, now=0.0)
    assert other_body is not None
    receiver.decode(other_body, 64, now=0.0)
    assert receiver.queue_heads(0.0) == {"http://a": 700, "http://b": 100}
    # A change of heads alone is news; none left sends no "queue", and the receiver forgets the sender's.
    assert sender.message(64, {}, now=0.1) is None
    heads.clear()
    body = sender.message(64, {}, now=0.1)
    assert body is not None and "queue" not in json.loads(body)
    receiver.decode(body, 64, now=0.1)
    assert receiver.queue_heads(0.1) == {"http://a": 900, "http://b": 100}
    # A peer not heard from within PEER_STALE counts no more.
    assert receiver.queue_heads(PEER_STALE + 0.05) == {}
    for bad in ([1], {"http://a": -1}, {"http://a": 1.5}, {"http://a": "7"}):
        with pytest.raises(PeerMessageError, match="'queue'"):
            receiver.decode(json.dumps({"from": "x", "placements": [], "queue": bad}).encode(), 64, now=0.0)


def conversation(index: int, *later: str) -> dict[str, Any]:
    """Conversation INDEX's chat, its opening long enough for many prompt blocks, then LATER messages."""
    messages = [{"role": "system", "content": f"You are assistant {index}. " + "Be brief and exact. " * 40},
                {"role": "user", "content": f"Question {index}: " + "what does this document say? " * 60}]
    for i, content in enumerate(later):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": content})
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


@pytest.mark.asyncio
async def test_the_slot_one_replica_frees_goes_to_the_other_replicas_cheaper_waiter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Room enough for a loaded machine's message delay: the order must not hang on timing.
    monkeypatch.setattr(yielding, "YIELD_SECONDS", 5.0)
    release = asyncio.Event()
    served: list[str] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        served.append(body["messages"][-1]["content"])
        if len(served) == 1:
            await release.wait()   # the first request holds the engine's one slot
        return web.json_response({"choices": []})

    async with AsyncExitStack() as stack:
        engine, _calls = await stack.enter_async_context(fake_engine(answer))
        a, b = await stack.enter_async_context(router_pair([engine], strategy="cache-aware",
                                                           max_concurrency_per_backend=1))
        client = await stack.enter_async_context(aiohttp.ClientSession())

        def post(url: str, body: dict[str, Any]) -> asyncio.Task[aiohttp.ClientResponse]:
            return asyncio.create_task(client.post(url + "/v1/chat/completions", json=body))

        # B's request holds the engine: a conversation's opening, whose blocks A learns B placed there.
        opening = post(b.url, conversation(0))
        seen = a.router.pool.backends[engine]
        await eventually(lambda: seen.peers.requests == 1, timeout=5)
        # A queues the conversation's next turn (its history cached on the engine: little to compute), then B a
        # new conversation (all of it to compute).
        follow_up = post(a.url, conversation(0, "An answer.", "And the next question?"))
        await eventually(lambda: a.router.dispatcher.pending == 1, timeout=5)
        stranger = post(b.url, conversation(1))
        await eventually(lambda: b.router.dispatcher.pending == 1, timeout=5)
        own = b.router.dispatcher.queue_heads()[engine]
        await eventually(lambda: b.router.dispatcher.yielding.peer_queue is not None
                         and 0 <= b.router.dispatcher.yielding.peer_queue().get(engine, own) < own // 2, timeout=5)
        # B's opening ends: B frees the slot, and A's cheaper waiter gets it before B's own.
        release.set()
        for response in await asyncio.gather(opening, follow_up, stranger):
            assert response.status == 200, await response.text()
            response.release()
        assert served == [conversation(0)["messages"][-1]["content"], "And the next question?",
                          conversation(1)["messages"][-1]["content"]]
        # B counted the slot it left, and that A took it.
        for replica, taken in ((b, 1.0), (a, 0.0)):
            async with client.get(replica.url + contract.METRICS_PATH) as resp:
                text = await resp.text()
            name = contract.ROUTER_METRIC_PEER_YIELDS + "_total"
            assert (metric_value(text, name, outcome="taken"), metric_value(text, name, outcome="reclaimed")) == \
                (taken, 0.0)
