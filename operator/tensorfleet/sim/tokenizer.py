"""A cheap, deterministic stand-in for a BPE tokenizer.

Real tokenizers average about four characters of English per token; this one
splits text into runs of at most four letters or three digits (with the
leading space attached, as BPE vocabularies do), single punctuation marks and
whitespace runs (leaving the last space to the word after it, as GPT-2's
pattern does, so text re-tokenizes the same wherever it is embedded: an
answer sent back in the next turn's prompt gives the tokens generated), which
lands close to that. No vocabulary or weights are
loaded. The simulator only needs counts and stable pieces to hash into
prefix-cache blocks, so pieces stay strings rather than ids.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_PIECES = re.compile(r" ?[^\W\d_]{1,4}| ?\d{1,3}| ?[^\w\s]|\s+(?!\S)|\s+|_")

# Chat template markers: a few tokens per message, like Llama 3's header ids.
_ROLE_OPEN = "<|start|>"
_ROLE_CLOSE = "<|end|>"


def tokenize(text: str) -> list[str]:
    return _PIECES.findall(text)


def count_tokens(text: str) -> int:
    return len(_PIECES.findall(text))


def _content_text(content: Any) -> str:
    """Text of an OpenAI message `content`: a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Iterable):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return str(content)


def render_chat(messages: Iterable[Mapping[str, Any]]) -> str:
    """The prompt a chat template would build, ending with the assistant header."""
    parts = [f"{_ROLE_OPEN}{m.get('role', 'user')}\n{_content_text(m.get('content'))}{_ROLE_CLOSE}\n" for m in messages]
    parts.append(f"{_ROLE_OPEN}assistant\n")
    return "".join(parts)
