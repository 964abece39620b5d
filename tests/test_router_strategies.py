"""Routing decisions, admission and circuit breakers, without sockets."""

from __future__ import annotations

import asyncio
import typing
from collections import Counter

import pytest

from tensorfleet import contract
from tensorfleet.api.models import RouterSpec
from tensorfleet.prompts import prompt_text
from tensorfleet.router.backends import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    Backend,
    BackendPool,
    BreakerPolicy,
    parse_engine_metrics,
)
from tensorfleet.router.dispatch import Dispatcher, NoBackend, QueueFull, QueueTimeout
from tensorfleet.router.strategies import (
    STRATEGIES,
    LeastPending,
    PrefixAware,
    RequestInfo,
    RoundRobin,
    Session,
    prefix_hashes,
)


def backends(n: int) -> list[Backend]:
    return [Backend(f"http://10.0.0.{i}:8000") for i in range(n)]


def test_strategy_names_match_the_api_and_the_contract() -> None:
    literal = typing.get_args(RouterSpec.model_fields["strategy"].annotation)
    assert set(literal) == set(contract.ROUTER_STRATEGIES) == set(STRATEGIES)
    assert RouterSpec().strategy == contract.DEFAULT_ROUTER_STRATEGY


def test_round_robin_takes_turns() -> None:
    pool = backends(3)
    rr = RoundRobin()
    picks = [rr.pick(pool, pool, RequestInfo()).url for _ in range(6)]
    assert picks == [b.url for b in pool] * 2


def test_least_pending_prefers_the_least_loaded_and_counts_engine_queues() -> None:
    a, b, c = pool = backends(3)
    a.in_flight, b.in_flight, c.in_flight = 5, 2, 3
    lp = LeastPending()
    assert lp.pick(pool, pool, RequestInfo()) is b
    # The engine says it is holding requests back: b is now worse than c.
    b.waiting = 4
    assert lp.pick(pool, pool, RequestInfo()) is c
    # Equal engines share ties instead of one taking them all.
    for x in pool:
        x.in_flight, x.waiting = 1, 0
    assert len({lp.pick(pool, pool, RequestInfo()).url for _ in range(6)}) == 3


def test_session_is_sticky_spread_and_bounded() -> None:
    pool = backends(4)
    session = Session()
    first = {f"user-{i}": session.pick(pool, pool, RequestInfo(session_key=f"user-{i}")).url for i in range(200)}
    again = {key: session.pick(pool, pool, RequestInfo(session_key=key)).url for key in first}
    assert again == first
    spread = Counter(first.values())
    assert len(spread) == 4 and min(spread.values()) > 20
    # Removing one engine moves only its sessions.
    gone = pool[0].url
    rest = pool[1:]
    moved = {k for k in first if session.pick(rest, rest, RequestInfo(session_key=k)).url != first[k]}
    assert moved == {k for k, url in first.items() if url == gone}
    # A hot session's engine over 1.25x the average load is skipped.
    hot = next(k for k, url in first.items() if url == pool[1].url)
    pool[1].in_flight = 10
    assert session.pick(pool, pool, RequestInfo(session_key=hot)) is not pool[1]
    # No key: least-pending.
    assert session.pick(pool, pool, RequestInfo()) is pool[0]


def test_prefix_aware_follows_the_prompt_and_respects_load() -> None:
    pool = backends(4)
    strategy = PrefixAware()
    document = "You are a careful assistant. " * 40
    first = RequestInfo(prefix_hashes=prefix_hashes(prompt_text({"messages": [{"role": "system", "content": document},
                                                                             {"role": "user", "content": "q1"}]})))
    assert first.prefix_hashes
    chosen = strategy.pick(pool, pool, first)
    strategy.routed(chosen, first)
    # Another question over the same document lands on the same engine, even
    # when others are slightly less loaded.
    follow = RequestInfo(prefix_hashes=prefix_hashes(prompt_text({"messages": [
        {"role": "system", "content": document}, {"role": "user", "content": "q2 is different"}]})))
    chosen.in_flight = 1
    assert strategy.pick(pool, pool, follow) is chosen
    # Past the load bound it goes elsewhere.
    chosen.in_flight = 8
    assert strategy.pick(pool, pool, follow) is not chosen
    # An unrelated prompt goes to the least loaded.
    other = RequestInfo(prefix_hashes=prefix_hashes("something else entirely " * 30))
    assert strategy.pick(pool, pool, other) is not chosen


