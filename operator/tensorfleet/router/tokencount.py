"""The tokens of one client stream, across every engine that served it: the completion tokens the client got and
the request's prompt, from the engines' own running `usage` where they report it, else estimated from the text;
and a continuation's usage restated as the client's stream's. It reads no bytes: the relay (router/relay.py) hands
it each event's text and usage. Design: docs/routing.md#stream-resumption-and-token-accounting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorfleet.prompts import content_text

# Characters a token, for estimates from text (prompts at admission, admission.py; a stream no engine counted): fewer
# than English has (about four), so an over-estimate.
CHARS_PER_TOKEN = 3


def stated_max_tokens(body: Mapping[str, Any]) -> int | None:
    """The most tokens the request lets each choice generate, as it states it (`max_completion_tokens`, else
    `max_tokens`); None when it states neither, or not as a whole number of at least 0."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        return None
    return limit


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """An over-estimate of a request's prompt in tokens: token ids count one each, text one per CHARS_PER_TOKEN
    characters (English runs about four; code and CJK text fewer)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = sum(len(content_text(m.get("content"))) for m in messages if isinstance(m, Mapping))
        return chars // CHARS_PER_TOKEN + 1
    prompt = body.get("prompt", body.get("input"))
    if isinstance(prompt, str):
        return len(prompt) // CHARS_PER_TOKEN + 1
    total = 0
    if isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, str):
                total += len(item) // CHARS_PER_TOKEN + 1
            elif isinstance(item, list):
                total += len(item)
            else:
                total += 1
    return total


def estimate_tokens(chars: int, events: int) -> int:
    """Completion tokens from the text alone, for an engine that reports no usage: CHARS_PER_TOKEN characters a
    token (an over-estimate for English, so a continuation never runs past the client's max_tokens; it may end
    short), and at least one for each event that carried text."""
    return max(events, -(-chars // CHARS_PER_TOKEN))


@dataclass(eq=False)
class TokenCount:
    """The counts of one stream. Events are no count of tokens: an event may carry several (vLLM merges the
    outputs of engine steps its HTTP handler has not written yet, and `--stream-interval` sends several at once by
    design) and vLLM puts the finish_reason on the event of the last token. So the counts are the engine's own:
    the router asks every stream it tracks for `continuous_usage_stats`, and vLLM then attaches the running usage
    (prompt_tokens, completion_tokens of the event's choice so far) to every event and sends a final usage event.
    What no usage covers is estimated from its text (estimate_tokens); a prompt no engine counted whole is, on a
    continuation, its prompt less the tokens it was given as text."""

    base: int = 0                            # completion tokens sent before the current engine's stream began
    prompt_tokens: int | None = None         # the request's prompt, as an engine given it whole counted it
    # The current engine's completion tokens: per choice, its last usage's count, and the text since (chars,
    # events with text) for what no usage covers; its final usage event's total once sent.
    _exact: dict[int, int] = field(default_factory=dict)
    _chars: dict[int, int] = field(default_factory=dict)
    _events: dict[int, int] = field(default_factory=dict)
    _final: int | None = None
    _own_prompt: bool = True                 # the current engine's prompt is the client's (not prompt + text sent)

    @property
    def tokens(self) -> int:
        """Completion tokens the client got, every choice: its engines' own counts (usage), else estimated from
        the text (estimate_tokens), never one per event (an event may carry several tokens)."""
        if self._final is not None:
            return self.base + self._final
        return self.base + sum(self._exact.get(i, 0) + estimate_tokens(self._chars.get(i, 0), self._events.get(i, 0))
                               for i in {*self._exact, *self._chars})

    def count(self, index: int, text: str, usage: Any) -> None:
        """An event of choice INDEX carrying TEXT and the engine's USAGE (or None)."""
        if text:
            self._chars[index] = self._chars.get(index, 0) + len(text)
            self._events[index] = self._events.get(index, 0) + 1
        if isinstance(usage, dict):
            self._prompt_seen(usage)
            completion = usage.get("completion_tokens")
            if isinstance(completion, int):
                self._exact[index] = completion
                self._chars[index] = self._events[index] = 0

    def count_final(self, usage: dict[str, Any]) -> None:
        """The engine's final usage event: every choice's tokens."""
        self._prompt_seen(usage)
        if isinstance(usage.get("completion_tokens"), int):
            self._final = usage["completion_tokens"]

    def _prompt_seen(self, usage: dict[str, Any]) -> None:
        prompt = usage.get("prompt_tokens")
        if self._own_prompt and isinstance(prompt, int):
            self.prompt_tokens = prompt

    def next_engine(self, shown: bool) -> None:
        """Another engine's stream follows: count on from what was sent, or from zero again for an answer that
        starts over (SHOWN False: nothing of it reached the client), its prompt then still the client's own."""
        self.base = self.tokens if shown else 0
        self._own_prompt = self._own_prompt and not shown
        self._exact, self._chars, self._events, self._final = {}, {}, {}, None

    def restate(self, usage: dict[str, Any]) -> dict[str, Any]:
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
