"""Profiles: a named way of placing requests, built from filters, weighted scorers and a picker (and, for
cache-aware, its own decision order over the same parts). `spec.router.strategy` names one. Design and how to
add a scorer: docs/routing.md#the-scheduling-framework.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from tensorfleet.router.backends import Backend
from tensorfleet.router.kvindex import KVIndex
from tensorfleet.router.scheduling.filters import UnderLoadBound, all_requests, has_room
from tensorfleet.router.scheduling.hashing import PREFIX_BLOCK_CHARS
from tensorfleet.router.scheduling.held import HeldPrefixes
from tensorfleet.router.scheduling.picker import MaxScore, Picker, RoundRobin
from tensorfleet.router.scheduling.prefixes import SentPrefixes
from tensorfleet.router.scheduling.request import RequestInfo
from tensorfleet.router.scheduling.scorers import (
    FewestDecodesAtRisk,
    LeastLoad,
    PrefixMatch,
    Rendezvous,
    Scorer,
    SessionRing,
)

# A conversation's first turn goes to its home unless the home has this much more prompt to compute ahead of
# it than the least busy engine (about 512 tokens: a short prompt's prefill).
HOME_SLACK_CHARS = 2048

Filter = Callable[[Sequence[Backend], Sequence[Backend], RequestInfo], list[Backend]]


@dataclass(frozen=True)
class Weighted:
    scorer: Scorer
    weight: float = 1.0


class Profile:
    """What the dispatcher asks of a profile. Candidates are routable engines under their admission limits (never
    empty); routable are all routable engines, for averages and rings.

    A profile declares what it needs of the router and the dispatcher: the session key (`needs_session_key`),
    the prompt's block hashes (`needs_prefix`), its token ids (`needs_tokens`), the prompt
    work charged to engines (`places_by_prefill`: it reads the engines' queued prompt work, and the prompt queue bounds
    it), the queue offered cheapest first (`orders_queue`)."""

    name = "base"
    needs_prefix = False
    needs_session_key = False
    places_by_prefill = False
    orders_queue = False

    def __init__(self, prefixes: SentPrefixes | None = None) -> None:
        self.prefixes = prefixes
        self.held: HeldPrefixes | None = None

    def use_kv_index(self, index: KVIndex) -> None:
        """The engines' KV events are indexed (router --kv-events). A profile that reads them (cache-aware) then
        places by what the engines really hold, for requests whose token ids the router has (`needs_tokens`)."""

    @property
    def needs_tokens(self) -> bool:
        return self.held is not None

    def wants_tokens(self, routable: Sequence[Backend], info: RequestInfo) -> bool:
        """Whether this request's token ids could change where it goes (they cost the router a call to an
        engine's /tokenize): only for a profile that reads the index."""
        return self.held is not None

    @property
    def block_chars(self) -> int:
        return self.prefixes.block_chars if self.prefixes is not None else PREFIX_BLOCK_CHARS

    def pick(self, candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> Backend:
        raise NotImplementedError

    def align(self, kv_block_sizes: Iterable[int | None]) -> None:
        """Called after each round of health checks with the engines' KV block sizes, as scraped."""
        if self.prefixes is not None:
            self.prefixes.align(kv_block_sizes)

    def routed(self, backend: Backend, info: RequestInfo) -> None:
        """Called once a request is sent to `backend`."""
        if self.prefixes is not None:
            self.prefixes.learn(backend, info.prefix_hashes, info.opening)

    def learn(self, backend: Backend, hashes: Sequence[int], opening: int | None) -> None:
        """Another router replica sent a prompt (its block HASHES, its conversation's OPENING) to `backend`
        (router/peers.py): taken in as if routed here."""
        if self.prefixes is not None:
            self.prefixes.learn(backend, hashes, opening)

    def prefill_cost(self, backend: Backend, info: RequestInfo) -> float:
        """Prompt characters `backend` would compute for this request: all but what it may hold cached, by its
        KV events or by what this router (and its peers) sent it, whichever says more (the events lag a prompt
        still being computed; the memory misses evictions)."""
        cost = float(info.prompt_chars)
        if self.prefixes is not None:
            cost = self.prefixes.uncached_chars(backend, info)
        if self.held is not None and cost:
            cost = min(cost, max(info.prompt_chars - self.held.chars(backend, info), 0.0))
        return cost

    def forget(self, backend: Backend) -> None:
        """Called when an engine leaves the pool."""
        if self.prefixes is not None:
            self.prefixes.forget(backend)


class Scored(Profile):
    """Filters, then the weighted scorers' sum, then the picker. With REQUIRED (a scorer of SCORERS), only
    engines it scores above 0 may win; where none is left, FALLBACK picks among all candidates."""

    def __init__(self, name: str, *, filters: Sequence[Filter] = (), scorers: Sequence[Weighted] = (),
                 picker: Picker | None = None, required: Scorer | None = None, fallback: Profile | None = None,
                 prefixes: SentPrefixes | None = None) -> None:
        super().__init__(prefixes)
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker or MaxScore()
        self.required = required
        self.fallback = fallback
        self.needs_prefix = any(isinstance(w.scorer, PrefixMatch) for w in self.scorers)
        self.needs_session_key = any(isinstance(w.scorer, SessionRing) for w in self.scorers)

    def pick(self, candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> Backend:
        engines: Sequence[Backend] = candidates
        for keep in self.filters:
            engines = keep(engines, routable, info)
        totals = [0.0] * len(engines)
        for weighted in self.scorers:
            scores = weighted.scorer.scores(engines, routable, info)
            if weighted.scorer is self.required:
                engines = [b for b, s in zip(engines, scores, strict=True) if s > 0]
                totals = [t for t, s in zip(totals, scores, strict=True) if s > 0]
                scores = [s for s in scores if s > 0]
            totals = [t + weighted.weight * s for t, s in zip(totals, scores, strict=True)]
        if not engines:
            if self.fallback is None:
                raise LookupError(f"profile {self.name}: no engine passes its filters and none to fall back on")
            return self.fallback.pick(candidates, routable, info)
        return self.picker.pick(engines, totals)


class CacheAware(Profile):
    """The default: stays on the engine that holds the conversation's KV cache until that engine is saturated,
    then routes by load, in a decision order of its own over the framework's parts (docs/routing.md)."""

    name = "cache-aware"
    needs_prefix = True
    places_by_prefill = True
    orders_queue = True

    def __init__(self) -> None:
        super().__init__(SentPrefixes(openings=True))
        self.bounded = UnderLoadBound(all_requests)
        self.least = Scored("least-loaded", scorers=[Weighted(LeastLoad(Backend.estimated_load))])
        self.at_risk = FewestDecodesAtRisk()
        self.adapter_order = Rendezvous(lambda info: info.adapter)
        self.conversation_order = Rendezvous(lambda info: info.opening)

    def pick(self, candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> Backend:
        prefixes = self.prefixes
        assert prefixes is not None
        held = self.held if self.held is not None and self.held.known(info) else None
        under = self.bounded(candidates, routable, info)
        if not under:
            return self.least.pick(candidates, routable, info)
        if info.adapter is not None:
            # A LoRA adapter's requests: its home engine by rendezvous, the next in its order once that is past the
            # load bound, so a cold adapter sits in one engine's slots and a hot one spreads as far as its load.
            return self.adapter_order.first(under, info.adapter)
        opening = info.opening
        if held is not None and (opening is None or info.continues):
            # What the engines report holding: a later turn goes to the engine holding the most of its conversation
            # (at least its opening, less a block), a prompt that is not a chat to the one holding the longest run
            # of it. First turns are placed below: a shared system prompt held everywhere says nothing of where
            # a new conversation should live.
            found = self._holder(under, info, held)
            if found is not None:
                return found
        if opening is None:
            # Not a chat: where the longest run of the prompt's blocks went, else the least loaded.
            best: Backend | None = None
            best_key = (0, 0.0)
            for backend in under:
                match = prefixes.match(backend, info) if info.prefix_hashes else 0
                key = (match, -backend.estimated_load())
                if match and (best is None or key > best_key):
                    best, best_key = backend, key
            return best if best is not None else self.least.pick(under, routable, info)
        # Where this router already sent the conversation (its home, or where it spilled over to): the engine
        # holding the longest run of it.
        sent: Backend | None = None
        sent_match = -1
        for backend in under:
            if prefixes.holds_opening(backend, opening):
                match = prefixes.match(backend, info)
                if match > sent_match:
                    sent, sent_match = backend, match
        if sent is not None:
            return sent
        if not info.continues:
            # A first turn: no engine holds this conversation's KV yet (at most a shared system prompt, which
            # prefill_cost counts), so it goes to an engine with room for its KV (`has_room`), and what its first
            # token waits for is the prompt work queued on the engine ahead of it (this router's, and the other
            # replicas' as they last told: router/peers.py), its own uncached part included. Among the engines
            # within HOME_SLACK_CHARS of the least of that, the earliest in the conversation's rendezvous order:
            # its home whenever the home is not busy computing other prompts, so router replicas agree wherever
            # the load leaves the choice.
            roomy = [b for b in under if has_room(b, info)] or under
            costs = [(b.own.prefill_chars + b.peers.prefill_chars + self.prefill_cost(b, info), b) for b in roomy]
            least = min(cost for cost, _ in costs) + HOME_SLACK_CHARS
            near = [b for cost, b in costs if cost <= least]
            # Of those, the one with the fewest decodes at risk: its prompt slows every decode in the engine's
            # steps while it is computed, the short answers' mean inter-token time the most (the ITL target).
            calm = self.at_risk.scores(near, routable, info)
            top = max(calm)
            return self.conversation_order.first([b for b, s in zip(near, calm, strict=True) if s >= top], opening)
        # A later turn of a conversation new to this router (another replica served its start): its home by
        # rendezvous, or the next engine in its order.
        return self.conversation_order.first(under, opening)

    def use_kv_index(self, index: KVIndex) -> None:
        self.held = HeldPrefixes(index)

    def wants_tokens(self, routable: Sequence[Backend], info: RequestInfo) -> bool:
        """The index decides only where this router's own memory cannot: a later turn of a conversation it did not
        place (another replica's, or from before it started), a prompt that is not a chat with no run of it
        sent anywhere. A first turn is placed by load and room, which token ids do not change; asking an
        engine's /tokenize for every request would cost more router CPU than the rest of the request."""
        if self.held is None or info.adapter is not None:
            return False
        prefixes = self.prefixes
        assert prefixes is not None
        if info.opening is None:
            return bool(info.prefix_hashes) and not any(prefixes.match(b, info) for b in routable)
        return info.continues and not any(prefixes.holds_opening(b, info.opening) for b in routable)

    def _holder(self, under: Sequence[Backend], info: RequestInfo, held: HeldPrefixes) -> Backend | None:
        """The engine holding the longest leading run of the prompt (a conversation's: at least its opening,
        less one block), ties to the conversation's home order, else to the less loaded; None if none holds it."""
        need = held.opening_tokens(info) if info.opening is not None else 1
        best: Backend | None = None
        best_key: tuple[int, float] = (0, 0.0)
        for backend in under:
            tokens = held.tokens(backend, info)
            block = held.index.block_size(backend.url) or 0
            if tokens <= 0 or tokens < need - block:
                continue
            tie = (self.conversation_order.weight(backend, info.opening) / 2.0 ** 64 if info.opening is not None
                   else -backend.estimated_load())
            key = (tokens, tie)
            if best is None or key > best_key:
                best, best_key = backend, key
        return best

    def forget(self, backend: Backend) -> None:
        super().forget(backend)
        self.adapter_order.forget(backend)
        self.conversation_order.forget(backend)


def round_robin() -> Profile:
    """Each request to the next engine in turn. Blind to load and to request size; the baseline."""
    return Scored("round-robin", picker=RoundRobin())


def least_pending() -> Profile:
    """The engine with the lowest load score: the router's own in-flight count (exact, immediate) plus the
    engine's scraped queue and KV-cache fill (lagging, but they see other routers' traffic). Ties rotate."""
    return Scored("least-pending", scorers=[Weighted(LeastLoad())])


def session() -> Profile:
    """Consistent hashing of a session key onto a ring, so a conversation returns to the engine holding its KV
    cache; an engine above the bounded-load limit is skipped for the next on the ring. No key: least-pending."""
    ring = SessionRing()
    return Scored("session", filters=[UnderLoadBound()], scorers=[Weighted(ring)], required=ring,
                  fallback=least_pending())


def prefix_aware() -> Profile:
    """The engine this router sent the longest leading run of the prompt's blocks, among engines under the
    bounded-load limit (ties to the less loaded); without a match, least-pending."""
    prefixes = SentPrefixes()
    match = PrefixMatch(prefixes)
    # The load only orders engines of equal match: a match differs by at least 1/PREFIX_MAX_BLOCKS.
    return Scored("prefix-aware", filters=[UnderLoadBound()],
                  scorers=[Weighted(match), Weighted(LeastLoad(), 1e-3)], required=match,
                  picker=MaxScore(rotate=False), fallback=least_pending(), prefixes=prefixes)


PROFILES: Mapping[str, Callable[[], Profile]] = {
    "round-robin": round_robin,
    "least-pending": least_pending,
    "session": session,
    "prefix-aware": prefix_aware,
    "cache-aware": CacheAware,
}


def make_profile(name: str) -> Profile:
    try:
        return PROFILES[name]()
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; one of {', '.join(PROFILES)}") from None
