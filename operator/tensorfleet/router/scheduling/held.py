"""What each engine really holds of a prompt, by the engines' own KV events (router/kvindex.py): the leading
tokens, in whole blocks, of the prompt's token ids. Every router replica reads the same events, so replicas
agree by construction. Design: docs/routing.md#the-kv-cache-index.
"""

from __future__ import annotations

from tensorfleet.router.backends import Backend
from tensorfleet.router.kvindex import KVIndex
from tensorfleet.router.scheduling.request import RequestInfo


class HeldPrefixes:
    def __init__(self, index: KVIndex) -> None:
        self.index = index

    def known(self, info: RequestInfo) -> bool:
        """Whether the request carries what a lookup needs (its token ids)."""
        return bool(info.token_ids)

    def tokens(self, backend: Backend, info: RequestInfo) -> int:
        """Leading prompt tokens BACKEND holds (0 when the request has no token ids), looked up once per index
        version for every engine at once."""
        if not info.token_ids:
            return 0
        if info.held_version != self.index.version:
            index = self.index
            info.held = {url: blocks * (index.block_size(url) or 0)
                         for url, blocks in index.match(info.token_ids, info.adapter_name).items()}
            info.held_version = index.version
        return info.held.get(backend.url, 0)

    def chars(self, backend: Backend, info: RequestInfo) -> float:
        """`tokens` in the prompt's own characters per token."""
        held = self.tokens(backend, info)
        if not held or not info.token_ids:
            return 0.0
        return held * info.prompt_chars / len(info.token_ids)

    def opening_tokens(self, info: RequestInfo) -> int:
        """The conversation's opening in tokens, at the prompt's own characters per token."""
        if not info.token_ids or not info.prompt_chars:
            return 0
        return info.opening_chars * len(info.token_ids) // info.prompt_chars
