"""Engines the router can send to: load it knows, load it scrapes, and health.

Load: `in_flight` is the router's own count of requests it has sent to an
engine and not yet seen finish; it is exact and changes the moment a request
is routed. The engine's `vllm:num_requests_running`, `vllm:num_requests_waiting`
and `vllm:kv_cache_usage_perc` are scraped every health interval; they lag by
up to that interval but include load from other router replicas. `others` is
what the engine held at the last scrape beyond this router's own in-flight
requests then: the other replicas' share, so `estimated_load` (own, exact, plus
theirs, lagging) is the whole engine's as every replica sees it alike. Replicas
that know each other (router/peers.py) also tell each other their counts as
they change, which replace the scraped share until the next scrape.

Health is a circuit breaker per engine, after a first state of its own:
  joining    in the pool, not yet seen healthy (the router's pool starts every
             engine here, `check_first`): no traffic until a health check
             answers 200. Failures while joining count for nothing, so an
             engine loading its model is not ejected again and again, and is
             taken the first health interval after it is up.
  closed     normal; consecutive failures (5xx answers, failed health checks)
             reaching the threshold open it; a refused or reset connection, or
             a health check left unanswered past its timeout, opens it at once
  open       ejected: no traffic for the ejection time, which doubles on every
             consecutive ejection (capped), so a dead pod costs little
  half-open  after the ejection time: one request (or the next health check)
             probes it; success closes the breaker, failure reopens it. An
             engine ejected as unresponsive (a health check timed out: hung,
             stopped, partitioned) is probed by health checks only, so no
             client request waits on it to find out.

Only the engine's own faults count. What a client controls never does: the
router refuses malformed requests itself, the engine's 4xx answers are neutral
(neither failure nor success), and a 5xx counts only once another engine has
answered the same request without one (see app.py).
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


@dataclass(eq=False)
class Backend:
    url: str
    in_flight: int = 0
    # Scraped from /metrics.
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    kv_cache_tokens: int | None = None
    kv_block_size: int | None = None   # tokens per KV block (vllm:cache_config_info)
    # Requests on the engine that are not ours: at the last scrape, or as the other router replicas last told
    # (router/peers.py), whichever came later.
    others: float = 0.0
    # Prompt characters this engine has yet to compute for this router: the uncached part of each request sent
    # here that has not had its first byte back (cache-aware places a conversation's first turn by it); and for
    # the other router replicas, as they last told.
    prefill_chars: float = 0.0
    peer_prefill_chars: float = 0.0
    # Of this router's prefill_chars, those of streamed answers: what it bounds the engine's prompt queue by
    # (dispatch.py), as it sees their first token; and the other router replicas', as they last told.
    queued_prompt_chars: float = 0.0
    peer_queued_prompt_chars: float = 0.0
    # Prompt characters of the requests in flight here, first byte back or not: what their KV takes of the
    # engine's cache (cache-aware starts a conversation elsewhere when it is nearly full); this router's, and the
    # other replicas' as they last told.
    context_chars: float = 0.0
    peer_context_chars: float = 0.0
    # The other router replicas' requests in flight here, as they last told (router/peers.py): they count
    # against the per-engine limit with this router's own (dispatch.py).
    peer_in_flight: int = 0
    # Admission (dispatch.py): requests this router sends here at once, within [ceiling, burst]; 0 until the
    # dispatcher sets it. `held_back`: a request found it at that limit since the last scrape.
    limit: int = 0
    held_back: bool = False
    # Circuit breaker.
    state: str = CLOSED
    failures: int = 0
    open_until: float = 0.0
    ejections: int = 0
    probing: bool = False
    unresponsive: bool = False  # ejected by a health-check timeout: only a health check may probe it
    checked: bool = False       # a health check of it has completed (whatever it found)
    # Its last health check could not connect (refused, unreachable, the name not resolved): nothing listens
    # there, so while joining it is not taken as starting (router/app.py, cold_start).
    unreachable: bool = False
    # Set by the router's metrics layer; called with the new in-flight count.
    on_change: Callable[[Backend], None] | None = field(default=None, repr=False)

    @property
    def healthy(self) -> bool:
        return self.state == CLOSED

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

    def load(self) -> float:
        """Least-pending score: own in-flight requests, plus the engine's queue
        (requests it holds back for lack of KV blocks or batch slots) and its
        KV-cache fill, which count against an engine this router alone cannot see."""
        return self.in_flight + self.waiting + self.kv_usage

    def estimated_load(self) -> float:
        """Requests on the engine from every router: this one's (exact) plus the others' (as last scraped), with
        the KV-cache fill (0-1) breaking ties towards the emptier cache."""
        return self.in_flight + self.others + self.kv_usage

    def scraped(self, load: EngineLoad) -> None:
        """Take a scrape of the engine's own metrics."""
        self.waiting, self.running = load.waiting, load.running
        self.kv_usage, self.kv_cache_tokens = load.kv_usage, load.kv_cache_tokens
        self.kv_block_size = load.kv_block_size or self.kv_block_size
        self.others = max(0.0, load.running + load.waiting - self.in_flight)


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
                self.backends[url] = Backend(url, state=JOINING if self.check_first else CLOSED)
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
        backend.failures = 0
        backend.unresponsive = False
        if backend.state != CLOSED:
            backend.state = CLOSED
            backend.ejections = 0
            backend.probing = False
            self._notify_routable()

    def record_neutral(self, backend: Backend) -> None:
        """An answer that says nothing about the engine's health (a 4xx): a
        half-open probe that got one is over, and the next request probes."""
        if backend.state == HALF_OPEN and backend.probing:
            backend.probing = False
            self._notify_routable()

    def record_failure(self, backend: Backend, *, fatal: bool = False, unresponsive: bool = False) -> None:
        """A failed request or health check; `fatal` (connection refused or
        reset) ejects at once instead of counting towards the threshold, and
        `unresponsive` (a health check timed out) ejects at once and leaves the
        probing to health checks. A joining engine has nothing to eject: it stays joining."""
        if backend.state == JOINING:
            return
        if backend.state == OPEN:
            # Already ejected (a request sent before the ejection failing
            # late): the ejection stands as it is, neither extended nor doubled.
            return
        backend.failures += 1
        backend.probing = False
        if unresponsive:
            backend.unresponsive = True
        if backend.state == HALF_OPEN or fatal or unresponsive or backend.failures >= self.policy.failure_threshold:
            self.eject(backend)

    def eject(self, backend: Backend) -> None:
        policy = self.policy
        seconds = min(policy.ejection_seconds * 2 ** backend.ejections, policy.max_ejection_seconds)
        backend.ejections += 1
        backend.state = OPEN
        backend.open_until = self.clock() + seconds
        for callback in self.on_ejected:
            callback(backend)

    def begin_probe(self, backend: Backend) -> None:
        """Routing to a backend past its ejection time makes it half-open."""
        if backend.state in (OPEN, HALF_OPEN):
            backend.state = HALF_OPEN
            backend.probing = True

    def tick(self) -> None:
        """Wake waiters when an ejection time has passed (half-open is routable)."""
        now = self.clock()
        if any(b.state != CLOSED and b.routable(now) for b in self.backends.values()):
            self._notify_routable()


@dataclass
class EngineLoad:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    kv_cache_tokens: int | None = None
    kv_block_size: int | None = None


_WAITING = contract.VLLM_METRIC_WAITING
_RUNNING = contract.VLLM_METRIC_RUNNING
_KV = contract.VLLM_METRIC_KV_CACHE_USAGE
_CACHE_CONFIG = contract.VLLM_METRIC_CACHE_CONFIG
_READ = frozenset((_WAITING, _RUNNING, _KV, _CACHE_CONFIG))


def parse_engine_metrics(text: str) -> EngineLoad:
    """The few samples the router needs from vLLM's /metrics, summed over
    engines (data-parallel ranks) where there are several; KV usage averaged.
    A NaN reads as 0. Only their lines are parsed (promtext.samples with
    names: a real engine's page is hundreds of lines, scraped every health
    interval). Text with none of them is parsed whole, so text that is not
    Prometheus text raises ValueError (the health check that scraped it has
    failed)."""
    load = EngineLoad()
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
