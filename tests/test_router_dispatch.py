"""Admission, without sockets: the dispatcher's ceiling, queue, deadline and burst, the prompt work it charges each
engine until the first byte and the bound on it, the order in which waiters get a freed slot; and the circuit
breakers and engine metrics that decide which engines may take a request.
"""

from __future__ import annotations

import asyncio

import pytest
from test_router_strategies import chat, info_of, owed

from tensorfleet.router.backends import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    Backend,
    BackendPool,
    BreakerPolicy,
    EngineMetrics,
    Load,
    parse_engine_metrics,
)
from tensorfleet.router.dispatch import Dispatcher, NoBackend, QueueTimeout
from tensorfleet.router.scheduling import CacheAware, RequestInfo, make_profile
from tensorfleet.router.waitqueue import QueueFull

# --- breaker ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_ejects_probes_and_recovers() -> None:
    clock = Clock()
    pool = BackendPool(BreakerPolicy(failure_threshold=3, ejection_seconds=1.0, max_ejection_seconds=4.0), clock)
    pool.set_urls(["http://a", "http://b"])
    a = pool.backends["http://a"]
    pool.record_failure(a)
    pool.record_failure(a)
    assert a.state == CLOSED
    pool.record_failure(a)
    assert a.state == OPEN and [b.url for b in pool.routable()] == ["http://b"]
    until = a.breaker.open_until
    pool.record_failure(a)                        # late failures do not extend it
    assert a.breaker.open_until == until and a.breaker.ejections == 1
    clock.now += 1.0
    assert a in pool.routable()                   # half-open: one probe
    pool.begin_probe(a)
    assert a.state == HALF_OPEN and a not in pool.routable()
    pool.record_failure(a)                        # probe failed: longer ejection
    assert a.state == OPEN and a.breaker.open_until == clock.now + 2.0
    clock.now += 2.0
    pool.begin_probe(a)
    pool.record_success(a)
    assert a.state == CLOSED and a.breaker.ejections == 0
    pool.record_failure(a, fatal=True)            # connection refused: at once
    assert a.state == OPEN


def test_parse_engine_metrics() -> None:
    text = """# HELP vllm:num_requests_waiting x
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:cache_config_info{block_size="16",engine="0",model_name="m",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",model_name="m",num_gpu_blocks="100"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9.0
"""
    load = parse_engine_metrics(text)
    assert (load.waiting, load.running, load.kv_cache_tokens, load.kv_block_size) == (4.0, 7.0, 3200, 16)
    assert load.kv_usage == pytest.approx(0.6)
    assert parse_engine_metrics("").kv_cache_tokens is None


# --- dispatcher ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_dispatcher_charges_a_prompt_to_its_engine_until_the_first_byte() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    dispatcher = Dispatcher(pool, CacheAware(), ceiling=1, max_queue=4, queue_timeout=5)
    changes: list[tuple[int, float]] = []   # the load as each change of it is told (the router tells its peers)
    dispatcher.on_load = lambda: changes.append((sum(b.in_flight for b in pool), sum(b.own.prefill_chars for b in pool)))
    first = info_of(chat("a question " * 100))
    a = await dispatcher.acquire(first)
    assert a.own.prefill_chars == owed(dispatcher, a, first).prefill == first.prompt_chars > 0
    assert a.own.context_chars == owed(dispatcher, a, first).context == first.prompt_chars
    assert a.own.prefilling == 1 and a.own.requests == 1
    assert a.own.exposure == owed(dispatcher, a, first).exposure == first.exposure > 0   # from placement to its end
    dispatcher.discharge(a, first)                   # its first byte came back
    assert a.own.prefill_chars == 0 and owed(dispatcher, a, first).prefill == 0
    assert a.own.prefilling == 0 and a.own.requests == 1
    dispatcher.discharge(a, first)                   # a second first byte (a resumed stream) takes off nothing
    assert a.own.prefilling == 0 and a.own.requests == 1
    assert a.own.context_chars == first.prompt_chars     # its KV stays on the engine until it ends
    dispatcher.release(a, first)                     # nothing charged twice
    assert a.own.prefill_chars == 0 and a.in_flight == 0 and a.own.context_chars == 0 and len(dispatcher.ledger) == 0
    dispatcher.release(a, first)                     # released twice: a bug, logged, and no count goes below 0
    assert a.own == Load()
    assert changes == [(1, first.prompt_chars), (1, 0.0), (0, 0.0)]
    dispatcher.on_load = None
    # A strategy that never reads the charge is spared computing it.
    blind = Dispatcher(pool, make_profile("prefix-aware"), ceiling=1, max_queue=4, queue_timeout=5)
    other = info_of(chat("a question " * 100))
    c = await blind.acquire(other)
    assert c.own.prefill_chars == 0 and owed(blind, c, other).prefill == 0
    blind.release(c, other)
    # Released without a first byte (the engine failed, the client left): the charge goes with the slot.
    second = info_of(chat("another question " * 100))
    b = await dispatcher.acquire(second)
    dispatcher.release(b, second)
    assert b.own.prefill_chars == 0 and b.own.context_chars == 0
    # A waiter granted a slot just as it was cancelled gives back the slot and its charge.
    holders = [info_of(chat(f"hold {n} " * 50)) for n in range(2)]
    held = [await dispatcher.acquire(info) for info in holders]
    waiting = info_of(chat("a waiting question " * 100))
    waiter = asyncio.create_task(dispatcher.acquire(waiting))
    await asyncio.sleep(0)
    dispatcher.release(held[0], holders[0])          # the slot, and the waiter's charge, pass to the waiter
    assert held[0].own.prefill_chars == owed(dispatcher, held[0], waiting).prefill > 0
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert held[0].own == Load() and dispatcher.ledger.get(held[0], waiting) is None


