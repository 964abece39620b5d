"""Stream resumption, the request side: which streamed requests may go on from another engine should theirs
break after part of the answer reached the client, the usage the router asks a tracked stream's engine for, and,
after a break, the request for the rest of the same answer (a continuation, which forward.py sends) or, when
nothing is left to generate, the stream's end. What the stream was sent, and its tokens, are router/relay.py's and
router/tokencount.py's. Design: docs/routing.md#stream-resumption-and-token-accounting.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorfleet.router.relay import EVENT_END, RelayedStream

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MAX_BODY_BYTES = 1 << 20  # a resumable stream keeps its request body until it ends: a bound on that memory
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's /v1/completions default when the request has no max_tokens
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag", "structured_outputs")
# What the router asks every engine stream it tracks (a resumable one, or any with per-key token limits) for: the
# engine's own token counts on every event, which make a continuation's limits, the client's usage after a
# resumption and the key's token charge (tenants.UsageMeter) exact where counting events would not be.
USAGE_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
_USAGE_OPTIONS_JSON = json.dumps(USAGE_OPTIONS, separators=(",", ":")).encode()


def _unset(value: Any) -> bool:
    return value is None or value is False


def _count(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def resumable(path: str, body: Mapping[str, Any], size: int) -> bool:
    """Whether a request's stream may be continued on another engine should its engine break mid-stream. Not
    when a continuation would not be the same answer: several choices (`n` > 1, `best_of`), logprobs or
    prompt_logprobs (the sent tokens' would be missing), `echo`, a client's own `continue_final_message` or
    `add_generation_prompt: false`, guided decoding (response_format json, guided_*, structured outputs, a forced
    tool_choice: the grammar restarts), a completions prompt of token ids or of several prompts, `suffix`; nor a
    body over MAX_BODY_BYTES (kept in memory for the whole stream). A stream that sends tool calls, reasoning or
    anything the router cannot parse is blocked later, as it is relayed (RelayedStream.blocked)."""
    if path not in (CHAT_PATH, COMPLETIONS_PATH) or body.get("stream") is not True or size > MAX_BODY_BYTES:
        return False
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or not _unset(body.get("echo")):
        return False
    if not _unset(body.get("use_beam_search")) or body.get("prompt_logprobs") is not None:
        return False
    if not all(_count(body.get(name)) for name in ("max_tokens", "max_completion_tokens", "min_tokens")):
        return False
    if any(body.get(name) is not None for name in _GUIDED):
        return False
    response_format = body.get("response_format")
    if response_format is not None and not (isinstance(response_format, Mapping)
                                            and response_format.get("type") == "text"):
        return False
    if path == COMPLETIONS_PATH:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return isinstance(prompt, str) and body.get("logprobs") is None and body.get("suffix") is None
    messages = body.get("messages")
    tool_choice = body.get("tool_choice")
    return (isinstance(messages, list) and bool(messages) and all(isinstance(m, Mapping) for m in messages)
            and _unset(body.get("logprobs")) and _unset(body.get("continue_final_message"))
            and body.get("add_generation_prompt") in (None, True)
            and (tool_choice is None or tool_choice in ("auto", "none")))


def usage_asked(body: Mapping[str, Any]) -> tuple[bool, bool] | None:
    """The usage a streamed request's client asked for, as vLLM reads `stream_options`: (include_usage,
    continuous_usage_stats), the second only with the first. None when stream_options is not an object (the
    engine refuses the request: nothing to add to it)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, Mapping):
        return None
    include = bool(options.get("include_usage"))
    return include, include and bool(options.get("continuous_usage_stats"))


def ask_usage(raw: bytes | bytearray, body: Mapping[str, Any]) -> tuple[bytes, dict[str, Any]] | None:
    """RAW, the bytes of the streamed request BODY, asking the engine for its usage on every event
    (USAGE_OPTIONS, with the client's other stream_options), and the stream_options that says; None when it asks
    already. Without stream_options in the body the bytes are spliced (the object's end), not serialised again."""
    options = body.get("stream_options")
    merged = {**(options or {}), **USAGE_OPTIONS}
    if options == merged:
        return None
    data = bytes(raw).rstrip()
    if "stream_options" not in body and data.endswith(b"}"):
        return data[:-1] + b',"stream_options":' + _USAGE_OPTIONS_JSON + b"}", merged
    return json.dumps({**body, "stream_options": merged}, ensure_ascii=False, separators=(",", ":")).encode(), merged


@dataclass(eq=False)
class StreamState(RelayedStream):
    """A relayed stream (RelayedStream: what it was sent, its tokens) that may go on from another engine should
    its engine break: the request it continues, the engines it broke on, how often it was resumed; after a break,
    whether anything is left to generate, the continuation's request, or the stream's end. A stream that may not
    be resumed (`resumable` False) is tracked all the same, for its usage."""

    body: bytes | bytearray = field(kw_only=True)  # the client's request, as sent to the engine
    resumable: bool = True
    resumptions: int = 0
    failed: set[str] = field(default_factory=set)  # engines it broke on: never resumed there

    @classmethod
    def start(cls, path: str, body: bytes | bytearray, *, resumable: bool = True,
              usage: tuple[bool, bool] = (False, False), added: bool = False) -> StreamState:
        state = cls(chat=path == CHAT_PATH, body=body, resumable=resumable, usage=usage, added=added)
        if not resumable:
            state.blocked = "not resumable"
        return state

    @property
    def complete(self) -> bool:
        """Nothing is left to generate: the answer's end (finish_reason or [DONE]) was sent already."""
        return self.finished or self.done

    def continuation_body(self) -> dict[str, Any] | None:
        """The request for the rest of the answer, on another engine; None when the tokens sent already reach
        the request's max_tokens. Completions: the prompt + the text already sent. Chat: the messages + an
        assistant message holding the content already sent, with vLLM's `continue_final_message: true` and
        `add_generation_prompt: false`. Either with max_tokens (chat: max_completion_tokens when given) and
        min_tokens less the tokens already sent."""
        body = json.loads(self.body)
        # A disaggregated request's KV was read by the engine that broke: the next one computes the prompt.
        body.pop("kv_transfer_params", None)
        text = "".join(self.text)
        sent = self.tokens if text else 0  # nothing shown: the answer starts over
        if self.chat:
            key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        else:
            key = "max_tokens"
            if key not in body:
                body[key] = COMPLETIONS_DEFAULT_MAX_TOKENS
        limit = body.get(key)
        if isinstance(limit, int):
            if limit - sent < 1:
                return None
            body[key] = limit - sent
        least = body.get("min_tokens")
        if isinstance(least, int) and least > 0:
            body["min_tokens"] = max(least - sent, 0)
        if self.chat:
            if text:
                body["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
        else:
            prompt = body["prompt"]
            body["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + text
        return body

    def ending(self) -> bytes:
        """The end of a stream whose answer was all sent but whose engine broke before its last events: the
        finish event if it was not sent (the tokens reached max_tokens: "length"), the usage event if the client
        asked for it and an engine counted the prompt, and [DONE]."""
        if self.done:
            return b""
        out = b""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if not self.finished:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            if self.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            event = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}
            out += b"data: " + json.dumps(event, separators=(",", ":")).encode() + EVENT_END
        if self.usage[0] and not self.usage_sent and self.prompt_tokens is not None:
            tokens = self.tokens
            usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": tokens,
                     "total_tokens": self.prompt_tokens + tokens}
            event = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [],
                     "usage": usage}
            out += b"data: " + json.dumps(event, separators=(",", ":")).encode() + EVENT_END
        return out + b"data: [DONE]" + EVENT_END