def test_prefix_index_is_bounded_by_engine_kv_capacity() -> None:
    backend = Backend("http://e:8000", kv_cache_tokens=3200)  # 100 blocks of 128 chars
    strategy = PrefixAware()
    for i in range(50):
        strategy.routed(backend, RequestInfo(prefix_hashes=prefix_hashes(f"doc {i} " * 200)))
    assert len(strategy._index[backend.url]) == strategy.capacity(backend) == 100
    strategy.forget(backend)
    assert backend.url not in strategy._index


def test_prompt_text_covers_chat_and_completions() -> None:
    assert "hello" in prompt_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]})
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text({}) == ""


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
    until = a.open_until
    pool.record_failure(a)                        # late failures do not extend it
    assert a.open_until == until and a.ejections == 1
    clock.now += 1.0
    assert a in pool.routable()                   # half-open: one probe
    pool.begin_probe(a)
    assert a.state == HALF_OPEN and a not in pool.routable()
    pool.record_failure(a)                        # probe failed: longer ejection
    assert a.state == OPEN and a.open_until == clock.now + 2.0
    clock.now += 2.0
    pool.begin_probe(a)
    pool.record_success(a)
    assert a.state == CLOSED and a.ejections == 0
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
    assert (load.waiting, load.running, load.kv_cache_tokens) == (4.0, 7.0, 3200)
    assert load.kv_usage == pytest.approx(0.6)
    assert parse_engine_metrics("").kv_cache_tokens is None


# --- dispatcher ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_dispatcher_ceiling_queue_429_and_deadline() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    dispatcher = Dispatcher(pool, RoundRobin(), ceiling=1, max_queue=1, queue_timeout=0.2)
    first = await dispatcher.acquire(RequestInfo())
    waiter = asyncio.create_task(dispatcher.acquire(RequestInfo()))
    await asyncio.sleep(0)
    assert dispatcher.pending == 1
    with pytest.raises(QueueFull):
        await dispatcher.acquire(RequestInfo())
    dispatcher.release(first)                     # the slot passes to the waiter
    assert await waiter is first and first.in_flight == 1 and dispatcher.pending == 0
    with pytest.raises(QueueTimeout):
        await dispatcher.acquire(RequestInfo())
    assert dispatcher.pending == 0
    dispatcher.release(first)
    assert first.in_flight == 0


@pytest.mark.asyncio
async def test_dispatcher_cancelled_waiter_leaves_no_trace() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a"])
    dispatcher = Dispatcher(pool, RoundRobin(), ceiling=1, max_queue=10, queue_timeout=5)
    held = await dispatcher.acquire(RequestInfo())
    waiter = asyncio.create_task(dispatcher.acquire(RequestInfo()))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert dispatcher.pending == 0
    dispatcher.release(held)
    assert held.in_flight == 0


@pytest.mark.asyncio
async def test_dispatcher_retry_excludes_tried_engines() -> None:
    pool = BackendPool()
    pool.set_urls(["http://a", "http://b"])
    dispatcher = Dispatcher(pool, RoundRobin(), ceiling=4, queue_timeout=1)
    a = await dispatcher.acquire(RequestInfo())
    b = await dispatcher.acquire(RequestInfo(), frozenset({a.url}))
    assert b is not a
    with pytest.raises(NoBackend):
        await dispatcher.acquire(RequestInfo(), frozenset({a.url, b.url}))


@pytest.mark.asyncio
async def test_dispatcher_auto_queue_scales_with_the_fleet() -> None:
    pool = BackendPool()
    pool.set_urls([f"http://{i}" for i in range(4)])
    assert Dispatcher(pool, RoundRobin(), ceiling=100).max_queue == 800
    assert Dispatcher(pool, RoundRobin(), ceiling=2).max_queue == 64