def streamed(body: dict[str, object]) -> RequestInfo:
    info = info_of(body)
    info.queues_prompt = True
    return info


@pytest.mark.asyncio
async def test_cache_aware_holds_prompts_beyond_a_step_and_sends_each_to_the_first_engine_to_clear() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    dispatcher = Dispatcher(pool, CacheAware(), ceiling=8, queue_timeout=30, prompt_queue_chars=4000)
    first, second = streamed(chat("the first question " * 150)), streamed(chat("the second question " * 150))
    assert 2500 < first.prompt_chars < 4000 and 2500 < second.prompt_chars < 4000
    a = await dispatcher.acquire(first)
    b = await dispatcher.acquire(second)
    assert {a.url, b.url} == {"http://a", "http://b"}
    assert a.own.queued_prompt_chars == owed(dispatcher, a, first).queued == owed(dispatcher, a, first).prefill > 0
    # Each engine has most of a step's prompt to compute: a third prompt would only wait inside one of them, so it
    # waits here, and so does a short one behind it (it keeps its place in the queue, then goes cheapest first).
    third = streamed(chat("the third question, the longest of all " * 110))
    short = streamed(chat("a short one"))
    assert third.prompt_chars > 4000 and short.prompt_chars < 600
    waiting = [asyncio.create_task(dispatcher.acquire(info)) for info in (third, short)]
    await asyncio.sleep(0)
    assert not any(task.done() for task in waiting) and dispatcher.pending == 2
    assert a.in_flight == b.in_flight == 1            # held for the prompt bound, under the ceiling
    # The first prompt's first token: its engine has room again. The short prompt goes first; the long one, more
    # than a step by itself, goes only to an engine with nothing queued, and waits for the next to clear.
    dispatcher.discharge(a, first)
    await asyncio.sleep(0)
    assert waiting[1].done() and not waiting[0].done()
    assert waiting[1].result() is a and a.own.queued_prompt_chars == owed(dispatcher, a, short).queued
    dispatcher.discharge(b, second)
    await asyncio.sleep(0)
    assert waiting[0].result() is b and b.own.queued_prompt_chars == owed(dispatcher, b, third).queued
    # A prompt longer than a step goes to an engine that has none queued, alone.
    dispatcher.discharge(a, short)
    huge = streamed(chat("a document to read " * 400))
    assert huge.prompt_chars > 4000
    assert await dispatcher.acquire(huge) is a
    # A whole (not streamed) answer comes back only when its generation ends: it is placed by its prompt work
    # but not counted against the bound, and it is held like any other while no engine has room.
    dispatcher.discharge(b, third)
    whole = info_of(chat("a question answered whole " * 100))
    c = await dispatcher.acquire(whole)
    assert c is b and owed(dispatcher, b, whole).prefill > 0 and owed(dispatcher, b, whole).queued == 0
    assert b.own.queued_prompt_chars == 0
    # Released without a first token (the engine failed, the client left): its charge goes with the slot.
    dispatcher.release(a, huge)
    assert a.own.queued_prompt_chars == 0 and dispatcher.ledger.get(a, huge) is None


