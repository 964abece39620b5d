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
prefix-aware  the whole rendered prompt is hashed in blocks (below), each hash
              covering everything before it; the router remembers, per engine, the
              block hashes it sent there recently (an LRU sized from the engine's
              KV-cache capacity, scraped from vllm:cache_config_info). The engine
              holding the longest leading run of the prompt's blocks wins, among
              engines under the same 1.25x-average load bound; without a match,
              least-pending.
cache-aware   (the default) stays on the engine that holds the conversation's
              KV cache until that engine is saturated, then routes by load:
              - load is every router's, not this one's alone: the router's own
                in-flight requests plus what the engine held beyond them at the
                last scrape (the other replicas'), plus its KV-cache fill;
              - an engine is saturated above the bounded-load limit (1.25x the
                average plus two) or at the per-engine ceiling;
              - the conversation's home is chosen by rendezvous hashing of its
                opening (the rendered prompt through the first user message,
                which every later turn repeats) over the engines, so every
                router replica sends a conversation to the same engine with no
                shared state, and only the conversations of an engine that
                comes or goes move; a saturated home passes the request to the
                next engine in the same order;
              - a first turn (no engine holds the conversation yet) goes to an
                engine with room for its KV (`has_room`: the cache below
                KV_HIGH_WATER by the engine's last scrape and by the prompts in
                flight there), and there home unless the home has more prompt
                to compute ahead of it than the least busy engine, by
                HOME_SLACK_CHARS: its first token waits
                for that work (prompt characters of this router's requests
                there that have no first byte back, less the blocks this router
                sent the engine before), so a new conversation is not queued
                behind long prefills while another engine is free;
              - where this router has sent a longer run of the prompt's blocks
                to another engine (the conversation spilled over there), that
                engine wins; a prompt that is not a chat goes where its longest
                prefix was sent, else to the least-loaded engine.

Prompt hashing (prefix-aware, cache-aware): the prompt as the engine's chat
template renders it (tensorfleet.prompts), UTF-8, in blocks of BLOCK_CHARS
characters' worth of bytes, a whole multiple of the engines' KV block (16
tokens unless vllm:cache_config_info says otherwise, at about four characters
a token; the router has no tokenizer, so the alignment is by estimate). Each
block's hash is the CRC-32 of the whole prompt up to its end: stable across
processes, so router replicas agree, and cheap (one C call per block). A
forged collision can only move a request between engines, within the load
bound.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from tensorfleet.router.backends import Backend

LOAD_BOUND = 1.25          # bounded-load factor c: an engine may hold c x the average
LOAD_SLACK = 2             # ... plus this many requests
VIRTUAL_NODES = 100        # ring points per engine; spreads keys within ~10%
CHARS_PER_TOKEN = 4
DEFAULT_KV_BLOCK_TOKENS = 16   # vLLM's default --block-size
# Each block costs a few steps of Python per request (its hash, its match, its place in the index), so a block is
# coarser than the engine's: on an 8.5 KB conversation the default cost 21% more router CPU than least-pending with
# 128-character blocks, 17% with 256 (benchmarks/README.md, section 7), and the part of a prompt an engine holds is
# still known within 64 tokens.
MIN_BLOCK_CHARS = 256
PREFIX_BLOCK_CHARS = MIN_BLOCK_CHARS  # ~64 tokens of English per block: four default KV blocks
PREFIX_MAX_BLOCKS = 256        # hash at most the first 256 blocks (64k characters at the default)
DEFAULT_INDEX_BLOCKS = 8192    # per engine, until its KV capacity is scraped
# A conversation's first turn goes to its home unless the home has this much more prompt to compute ahead of
# it than the least busy engine (about 512 tokens: a short prompt's prefill).
HOME_SLACK_CHARS = 2048
# An engine's KV-cache fill (0-1) at or above which it has no room for a new conversation (cache-aware), and its
# admission limit comes down (dispatch.py): past it vLLM evicts every idle conversation's cache, then preempts.
KV_HIGH_WATER = 0.9
_MASK64 = (1 << 64) - 1
# Versions of the prefix indexes, unique across strategies: a prefix match remembered under one is stale under any other.
_EPOCHS = itertools.count()


@dataclass
class RequestInfo:
    """What strategies may know about a request, parsed once."""

    session_key: str | None = None
    prefix_hashes: list[int] = field(default_factory=list)
    # The conversation's opening (through its first user message): its hash, and the whole blocks inside it.
    opening: int | None = None
    opening_blocks: int = 0
    # The rendered prompt's length in characters, and whether the chat goes on past its opening (an assistant
    # turn, or more, after the first user message): a first turn's KV is on no engine yet.
    prompt_chars: int = 0
    continues: bool = False
    # Prompt characters charged to the engine picked for this request (dispatch.py): its uncached part until its
    # first byte (prefill), all of it until it ends (context).
    prefill_charge: float = 0.0
    context_charge: float = 0.0
    # Whether the prompt counts in its engine's prompt queue (dispatch.py): its answer is streamed, so its first
    # token comes back as soon as the prompt is computed, and the engine computes it (a disaggregated request's
    # KV comes from a prefill engine instead). queue_charge: the part of prefill_charge counted there.
    queues_prompt: bool = False
    queue_charge: float = 0.0
    # Each engine's run of the prompt's leading blocks (by URL), computed once for a pick and the charge that
    # follows it; valid while the strategy's index is as it was (`matches_epoch`, see PrefixAware.match).
    matches: dict[str, int] = field(default_factory=dict)
    matches_epoch: int = -1
    # A LoRA adapter's name, hashed: cache-aware keeps an adapter on the engines that hold it.
    adapter: int | None = None
    # The engines that list that adapter (their URLs), when the router knows: every strategy sends the request
    # to one of them while any is routable, not to an engine that would answer 404 (one just started, say,
    # before the operator loaded its adapters). None: any engine.
    hosts: frozenset[str] | None = None


def _stable_hash(text: str) -> int:
    # Stable across processes, so every router replica maps a session alike
    # (Python's str hash is salted per process).
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def block_chars(kv_block_tokens: int | None) -> int:
    """Characters per hashed block: a whole number of the engines' KV blocks, at least MIN_BLOCK_CHARS."""
    per_block = CHARS_PER_TOKEN * (kv_block_tokens or DEFAULT_KV_BLOCK_TOKENS)
    return per_block * max(1, -(-MIN_BLOCK_CHARS // per_block))


def hash_prompt(text: str, opening: int | None = None, block: int = PREFIX_BLOCK_CHARS,
                max_blocks: int = PREFIX_MAX_BLOCKS) -> tuple[list[int], int | None, int]:
    """(hashes of the prompt's full blocks, each the CRC-32 of everything up to its end; the hash of its first
    OPENING characters, None without; how many full blocks lie inside those)."""
    data = text.encode()
    end = min(len(data), block * max_blocks)
    out: list[int] = []
    append, crc = out.append, zlib.crc32   # the loop runs per block of every prompt: no attribute lookups
    h = 0
    for start in range(0, end - block + 1, block):
        h = crc(data[start:start + block], h)
        append(h)
    if opening is None or opening <= 0:
        return out, None, 0
    if opening >= len(text):
        cut = len(data)
    else:   # the opening's length in bytes: its length in characters when the prompt is ASCII (a flag, no scan)
        cut = opening if text.isascii() else len(text[:opening].encode())
    inside = min(cut // block, len(out))
    return out, crc(data[inside * block:cut], out[inside - 1] if inside else 0), inside


def prefix_hashes(text: str) -> list[int]:
    """Hashes of the full PREFIX_BLOCK_CHARS blocks of `text` (at most PREFIX_MAX_BLOCKS), each over everything
    before it too."""
    return hash_prompt(text)[0]


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit value from any integer (for rendezvous scores)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def has_room(backend: Backend, info: RequestInfo) -> bool:
    """Whether BACKEND's KV cache has room for the request's prompt: at its last scrape below KV_HIGH_WATER, and the
    prompts in flight there (every router replica's, as they last told) with this one below KV_HIGH_WATER of its
    capacity. An engine whose cache is full keeps only the running requests' blocks: it evicts the idle
    conversations' caches, whose next turns then compute their whole history again, and it holds new requests
    until blocks free. True while its capacity is unknown."""
    if not backend.kv_cache_tokens:
        return True
    if backend.kv_usage >= KV_HIGH_WATER:
        return False
    context = backend.context_chars + backend.peer_context_chars + info.prompt_chars
    return context < KV_HIGH_WATER * backend.kv_cache_tokens * CHARS_PER_TOKEN


def _own_requests(backend: Backend) -> float:
    return backend.in_flight


def _all_requests(backend: Backend) -> float:
    """Requests on the engine from every router replica: ours (exact) and the others' (as last scraped)."""
    return backend.in_flight + backend.others


def _bound(routable: Sequence[Backend], requests: Callable[[Backend], float] = _own_requests) -> float:
    """Most requests (as REQUESTS counts them) one engine may hold under bounded load.

    The paper's ceil(c x average) alone would forbid a second request on an
    idle fleet (average 0.5 -> bound 1), trading away affinity where load
    costs nothing; a small absolute slack keeps affinity at low load.
    """
    total = sum(requests(b) for b in routable) + 1
    return math.ceil(LOAD_BOUND * total / max(len(routable), 1)) + LOAD_SLACK


def _least_loaded(backends: Sequence[Backend], counter: Iterator[int], load: Callable[[Backend], float]) -> Backend:
    """The backend with the lowest LOAD. The scan starts at a rotating offset and the first minimum wins, so ties
    go to each engine in turn instead of always to the first."""
    n = len(backends)
    if n == 1:
        return backends[0]
    start = next(counter) % n
    best = backends[start]
    best_load = load(best)
    for i in range(1, n):
        backend = backends[(start + i) % n]
        value = load(backend)
        if value < best_load:
            best, best_load = backend, value
    return best


class Strategy:
    name = "base"
    needs_prefix = False
    places_by_prefill = False   # reads Backend.prefill_chars: the dispatcher charges each request's prompt to it
    orders_queue = False        # the dispatcher offers a free slot to the waiter with the least prefill_cost first
    block_chars = PREFIX_BLOCK_CHARS   # for strategies that need the prompt's block hashes

    def align(self, kv_block_sizes: Iterable[int | None]) -> None:
        """Called after each round of health checks with the engines' KV block sizes, as scraped."""

    def pick(self, candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> Backend:
        raise NotImplementedError

    def routed(self, backend: Backend, info: RequestInfo) -> None:
        """Called once a request is sent to `backend`."""

    def learn(self, backend: Backend, hashes: Sequence[int], opening: int | None) -> None:
        """Called when another router replica sent a prompt (its block HASHES, its conversation's OPENING) to
        `backend` (router/peers.py): strategies that index prompts take it in as if routed here."""

    def prefill_cost(self, backend: Backend, info: RequestInfo) -> float:
        """Prompt characters `backend` would compute for this request: all of them, as far as this strategy knows."""
        return info.prompt_chars

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
        return _least_loaded(candidates, self._counter, Backend.load)


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
        self._epoch = next(_EPOCHS)   # a new one whenever _index changes (match)

    def capacity(self, backend: Backend) -> int:
        if backend.kv_cache_tokens:
            return max(backend.kv_cache_tokens * CHARS_PER_TOKEN // self.block_chars, 1)
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

    def match(self, backend: Backend, info: RequestInfo) -> int:
        """`matched` for this request's prompt, remembered on `info` until this index next changes."""
        memo = info.matches
        if info.matches_epoch != self._epoch:
            memo.clear()
            info.matches_epoch = self._epoch
        count = memo.get(backend.url)
        if count is None:
            count = memo[backend.url] = self.matched(backend, info.prefix_hashes)
        return count

    def prefill_cost(self, backend: Backend, info: RequestInfo) -> float:
        """Prompt characters beyond the leading blocks this router sent to `backend` (which it may hold cached)."""
        if not info.prompt_chars:
            return 0.0
        return max(info.prompt_chars - self.match(backend, info) * self.block_chars, 0)

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

    def align(self, kv_block_sizes: Iterable[int | None]) -> None:
        # The engines of one service share their block size; the most common one wins if they do not.
        counts = Counter(size for size in kv_block_sizes if size)
        wanted = block_chars(counts.most_common(1)[0][0] if counts else None)
        if wanted != self.block_chars:
            self.block_chars = wanted
            self._index.clear()  # hashes of other block sizes never match again
            self._epoch = next(_EPOCHS)

    def routed(self, backend: Backend, info: RequestInfo) -> None:
        self.learn(backend, info.prefix_hashes, info.opening)

    def learn(self, backend: Backend, hashes: Sequence[int], opening: int | None) -> None:
        self._epoch = next(_EPOCHS)   # (CacheAware adds the opening after this)
        if not hashes:
            return
        index = self._index.setdefault(backend.url, OrderedDict())
        # Head last, so it is the most recently used: the engine frees a
        # prompt's tail blocks first, and the head is what other prompts share.
        touch = index.move_to_end
        for h in reversed(hashes):
            if h in index:
                touch(h)
            else:
                index[h] = None   # a new key goes in last
        capacity = self.capacity(backend)
        while len(index) > capacity:
            index.popitem(last=False)

    def forget(self, backend: Backend) -> None:
        self._index.pop(backend.url, None)
        self._epoch = next(_EPOCHS)


class CacheAware(PrefixAware):
    name = "cache-aware"
    places_by_prefill = True
    orders_queue = True

    def __init__(self) -> None:
        super().__init__()
        self._counter = itertools.count()
        self._salts: dict[str, int] = {}

    def _salt(self, url: str) -> int:
        salt = self._salts.get(url)
        if salt is None:
            salt = self._salts[url] = _stable_hash(url)
        return salt

    def _least(self, backends: Sequence[Backend]) -> Backend:
        """The least-loaded engine (every router's load); ties rotate."""
        return _least_loaded(backends, self._counter, Backend.estimated_load)

    def pick(self, candidates: Sequence[Backend], routable: Sequence[Backend], info: RequestInfo) -> Backend:
        bound = _bound(routable, _all_requests)
        under = [b for b in candidates if _all_requests(b) + 1 <= bound]
        if not under:
            return self._least(candidates)
        if info.adapter is not None:
            # A LoRA adapter's requests: its home engine by rendezvous, the next in its order once that is past the
            # load bound, so a cold adapter sits in one engine's slots and a hot one spreads as far as its load.
            adapter = info.adapter
            return max(under, key=lambda b: _mix(adapter ^ self._salt(b.url)))
        hashes = info.prefix_hashes
        opening = info.opening
        if opening is None:
            # Not a chat: where the longest run of the prompt's blocks went, else the least loaded.
            best: Backend | None = None
            best_key = (0, 0.0)
            for backend in under:
                match = self.match(backend, info) if hashes else 0
                key = (match, -backend.estimated_load())
                if match and (best is None or key > best_key):
                    best, best_key = backend, key
            return best if best is not None else self._least(under)
        # Where this router already sent the conversation (its home, or where it spilled over to): the engine
        # holding the longest run of it.
        sent: Backend | None = None
        sent_match = -1
        for backend in under:
            index = self._index.get(backend.url)
            if index is not None and opening in index:
                match = self.match(backend, info)
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
            costs = [(b.prefill_chars + b.peer_prefill_chars + self.prefill_cost(b, info), b) for b in roomy]
            least = min(cost for cost, _ in costs) + HOME_SLACK_CHARS
            return max((b for cost, b in costs if cost <= least), key=lambda b: _mix(opening ^ self._salt(b.url)))
        # A later turn of a conversation new to this router (another replica served its start): its home by
        # rendezvous, or the next engine in its order.
        return max(under, key=lambda b: _mix(opening ^ self._salt(b.url)))

    def learn(self, backend: Backend, hashes: Sequence[int], opening: int | None) -> None:
        super().learn(backend, hashes, opening)
        if opening is not None:
            index = self._index.setdefault(backend.url, OrderedDict())
            index[opening] = None
            index.move_to_end(opening)

    def forget(self, backend: Backend) -> None:
        super().forget(backend)
        self._salts.pop(backend.url, None)


STRATEGIES: Mapping[str, type[Strategy]] = {
    cls.name: cls for cls in (RoundRobin, LeastPending, Session, PrefixAware, CacheAware)
}


def make_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; one of {', '.join(STRATEGIES)}") from None
