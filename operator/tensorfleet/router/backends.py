"""Engines the router can send to: the load it knows (its own requests, exact) and scrapes (every replica's, lagging),
and each engine's health, a circuit breaker after a first joining state. Design: docs/routing.md#engine-health.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from tensorfleet import contract, promtext

CLOSED, OPEN, HALF_OPEN, JOINING = "closed", "open", "half-open", "joining"


@dataclass
class BreakerPolicy:
    failure_threshold: int = 3
    ejection_seconds: float = 2.0
    max_ejection_seconds: float = 30.0


@dataclass
class Breaker:
    """One engine's circuit breaker (joining, closed, open, half-open: docs/routing.md#engine-health); BackendPool
    moves it."""

    state: str = CLOSED
    failures: int = 0
    open_until: float = 0.0
    ejections: int = 0
    probing: bool = False
    unresponsive: bool = False  # ejected by a health-check timeout: only a health check may probe it
    checked: bool = False       # a health check of it has completed (whatever it found)
    # Its last health check could not connect (refused, unreachable, the name not resolved): nothing listens
    # there, so while joining it is not taken as starting (router/fleet.py, cold start).
    unreachable: bool = False

    def routable(self, now: float) -> bool:
        """Whether a request may go here now (ignoring the concurrency ceiling)."""
        if self.state == CLOSED:
            return True
        # Half-open admits exactly one probe at a time; a joining engine waits for its health check.
        return not self.unresponsive and self.probe_due(now)

    def probe_due(self, now: float) -> bool:
        """Ejected, past its ejection time, and no probe out yet."""
        return self.state in (OPEN, HALF_OPEN) and now >= self.open_until and not self.probing

    def back_in(self, now: float, check_interval: float) -> float:
        """Seconds until this engine may take requests again, as far as the router can tell: 0 when it can now;
        for a joining engine or a probe in flight, the next health check; for an ejected one, the end of its
        ejection (plus the health check that must then probe it, when it was ejected as unresponsive)."""
        if self.state == CLOSED:
            return 0.0
        if self.state == JOINING or self.probing:
            return check_interval
        rest = max(self.open_until - now, 0.0)
        return rest + check_interval if self.unresponsive else rest


@dataclass
class Load:
    """Requests one router has on one engine, as the dispatcher charged them (its Ledger, router/dispatch.py):
    this router's own exactly, or the other replicas' together as they last told (router/peers.py)."""

    requests: int = 0
    prefilling: int = 0               # of them, those with no first byte back yet
    prefill_chars: float = 0.0        # the uncached prompt characters of those: work queued on the engine
    queued_prompt_chars: float = 0.0  # of that, streamed answers': what the prompt queue bound counts
    context_chars: float = 0.0        # the prompt characters of all of them: what their KV takes of the cache
    exposure: float = 0.0             # their exposures summed (scheduling/request.py): the engine's decodes at risk

    def __add__(self, other: Load) -> Load:
        return Load(self.requests + other.requests, self.prefilling + other.prefilling,
                    self.prefill_chars + other.prefill_chars, self.queued_prompt_chars + other.queued_prompt_chars,
                    self.context_chars + other.context_chars, self.exposure + other.exposure)


@dataclass
class EngineMetrics:
    """The few samples the router reads from an engine's /metrics (parse_engine_metrics)."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    kv_cache_tokens: int | None = None
    kv_block_size: int | None = None   # tokens per KV block (vllm:cache_config_info)


@dataclass(eq=False)
class Backend:
    """One engine: what it reported at its last scrape, its breaker, this router's load on it and the other
    replicas' (`own`, `peers`), and its admission limit."""

    url: str
    engine: EngineMetrics = field(default_factory=EngineMetrics)
    breaker: Breaker = field(default_factory=Breaker)
    own: Load = field(default_factory=Load)
    peers: Load = field(default_factory=Load)
    # Requests on the engine that are not ours: at the last scrape, or as the other router replicas last told
    # (router/peers.py), whichever came later.
    others: float = 0.0
    # Admission (dispatch.py): requests this router sends here at once, within [ceiling, burst]; 0 until the
    # dispatcher sets it. `held_back`: a request found it at that limit since the last scrape.
    limit: int = 0
    held_back: bool = False

    @property
    def in_flight(self) -> int:
        """This router's requests on the engine."""
        return self.own.requests

    @property
    def state(self) -> str:
        return self.breaker.state

    @property
    def healthy(self) -> bool:
        return self.breaker.state == CLOSED

    def routable(self, now: float) -> bool:
        return self.breaker.routable(now)

    def load(self) -> float:
        """Least-pending score: own in-flight requests, plus the engine's queue
        (requests it holds back for lack of KV blocks or batch slots) and its
        KV-cache fill, which count against an engine this router alone cannot see."""
        return self.own.requests + self.engine.waiting + self.engine.kv_usage

    def estimated_load(self) -> float:
        """Requests on the engine from every router: this one's (exact) plus the others' (as last scraped), with
        the KV-cache fill (0-1) breaking ties towards the emptier cache."""
        return self.own.requests + self.others + self.engine.kv_usage

    def exposure(self) -> float:
        """The engine's decodes at risk from a prompt computed beside them: the exposures of this router's requests
        there (exact) and the other replicas' (as they last told)."""
        return self.own.exposure + self.peers.exposure

    def scraped(self, metrics: EngineMetrics) -> None:
        """Take a scrape of the engine's own metrics."""
        metrics.kv_block_size = metrics.kv_block_size or self.engine.kv_block_size
        self.engine = metrics
        self.others = max(0.0, metrics.running + metrics.waiting - self.own.requests)


