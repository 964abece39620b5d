"""Admission: a request goes to an engine under its limit (router/limits.py) with room for its prompt (a step's worth
of prompt queued per engine), else waits in the one bounded queue, where a freed slot is offered cheapest first (left
briefly to a peer replica with a cheaper waiter: router/yielding.py) and fairly among tenants; a request is refused
when the queue is full, when no engine can come, or once the router is shutting down. Design:
docs/routing.md#admission-and-the-queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from tensorfleet.router.backends import CLOSED, Backend, BackendPool
from tensorfleet.router.ledger import Charge, Ledger
from tensorfleet.router.limits import EngineLimits
from tensorfleet.router.scheduling import Profile, RequestInfo
from tensorfleet.router.waitqueue import TenantQueues, Waiter
from tensorfleet.router.yielding import PeerYield

MIN_AUTO_QUEUE = 64
log = logging.getLogger(__name__)

ORDER_SCAN = 64    # waiters a strategy that orders the queue compares for each free slot


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


class Dispatcher:
    """Engine slots for requests: one now under an engine's limit and prompt bound, else a place in the queue until
    one frees, else a refusal (QueueFull, QueueTimeout, Unavailable, ShuttingDown, NoBackend)."""

    def __init__(self, pool: BackendPool, strategy: Profile, *, ceiling: int, burst: int = 0, max_queue: int = 0,
                 queue_timeout: float = 30.0, order_age: float | None = None, prompt_queue_chars: float = 0.0,
                 unavailable: Callable[[frozenset[str]], Unavailable | None] | None = None) -> None:
        self.pool = pool
        self.strategy = strategy
        self.limits = EngineLimits(pool, ceiling, burst)
        self.configured_max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.order_age = queue_timeout / 2 if order_age is None else order_age
        # Prompt characters an engine may have queued with no first token back, every replica's together (the prompt
        # queue bound, a step's budget: docs/routing.md#admission-and-the-queue); 0: no bound.
        self.prompt_queue_chars = prompt_queue_chars if strategy.places_by_prefill else 0.0
        # Given the engines a request already failed on: why it cannot wait for one (None: it may queue).
        self.unavailable = unavailable
        self.queue = TenantQueues()
        # Called with each request's engine once picked (the router tells its peers: router/peers.py).
        self.on_placed: Callable[[Backend, RequestInfo], None] | None = None
        # Called when this router's load on an engine changed: a request placed, its first byte back, its slot
        # freed; with a strategy that orders the queue, also when a request joins or leaves the queue (the router
        # tells its peers at once: router/peers.py).
        self.on_load: Callable[[], None] | None = None
        # Free slots left to a peer replica's cheaper waiter (its peer_queue: the peers' `queue_heads`).
        self.yielding = PeerYield(self._yield_over)
        self.ledger = Ledger()
        self.closed = False
        pool.on_routable.append(self.drain)

    @property
    def pending(self) -> int:
        return len(self.queue)

    def pending_by_tenant(self) -> dict[str | None, int]:
        return self.queue.by_tenant()

    def forget(self, keep: frozenset[str]) -> None:
        """Forget the turns of tenants that are gone (and have nothing queued)."""
        self.queue.forget(keep)

    @property
    def max_queue(self) -> int:
        if self.configured_max_queue:
            return self.configured_max_queue
        return max(MIN_AUTO_QUEUE, 2 * self.limits.ceiling * len(self.pool))

    @staticmethod
    def queued_prompt(backend: Backend) -> float:
        """Prompt characters queued on BACKEND with no first token back: this router's, and its peers' as last
        told."""
        return backend.own.queued_prompt_chars + backend.peers.queued_prompt_chars

    def prompt_room(self, backend: Backend, info: RequestInfo) -> bool:
        """Whether BACKEND may take INFO's prompt under the prompt queue bound: no prompt is queued there, or this
        one's uncached part fits beside those that are (a prompt longer than a step still goes, alone)."""
        queued = self.queued_prompt(backend)
        return not queued or queued + self.strategy.prefill_cost(backend, info) <= self.prompt_queue_chars

    def _open(self, backend: Backend) -> bool:
        """Whether BACKEND could take some request now: under its limit, and, with a prompt bound, with room
        for more prompt."""
        if self.limits.full(backend):
            return False
        return not self.prompt_queue_chars or self.queued_prompt(backend) < self.prompt_queue_chars

    def adapt(self, backend: Backend) -> None:
        """After a scrape of BACKEND: move its limit (router/limits.py), and hand any slots that opened to
        waiters."""
        if self.limits.adapt(backend) and self.queue:
            self.drain()

    def queue_heads(self) -> dict[str, int]:
        """Per engine, the prompt characters the cheapest of this router's first ORDER_SCAN waiters that could go
        there once a slot frees (it may use the engine, and its prompt fits the prompt bound there) would compute
        (0 where one has waited the order age): what the peers weigh before they fill a slot there (`_yields`).
        Empty unless the strategy orders the queue."""
        if not self.queue or not self.strategy.orders_queue:
            return {}
        now = asyncio.get_running_loop().time()
        routable = self.pool.routable()
        head = [w for w in self.queue.waiters()[:ORDER_SCAN] if not w.future.done()]
        cost = self.strategy.prefill_cost
        heads: dict[str, int] = {}
        for backend in routable:
            costs = [0.0 if now - w.since >= self.order_age else cost(backend, w.info)
                     for w in head if self._usable([backend], routable, w.info, w.exclude)
                     and (not self.prompt_queue_chars or not w.info.prompt_chars or self.prompt_room(backend, w.info))]
            if costs:
                heads[backend.url] = round(min(costs))
        return heads

    def _yields(self, backend: Backend, info: RequestInfo, since: float) -> bool:
        """Whether to leave BACKEND's free slot to a peer replica's cheaper waiter (router/yielding.py) rather than
        give it to INFO, which began to wait at SINCE (and counts as computing nothing once it waited order_age)."""
        def mine() -> float:
            aged = asyncio.get_running_loop().time() - since >= self.order_age
            return 0.0 if aged else self.strategy.prefill_cost(backend, info)
        return self.yielding.yields(backend.url, mine, self.strategy.block_chars)

    def _yield_over(self) -> None:
        """A slot's time for a peer is over: this router's waiters may take it."""
        if self.queue:
            self.drain()

    def _queue_changed(self) -> None:
        if self.on_load is not None and self.strategy.orders_queue:
            self.on_load()   # the queue's heads are news to the peers

    def _pick(self, info: RequestInfo, exclude: frozenset[str], since: float | None = None) -> Backend | None:
        """An engine for INFO, charged, or None. SINCE: when the request began to wait (None: it does not wait
        for one, so it leaves no slot to a peer)."""
        routable = self.pool.routable()
        free = []
        for b in routable:
            if self.limits.full(b):
                b.held_back = True
            else:
                free.append(b)
        candidates = self._usable(free, routable, info, exclude)
        if not candidates:
            return None
        roomy: list[Backend] | None = None   # under the prompt bound: the engines with room for this prompt
        if self.prompt_queue_chars and info.prompt_chars:
            roomy = [b for b in candidates if self.prompt_room(b, info)]
            if not roomy:
                return None   # every engine it may use has a step's worth of prompt queued: wait for one to clear
        # A later turn goes where the strategy sends it (where its conversation's KV is), and waits for that
        # engine to clear rather than compute its whole history on another; a first turn goes to one with room.
        backend = self.strategy.pick(candidates if roomy is None or info.continues else roomy, routable, info)
        if roomy is not None and backend not in roomy:
            return None
        if since is not None and self._yields(backend, info, since):
            return None
        if backend.state != CLOSED:
            self.pool.begin_probe(backend)
        prefill = queued = context = 0.0
        if info.prompt_chars and self.strategy.places_by_prefill:
            prefill = self.strategy.prefill_cost(backend, info)
            queued = prefill if info.queues_prompt and self.prompt_queue_chars else 0.0
            context = info.prompt_chars
        self.ledger.charge(backend, info, Charge(prefill, queued, context, info.exposure))
        self.yielding.end(backend.url, "reclaimed")
        self.strategy.routed(backend, info)
        if self.on_placed is not None:
            self.on_placed(backend, info)
        if self.on_load is not None:
            self.on_load()
        return backend

    @staticmethod
    def _usable(backends: list[Backend], routable: list[Backend], info: RequestInfo,
                exclude: frozenset[str]) -> list[Backend]:
        """Of BACKENDS, those the request may go to: not one it already failed on (EXCLUDE), and one that lists
        its LoRA adapter if any routable engine does."""
        hosts = info.hosts
        if hosts is not None and any(b.url in hosts for b in routable):
            backends = [b for b in backends if b.url in hosts]
        return [b for b in backends if b.url not in exclude] if exclude else backends

    def try_acquire(self, info: RequestInfo) -> Backend | None:
        """A slot on an engine now, or None (nothing is queued): for callers with somewhere else to go."""
        if self.closed:
            return None
        return self._pick(info, frozenset())

    def _has_capacity(self) -> bool:
        return any(self._open(b) for b in self.pool.routable())

    async def acquire(self, info: RequestInfo, exclude: frozenset[str] = frozenset(), *,
                      tenant: str | None = None, timeout: float | None = None) -> Backend:
        """An engine slot for TENANT's request: at once, or after queueing up to TIMEOUT (default queue_timeout)."""
        if self.closed:
            raise ShuttingDown()
        loop = asyncio.get_running_loop()
        if not self.queue:
            backend = self._pick(info, exclude, since=loop.time())
            if backend is not None:
                self.queue.granted(tenant)
                return backend
        if exclude and all(b.url in exclude for b in self.pool):
            raise NoBackend()
        if self.unavailable is not None:
            refusal = self.unavailable(exclude)
            if refusal is not None:
                raise refusal
        if self.pending >= self.max_queue:
            self.queue.displace(tenant)
        waiter = Waiter(info, exclude, loop.create_future(), tenant, since=loop.time())
        waiter.timer = loop.call_later(self.queue_timeout if timeout is None else timeout, self._expire, waiter)
        self.queue.add(waiter)
        self._queue_changed()
        try:
            return await waiter.future
        except BaseException:
            # Cancelled (client gone) just as a slot was granted: give it back.
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result(), info)
            raise
        finally:
            waiter.timer.cancel()
            self.queue.remove(waiter)
            self._queue_changed()

    def close(self) -> None:
        """Refuse every waiter and every later request (ShuttingDown)."""
        self.closed = True
        for waiter in self.queue.waiters():
            self.queue.remove(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(ShuttingDown())

    def reevaluate(self) -> None:
        """Refuse the waiters that can no longer expect an engine (Unavailable), after the pool or the fleet
        changed."""
        if self.unavailable is None or not self.queue:
            return
        verdicts: dict[frozenset[str], Unavailable | None] = {}
        for waiter in self.queue.waiters():
            if waiter.exclude not in verdicts:
                verdicts[waiter.exclude] = self.unavailable(waiter.exclude)
            refusal = verdicts[waiter.exclude]
            if refusal is not None:
                self.queue.remove(waiter)
                if not waiter.future.done():
                    waiter.future.set_exception(Unavailable(str(refusal), refusal.retry_after))

    def _expire(self, waiter: Waiter) -> None:
        self.queue.remove(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(QueueTimeout())

    def discharge(self, backend: Backend, info: RequestInfo, *, drain: bool = True) -> None:
        """The request's first byte came back from BACKEND (or it never will): its prompt is no longer work queued
        there, and a waiter may take its place under the prompt bound."""
        charge = self.ledger.first_byte(backend, info)
        if charge is None:
            return
        if self.on_load is not None:
            self.on_load()
        if charge.queued and drain and self.queue:
            self.drain()

    def release(self, backend: Backend, info: RequestInfo) -> None:
        """BACKEND's slot, taken for the request INFO describes, is free again."""
        if not self.ledger.release(backend, info):
            return
        if self.on_load is not None:
            self.on_load()
        if self.queue:
            self.drain()

    def drain(self) -> None:
        """Hand free slots to waiters: the tenant served least recently first, each tenant's oldest first."""
        while self.queue:
            for queue in self.queue.in_turn():
                served = self._serve(queue)
                if served is None:
                    return  # no engine has a free slot
                if served:
                    break  # the order changed: that tenant goes last
            else:
                return  # free slots only on engines the waiters already failed on

    def _serve(self, waiters: list[Waiter]) -> bool | None:
        """Give a free slot to the first of one tenant's WAITERS (oldest first, or in the strategy's order) that can
        use one: whether one got it, None when no engine has a free slot."""
        if self.strategy.orders_queue and len(waiters) > 1:
            waiters = self._cheapest_first(waiters)
        for waiter in waiters:
            if waiter.future.done():
                self.queue.remove(waiter)
                continue
            backend = self._pick(waiter.info, waiter.exclude, since=waiter.since)
            if backend is None:
                if not self._has_capacity():
                    return None
                continue  # the free engines are ones this waiter failed on, or lack its adapter
            self.queue.remove(waiter)
            self.queue.granted(waiter.tenant)
            waiter.future.set_result(backend)
            return True
        return False

    def _cheapest_first(self, waiters: list[Waiter]) -> list[Waiter]:
        """WAITERS (in arrival order) in the order to offer a free slot: those that have waited order_age
        first, oldest first; then, of the first ORDER_SCAN, the least prompt work on a free engine they may use
        first (one that cannot use any goes last); then the rest in arrival order."""
        routable = self.pool.routable()
        free = [b for b in routable if self._open(b)]
        if not free:
            return waiters
        now = asyncio.get_running_loop().time()
        head, rest = waiters[:ORDER_SCAN], waiters[ORDER_SCAN:]
        aged = [w for w in head if now - w.since >= self.order_age]
        if len(aged) == len(head):
            return waiters
        prefill_cost = self.strategy.prefill_cost

        def cost(waiter: Waiter) -> float:
            usable = self._usable(free, routable, waiter.info, waiter.exclude)
            return min((prefill_cost(b, waiter.info) for b in usable), default=math.inf)

        fresh = sorted((w for w in head if now - w.since < self.order_age), key=cost)
        return aged + fresh + rest
