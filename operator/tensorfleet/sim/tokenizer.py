"""A cheap, deterministic stand-in for a BPE tokenizer.

Real tokenizers average about four characters of English per token; this one
splits text into runs of at most four letters or three digits (with the
leading space attached, as BPE vocabularies do), single punctuation marks and
whitespace runs (leaving the last space to the word after it, as GPT-2's
pattern does, so text re-tokenizes the same wherever it is embedded: an
answer sent back in the next turn's prompt gives the tokens generated), which
lands close to that. No vocabulary or weights are
loaded. The simulator only needs counts and stable pieces to hash into
prefix-cache blocks, so pieces stay strings rather than ids. The chat template
it tokenizes is tensorfleet.prompts.render_chat.
"""

from __future__ import annotations

import re

_PIECES = re.compile(r" ?[^\W\d_]{1,4}| ?\d{1,3}| ?[^\w\s]|\s+(?!\S)|\s+|_")


def tokenize(text: str) -> list[str]:
    return _PIECES.findall(text)


def count_tokens(text: str) -> int:
    return len(_PIECES.findall(text))
