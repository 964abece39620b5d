"""Stream resumption: what the router needs to carry a broken stream over to another engine.

A streamed generation whose engine stalls or fails after some of its answer reached the client can go on
elsewhere as a continuation, a request for the rest of the same answer, when that is equivalent to letting the
first engine finish (app.py sends it; this module decides, tracks and rewrites):
  completions  the prompt + the text already sent, max_tokens (and min_tokens) less the tokens already sent;
  chat         the messages + an assistant message holding the content already sent, with vLLM's
               `continue_final_message: true` and `add_generation_prompt: false`, max_completion_tokens (or
               max_tokens, and min_tokens) likewise less what was sent.
The continuation's events reach the client rewritten to the first stream's `id`, `created` and `model`, without a
second role delta, and its usage (the final chunk with `stream_options.include_usage`, or every chunk with
`continuous_usage_stats`) counts the original prompt and every completion token the client got.

Not resumable (the client gets the SSE error event as before), because a continuation would not be the same
answer: several choices (`n` > 1, `best_of`), logprobs or prompt_logprobs (the sent tokens' would be missing),
`echo`, a client's own `continue_final_message` or `add_generation_prompt: false`, guided decoding
(response_format json, guided_*, structured outputs, a forced tool_choice: the grammar restarts), a completions
prompt of token ids or of several prompts, `suffix`, a body over MAX_BODY_BYTES (kept in memory for the whole
stream), and a stream that has sent tool calls, reasoning or anything the router cannot parse.

Tokens sent are counted one per event, as vLLM streams them (one event per engine step; a step that yields
several tokens, with speculative decoding, counts one), or exactly from `continuous_usage_stats` when the
client asked for it. An engine that breaks after the answer's last token (its finish event, or max_tokens
reached) leaves nothing to continue: the stream ends with the finish event and [DONE], without the usage chunk
that engine would have sent (no other engine knows the prompt's count).

Tracking costs a parse per event: plain token events (most of them) are read by their keys alone
(`StreamState._quick`, a few microseconds), the rest with json.loads; only a continuation's events are
rewritten.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from json.decoder import scanstring  # type: ignore[attr-defined]  # C-accelerated, untyped in typeshed
from typing import Any

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MAX_BODY_BYTES = 1 << 20  # a resumable stream keeps its request body until it ends: a bound on that memory
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's /v1/completions default when the request has no max_tokens
MAX_PENDING_BYTES = 1 << 20  # an unfinished event this long is not vLLM's: relay it, stop tracking the stream
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag", "structured_outputs")
# Keys that make an event more than a plain token event: parsed whole (resume.StreamState._quick).
_UNUSUAL = re.compile(r'"(?:usage|error|tool_calls|function_call|reasoning\w*)":|"logprobs":[\[{]')
_DATA = b"data:"
_DONE = b"[DONE]"
_EVENT_END = b"\n\n"


def _unset(value: Any) -> bool:
    return value is None or value is False


def _count(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def resumable(path: str, body: Mapping[str, Any], size: int) -> bool:
    """Whether a request's stream may be continued on another engine should its engine break mid-stream."""
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


