"""Scorers: each rates every candidate engine for a request, 0 (worst) to 1 (best), from one signal: load, the
decodes at risk there, the prompt's blocks the engine holds, a session's or an adapter's place on a consistent-hashing order. A profile
weighs them (router/scheduling/profiles.py). Design: docs/routing.md#the-scheduling-framework.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tensorfleet.router.backends import Backend
from tensorfleet.router.scheduling.hashing import mix, stable_hash
from tensorfleet.router.scheduling.prefixes import SentPrefixes
from tensorfleet.router.scheduling.request import RequestInfo

VIRTUAL_NODES = 100        # ring points per engine; spreads keys within ~10%


class Scorer(Protocol):
    def scores(self, backends: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> list[float]:
        """One score in [0, 1] per engine of BACKENDS, in their order."""


@dataclass(frozen=True)
class LeastLoad:
    """The less loaded the better, by LOAD (this router's own requests and the engine's scraped queue and cache,
    or every replica's)."""

    load: Callable[[Backend], float] = Backend.load

    def scores(self, backends: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> list[float]:
        loads = [self.load(b) for b in backends]
        top = max(loads, default=0.0)
        return [1.0 - value / (top + 1.0) for value in loads]


@dataclass(frozen=True)
class FewestDecodesAtRisk:
    """The fewer decodes at risk on the engine the better: its requests' exposures summed (this router's exactly,
    the other replicas' as they last told: Backend.exposure). Every step of an engine decodes all its running
    requests, and a prompt computed there joins those steps (vLLM's chunked prefill), stretching each one's mean
    inter-token time by the prompt's time over its answer's length; a short answer has the fewest gaps to spread it
    over. The requests still waiting for their first token count too: they decode while the prompt placed behind
    them computes."""

    def scores(self, backends: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> list[float]:
        risks = [b.exposure() for b in backends]
        top = max(risks, default=0.0)
        return [1.0 - risk / top if top > 0 else 1.0 for risk in risks]


@dataclass(frozen=True)
class PrefixMatch:
    """The longer the leading run of the prompt's blocks the engine holds, the better: 0 for none."""

    prefixes: SentPrefixes

    def scores(self, backends: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> list[float]:
        total = len(info.prefix_hashes)
        if not total:
            return [0.0] * len(backends)
        return [self.prefixes.match(b, info) / total for b in backends]


class SessionRing:
    """A session's engines in the order of a consistent-hashing ring of virtual nodes (the `x-session-id`
    header, else the OpenAI `user` field): 1 for the first on the ring after the key, less for each later one, 0
    without a key. The ring spans every routable engine, so a momentarily full one does not remap its
    sessions, and only 1/N of them move when an engine comes or goes."""

    def __init__(self) -> None:
        self._ring_for: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, urls: frozenset[str]) -> None:
        if urls == self._ring_for:
            return
        points = sorted((stable_hash(f"{url}#{i}"), url) for url in urls for i in range(VIRTUAL_NODES))
        self._points = [p for p, _ in points]
        self._owners = [u for _, u in points]
        self._ring_for = urls

    def scores(self, backends: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> list[float]:
        if info.session_key is None or not backends:
            return [0.0] * len(backends)
        self._ring(frozenset(b.url for b in (*routable, *backends)))
        wanted = {b.url for b in backends}
        rank: dict[str, int] = {}
        start = bisect.bisect(self._points, stable_hash(info.session_key))
        for i in range(len(self._points)):
            url = self._owners[(start + i) % len(self._points)]
            if url in wanted and url not in rank:
                rank[url] = len(rank)
                if len(rank) == len(wanted):
                    break
        n = len(wanted)
        return [(n - rank[b.url]) / n for b in backends]


class Rendezvous:
    """Engines in a key's rendezvous (highest-random-weight) order: every router replica orders them alike with
    no shared state, and only the keys of an engine that comes or goes move. KEY: the request's key (its
    adapter, its conversation's opening); 0 for all without one."""

    def __init__(self, key: Callable[[RequestInfo], int | None]) -> None:
        self.key = key
        self._salts: dict[str, int] = {}

    def salt(self, url: str) -> int:
        salt = self._salts.get(url)
        if salt is None:
            salt = self._salts[url] = stable_hash(url)
        return salt

    def weight(self, backend: Backend, key: int) -> int:
        return mix(key ^ self.salt(backend.url))

    def scores(self, backends: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> list[float]:
        key = self.key(info)
        if key is None:
            return [0.0] * len(backends)
        return [self.weight(b, key) / 2.0 ** 64 for b in backends]

    def first(self, backends: Sequence[Backend], key: int) -> Backend:
        """The first of BACKENDS in KEY's order."""
        return max(backends, key=lambda b: self.weight(b, key))

    def forget(self, backend: Backend) -> None:
        self._salts.pop(backend.url, None)
