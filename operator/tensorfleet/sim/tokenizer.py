"""A cheap, deterministic stand-in for a BPE tokenizer.

Real tokenizers average about four characters of English per token; this one
splits text into runs of at most four letters or three digits (with the
leading space attached, as BPE vocabularies do), single punctuation marks and
whitespace runs (leaving the last space to the word after it, as GPT-2's
pattern does, so text re-tokenizes the same wherever it is embedded: an
answer sent back in the next turn's prompt gives the tokens generated), which
lands close to that. No vocabulary or weights are loaded: a piece's id is the
CRC-32 of its UTF-8 modulo the simulated model's vocabulary size (the
catalog's `vocabSize` for the model, `Profile.vocab_size`), the same in every
process. The ids are what the simulator hashes into its prefix-cache blocks,
publishes in its KV events and answers `/tokenize` with
(docs/real-engine.md#the-simulator-held-to-real-vllm). The chat template it tokenizes is
tensorfleet.prompts.render_chat.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable

_PIECES = re.compile(r" ?[^\W\d_]{1,4}| ?\d{1,3}| ?[^\w\s]|\s+(?!\S)|\s+|_")


def tokenize(text: str) -> list[str]:
    return _PIECES.findall(text)


def count_tokens(text: str) -> int:
    return len(_PIECES.findall(text))


def token_id(piece: str, vocab_size: int) -> int:
    """PIECE's id: stable across processes (Python's own str hash is salted per process)."""
    return zlib.crc32(piece.encode()) % vocab_size


def token_ids(pieces: Iterable[str], vocab_size: int) -> list[int]:
    return [zlib.crc32(piece.encode()) % vocab_size for piece in pieces]
