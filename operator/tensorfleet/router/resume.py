"""Stream resumption and token accounting: what the router needs to carry a broken stream over to another
engine, and to know what every stream cost.

A streamed generation whose engine stalls or fails after some of its answer reached the client can go on
elsewhere as a continuation, a request for the rest of the same answer, when that is equivalent to letting the
first engine finish (forward.py sends it; this module decides, tracks and rewrites):
  completions  the prompt + the text already sent, max_tokens (and min_tokens) less the tokens already sent;
  chat         the messages + an assistant message holding the content already sent, with vLLM's
               `continue_final_message: true` and `add_generation_prompt: false`, max_completion_tokens (or
               max_tokens, and min_tokens) likewise less what was sent.
The continuation's events reach the client rewritten to the first stream's `id`, `created` and `model`, without a
second role delta, and its usage counts the original prompt (as the first engine counted it) and every
completion token the client got, from all its engines.

Not resumable (the client gets the SSE error event as before), because a continuation would not be the same
answer: several choices (`n` > 1, `best_of`), logprobs or prompt_logprobs (the sent tokens' would be missing),
`echo`, a client's own `continue_final_message` or `add_generation_prompt: false`, guided decoding
(response_format json, guided_*, structured outputs, a forced tool_choice: the grammar restarts), a completions
prompt of token ids or of several prompts, `suffix`, a body over MAX_BODY_BYTES (kept in memory for the whole
stream), and a stream that has sent tool calls, reasoning or anything the router cannot parse.

Token accounting. An event may carry several tokens (vLLM merges the outputs of engine steps its HTTP handler
has not written yet, and `--stream-interval` sends several at once by design) and vLLM puts the finish_reason on
the event of the last token, so events are no count of tokens. The router therefore asks the engine for its own
counts on every stream it tracks (a resumable one, or any with per-key token limits): `ask_usage` adds
`stream_options: {include_usage: true, continuous_usage_stats: true}` to the request, and vLLM then attaches the
running `usage` (prompt_tokens, completion_tokens of the event's choice so far) to every event and sends the
final usage event. Those counts make the continuation's max_tokens/max_completion_tokens/min_tokens, the usage
the client gets after a resumption, and the tenant's token charge (tenants.UsageMeter) exact. The client gets
only the usage it asked for: the per-event usage is cut from each event unless it asked continuous_usage_stats,
the final usage event dropped unless it asked include_usage. An engine that reports no usage at all is counted
from its text (estimate_tokens: CHARS_PER_TOKEN characters a token, at least one per event with text; an
over-estimate, so a continuation never runs past max_tokens), and its prompt, when no engine counted it, as the
continuation's prompt less the tokens sent. An engine that breaks after the answer's last token (its finish
event, or max_tokens reached) leaves nothing to continue: the stream ends with the finish event, the usage event
when the client asked for one (from the counts already in hand) and [DONE].

Tracking costs a parse per event: plain token events (most of them) are read by their keys alone, their usage
(the event's last member, as vLLM writes it) decoded and cut where the client did not ask for it
(`StreamState._quick`, a few microseconds); the rest with json.loads. Only a continuation's events, and events
whose usage must go and that the quick path cannot read, are serialised again.
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
_INDEX = re.compile(r'"index":(\d+)')
_USAGE = '"usage":'
_DECODER = json.JSONDecoder()
_DATA = b"data:"
_DONE = b"[DONE]"
_EVENT_END = b"\n\n"
_SAME, _DROP = object(), object()  # StreamState._quick: send the event as it came; send nothing
# What the router asks every engine stream it tracks for: the engine's own token counts on every event.
USAGE_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
_USAGE_OPTIONS_JSON = json.dumps(USAGE_OPTIONS, separators=(",", ":")).encode()
# Characters a token, for estimates from text (prompts at admission, admission.py; a stream no engine counted): fewer
# than English has (about four), so an over-estimate.
CHARS_PER_TOKEN = 3


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


def estimate_tokens(chars: int, events: int) -> int:
    """Completion tokens from the text alone, for an engine that reports no usage: CHARS_PER_TOKEN characters a
    token (an over-estimate for English, so a continuation never runs past the client's max_tokens; it may end
    short), and at least one for each event that carried text."""
    return max(events, -(-chars // CHARS_PER_TOKEN))


def _top_usage(event: str, at: int) -> tuple[Any, int, int] | None:
    """The `usage` member whose key is at AT, when it is the event's last top-level member (as vLLM writes it):
    its value, and where the member starts (its comma) and ends; None for any other placement (parsed whole)."""
    try:
        value, end = _DECODER.raw_decode(event, at + len(_USAGE))
    except ValueError:
        return None
    if not (value is None or isinstance(value, dict)) or event[end:].strip() != "}":
        return None
    comma = event.rfind(",", 0, at)
    if comma < 0 or event[comma + 1:at].strip():
        return None
    return value, comma, end


@dataclass(eq=False)
class StreamState:
    """One client stream as relayed: what it has sent (text, tokens), its identity (`id`, `created`, `model`
    of its first engine's events), the usage its engines reported, and the rewriting of a continuation's events
    into it.

    `feed` takes the bytes an engine sent and returns those to write to the client: whole events only (an
    unfinished one waits for its end, so a broken stream never leaves half an event for a continuation to
    follow), unchanged from the first engine, less the usage the client did not ask for where the router asked
    for it (`added`), rewritten from a continuation. A stream that may not be resumed (`resumable` False) is
    tracked all the same, for its usage."""

    chat: bool
    body: bytes | bytearray                  # the client's request, as sent to the engine
    resumable: bool = True
    usage: tuple[bool, bool] = (False, False)  # what the client asked: include_usage, continuous_usage_stats
    added: bool = False                      # the router asked the engines for usage (USAGE_OPTIONS) on its own
    text: list[str] = field(default_factory=list)
    base: int = 0                            # completion tokens sent before the current engine's stream began
    prompt_tokens: int | None = None         # the request's prompt, as an engine given it whole counted it
    id: Any = None
    created: Any = None
    model: Any = None
    finished: bool = False                   # the choice's finish_reason was sent
    done: bool = False                       # [DONE] was sent
    usage_sent: bool = False                 # the final usage event was sent
    blocked: str | None = None               # why it can no longer be resumed
    continuation: bool = False               # the current engine's events are a continuation's
    resumptions: int = 0
    failed: set[str] = field(default_factory=set)  # engines it broke on: never resumed there
    # The current engine's completion tokens: per choice, its last usage's count, and the text since (chars,
    # events with text) for what no usage covers; its final usage event's total once sent.
    _exact: dict[int, int] = field(default_factory=dict)
    _chars: dict[int, int] = field(default_factory=dict)
    _events: dict[int, int] = field(default_factory=dict)
    _final: int | None = None
    _own_prompt: bool = True                 # the current engine's prompt is the client's (not prompt + text sent)
    _pending: bytes = b""
    _rewrote: bool = False                   # feed: an event of this read was changed or dropped

    @classmethod
    def start(cls, path: str, body: bytes | bytearray, *, resumable: bool = True,
              usage: tuple[bool, bool] = (False, False), added: bool = False) -> StreamState:
        state = cls(chat=path == CHAT_PATH, body=body, resumable=resumable, usage=usage, added=added)
        if not resumable:
            state.blocked = "not resumable"
        return state

    # --- what was sent ----------------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Completion tokens the client got, every choice: its engines' own counts (usage), else estimated from
        the text (estimate_tokens), never one per event (an event may carry several tokens)."""
        if self._final is not None:
            return self.base + self._final
        return self.base + sum(self._exact.get(i, 0) + estimate_tokens(self._chars.get(i, 0), self._events.get(i, 0))
                               for i in {*self._exact, *self._chars})

    @property
    def _keep_final(self) -> bool:
        """The client gets the final usage event: it asked for it, or the router asked for nothing."""
        return self.usage[0] or not self.added

    @property
    def _keep_running(self) -> bool:
        """The client gets every event's usage: it asked for it, or the router asked for nothing."""
        return self.usage[1] or not self.added

    def _count(self, index: int, text: str, usage: Any) -> None:
        """An event of choice INDEX carrying TEXT and the engine's USAGE (or None)."""
        if text:
            self._chars[index] = self._chars.get(index, 0) + len(text)
            self._events[index] = self._events.get(index, 0) + 1
        if isinstance(usage, dict):
            self._usage_seen(usage)
            completion = usage.get("completion_tokens")
            if isinstance(completion, int):
                self._exact[index] = completion
                self._chars[index] = self._events[index] = 0

    def _final_usage(self, usage: dict[str, Any]) -> bool:
        """The final usage event (every choice's tokens): whether the client gets it."""
        self._usage_seen(usage)
        if isinstance(usage.get("completion_tokens"), int):
            self._final = usage["completion_tokens"]
        if not self._keep_final:
            return False
        self.usage_sent = True
        return True

    def _usage_seen(self, usage: dict[str, Any]) -> None:
        prompt = usage.get("prompt_tokens")
        if self._own_prompt and isinstance(prompt, int):
            self.prompt_tokens = prompt

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
        out = []
        self._rewrote = False
        for event in complete.split(_EVENT_END)[:-1]:
            sent = self._event(event)
            if sent is not None:
                out.append(sent)
        return b"".join(out) if self._rewrote else complete

    def leftover(self) -> bytes:
        """Bytes of an unfinished event at the end of a stream that ended normally: relayed as they are."""
        data, self._pending = self._pending, b""
        return data

    def _event(self, event: bytes) -> bytes | None:
        """Track one event; the event to send instead (None: send nothing)."""
        raw = event + _EVENT_END
        start = event.find(_DATA)
        if start < 0:
            return raw  # a comment or another field: nothing to track
        payload = event[start + len(_DATA):].strip()
        if payload == _DONE:
            self.done = True
            return raw
        if not self.continuation and self.id is not None:
            quick = self._quick(payload)
            if quick is _SAME:
                return raw
            if quick is _DROP:
                return self._rewritten(None)
            if isinstance(quick, bytes):
                return self._rewritten(event[:start] + b"data: " + quick + _EVENT_END)
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
        usage = message.get("usage")
        keep = self._choices(message, usage)
        final = False
        if isinstance(usage, dict) and message.get("choices") == []:
            final = True
            if not self._final_usage(usage):
                return self._rewritten(None)
        changed = False
        if isinstance(usage, dict) and not final and not self._keep_running:
            self._cut_usage(message)
            changed = True
        if self.continuation:
            if not keep:
                return self._rewritten(None)
            message["id"], message["created"], message["model"] = self.id, self.created, self.model
            if isinstance(message.get("usage"), dict):  # (not cut)
                message["usage"] = self._usage(message["usage"])
            changed = True
        if not changed:
            return raw
        return self._rewritten(event[:start] + b"data: "
                               + json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode() + _EVENT_END)

    def _cut_usage(self, message: dict[str, Any]) -> None:
        """Take an event's usage out, as vLLM writes an event without it: chat leaves the key out, completions
        say null."""
        if self.chat:
            del message["usage"]
        else:
            message["usage"] = None

    def _rewritten(self, event: bytes | None) -> bytes | None:
        """EVENT, sent instead of the engine's (None: nothing)."""
        self._rewrote = True
        return event

    def _quick(self, payload: bytes) -> object:
        """Track a plain event of the first engine (one choice; its text a string; no logprobs, tool calls,
        reasoning or error; its usage, if any, the last member) from its text alone, at a fraction of a whole
        parse. The payload to send (_SAME: as it came; _DROP: nothing), or None for an event to parse whole. Keys
        are found by their quoted names, which no JSON string can hold unescaped."""
        try:
            event = payload.decode()
        except UnicodeDecodeError:
            return None
        usage: Any = None
        usage_at = event.rfind(_USAGE)
        rest = event
        if usage_at >= 0:
            found = _top_usage(event, usage_at)
            if found is None:
                return None
            usage, comma, end = found
            rest = event[:comma] + event[end:]
        if _UNUSUAL.search(rest):
            return None
        if '"choices":[]' in rest:  # the final usage event
            if not isinstance(usage, dict):
                return None
            return _SAME if self._final_usage(usage) else _DROP
        index = _INDEX.findall(rest)
        if len(index) != 1 or (index[0] != "0" and self.blocked is None):
            return None
        key = '"content":"' if self.chat else '"text":"'
        at = rest.find(key)
        finish = rest.find('"finish_reason":')
        if at < 0 or finish < 0:
            return None
        try:
            text, _ = scanstring(rest, at + len(key))
        except ValueError:
            return None
        if text and self.blocked is None:
            self.text.append(text)
        if not rest.startswith("null", finish + len('"finish_reason":')):
            self.finished = True
        self._count(int(index[0]), text, usage)
        if isinstance(usage, dict) and not self._keep_running:
            # Cut as vLLM writes an event without it: chat leaves the key out, completions say null.
            return (rest if self.chat else event[:usage_at + len(_USAGE)] + "null" + event[end:]).encode()
        return _SAME

    def _choices(self, message: dict[str, Any], usage: Any) -> bool:
        """Track the event's choices: text, tokens, finish. False for a continuation's event that carries
        nothing to send (its role delta)."""
        choices = message.get("choices")
        if not isinstance(choices, list) or not choices:
            return True  # a usage chunk
        keep = True
        for choice in choices:
            if not isinstance(choice, dict):
                self.blocked = self.blocked or "an event the router cannot parse"
                continue
            index = choice.get("index", 0)
            index = index if isinstance(index, int) else 0
            if index != 0:
                self.blocked = self.blocked or "an event of another choice"
            if self.chat:
                delta = choice.get("delta")
                if not isinstance(delta, dict):
                    self.blocked = self.blocked or "an event without a delta"
                    continue
                if any(delta.get(k) for k in ("tool_calls", "function_call", "reasoning", "reasoning_content")):
                    self.blocked = self.blocked or "tool calls or reasoning already sent"
                content = delta.get("content")
                if self.continuation and "role" in delta:
                    del delta["role"]  # the client had its role delta from the first engine
                    keep = (bool(content) or choice.get("finish_reason") is not None
                            or any(value for name, value in delta.items() if name != "content"))
            else:
                content = choice.get("text")
            text = content if isinstance(content, str) else ""
            if text and self.blocked is None:
                self.text.append(text)
            if choice.get("finish_reason") is not None:
                self.finished = True
            # An event's usage is its choice's (vLLM's continuous usage): one choice an event.
            self._count(index, text, usage if len(choices) == 1 else None)
        return keep

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A continuation's usage as the client's stream's: the original prompt (as its first engine counted it;
        when no engine did, the continuation's less the tokens it was given as text), every completion token
        sent. (Cached-token details were about the continuation's prompt: left out.)"""
        out = dict(usage)
        if not self._own_prompt:
            out.pop("prompt_tokens_details", None)
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            if self.prompt_tokens is not None:
                out["prompt_tokens"] = self.prompt_tokens
            elif not self._own_prompt:
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
        starts over (nothing of it shown yet) counts from zero again, its prompt the client's own."""
        shown = bool("".join(self.text))
        self.base = self.tokens if shown else 0
        self._own_prompt = self._own_prompt and not shown
        self._exact, self._chars, self._events, self._final = {}, {}, {}, None
        self.continuation = True
        self._pending = b""

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
            out += b"data: " + json.dumps(event, separators=(",", ":")).encode() + _EVENT_END
        if self.usage[0] and not self.usage_sent and self.prompt_tokens is not None:
            tokens = self.tokens
            usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": tokens,
                     "total_tokens": self.prompt_tokens + tokens}
            event = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [],
                     "usage": usage}
            out += b"data: " + json.dumps(event, separators=(",", ":")).encode() + _EVENT_END
        return out + b"data: [DONE]" + _EVENT_END
