"""The router's hashes of prompts and keys: the prompt in blocks, each hash covering everything before it (for
prefix matching without a tokenizer), and stable 64-bit hashes for session rings and rendezvous orders, alike
in every router replica. Design: docs/routing.md.
"""

from __future__ import annotations

import hashlib
import zlib

CHARS_PER_TOKEN = 4
DEFAULT_KV_BLOCK_TOKENS = 16   # vLLM's default --block-size
# Each block costs a few steps of Python per request (its hash, its match, its place in the index), so a block is
# coarser than the engine's: on an 8.5 KB conversation the default cost 21% more router CPU than least-pending with
# 128-character blocks, 17% with 256 (benchmarks/README.md, section 7), and the part of a prompt an engine holds is
# still known within 64 tokens.
MIN_BLOCK_CHARS = 256
PREFIX_BLOCK_CHARS = MIN_BLOCK_CHARS  # ~64 tokens of English per block: four default KV blocks
PREFIX_MAX_BLOCKS = 256        # hash at most the first 256 blocks (64k characters at the default)
_MASK64 = (1 << 64) - 1


def stable_hash(text: str) -> int:
    # Stable across processes, so every router replica maps a session alike (Python's str hash is salted per
    # process).
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def mix(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit value from any integer (for rendezvous scores)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


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
