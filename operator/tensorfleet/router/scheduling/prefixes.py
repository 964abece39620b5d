"""The router's memory of which prompt blocks it sent to each engine (and, for conversations, their openings):
per engine an LRU as large as the engine's KV cache, which the prefix scorer reads as "what the engine may
hold". Router replicas feed each other's placements in (router/peers.py). Design: docs/routing.md.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from tensorfleet.router.backends import Backend
from tensorfleet.router.scheduling.hashing import CHARS_PER_TOKEN, PREFIX_BLOCK_CHARS, block_chars
from tensorfleet.router.scheduling.request import RequestInfo

DEFAULT_INDEX_BLOCKS = 8192    # per engine, until its KV capacity is scraped
# Versions of the memories, unique across instances: a prefix match remembered under one is stale under any other.
_EPOCHS = itertools.count()


class SentPrefixes:
    """Per engine (by URL), the block hashes sent there lately, most recent last; with OPENINGS, each
    conversation's opening hash too (the engine its turns went to)."""

    def __init__(self, openings: bool = False) -> None:
        self.openings = openings
        self.block_chars = PREFIX_BLOCK_CHARS
        self._index: dict[str, OrderedDict[int, None]] = {}
        self._epoch = next(_EPOCHS)   # a new one whenever _index changes (match)

    def capacity(self, backend: Backend) -> int:
        tokens = backend.engine.kv_cache_tokens
        if tokens:
            return max(tokens * CHARS_PER_TOKEN // self.block_chars, 1)
        return DEFAULT_INDEX_BLOCKS

    def matched(self, backend: Backend, hashes: Sequence[int]) -> int:
        """How many of HASHES' leading blocks were sent to BACKEND."""
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
        """`matched` for this request's prompt, remembered on `info` until this memory next changes."""
        memo = info.matches
        if info.matches_epoch != self._epoch:
            memo.clear()
            info.matches_epoch = self._epoch
        count = memo.get(backend.url)
        if count is None:
            count = memo[backend.url] = self.matched(backend, info.prefix_hashes)
        return count

    def blocks(self, backend: Backend) -> int:
        """Hashes remembered for BACKEND (blocks and openings)."""
        return len(self._index.get(backend.url) or ())

    def holds_opening(self, backend: Backend, opening: int) -> bool:
        index = self._index.get(backend.url)
        return index is not None and opening in index

    def uncached_chars(self, backend: Backend, info: RequestInfo) -> float:
        """Prompt characters beyond the leading blocks sent to BACKEND (which it may hold cached)."""
        if not info.prompt_chars:
            return 0.0
        return max(info.prompt_chars - self.match(backend, info) * self.block_chars, 0)

    def align(self, kv_block_sizes: Iterable[int | None]) -> None:
        # The engines of one service share their block size; the most common one wins if they do not.
        counts = Counter(size for size in kv_block_sizes if size)
        wanted = block_chars(counts.most_common(1)[0][0] if counts else None)
        if wanted != self.block_chars:
            self.block_chars = wanted
            self._index.clear()  # hashes of other block sizes never match again
            self._epoch = next(_EPOCHS)

    def learn(self, backend: Backend, hashes: Sequence[int], opening: int | None) -> None:
        self._epoch = next(_EPOCHS)
        if hashes:
            index = self._index.setdefault(backend.url, OrderedDict())
            # Head last, so it is the most recently used: the engine frees a prompt's tail blocks first, and the
            # head is what other prompts share.
            touch = index.move_to_end
            for h in reversed(hashes):
                if h in index:
                    touch(h)
                else:
                    index[h] = None   # a new key goes in last
            capacity = self.capacity(backend)
            while len(index) > capacity:
                index.popitem(last=False)
        if self.openings and opening is not None:
            index = self._index.setdefault(backend.url, OrderedDict())
            index[opening] = None
            index.move_to_end(opening)

    def forget(self, backend: Backend) -> None:
        self._index.pop(backend.url, None)
        self._epoch = next(_EPOCHS)
