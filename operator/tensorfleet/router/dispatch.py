"""Admission: a per-engine concurrency ceiling and one bounded FIFO queue.

An engine batches at most max-num-seqs sequences; past that, requests only
wait inside it, invisible to the router and impossible to move. So the router
sends at most `ceiling` requests to each engine and holds the rest itself,
where they can still go to whichever engine frees a slot first. The queue is
bounded: when it is full a request is refused at once (429 with Retry-After)
rather than piling up memory and latency, and a request that waits longer
than the deadline gets 503. Waiters are served in arrival order; one that
cannot use the free engine (it already failed there) lets the next one go.

Queueing is for engines that will free a slot or come up soon. The router
hands the dispatcher an `unavailable` check: when it says no engine can take
the request now or soon (none healthy, none starting: see router/app.py), a
request is refused at once with Unavailable (503 with Retry-After) instead of
being queued, and `reevaluate` refuses the waiters the same way when that
becomes true while they wait (the last engine ejected, the last starting pod
gone).

When the router's shutdown grace is over, `close` answers every waiter (and
every later request) with ShuttingDown: 503.

BodyBudget bounds the other thing clients can make the router hold: the bytes
of request bodies, over all requests at once.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tensorfleet.router.backends import CLOSED, Backend, BackendPool
from tensorfleet.router.strategies import RequestInfo, Strategy

MIN_AUTO_QUEUE = 64


class QueueFull(Exception):
    """The router's queue is at its bound: answer 429."""


class QueueTimeout(Exception):
    """No engine slot freed before the deadline: answer 503."""


class NoBackend(Exception):
    """Every engine was already tried for this request."""


class ShuttingDown(Exception):
    """The router is stopping: answer 503."""


