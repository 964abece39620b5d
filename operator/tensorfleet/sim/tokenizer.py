"""A cheap, deterministic stand-in for a BPE tokenizer: pieces of about four characters, each piece's id the CRC-32
of its UTF-8 modulo the simulated model's vocabulary size, the same in every process. Design:
docs/simulator.md#tokens."""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable

# Runs of at most four letters or three digits (the leading space attached, as BPE vocabularies do), single
# punctuation marks, and whitespace runs that leave their last space to the word after them (GPT-2's pattern), so
# text tokenizes the same wherever it is embedded: an answer sent back in the next turn gives the tokens generated.
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