class BackendPool:
    """The current set of engines, keyed by base URL, in discovery order."""

    def __init__(self, policy: BreakerPolicy | None = None, clock: Callable[[], float] = time.monotonic, *,
                 check_first: bool = False) -> None:
        self.policy = policy or BreakerPolicy()
        self.clock = clock
        self.check_first = check_first  # new engines join (no traffic) until a health check passes
        self.backends: dict[str, Backend] = {}
        self.on_removed: list[Callable[[Backend], None]] = []
        self.on_routable: list[Callable[[], None]] = []
        self.on_ejected: list[Callable[[Backend], None]] = []

    def __len__(self) -> int:
        return len(self.backends)

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.backends.values())

    def set_urls(self, urls: Iterable[str]) -> bool:
        """Make the pool exactly `urls`; whether an engine joined (it wants a health check). Requests in
        flight to a removed engine finish on their own; they hold the Backend object."""
        wanted = list(dict.fromkeys(u.rstrip("/") for u in urls))
        for url in [u for u in self.backends if u not in wanted]:
            backend = self.backends.pop(url)
            for callback in self.on_removed:
                callback(backend)
        added = False
        for url in wanted:
            if url not in self.backends:
                self.backends[url] = Backend(url, breaker=Breaker(JOINING if self.check_first else CLOSED))
                added = True
        if added:
            self._notify_routable()
        return added

    def routable(self, now: float | None = None) -> list[Backend]:
        now = self.clock() if now is None else now
        return [b for b in self.backends.values() if b.routable(now)]

    # --- breaker transitions ---------------------------------------------------
    def _notify_routable(self) -> None:
        for callback in self.on_routable:
            callback()

    def record_success(self, backend: Backend) -> None:
        """A good answer or health check; a joining engine joins (closed)."""
        breaker = backend.breaker
        breaker.failures = 0
        breaker.unresponsive = False
        if breaker.state != CLOSED:
            breaker.state = CLOSED
            breaker.ejections = 0
            breaker.probing = False
            self._notify_routable()

    def record_neutral(self, backend: Backend) -> None:
        """An answer that says nothing about the engine's health (a 4xx): a
        half-open probe that got one is over, and the next request probes."""
        breaker = backend.breaker
        if breaker.state == HALF_OPEN and breaker.probing:
            breaker.probing = False
            self._notify_routable()

    def record_failure(self, backend: Backend, *, fatal: bool = False, unresponsive: bool = False) -> None:
        """A failed request or health check; `fatal` (connection refused or
        reset) ejects at once instead of counting towards the threshold, and
        `unresponsive` (a health check timed out) ejects at once and leaves the
        probing to health checks. A joining engine has nothing to eject: it stays joining."""
        breaker = backend.breaker
        if breaker.state == JOINING:
            return
        if breaker.state == OPEN:
            # Already ejected (a request sent before the ejection failing
            # late): the ejection stands as it is, neither extended nor doubled.
            return
        breaker.failures += 1
        breaker.probing = False
        if unresponsive:
            breaker.unresponsive = True
        if breaker.state == HALF_OPEN or fatal or unresponsive or breaker.failures >= self.policy.failure_threshold:
            self.eject(backend)

    def eject(self, backend: Backend) -> None:
        policy, breaker = self.policy, backend.breaker
        seconds = min(policy.ejection_seconds * 2 ** breaker.ejections, policy.max_ejection_seconds)
        breaker.ejections += 1
        breaker.state = OPEN
        breaker.open_until = self.clock() + seconds
        for callback in self.on_ejected:
            callback(backend)

    def begin_probe(self, backend: Backend) -> None:
        """Routing to a backend past its ejection time makes it half-open."""
        breaker = backend.breaker
        if breaker.state in (OPEN, HALF_OPEN):
            breaker.state = HALF_OPEN
            breaker.probing = True

    def tick(self) -> None:
        """Wake waiters when an ejection time has passed (half-open is routable)."""
        now = self.clock()
        if any(b.state != CLOSED and b.routable(now) for b in self.backends.values()):
            self._notify_routable()


_WAITING = contract.VLLM_METRIC_WAITING
_RUNNING = contract.VLLM_METRIC_RUNNING
_KV = contract.VLLM_METRIC_KV_CACHE_USAGE
_CACHE_CONFIG = contract.VLLM_METRIC_CACHE_CONFIG
_READ = frozenset((_WAITING, _RUNNING, _KV, _CACHE_CONFIG))


def parse_engine_metrics(text: str) -> EngineMetrics:
    """The few samples the router needs from vLLM's /metrics, summed over
    engines (data-parallel ranks) where there are several; KV usage averaged.
    A NaN reads as 0. Only their lines are parsed (promtext.samples with
    names: a real engine's page is hundreds of lines, scraped every health
    interval). Text with none of them is parsed whole, so text that is not
    Prometheus text raises ValueError (the health check that scraped it has
    failed)."""
    load = EngineMetrics()
    kv_samples = 0
    blocks = 0
    for sample in promtext.samples(text, names=_READ):
        name = sample.name
        value = 0.0 if math.isnan(sample.value) else sample.value
        if name == _WAITING:
            load.waiting += value
        elif name == _RUNNING:
            load.running += value
        elif name == _KV:
            load.kv_usage += value
            kv_samples += 1
        else:
            size, count = sample.labels.get("block_size"), sample.labels.get("num_gpu_blocks")
            if size and count and size.isdigit() and count.isdigit():
                blocks += int(size) * int(count)
                load.kv_block_size = int(size) or load.kv_block_size
    if kv_samples > 1:
        load.kv_usage /= kv_samples
    load.kv_cache_tokens = blocks or None
    return load