@pytest.mark.asyncio
async def test_the_prompt_bound_is_off_at_zero_and_for_strategies_that_do_not_place_by_prompt_work() -> None:
    for strategy, bound in ((CacheAware(), 0.0), (make_profile("round-robin"), 4000.0), (make_profile("least-pending"), 4000.0)):
        pool = BackendPool()
        pool.set_urls(["http://a"])
        dispatcher = Dispatcher(pool, strategy, ceiling=8, queue_timeout=1, prompt_queue_chars=bound)
        assert dispatcher.prompt_queue_chars == 0
        infos = [streamed(chat(f"question {n} " * 400)) for n in range(3)]
        engines = [await dispatcher.acquire(info) for info in infos]   # not one waits
        assert all(engine.url == "http://a" for engine in engines) and dispatcher.pending == 0


@pytest.mark.asyncio
async def test_a_later_turn_waits_for_its_engine_under_the_prompt_bound_rather_than_recompute_elsewhere() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    strategy = CacheAware()
    dispatcher = Dispatcher(pool, strategy, ceiling=8, queue_timeout=30, prompt_queue_chars=4000)
    talk = "the fleet's history in detail " * 100
    opening = streamed(chat(talk))
    home = await dispatcher.acquire(opening)
    dispatcher.discharge(home, opening)
    dispatcher.release(home, opening)
    filler = streamed(chat("a new conversation about something else " * 70))
    assert await dispatcher.acquire(filler) is home
    pool.set_urls(["http://a", "http://b"])      # a second engine joins, with nothing queued
    other = next(b for b in pool if b is not home)
    # The next turn computes only its new message at home, which fits beside what is queued there: it goes home.
    follow_up = streamed(chat(talk, "an answer " * 20, "and one more question " * 5))
    assert home.own.queued_prompt_chars + strategy.prefill_cost(home, follow_up) <= 4000
    assert strategy.prefill_cost(other, follow_up) > 4000 - home.own.queued_prompt_chars
    assert await dispatcher.acquire(follow_up) is home
    # With no room left at home, the turn after waits for it (the other engine would compute the whole
    # history) and goes home once it clears.
    later = streamed(chat(talk, "an answer " * 20, "and one more question " * 5, "another answer " * 20,
                          "and a last question " * 40))
    assert home.own.queued_prompt_chars + strategy.prefill_cost(home, later) > 4000
    task = asyncio.create_task(dispatcher.acquire(later))
    await asyncio.sleep(0)
    assert not task.done() and other.in_flight == 0
    dispatcher.discharge(home, filler)
    await asyncio.sleep(0)
    assert task.done() and task.result() is home


async def _grant_order(dispatcher: Dispatcher, infos: list[RequestInfo], held: Backend,
                       held_info: RequestInfo) -> list[int]:
    """Queue INFOS (in this order) behind the one slot HELD, then free it again and again: the indexes of INFOS
    in the order they got the slot."""
    tasks = []
    for info in infos:
        tasks.append(asyncio.create_task(dispatcher.acquire(info)))
        await asyncio.sleep(0)
    order: list[int] = []
    current = held_info
    for _ in infos:
        dispatcher.release(held, current)
        await asyncio.sleep(0)
        done = [i for i, t in enumerate(tasks) if t.done() and i not in order]
        assert len(done) == 1, done
        order.append(done[0])
        current = infos[done[0]]
    return order


@pytest.mark.asyncio
async def test_cache_aware_gives_a_free_slot_to_the_waiter_with_the_least_prompt_work() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    long, short, middle = (info_of(chat(f"question {n} " * words)) for n, words in ((0, 400), (1, 20), (2, 100)))
    dispatcher = Dispatcher(pool, CacheAware(), ceiling=1, queue_timeout=30)
    holder = info_of(chat("the request running now " * 10))
    a = await dispatcher.acquire(holder)
    # The shortest prompt first: at saturation it is the one most likely to get its first token in time.
    assert await _grant_order(dispatcher, [long, short, middle], a, holder) == [1, 2, 0]

    # Work, not length: a later turn of a conversation this engine holds computes only its new message.
    pool = BackendPool()
    pool.set_urls(["http://a"])
    strategy = CacheAware()
    dispatcher = Dispatcher(pool, strategy, ceiling=1, queue_timeout=30)
    talk = "the fleet's history in detail " * 60
    opening = info_of(chat(talk))
    a = await dispatcher.acquire(opening)
    follow_up = info_of(chat(talk, "an answer " * 20, "and one more question " * 5))
    stranger = info_of(chat("a new conversation, shorter in all " * 40))
    assert stranger.prompt_chars < follow_up.prompt_chars
    assert strategy.prefill_cost(a, follow_up) < strategy.prefill_cost(a, stranger)
    assert await _grant_order(dispatcher, [stranger, follow_up], a, opening) == [1, 0]


