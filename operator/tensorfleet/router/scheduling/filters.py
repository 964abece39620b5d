"""Filters: which engines a request may go to under a profile's rules (the engines' load bound, room in their
KV cache). The dispatcher's own admission rules (the per-engine ceiling, the prompt queue, the engines a
request already failed on, the adapter's hosts) run before any profile (router/dispatch.py). Design:
docs/routing.md#the-scheduling-framework.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensorfleet.router.backends import Backend
from tensorfleet.router.scheduling.hashing import CHARS_PER_TOKEN
from tensorfleet.router.scheduling.request import RequestInfo

LOAD_BOUND = 1.25          # bounded-load factor c: an engine may hold c x the average
LOAD_SLACK = 2             # ... plus this many requests
# An engine's KV-cache fill (0-1) at or above which it has no room for a new conversation (cache-aware), and its
# admission limit comes down (dispatch.py): past it vLLM evicts every idle conversation's cache, then preempts.
KV_HIGH_WATER = 0.9


def own_requests(backend: Backend) -> float:
    return backend.own.requests


def all_requests(backend: Backend) -> float:
    """Requests on the engine from every router replica: ours (exact) and the others' (as last scraped)."""
    return backend.own.requests + backend.others


def load_bound(routable: Sequence[Backend], requests: Callable[[Backend], float] = own_requests) -> float:
    """Most requests (as REQUESTS counts them) one engine may hold under bounded load (Mirrokni et al., 2018).

    The paper's ceil(c x average) alone would forbid a second request on an idle fleet (average 0.5 -> bound 1),
    trading away affinity where load costs nothing; a small absolute slack keeps affinity at low load.
    """
    total = sum(requests(b) for b in routable) + 1
    return math.ceil(LOAD_BOUND * total / max(len(routable), 1)) + LOAD_SLACK


@dataclass(frozen=True)
class UnderLoadBound:
    """Engines that may take one more request within the bounded-load limit, by REQUESTS (this router's own, or
    every replica's)."""

    requests: Callable[[Backend], float] = own_requests

    def __call__(self, candidates: Sequence[Backend], routable: Sequence[Backend],
                 info: RequestInfo) -> list[Backend]:
        bound = load_bound(routable, self.requests)
        requests = self.requests
        return [b for b in candidates if requests(b) + 1 <= bound]


def has_room(backend: Backend, info: RequestInfo) -> bool:
    """Whether BACKEND's KV cache has room for the request's prompt: at its last scrape below KV_HIGH_WATER, and the
    prompts in flight there (every router replica's, as they last told) with this one below KV_HIGH_WATER of its
    capacity. An engine whose cache is full keeps only the running requests' blocks: it evicts the idle
    conversations' caches, whose next turns then compute their whole history again, and it holds new requests
    until blocks free. True while its capacity is unknown."""
    capacity = backend.engine.kv_cache_tokens
    if not capacity:
        return True
    if backend.engine.kv_usage >= KV_HIGH_WATER:
        return False
    context = backend.own.context_chars + backend.peers.context_chars + info.prompt_chars
    return context < KV_HIGH_WATER * capacity * CHARS_PER_TOKEN


def with_room(candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> list[Backend]:
    """Engines with room in their KV cache for the prompt (`has_room`)."""
    return [b for b in candidates if has_room(b, info)]
