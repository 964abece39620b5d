"""A client's stream as the router relays it, read from the engines' SSE events on their way through: the text
and finish it was sent, its identity (`id`, `created`, `model`), what would keep a continuation from being the
same answer, and its tokens (router/tokencount.py); the usage the client did not ask for cut from the events, and
a continuation's events rewritten into the first stream's. Design:
docs/routing.md#stream-resumption-and-token-accounting.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from json.decoder import scanstring  # type: ignore[attr-defined]  # C-accelerated, untyped in typeshed
from typing import Any

from tensorfleet.router.tokencount import TokenCount

MAX_PENDING_BYTES = 1 << 20  # an unfinished event this long is not vLLM's: relay it, stop tracking the stream
EVENT_END = b"\n\n"
# Keys that make an event more than a plain token event: parsed whole (RelayedStream._quick).
_UNUSUAL = re.compile(r'"(?:usage|error|tool_calls|function_call|reasoning\w*)":|"logprobs":[\[{]')
_INDEX = re.compile(r'"index":(\d+)')
_USAGE = '"usage":'
_DECODER = json.JSONDecoder()
_DATA = b"data:"
_DONE = b"[DONE]"
_SAME, _DROP = object(), object()  # RelayedStream._quick: send the event as it came; send nothing


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
class RelayedStream:
    """One client stream as relayed: what it has sent (text, tokens), its identity (`id`, `created`, `model`
    of its first engine's events), the usage its engines reported, and the rewriting of a continuation's events
    into it: the first stream's identity, no second role delta, usage counting the original prompt and every
    completion token the client got (TokenCount.restate).

    `feed` takes the bytes an engine sent and returns those to write to the client: whole events only (an
    unfinished one waits for its end, so a broken stream never leaves half an event for a continuation to
    follow), unchanged from the first engine, less the usage the client did not ask for where the router asked
    for it (`added`), rewritten from a continuation. The client gets only the usage it asked for: the per-event
    usage is cut from each event unless it asked continuous_usage_stats, the final usage event dropped unless it
    asked include_usage.

    Tracking costs a parse per event: plain token events (most of them) are read by their keys alone, their usage
    (the event's last member, as vLLM writes it) decoded and cut where the client did not ask for it (`_quick`, a
    few microseconds); the rest with json.loads. Only a continuation's events, and events whose usage must go and
    that the quick path cannot read, are serialised again."""

    chat: bool
    usage: tuple[bool, bool] = (False, False)  # what the client asked: include_usage, continuous_usage_stats
    added: bool = False                      # the router asked the engines for usage (resume.USAGE_OPTIONS) on its own
    text: list[str] = field(default_factory=list)
    counts: TokenCount = field(default_factory=TokenCount)
    id: Any = None
    created: Any = None
    model: Any = None
    finished: bool = False                   # the choice's finish_reason was sent
    done: bool = False                       # [DONE] was sent
    usage_sent: bool = False                 # the final usage event was sent
    blocked: str | None = None               # why it can no longer be resumed
    continuation: bool = False               # the current engine's events are a continuation's
    _pending: bytes = b""
    _rewrote: bool = False                   # feed: an event of this read was changed or dropped

    # --- what was sent ----------------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Completion tokens the client got, every choice (TokenCount.tokens)."""
        return self.counts.tokens

    @property
    def prompt_tokens(self) -> int | None:
        """The request's prompt, as an engine given it whole counted it; None when none did."""
        return self.counts.prompt_tokens

    @property
    def _keep_final(self) -> bool:
        """The client gets the final usage event: it asked for it, or the router asked for nothing."""
        return self.usage[0] or not self.added

    @property
    def _keep_running(self) -> bool:
        """The client gets every event's usage: it asked for it, or the router asked for nothing."""
        return self.usage[1] or not self.added

    def _final_usage(self, usage: dict[str, Any]) -> bool:
        """The final usage event (every choice's tokens): whether the client gets it."""
        self.counts.count_final(usage)
        if not self._keep_final:
            return False
        self.usage_sent = True
        return True

    # --- relaying ---------------------------------------------------------------------------------------
    def feed(self, data: bytes) -> bytes:
        """What to write to the client for DATA, the engine's next bytes."""
        data = self._pending + data if self._pending else data
        end = data.rfind(EVENT_END)
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
        for event in complete.split(EVENT_END)[:-1]:
            sent = self._event(event)
            if sent is not None:
                out.append(sent)
        return b"".join(out) if self._rewrote else complete

    def leftover(self) -> bytes:
        """Bytes of an unfinished event at the end of a stream that ended normally: relayed as they are."""
        data, self._pending = self._pending, b""
        return data

    def begin_continuation(self) -> None:
        """The next events come from a continuation: rewrite them, count on from what was sent. An answer that
        starts over (nothing of it shown yet) counts from zero again, its prompt the client's own."""
        self.counts.next_engine(shown=bool("".join(self.text)))
        self.continuation = True
        self._pending = b""

    def _event(self, event: bytes) -> bytes | None:
        """Track one event; the event to send instead (None: send nothing)."""
        raw = event + EVENT_END
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
                return self._rewritten(event[:start] + b"data: " + quick + EVENT_END)
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
                message["usage"] = self.counts.restate(message["usage"])
            changed = True
        if not changed:
            return raw
        return self._rewritten(event[:start] + b"data: "
                               + json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode() + EVENT_END)

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
        self.counts.count(int(index[0]), text, usage)
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
            self.counts.count(index, text, usage if len(choices) == 1 else None)
        return keep