@pytest.mark.asyncio
async def test_a_waiter_that_waited_the_order_age_goes_first_and_other_strategies_keep_arrival_order() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    long, short = info_of(chat("question " * 400)), info_of(chat("question " * 20))
    # Past the order age the oldest goes first whatever its prompt: nobody waits behind cheaper work forever.
    dispatcher = Dispatcher(pool, CacheAware(), ceiling=1, queue_timeout=30, order_age=0.05)
    holder = RequestInfo()
    a = await dispatcher.acquire(holder)
    tasks = [asyncio.create_task(dispatcher.acquire(info)) for info in (long, short)]
    await asyncio.sleep(0.1)
    dispatcher.release(a, holder)
    await asyncio.sleep(0)
    assert tasks[0].done() and not tasks[1].done()
    dispatcher.release(a, long)
    assert await tasks[1] is a
    # Round-robin and least-pending serve the queue in arrival order.
    for strategy in (make_profile("round-robin"), make_profile("least-pending")):
        pool = BackendPool()
        pool.set_urls(["http://a"])
        dispatcher = Dispatcher(pool, strategy, ceiling=1, queue_timeout=30)
        holder = RequestInfo()
        a = await dispatcher.acquire(holder)
        assert await _grant_order(dispatcher, [long, short], a, holder) == [0, 1]


@pytest.mark.asyncio
async def test_dispatcher_ceiling_queue_429_and_deadline() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=1, max_queue=1, queue_timeout=0.2)
    infos = [RequestInfo(), RequestInfo()]
    first = await dispatcher.acquire(infos[0])
    waiter = asyncio.create_task(dispatcher.acquire(infos[1]))
    await asyncio.sleep(0)
    assert dispatcher.pending == 1
    with pytest.raises(QueueFull):
        await dispatcher.acquire(RequestInfo())
    dispatcher.release(first, infos[0])           # the slot passes to the waiter
    assert await waiter is first and first.in_flight == 1 and dispatcher.pending == 0
    with pytest.raises(QueueTimeout):
        await dispatcher.acquire(RequestInfo())
    assert dispatcher.pending == 0
    dispatcher.release(first, infos[1])
    assert first.in_flight == 0


@pytest.mark.asyncio
async def test_dispatcher_cancelled_waiter_leaves_no_trace() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=1, max_queue=10, queue_timeout=5)
    holder = RequestInfo()
    held = await dispatcher.acquire(holder)
    waiter = asyncio.create_task(dispatcher.acquire(RequestInfo()))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert dispatcher.pending == 0
    dispatcher.release(held, holder)
    assert held.in_flight == 0


@pytest.mark.asyncio
async def test_dispatcher_retry_excludes_tried_engines() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=4, queue_timeout=1)
    a = await dispatcher.acquire(RequestInfo())
    b = await dispatcher.acquire(RequestInfo(), frozenset({a.url}))
    assert b is not a
    with pytest.raises(NoBackend):
        await dispatcher.acquire(RequestInfo(), frozenset({a.url, b.url}))


@pytest.mark.asyncio
@pytest.mark.parametrize("strategy", ["round-robin", "cache-aware"])
async def test_a_waiter_for_an_adapter_on_a_busy_engine_does_not_hold_up_the_queue(strategy: str) -> None:
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    dispatcher = Dispatcher(pool, make_profile(strategy), ceiling=1, queue_timeout=5)
    adapter = RequestInfo(hosts=frozenset({"http://a"}), prompt_chars=100)   # only engine a lists its adapter
    holders = [RequestInfo(), RequestInfo()]
    held = [await dispatcher.acquire(info) for info in holders]
    on_a, on_a_info = next((b, i) for b, i in zip(held, holders, strict=True) if b.url == "http://a")
    on_b, on_b_info = next((b, i) for b, i in zip(held, holders, strict=True) if b.url == "http://b")
    first = asyncio.create_task(dispatcher.acquire(adapter))
    await asyncio.sleep(0)
    second = asyncio.create_task(dispatcher.acquire(RequestInfo(prompt_chars=5000)))
    await asyncio.sleep(0)
    dispatcher.release(on_b, on_b_info)   # engine b frees: the adapter's request cannot use it, the next one can
    assert await asyncio.wait_for(second, 1) is on_b
    assert not first.done()
    dispatcher.release(on_a, on_a_info)
    assert await asyncio.wait_for(first, 1) is on_a