@dataclass(eq=False)
class StreamState:
    """One client stream as relayed: what it has sent (text, tokens), its identity (`id`, `created`, `model`
    of its first engine's events), and the rewriting of a continuation's events into it.

    `feed` takes the bytes an engine sent and returns those to write to the client: whole events only (an
    unfinished one waits for its end, so a broken stream never leaves half an event for a continuation to
    follow), unchanged from the first engine, rewritten from a continuation."""

    chat: bool
    body: bytes | bytearray                  # the client's request, as sent
    text: list[str] = field(default_factory=list)
    tokens: int = 0                          # completion tokens the client got
    base: int = 0                            # ... before the current engine's stream began
    id: Any = None
    created: Any = None
    model: Any = None
    finished: bool = False                   # the choice's finish_reason was sent
    done: bool = False                       # [DONE] was sent
    blocked: str | None = None               # why it can no longer be resumed
    continuation: bool = False               # the current engine's events are a continuation's
    resumptions: int = 0
    failed: set[str] = field(default_factory=set)  # engines it broke on: never resumed there
    _pending: bytes = b""

    @classmethod
    def start(cls, path: str, body: bytes | bytearray) -> StreamState:
        return cls(chat=path == CHAT_PATH, body=body)

    # --- relaying ---------------------------------------------------------------------------------------
    def feed(self, data: bytes) -> bytes:
        """What to write to the client for DATA, the engine's next bytes."""
        data = self._pending + data if self._pending else data
        end = data.rfind(_EVENT_END)
        if end < 0:
            if len(data) > MAX_PENDING_BYTES:
                self.blocked = "an event too large to parse"
                self._pending = b""
                return data
            self._pending = data
            return b""
        complete, self._pending = data[:end + 2], data[end + 2:]
        if not self.continuation:
            if self.blocked is None:
                for event in complete.split(_EVENT_END)[:-1]:
                    self._event(event)
            return complete
        out = []
        for event in complete.split(_EVENT_END)[:-1]:
            rewritten = self._event(event)
            if rewritten is not None:
                out.append(rewritten)
        return b"".join(out)

    def leftover(self) -> bytes:
        """Bytes of an unfinished event at the end of a stream that ended normally: relayed as they are."""
        data, self._pending = self._pending, b""
        return data

    def _event(self, event: bytes) -> bytes | None:
        """Track one event; from a continuation, the event to send instead (None: send nothing)."""
        raw = event + _EVENT_END
        start = event.find(_DATA)
        if start < 0:
            return raw  # a comment or another field: nothing to track
        payload = event[start + len(_DATA):].strip()
        if payload == _DONE:
            self.done = True
            return raw
        if not self.continuation and self.id is not None and self._quick(payload):
            return raw
        try:
            message = json.loads(payload)
        except ValueError:
            self.blocked = "an event the router cannot parse"
            return raw
        if not isinstance(message, dict) or "error" in message:
            self.blocked = "an engine's error event"
            return raw
        if self.id is None:
            self.id, self.created, self.model = message.get("id"), message.get("created"), message.get("model")
        keep = self._choices(message)
        usage = message.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.tokens = self.base + usage["completion_tokens"]
        if not self.continuation:
            return raw
        if not keep:
            return None
        message["id"], message["created"], message["model"] = self.id, self.created, self.model
        if isinstance(usage, dict):
            message["usage"] = self._usage(usage)
        return b"data: " + json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode() + _EVENT_END

    def _quick(self, payload: bytes) -> bool:
        """Track a plain token event (one choice, index 0, its text a string; no usage, logprobs, tool calls,
        reasoning or error) from its text alone, at a fraction of a whole parse; False for any other event (to be
        parsed). Keys are found by their quoted names, which no JSON string can hold unescaped."""
        try:
            event = payload.decode()
        except UnicodeDecodeError:
            return False
        if _UNUSUAL.search(event) or event.count('"index":') != 1 or '"index":0' not in event:
            return False
        key = '"content":"' if self.chat else '"text":"'
        at = event.find(key)
        finish = event.find('"finish_reason":')
        if at < 0 or finish < 0:
            return False
        try:
            text, _ = scanstring(event, at + len(key))
        except ValueError:
            return False
        if text:
            self.text.append(text)
        if not event.startswith("null", finish + len('"finish_reason":')):
            self.finished = True
        elif text or '"role":' not in event:
            self.tokens += 1
        return True

    def _choices(self, message: dict[str, Any]) -> bool:
        """Track the event's choices: text, tokens, finish. False for a continuation's event that carries
        nothing to send (its role delta)."""
        choices = message.get("choices")
        if not isinstance(choices, list) or not choices:
            return True  # a usage chunk
        keep = True
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self.blocked = "an event of another choice"
                return True
            if self.chat:
                delta = choice.get("delta")
                if not isinstance(delta, dict):
                    self.blocked = "an event without a delta"
                    return True
                if any(delta.get(k) for k in ("tool_calls", "function_call", "reasoning", "reasoning_content")):
                    self.blocked = "tool calls or reasoning already sent"
                content = delta.get("content")
                role_only = "role" in delta and not content
                if self.continuation and "role" in delta:
                    del delta["role"]  # the client had its role delta from the first engine
                    keep = (bool(content) or choice.get("finish_reason") is not None
                            or any(value for name, value in delta.items() if name != "content"))
            else:
                content = choice.get("text")
                role_only = False
            if isinstance(content, str) and content:
                self.text.append(content)
            if choice.get("finish_reason") is not None:
                self.finished = True
            elif not role_only:
                self.tokens += 1
        return keep

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A continuation's usage as the client's stream's: its prompt less the tokens it was given as text,
        every completion token sent. (Cached-token details were about the continuation's prompt: left out.)"""
        out = dict(usage)
        out.pop("prompt_tokens_details", None)
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            out["prompt_tokens"] = max(prompt - self.base, 0)
            out["completion_tokens"] = self.base + completion
            out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out

    # --- resuming ---------------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """Nothing is left to generate: the answer's end (finish_reason or [DONE]) was sent already."""
        return self.finished or self.done

    def continuation_body(self) -> dict[str, Any] | None:
        """The request for the rest of the answer, on another engine; None when the tokens sent already reach
        the request's max_tokens."""
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

    def begin_continuation(self) -> None:
        """The next events come from a continuation: rewrite them, count on from what was sent. An answer that
        starts over (nothing of it shown yet) counts from zero again."""
        if not "".join(self.text):
            self.tokens = 0
        self.continuation = True
        self.base = self.tokens
        self._pending = b""

    def ending(self) -> bytes:
        """The end of a stream whose answer was all sent but whose engine broke before its last events: the
        finish event if it was not sent (the tokens reached max_tokens: "length") and [DONE]. The usage chunk is
        left out: the engine that would have counted the prompt is gone."""
        if self.done:
            return b""
        out = b""
        if not self.finished:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            if self.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            event = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": self.created, "model": self.model, "choices": [choice]}
            out += b"data: " + json.dumps(event, separators=(",", ":")).encode() + _EVENT_END
        return out + b"data: [DONE]" + _EVENT_END