class Unavailable(Exception):
    """No engine can take the request now and none is expected soon: answer 503 at once, with Retry-After."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class _Waiter:
    info: RequestInfo
    exclude: frozenset[str]
    future: asyncio.Future[Backend]
    timer: asyncio.TimerHandle | None = None


class Dispatcher:
    def __init__(self, pool: BackendPool, strategy: Strategy, *, ceiling: int, max_queue: int = 0,
                 queue_timeout: float = 30.0,
                 unavailable: Callable[[frozenset[str]], Unavailable | None] | None = None) -> None:
        self.pool = pool
        self.strategy = strategy
        self.ceiling = ceiling
        self.configured_max_queue = max_queue
        self.queue_timeout = queue_timeout
        # Given the engines a request already failed on: why it cannot wait for one (None: it may queue).
        self.unavailable = unavailable
        self._waiters: OrderedDict[_Waiter, None] = OrderedDict()
        self.on_routed: Callable[[Backend], None] | None = None
        self.closed = False
        pool.on_routable.append(self.drain)

    @property
    def pending(self) -> int:
        return len(self._waiters)

    @property
    def max_queue(self) -> int:
        if self.configured_max_queue:
            return self.configured_max_queue
        return max(MIN_AUTO_QUEUE, 2 * self.ceiling * len(self.pool))

    def _pick(self, info: RequestInfo, exclude: frozenset[str]) -> Backend | None:
        routable = self.pool.routable()
        ceiling = self.ceiling
        if exclude:
            candidates = [b for b in routable if b.in_flight < ceiling and b.url not in exclude]
        else:
            candidates = [b for b in routable if b.in_flight < ceiling]
        if not candidates:
            return None
        backend = self.strategy.pick(candidates, routable, info)
        if backend.state != CLOSED:
            self.pool.begin_probe(backend)
        backend.in_flight += 1
        self.strategy.routed(backend, info)
        if self.on_routed is not None:
            self.on_routed(backend)
        return backend

    def _has_capacity(self) -> bool:
        ceiling = self.ceiling
        return any(b.in_flight < ceiling for b in self.pool.routable())

    async def acquire(self, info: RequestInfo, exclude: frozenset[str] = frozenset()) -> Backend:
        """An engine slot for this request: at once, or after queueing."""
        if self.closed:
            raise ShuttingDown()
        if not self._waiters:
            backend = self._pick(info, exclude)
            if backend is not None:
                return backend
        if exclude and all(b.url in exclude for b in self.pool):
            raise NoBackend()
        if self.unavailable is not None:
            refusal = self.unavailable(exclude)
            if refusal is not None:
                raise refusal
        if len(self._waiters) >= self.max_queue:
            raise QueueFull()
        loop = asyncio.get_running_loop()
        waiter = _Waiter(info, exclude, loop.create_future())
        waiter.timer = loop.call_later(self.queue_timeout, self._expire, waiter)
        self._waiters[waiter] = None
        try:
            return await waiter.future
        except BaseException:
            # Cancelled (client gone) just as a slot was granted: give it back.
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result())
            raise
        finally:
            waiter.timer.cancel()
            self._waiters.pop(waiter, None)

    def close(self) -> None:
        """Refuse every waiter and every later request (ShuttingDown)."""
        self.closed = True
        for waiter in list(self._waiters):
            self._waiters.pop(waiter, None)
            if not waiter.future.done():
                waiter.future.set_exception(ShuttingDown())

    def reevaluate(self) -> None:
        """Refuse the waiters that can no longer expect an engine (Unavailable), after the pool or the fleet
        changed."""
        if self.unavailable is None or not self._waiters:
            return
        verdicts: dict[frozenset[str], Unavailable | None] = {}
        for waiter in list(self._waiters):
            if waiter.exclude not in verdicts:
                verdicts[waiter.exclude] = self.unavailable(waiter.exclude)
            refusal = verdicts[waiter.exclude]
            if refusal is not None:
                self._waiters.pop(waiter, None)
                if not waiter.future.done():
                    waiter.future.set_exception(Unavailable(str(refusal), refusal.retry_after))

    def _expire(self, waiter: _Waiter) -> None:
        self._waiters.pop(waiter, None)
        if not waiter.future.done():
            waiter.future.set_exception(QueueTimeout())

    def release(self, backend: Backend) -> None:
        backend.in_flight -= 1
        if self.on_routed is not None:
            self.on_routed(backend)
        if self._waiters:
            self.drain()

    def drain(self) -> None:
        """Hand free slots to waiters, oldest first."""
        for waiter in list(self._waiters):
            if waiter.future.done():
                self._waiters.pop(waiter, None)
                continue
            backend = self._pick(waiter.info, waiter.exclude)
            if backend is None:
                if not waiter.exclude or not self._has_capacity():
                    return
                continue  # only engines this waiter already failed on are free
            self._waiters.pop(waiter, None)
            waiter.future.set_result(backend)


class BodyBudget:
    """Request-body bytes the router holds at once, over all requests: its memory bound for what clients send.

    A request takes bytes as they arrive, not as its Content-Length announces, so a slow sender holds only what
    it has sent; it gives them back once no retry can need them (the answer's first byte reached the client) or
    when it ends. When a take would pass the limit the request is refused (503): its sender can retry, and the
    router's memory stays bounded whatever arrives at once. Bodies larger than `large` bytes may fill only
    `large_share` of the budget, so a burst of big bodies leaves room for ordinary requests.
    """

    def __init__(self, limit: int, *, large: int = 1024 * 1024, large_share: float = 0.75) -> None:
        self.limit = limit
        self.large = min(large, limit)
        self.large_limit = int(limit * large_share)
        self.used = 0
        self.peak = 0
        self.refused = 0

    def take(self, n: int, *, held: int = 0) -> bool:
        """Charge `n` more bytes to a request that holds `held` already; False (nothing charged) if over."""
        limit = self.limit if held + n <= self.large else self.large_limit
        if self.used + n > limit:
            self.refused += 1
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n