@pytest.mark.asyncio
async def test_an_engine_with_room_bursts_past_the_ceiling_and_comes_back_when_it_queues() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=4, burst=10, queue_timeout=5)
    (engine,) = pool
    infos = [RequestInfo() for _ in range(12)]
    held = [await dispatcher.acquire(info) for info in infos[:4]]
    waiters = [asyncio.create_task(dispatcher.acquire(info)) for info in infos[4:]]
    await asyncio.sleep(0)
    assert dispatcher.pending == 8 and dispatcher.limits.burst_requests() == 0

    def scrape(running: float, waiting: float = 0.0, kv: float = 0.3) -> None:
        engine.scraped(EngineMetrics(waiting=waiting, running=running, kv_usage=kv))
        dispatcher.adapt(engine)

    # Room (nothing queued inside, cache below the high-water mark) while requests were held back: up a quarter,
    # and the waiters take the new slots at once.
    scrape(running=4)
    assert dispatcher.limits.limit(engine) == 5 and engine.in_flight == 5 and dispatcher.pending == 7
    # Running beyond the ceiling is demand beyond what the replica is sized for.
    scrape(running=5)
    assert dispatcher.limits.limit(engine) == 7 and engine.in_flight == 7
    assert dispatcher.limits.burst_requests() == pytest.approx(5 - 4)  # as the engine last reported
    for _ in range(3):
        scrape(running=engine.in_flight)
    assert dispatcher.limits.limit(engine) == 10 and engine.in_flight == 10 and dispatcher.pending == 2  # at the burst bound
    # The engine queues: the limit comes down (never below the ceiling); what is in flight finishes where it is.
    scrape(running=8, waiting=2)
    assert dispatcher.limits.limit(engine) == 10 - 3
    assert dispatcher.limits.burst_requests() == pytest.approx(8 - 4)  # what the engine runs beyond the ceiling, not its queue
    scrape(running=10, kv=0.95)
    assert dispatcher.limits.limit(engine) == 7 - 2
    scrape(running=10, kv=0.95)
    assert dispatcher.limits.limit(engine) == 4
    # A limit nobody needed is not raised: nothing was held back since the last scrape.
    for w in waiters[6:]:
        w.cancel()
    await asyncio.gather(*waiters[6:], return_exceptions=True)
    for backend, info in zip(held + [await w for w in waiters[:6]], infos, strict=False):
        dispatcher.release(backend, info)
    scrape(running=engine.in_flight)
    assert dispatcher.limits.limit(engine) == 4 and engine.in_flight == 0


@pytest.mark.asyncio
async def test_without_burst_the_ceiling_holds_and_others_share_the_burst() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    dispatcher = Dispatcher(pool, make_profile("round-robin"), ceiling=2, queue_timeout=5)
    (engine,) = pool
    holders = [RequestInfo(), RequestInfo()]
    held = [await dispatcher.acquire(info) for info in holders]
    waiter = asyncio.create_task(dispatcher.acquire(RequestInfo()))
    await asyncio.sleep(0)
    engine.scraped(EngineMetrics(running=2))
    dispatcher.adapt(engine)
    assert dispatcher.limits.limit(engine) == 2 and dispatcher.pending == 1
    # Another router put 6 more there: 8 running against a ceiling of 2, and this router's share is 2 of 8.
    engine.scraped(EngineMetrics(running=8))
    assert dispatcher.limits.burst_requests() == pytest.approx((8 - 2) * 2 / 8)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    for backend, info in zip(held, holders, strict=True):
        dispatcher.release(backend, info)


@pytest.mark.asyncio
async def test_dispatcher_auto_queue_scales_with_the_fleet() -> None:
    pool = BackendPool()
    pool.set_urls([f"http://{i}" for i in range(4)])
    assert Dispatcher(pool, make_profile("round-robin"), ceiling=100).max_queue == 800
    assert Dispatcher(pool, make_profile("round-robin"), ceiling=2).max_queue == 64
    # The ceiling sizes it, not the burst: a short queue answers a backlog with 429s at once rather than holding
    # hundreds of requests past any latency target (bench_autoscaling measured a longer one worse).
    assert Dispatcher(pool, make_profile("round-robin"), ceiling=16, burst=256).max_queue == 2 * 16 * 4
