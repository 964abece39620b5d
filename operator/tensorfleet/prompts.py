"""OpenAI request bodies as prompt text: a chat rendered as one chat template (the simulator's prompts and the
router's prompt blocks agree on it), a conversation's opening (the gateway's affinity key), and chained hashes of a
prompt's blocks. Design:
docs/routing.md#cache-aware-the-default."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Chat-template markers: a few tokens per message, like Llama 3's header ids.
ROLE_OPEN = "<|start|>"
ROLE_CLOSE = "<|end|>"


def content_text(content: Any) -> str:
    """Text of an OpenAI message `content`: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Iterable):
        return "".join(
            part["text"] for part in content
            if isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str)
        )
    return str(content)


def _render_message(message: Mapping[str, Any]) -> str:
    return f"{ROLE_OPEN}{message.get('role', 'user')}\n{content_text(message.get('content'))}{ROLE_CLOSE}\n"


GENERATION_PROMPT = f"{ROLE_OPEN}assistant\n"  # what a chat prompt ends with: the header the answer follows


def render_chat(messages: Iterable[Mapping[str, Any]]) -> str:
    """The prompt a chat template would build, ending with the assistant header."""
    parts = [_render_message(m) for m in messages if isinstance(m, Mapping)]
    parts.append(GENERATION_PROMPT)
    return "".join(parts)


def goes_on(text: str, opening: int | None) -> bool:
    """Whether a chat prompt (`prompt_text`) holds more than its opening (`opening_chars`): an answer, or any
    message, after the first user message, so an earlier turn of the conversation was served somewhere."""
    return opening is not None and len(text) - len(GENERATION_PROMPT) > opening


def opening_chars(body: Mapping[str, Any]) -> int | None:
    """How many leading characters of a chat request's prompt (`prompt_text`) run through its first user message:
    the opening every later turn of the conversation repeats word for word. None: not a chat, or no user message."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    count = 0
    for message in messages:
        if isinstance(message, Mapping):
            count += len(_render_message(message))
            if message.get("role") == "user":
                return count
    return None


def opening(body: Mapping[str, Any]) -> tuple[str, bool] | None:
    """A chat request's opening as `prompt_text` renders it (through its first user message), and whether the
    conversation goes on past it (a later turn); None: not a chat, or no user message. Reads only the opening's
    messages, however long the conversation."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    parts = []
    for index, message in enumerate(messages):
        if isinstance(message, Mapping):
            parts.append(_render_message(message))
            if message.get("role") == "user":
                return "".join(parts), index + 1 < len(messages)
    return None


def prompt_text(body: Mapping[str, Any]) -> str:
    """The prompt of a chat or completions request body as the engine will see it ("" when there is none)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return render_chat(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        return " ".join(map(str, first if isinstance(first, list) else prompt))
    return prompt if isinstance(prompt, str) else ""


def block_hashes(pieces: Sequence[Any], block_size: int, *, max_blocks: int | None = None) -> list[int]:
    """Chained hashes of the full `block_size` blocks of `pieces` (a str's characters, or tokens): each block's hash
    covers every block before it, so two prompts share a hash exactly as long as they share a prefix. Python's
    `hash` is salted per process: these compare within one process, never across processes."""
    out: list[int] = []
    h = 0
    end = len(pieces) if max_blocks is None else min(len(pieces), block_size * max_blocks)
    for start in range(0, end - block_size + 1, block_size):
        block = pieces[start:start + block_size]
        h = hash((h, block if isinstance(block, str) else tuple(block)))
        out.append(h)
    return out
