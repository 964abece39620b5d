"""Which engine holds which KV-cache blocks, as the engines themselves report it (vLLM's KV events: BlockStored,
BlockRemoved, AllBlocksCleared), and the longest leading run of a prompt's blocks each engine holds. Pure: the events
come in through router/kvevents.py. Blocks are keyed by their content, not by vLLM's hash, so any vLLM release reads
alike. Design: docs/routing.md#the-kv-cache-index.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

Key = int
# The tiers a block lives on that count as held: the GPU's (None from releases that do not say).
HELD_MEDIA = frozenset({None, "GPU"})


def block_keys(token_ids: Sequence[int], block_size: int, adapter: str | None = None,
               parent: Key | None = None) -> Iterable[Key]:
    """The content keys of the whole blocks of `token_ids` (a partial last block has none), each covering
    every token before it, lazily: a lookup stops at the first block no engine holds."""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size]), adapter))
        yield parent


@dataclass
class _Engine:
    block_size: int | None = None
    keys: dict[Hashable, Key] = field(default_factory=dict)   # the engine's block hash -> content key
    orphans: int = 0   # blocks stored under a parent this index never saw (events lost before it started)


class KVIndex:
    """Per engine, the blocks it holds; per block, the engines holding it."""

    def __init__(self) -> None:
        self._engines: dict[str, _Engine] = {}
        self._holders: dict[Key, dict[str, int]] = {}
        self.version = 0   # moves on every change: a lookup remembered under another version is stale

    def stored(self, engine: str, block_hashes: Sequence[Hashable], parent: Hashable | None,
               token_ids: Sequence[int], block_size: int, adapter: str | None = None) -> None:
        """BlockStored: the engine cached these full blocks, the first following `parent` (None: the
        prompt's first block)."""
        self.version += 1
        state = self._engines.setdefault(engine, _Engine())
        state.block_size = block_size
        parent_key: Key | None = None
        if parent is not None:
            known = state.keys.get(parent)
            if known is None:
                state.orphans += len(block_hashes)
                return
            parent_key = known
        keys = block_keys(token_ids, block_size, adapter, parent_key)
        for block_hash, key in zip(block_hashes, keys, strict=False):
            old = state.keys.get(block_hash)
            if old == key:
                continue
            if old is not None:
                self._release(engine, old)
            state.keys[block_hash] = key
            holders = self._holders.setdefault(key, {})
            holders[engine] = holders.get(engine, 0) + 1

    def removed(self, engine: str, block_hashes: Iterable[Hashable]) -> None:
        """BlockRemoved: the engine evicted these blocks."""
        self.version += 1
        state = self._engines.get(engine)
        if state is None:
            return
        for block_hash in block_hashes:
            key = state.keys.pop(block_hash, None)
            if key is not None:
                self._release(engine, key)

    def cleared(self, engine: str) -> None:
        """AllBlocksCleared, a restarted engine, or a stream the index lost track of: the engine holds nothing
        the index knows of."""
        self.version += 1
        state = self._engines.get(engine)
        if state is None:
            return
        for key in state.keys.values():
            self._release(engine, key)
        state.keys.clear()

    def forget(self, engine: str) -> None:
        """The engine left the pool."""
        self.cleared(engine)
        self._engines.pop(engine, None)

    def _release(self, engine: str, key: Key) -> None:
        holders = self._holders[key]
        count = holders[engine] - 1
        if count:
            holders[engine] = count
            return
        del holders[engine]
        if not holders:
            del self._holders[key]

    def blocks(self, engine: str) -> int:
        state = self._engines.get(engine)
        return len(state.keys) if state else 0

    def held(self, engine: str) -> frozenset[Key]:
        """The content keys of the blocks the engine holds (keys are this process's own)."""
        state = self._engines.get(engine)
        return frozenset(state.keys.values()) if state else frozenset()

    def orphans(self, engine: str) -> int:
        state = self._engines.get(engine)
        return state.orphans if state else 0

    def block_size(self, engine: str) -> int | None:
        state = self._engines.get(engine)
        return state.block_size if state else None

    def engines(self) -> list[str]:
        return list(self._engines)

    def match(self, token_ids: Sequence[int], adapter: str | None = None,
              engines: Iterable[str] | None = None) -> dict[str, int]:
        """Per engine (of `engines`, default all known), how many leading whole blocks of the prompt it holds;
        engines holding none are left out."""
        by_size: dict[int, set[str]] = {}
        for engine in self._engines if engines is None else engines:
            size = self.block_size(engine)
            if size:
                by_size.setdefault(size, set()).add(engine)
        found: dict[str, int] = {}
        for size, group in by_size.items():
            alive = group
            for depth, key in enumerate(block_keys(token_ids, size, adapter), start=1):
                holders = self._holders.get(key)
                alive = {engine for engine in alive if holders and engine in holders}
                if not alive:
                    break
                for engine in alive:
                    found[engine] = depth
        return found
