"""How many requests each engine may hold from every router replica at once: the ceiling the planner derives from its
KV cache, and a burst above it that each scrape of the engine moves, up while requests were held back and the engine
has room, down once it queues or its KV cache runs high. Design: docs/routing.md#admission-and-the-queue.
"""

from __future__ import annotations

import math

from tensorfleet.router.backends import Backend, BackendPool
from tensorfleet.router.scheduling import KV_HIGH_WATER

# Requests waiting inside an engine that count as it queueing: vLLM holds a just-arrived request in its waiting
# queue until its next scheduler step, so one seen there is routine.
ENGINE_QUEUEING = 2
LIMIT_STEP = 0.25  # the fraction an engine's limit moves by at a scrape


class EngineLimits:
    """Each engine's limit within [ceiling, burst]."""

    def __init__(self, pool: BackendPool, ceiling: int, burst: int = 0) -> None:
        self.pool = pool
        self.ceiling = ceiling
        self.burst = max(ceiling, burst)  # at most this many per engine while it has room; ceiling: no burst

    def limit(self, backend: Backend) -> int:
        """Requests BACKEND may have from every router replica at once now."""
        return backend.limit or self.ceiling

    def full(self, backend: Backend) -> bool:
        """Whether BACKEND holds its limit: this router's requests there, and its peers' as they last told
        (router/peers.py), so router replicas share one ceiling per engine rather than each filling it."""
        return backend.own.requests + backend.peers.requests >= self.limit(backend)

    def adapt(self, backend: Backend) -> bool:
        """After a scrape of BACKEND: move its limit within [ceiling, burst] on what the engine reports, up by a
        quarter while requests were held back for it and it has room, down by a quarter once it queues or its KV
        cache passes KV_HIGH_WATER. Whether the limit went up (slots opened)."""
        limit = self.limit(backend)
        if backend.engine.waiting >= ENGINE_QUEUEING or backend.engine.kv_usage >= KV_HIGH_WATER:
            new = max(self.ceiling, min(limit, backend.own.requests) - math.ceil(limit * LIMIT_STEP))
        elif backend.held_back and limit < self.burst:
            new = min(self.burst, limit + math.ceil(limit * LIMIT_STEP))
        else:
            new = limit
        backend.held_back = False
        backend.limit = new
        return new > limit

    def burst_requests(self) -> float:
        """Requests running on engines beyond the ceiling, this router's share: per engine, what it ran at the
        last scrape over the ceiling, times the part of its load that is this router's. The engine's own count,
        not the router's in-flight: a request sent since the scrape may be waiting inside the engine, which
        vllm:num_requests_waiting counts already."""
        total = 0.0
        for backend in self.pool:
            over = backend.engine.running - self.ceiling
            mine = backend.own.requests
            if over > 0 and mine:
                total += over * mine / (mine + backend.others)
        return total
