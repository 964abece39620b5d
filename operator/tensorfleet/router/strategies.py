"""How the router picks an engine for a request.

Every strategy chooses among `candidates`: engines that are routable and under
the per-engine concurrency ceiling (never empty when `pick` is called). The
load-bounded strategies also see all routable engines, to know the average.

round-robin   each request to the next engine in turn. Blind to load and to
              request size; the baseline.
least-pending the engine with the lowest load score: the router's own in-flight
              count (exact, immediate) plus the engine's scraped queue and
              KV-cache fill (lagging, but they see other routers' traffic).
              Ties rotate so equal engines share work.
session       consistent hashing of a session key (the `x-session-id` header,
              else the OpenAI `user` field) onto a ring of virtual nodes, so a
              conversation returns to the engine holding its KV cache and only
              1/N of sessions move when an engine comes or goes. Bounded load
              (Mirrokni et al., 2018): an engine above 1.25x the average load
              (plus two requests) is skipped for the next one on the ring, so a hot session cannot
              drown one engine. No key: least-pending.
prefix-aware  the prompt is hashed in blocks of characters, each hash chained
              over everything before it; the router remembers, per engine, the
              block hashes it sent there recently (an LRU sized from the engine's
              KV-cache capacity, scraped from vllm:cache_config_info). The engine
              holding the longest leading run of the prompt's blocks wins, among
              engines under the same 1.25x-average load bound; without a match,
              least-pending.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tensorfleet.prompts import block_hashes
from tensorfleet.router.backends import Backend

LOAD_BOUND = 1.25          # bounded-load factor c: an engine may hold c x the average
LOAD_SLACK = 2             # ... plus this many requests
VIRTUAL_NODES = 100        # ring points per engine; spreads keys within ~10%
PREFIX_BLOCK_CHARS = 128   # ~32 tokens of English per block
PREFIX_MAX_BLOCKS = 256    # hash at most the first 32k characters
CHARS_PER_TOKEN = 4
DEFAULT_INDEX_BLOCKS = 8192  # per engine, until its KV capacity is scraped


@dataclass
class RequestInfo:
    """What strategies may know about a request, parsed once."""

    session_key: str | None = None
    prefix_hashes: list[int] = field(default_factory=list)


def _stable_hash(text: str) -> int:
    # Stable across processes, so every router replica maps a session alike
    # (Python's str hash is salted per process).
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def prefix_hashes(text: str) -> list[int]:
    """Chained hashes of the full PREFIX_BLOCK_CHARS blocks of `text` (at most PREFIX_MAX_BLOCKS)."""
    return block_hashes(text, PREFIX_BLOCK_CHARS, max_blocks=PREFIX_MAX_BLOCKS)


def _bound(routable: Sequence[Backend]) -> float:
    """Most in-flight requests one engine may hold under bounded load.

    The paper's ceil(c x average) alone would forbid a second request on an
    idle fleet (average 0.5 -> bound 1), trading away affinity where load
    costs nothing; a small absolute slack keeps affinity at low load.
    """
    total = sum(b.in_flight for b in routable) + 1
    return math.ceil(LOAD_BOUND * total / max(len(routable), 1)) + LOAD_SLACK


class Strategy:
    name = "base"
    needs_prefix = False

    def pick(self, candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> Backend:
        raise NotImplementedError

    def routed(self, backend: Backend, info: RequestInfo) -> None:
        """Called once a request is sent to `backend`."""

    def forget(self, backend: Backend) -> None:
        """Called when an engine leaves the pool."""


class RoundRobin(Strategy):
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> Backend:
        return candidates[next(self._counter) % len(candidates)]


class LeastPending(Strategy):
    name = "least-pending"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> Backend:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        # Start the scan at a rotating offset: the first minimum wins, so ties
        # go to each engine in turn instead of always to the first.
        start = next(self._counter) % n
        best = candidates[start]
        best_load = best.load()
        for i in range(1, n):
            backend = candidates[(start + i) % n]
            load = backend.load()
            if load < best_load:
                best, best_load = backend, load
        return best


class Session(Strategy):
    name = "session"

    def __init__(self) -> None:
        self._fallback = LeastPending()
        self._ring_for: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, urls: frozenset[str]) -> None:
        if urls == self._ring_for:
            return
        points = sorted((_stable_hash(f"{url}#{i}"), url) for url in urls for i in range(VIRTUAL_NODES))
        self._points = [p for p, _ in points]
        self._owners = [u for _, u in points]
        self._ring_for = urls

    def pick(self, candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> Backend:
        if info.session_key is None:
            return self._fallback.pick(candidates, routable, info)
        # The ring spans every routable engine, not only those with a free
        # slot, so a momentarily full engine does not remap its sessions.
        self._ring(frozenset(b.url for b in (*routable, *candidates)))
        by_url = {b.url: b for b in candidates}
        bound = _bound(routable)
        start = bisect.bisect(self._points, _stable_hash(info.session_key))
        seen: set[str] = set()
        for i in range(len(self._points)):
            url = self._owners[(start + i) % len(self._points)]
            if url in seen:
                continue
            seen.add(url)
            backend = by_url.get(url)
            if backend is not None and backend.in_flight + 1 <= bound:
                return backend
        return self._fallback.pick(candidates, routable, info)


class PrefixAware(Strategy):
    name = "prefix-aware"
    needs_prefix = True

    def __init__(self) -> None:
        self._fallback = LeastPending()
        self._index: dict[str, OrderedDict[int, None]] = {}

    def capacity(self, backend: Backend) -> int:
        if backend.kv_cache_tokens:
            return max(backend.kv_cache_tokens * CHARS_PER_TOKEN // PREFIX_BLOCK_CHARS, 1)
        return DEFAULT_INDEX_BLOCKS

    def matched(self, backend: Backend, hashes: Sequence[int]) -> int:
        index = self._index.get(backend.url)
        if not index:
            return 0
        count = 0
        for h in hashes:
            if h not in index:
                break
            count += 1
        return count

    def pick(self, candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> Backend:
        hashes = info.prefix_hashes
        if not hashes:
            return self._fallback.pick(candidates, routable, info)
        bound = _bound(routable)
        best: Backend | None = None
        best_key: tuple[int, float] = (0, 0.0)
        for backend in candidates:
            if backend.in_flight + 1 > bound:
                continue
            match = self.matched(backend, hashes)
            key = (match, -backend.load())
            if match and (best is None or key > best_key):
                best, best_key = backend, key
        return best if best is not None else self._fallback.pick(candidates, routable, info)

    def routed(self, backend: Backend, info: RequestInfo) -> None:
        if not info.prefix_hashes:
            return
        index = self._index.setdefault(backend.url, OrderedDict())
        # Head last, so it is the most recently used: the engine frees a
        # prompt's tail blocks first, and the head is what other prompts share.
        for h in reversed(info.prefix_hashes):
            index[h] = None
            index.move_to_end(h)
        capacity = self.capacity(backend)
        while len(index) > capacity:
            index.popitem(last=False)

    def forget(self, backend: Backend) -> None:
        self._index.pop(backend.url, None)


STRATEGIES: Mapping[str, type[Strategy]] = {
    cls.name: cls for cls in (RoundRobin, LeastPending, Session, PrefixAware)
}


def make_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; one of {', '.join(STRATEGIES)}") from None
