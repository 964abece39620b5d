"""Admission: a per-engine concurrency ceiling and one bounded queue, shared fairly among tenants.

An engine batches at most max-num-seqs sequences; past that, requests only
wait inside it, invisible to the router and impossible to move. So the router
sends at most `ceiling` requests to each engine and holds the rest itself,
where they can still go to whichever engine frees a slot first. Router replicas
that tell each other their load (router/peers.py) share the ceiling: the
others' requests on an engine, as last told, count against it too. The queue is
bounded: when it is full a request is refused at once (429 with Retry-After)
rather than piling up memory and latency, and a request that waits longer
than the deadline gets 503. Waiters are served in arrival order; one that
cannot use the free engine (it already failed there, or the engine lacks
its LoRA adapter) lets the next one go.

Prompt queue (`prompt_queue_chars`, for a strategy that `places_by_prefill`:
cache-aware): an engine computes at most one step's token budget of prompt at a
time (vLLM's max-num-batched-tokens), first come first served, and a prompt
sent beyond that only waits inside it, where no later, shorter prompt can go
ahead of it and no other engine that frees first can take it. So the router
sends an engine a prompt only while the prompt characters it has there with no
first token back, this one's uncached part added, fit in that budget, or while
it has none there (a prompt longer than a step still goes, alone). A request
that no engine it may use has room for waits in the router's queue and goes to
the first that clears, cheapest first (below): late binding, one queue for the
fleet instead of one per engine. Only streamed answers count against the
bound, since the router sees their first token; a whole answer comes back
only when its generation ends, long after its prompt was computed. Router
replicas that tell each other their load (router/peers.py) share the bound:
the prompt the others have queued on an engine, as last told, counts with this
router's own, so the replicas together keep one step's budget there, not one
each.

A strategy that `orders_queue` (cache-aware) has a free slot offered first to
the waiter with the least prompt work there (`prefill_cost`: its prompt less
what the engine may hold cached), of the ORDER_SCAN longest-waiting: at
saturation that is the request most likely to get its first token in time,
and a conversation whose engine is busy waits for it instead of computing its
history elsewhere. A waiter passed over for `order_age` (half the queue
timeout) goes before every cheaper one, oldest first, so sustained overload
delays long prompts by a bounded time rather than starving them.

Tenants (API keys, router/tenants.py; without keys every request is the one
tenant None, and the queue is the one above): each tenant's waiters are kept
in their own arrival order (and offered a slot in the strategy's order), and a
free slot goes to the tenant served least recently, so a tenant with one
request waiting gets one of the next slots whatever another has queued. When
the queue is full, a request whose tenant has fewer waiters than the tenant
with the most takes the place of that tenant's newest waiter, which gets the
429 instead: a flooding tenant fills the queue only while nobody else needs it.
Requests already on engines are never interrupted: another tenant's request
waits for the next slot to free.

Queueing is for engines that will free a slot or come up soon. The router
hands the dispatcher an `unavailable` check: when it says no engine can take
the request now or soon (none healthy, none starting: see router/app.py), a
request is refused at once with Unavailable (503 with Retry-After) instead of
being queued, and `reevaluate` refuses the waiters the same way when that
becomes true while they wait (the last engine ejected, the last starting pod
gone).

When the router's shutdown grace is over, `close` answers every waiter (and
every later request) with ShuttingDown: 503.

Burst (`burst` above `ceiling`): the ceiling is sized for a typical request
(what the KV cache holds at typicalRequestTokens each), and requests are often
smaller, or share prefixes the cache holds once. So an engine's limit moves
between the ceiling and the burst bound on what the engine itself reports at
each scrape (`adapt`): it rises by a quarter while requests were held back for
it and the engine has room (nothing waiting inside it, KV cache below
KV_HIGH_WATER), and falls by a quarter, never below the ceiling, once the
engine queues or its cache passes the high-water mark. The engine then batches
what it can, and the router still holds what it cannot. Requests running on an
engine beyond the ceiling are demand beyond what a replica is sized for: the
router publishes its share of them (`burst_requests`), which the autoscaling
signal counts with the queues (render/autoscaling.py), so the fleet grows as
early as with the ceiling alone while every engine serves at its best batch.

BodyBudget bounds the other thing clients can make the router hold: the bytes
of request bodies, over all requests at once.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tensorfleet.router.backends import CLOSED, Backend, BackendPool
from tensorfleet.router.scheduling import KV_HIGH_WATER, Profile, RequestInfo

MIN_AUTO_QUEUE = 64
# Requests waiting inside an engine that count as it queueing: vLLM holds a just-arrived request in its waiting
# queue until its next scheduler step, so one seen there is routine.
ENGINE_QUEUEING = 2
LIMIT_STEP = 0.25  # the fraction an engine's limit moves by at a scrape
ORDER_SCAN = 64    # waiters a strategy that orders the queue compares for each free slot


class QueueFull(Exception):
    """The router's queue is at its bound: answer 429. `displaced`: the request had queued, and a tenant with
    fewer waiters took its place."""

    def __init__(self, displaced: bool = False) -> None:
        super().__init__("displaced" if displaced else "full")
        self.displaced = displaced


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
    tenant: str | None = None
    timer: asyncio.TimerHandle | None = None
    since: float = 0.0   # loop time it began to wait


class Dispatcher:
    def __init__(self, pool: BackendPool, strategy: Profile, *, ceiling: int, burst: int = 0, max_queue: int = 0,
                 queue_timeout: float = 30.0, order_age: float | None = None, prompt_queue_chars: float = 0.0,
                 unavailable: Callable[[frozenset[str]], Unavailable | None] | None = None) -> None:
        self.pool = pool
        self.strategy = strategy
        self.ceiling = ceiling
        self.burst = max(ceiling, burst)  # at most this many per engine while it has room; ceiling: no burst
        self.configured_max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.order_age = queue_timeout / 2 if order_age is None else order_age
        # Prompt characters an engine may have queued for this router (see the module docstring); 0: no bound.
        self.prompt_queue_chars = prompt_queue_chars if strategy.places_by_prefill else 0.0
        # Given the engines a request already failed on: why it cannot wait for one (None: it may queue).
        self.unavailable = unavailable
        # Each tenant's waiters in arrival order; a tenant has an entry only while it has waiters.
        self._queues: dict[str | None, OrderedDict[_Waiter, None]] = {}
        self._served: dict[str | None, int] = {}  # tenant -> the turn it last got a slot
        self._turn = 0
        # Called with each request's engine once picked (the router tells its peers: router/peers.py).
        self.on_placed: Callable[[Backend, RequestInfo], None] | None = None
        # Called when this router's load on an engine changed: a request placed, its first byte back, its slot
        # freed (the router tells its peers at once: router/peers.py).
        self.on_load: Callable[[], None] | None = None
        self.closed = False
        pool.on_routable.append(self.drain)

    @property
    def pending(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def pending_by_tenant(self) -> dict[str | None, int]:
        return {tenant: len(queue) for tenant, queue in self._queues.items()}

    def _waiters(self) -> list[_Waiter]:
        return [waiter for queue in self._queues.values() for waiter in queue]

    def _remove(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.tenant)
        if queue is None:
            return
        queue.pop(waiter, None)
        if not queue:
            del self._queues[waiter.tenant]

    def _granted(self, tenant: str | None) -> None:
        self._turn += 1
        self._served[tenant] = self._turn

    def forget(self, keep: frozenset[str]) -> None:
        """Forget the turns of tenants that are gone (and have nothing queued)."""
        for tenant in [t for t in self._served if t is not None and t not in keep and t not in self._queues]:
            del self._served[tenant]

    @property
    def max_queue(self) -> int:
        if self.configured_max_queue:
            return self.configured_max_queue
        return max(MIN_AUTO_QUEUE, 2 * self.ceiling * len(self.pool))

    def limit(self, backend: Backend) -> int:
        """Requests BACKEND may have from every router replica at once now."""
        return backend.limit or self.ceiling

    def full(self, backend: Backend) -> bool:
        """Whether BACKEND holds its limit: this router's requests there, and its peers' as they last told
        (router/peers.py), so router replicas share one ceiling per engine rather than each filling it."""
        return backend.in_flight + backend.peer_in_flight >= self.limit(backend)

    @staticmethod
    def queued_prompt(backend: Backend) -> float:
        """Prompt characters queued on BACKEND with no first token back: this router's, and its peers' as last
        told."""
        return backend.queued_prompt_chars + backend.peer_queued_prompt_chars

    def prompt_room(self, backend: Backend, info: RequestInfo) -> bool:
        """Whether BACKEND may take INFO's prompt under the prompt queue bound (see the module docstring): no
        prompt is queued there, or this one's uncached part fits beside those that are."""
        queued = self.queued_prompt(backend)
        return not queued or queued + self.strategy.prefill_cost(backend, info) <= self.prompt_queue_chars

    def _open(self, backend: Backend) -> bool:
        """Whether BACKEND could take some request now: under its limit, and, with a prompt bound, with room
        for more prompt."""
        if self.full(backend):
            return False
        return not self.prompt_queue_chars or self.queued_prompt(backend) < self.prompt_queue_chars

    def adapt(self, backend: Backend) -> None:
        """After a scrape of BACKEND: move its limit within [ceiling, burst] on what the engine reports (see the
        module docstring), and hand any slots that opened to waiters."""
        limit = self.limit(backend)
        if backend.waiting >= ENGINE_QUEUEING or backend.kv_usage >= KV_HIGH_WATER:
            new = max(self.ceiling, min(limit, backend.in_flight) - math.ceil(limit * LIMIT_STEP))
        elif backend.held_back and limit < self.burst:
            new = min(self.burst, limit + math.ceil(limit * LIMIT_STEP))
        else:
            new = limit
        backend.held_back = False
        backend.limit = new
        if new > limit and self._queues:
            self.drain()

    def burst_requests(self) -> float:
        """Requests running on engines beyond the ceiling, this router's share: per engine, what it ran at the
        last scrape over the ceiling, times the part of its load that is this router's. The engine's own count,
        not the router's in-flight: a request sent since the scrape may be waiting inside the engine, which
        vllm:num_requests_waiting counts already."""
        total = 0.0
        for backend in self.pool:
            over = backend.running - self.ceiling
            if over > 0 and backend.in_flight:
                total += over * backend.in_flight / (backend.in_flight + backend.others)
        return total

    def _pick(self, info: RequestInfo, exclude: frozenset[str]) -> Backend | None:
        routable = self.pool.routable()
        free = []
        for b in routable:
            if self.full(b):
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
        if backend.state != CLOSED:
            self.pool.begin_probe(backend)
        backend.in_flight += 1
        if info.prompt_chars and self.strategy.places_by_prefill:
            info.prefill_charge = self.strategy.prefill_cost(backend, info)
            backend.prefill_chars += info.prefill_charge
            if info.queues_prompt and self.prompt_queue_chars:
                info.queue_charge = info.prefill_charge
                backend.queued_prompt_chars += info.queue_charge
            info.context_charge = info.prompt_chars
            backend.context_chars += info.context_charge
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
        if not self._queues:
            backend = self._pick(info, exclude)
            if backend is not None:
                self._granted(tenant)
                return backend
        if exclude and all(b.url in exclude for b in self.pool):
            raise NoBackend()
        if self.unavailable is not None:
            refusal = self.unavailable(exclude)
            if refusal is not None:
                raise refusal
        if self.pending >= self.max_queue:
            self._displace(tenant)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(info, exclude, loop.create_future(), tenant, since=loop.time())
        waiter.timer = loop.call_later(self.queue_timeout if timeout is None else timeout, self._expire, waiter)
        self._queues.setdefault(tenant, OrderedDict())[waiter] = None
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
            self._remove(waiter)

    def _displace(self, tenant: str | None) -> None:
        """The queue is full: make room for TENANT's request by refusing the newest waiter of the tenant with the
        most, if that tenant has at least two more than TENANT; else QueueFull."""
        mine = len(self._queues.get(tenant, ()))
        most = max(self._queues, key=lambda t: len(self._queues[t]), default=None)
        if most is None or most == tenant or len(self._queues[most]) < mine + 2:
            raise QueueFull()
        waiter = next(reversed(self._queues[most]))
        self._remove(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(QueueFull(displaced=True))

    def close(self) -> None:
        """Refuse every waiter and every later request (ShuttingDown)."""
        self.closed = True
        for waiter in self._waiters():
            self._remove(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(ShuttingDown())

    def reevaluate(self) -> None:
        """Refuse the waiters that can no longer expect an engine (Unavailable), after the pool or the fleet
        changed."""
        if self.unavailable is None or not self._queues:
            return
        verdicts: dict[frozenset[str], Unavailable | None] = {}
        for waiter in self._waiters():
            if waiter.exclude not in verdicts:
                verdicts[waiter.exclude] = self.unavailable(waiter.exclude)
            refusal = verdicts[waiter.exclude]
            if refusal is not None:
                self._remove(waiter)
                if not waiter.future.done():
                    waiter.future.set_exception(Unavailable(str(refusal), refusal.retry_after))

    def _expire(self, waiter: _Waiter) -> None:
        self._remove(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(QueueTimeout())

    def discharge(self, backend: Backend, info: RequestInfo, *, drain: bool = True) -> None:
        """The request's first byte came back from BACKEND (or it never will): its prompt is no longer work queued
        there, and a waiter may take its place under the prompt bound."""
        if info.prefill_charge:
            backend.prefill_chars = max(backend.prefill_chars - info.prefill_charge, 0.0)
            info.prefill_charge = 0.0
            if self.on_load is not None:
                self.on_load()
        if info.queue_charge:
            backend.queued_prompt_chars = max(backend.queued_prompt_chars - info.queue_charge, 0.0)
            info.queue_charge = 0.0
            if drain and self._queues:
                self.drain()

    def release(self, backend: Backend, info: RequestInfo | None = None) -> None:
        """BACKEND's slot, taken for the request INFO describes, is free again."""
        if info is not None:
            self.discharge(backend, info, drain=False)
            if info.context_charge:
                backend.context_chars = max(backend.context_chars - info.context_charge, 0.0)
                info.context_charge = 0.0
        backend.in_flight -= 1
        if self.on_load is not None:
            self.on_load()
        if self._queues:
            self.drain()

    def drain(self) -> None:
        """Hand free slots to waiters: the tenant served least recently first, each tenant's oldest first."""
        while self._queues:
            for tenant in sorted(self._queues, key=lambda t: self._served.get(t, 0)):
                served = self._serve(self._queues[tenant])
                if served is None:
                    return  # no engine has a free slot
                if served:
                    break  # the order changed: that tenant goes last
            else:
                return  # free slots only on engines the waiters already failed on

    def _serve(self, queue: OrderedDict[_Waiter, None]) -> bool | None:
        """Give a free slot to the first waiter of QUEUE (oldest first, or in the strategy's order) that can use
        one: whether one got it, None when no engine has a free slot."""
        waiters = list(queue)
        if self.strategy.orders_queue and len(waiters) > 1:
            waiters = self._cheapest_first(waiters)
        for waiter in waiters:
            if waiter.future.done():
                self._remove(waiter)
                continue
            backend = self._pick(waiter.info, waiter.exclude)
            if backend is None:
                if not self._has_capacity():
                    return None
                continue  # the free engines are ones this waiter failed on, or lack its adapter
            self._remove(waiter)
            self._granted(waiter.tenant)
            waiter.future.set_result(backend)
            return True
        return False

    def _cheapest_first(self, waiters: list[_Waiter]) -> list[_Waiter]:
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

        def cost(waiter: _Waiter) -> float:
            usable = self._usable(free, routable, waiter.info, waiter.exclude)
            return min((prefill_cost(b, waiter.info) for b in usable), default=math.inf)

        fresh = sorted((w for w in head if now - w.since < self.order_age), key=cost)
        return aged + fresh + rest


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
