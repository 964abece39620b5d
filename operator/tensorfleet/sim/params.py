"""A completion request's sampling parameters, checked the way vLLM's OpenAI server checks them.

What the simulator honours (see server.py for the answers' shapes): `n`, `stop` (with
`include_stop_str_in_output`), `logprobs` (completions: how many alternatives per token; chat: `logprobs: true`
with `top_logprobs`), `echo` (completions: the prompt before the answer, `max_tokens: 0` for the prompt alone;
chat: vLLM's extension, the last message's content before the answer when it is the assistant's),
`response_format` (`text`, `json_object`, `json_schema`) and vLLM's `guided_json` and `guided_choice`, `seed`.

What it refuses with 400, as vLLM refuses what it cannot do: `n` below 1, `best_of` above 1 (vLLM V1 does not
support it), empty stop strings, logprobs below 0 or above MAX_LOGPROBS (vLLM's default --max-logprobs),
`top_logprobs` without `logprobs: true`, `suffix`, more than one kind of guided decoding, and schemas outside
what structured.py can generate. And what only the simulator cannot do, refused rather than ignored: `n` above
MAX_N, beam search, `prompt_logprobs`, `stop_token_ids` (it has no token ids), `guided_regex`, `guided_grammar`,
structural tags. Other sampling parameters (temperature, top_p, penalties, ...) change which tokens a model
picks, not the shape or the cost of the answer; the simulator's words are random either way, so it takes them
as given.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tensorfleet.sim.engine import RequestRejected
from tensorfleet.sim.structured import JsonSchema, guided_choice, json_object

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_N = 128        # choices per request: the simulator's own bound (each is an engine request)
COMPLETIONS_MAX_TOKENS = 16  # vLLM's default for /v1/completions (chat: the rest of the context)

Structure = Callable[[random.Random], str]


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    max_tokens: int | None = None
    prompt_only: bool = False              # completions: echo with max_tokens 0
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    logprobs: int | None = None            # alternatives per token (completions' logprobs, chat's top_logprobs)
    echo: bool = False
    structure: Structure | None = None     # writes the whole answer (structured output)
    seed: int | None = None


def _integer(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestRejected(f"{name} must be an integer", name)
    return value


def _boolean(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestRejected(f"{name} must be a boolean", name)
    return value


def _too_many(count: int, param: str) -> RequestRejected:
    return RequestRejected(f"Requested sample logprobs of {count}, which is greater than max allowed: {MAX_LOGPROBS}",
                           param)


def _unsupported(name: str, why: str = "") -> RequestRejected:
    return RequestRejected(f"{name} is not supported by the simulator{why}", name)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestRejected("stop must be a string or a list of strings", "stop")
    if any(not s for s in stop):
        raise RequestRejected("stop cannot contain an empty string.", "stop")
    return tuple(stop)


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    if chat:
        wanted = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", None)
        if top is not None and top < 0:
            raise RequestRejected("`top_logprobs` must be a positive value.", "top_logprobs")
        if top and not wanted:
            raise RequestRejected("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        if top is not None and top > MAX_LOGPROBS:
            raise _too_many(top, "top_logprobs")
        return (top or 0) if wanted else None
    count = _integer(body, "logprobs", None)
    if count is not None and count < 0:
        raise RequestRejected("`logprobs` must be a positive value.", "logprobs")
    if count is not None and count > MAX_LOGPROBS:
        raise _too_many(count, "logprobs")
    return count


def _schema(value: Any, param: str) -> JsonSchema:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestRejected("Invalid JSON grammar specification.", param) from None
    return JsonSchema(value)


def _structure(body: Mapping[str, Any]) -> Structure | None:
    for name in ("guided_regex", "guided_grammar", "structural_tag", "structured_outputs"):
        if body.get(name) is not None:
            raise _unsupported(name, " (only json_object, json_schema, guided_json and guided_choice are)")
    guided = [name for name in ("guided_json", "guided_choice") if body.get(name) is not None]
    response_format = body.get("response_format")
    kind = None
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise RequestRejected("response_format must be an object", "response_format")
        kind = response_format.get("type")
        if kind == "structural_tag":
            raise _unsupported("response_format", " with type structural_tag")
        if kind not in ("text", "json_object", "json_schema"):
            raise RequestRejected("response_format.type must be one of 'text', 'json_object', 'json_schema'",
                                  "response_format")
        if kind != "text":
            guided.append("response_format")
    if len(guided) > 1:
        raise RequestRejected("You can only use one kind of guided decoding "
                              "('guided_json', 'guided_regex' or 'guided_choice').", guided[-1])
    if kind == "json_object":
        return json_object
    if kind == "json_schema":
        assert isinstance(response_format, Mapping)
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or spec.get("schema") is None:
            raise RequestRejected("response_format.json_schema.schema is required for type json_schema",
                                  "response_format")
        return _schema(spec["schema"], "response_format").generate
    if "guided_json" in guided:
        return _schema(body["guided_json"], "guided_json").generate
    if "guided_choice" in guided:
        choices = guided_choice(body["guided_choice"])
        return lambda rng: choices[rng.randrange(len(choices))]
    return None


def parse(body: Mapping[str, Any], *, chat: bool) -> Sampling:
    """The request's sampling parameters; RequestRejected (400) for what vLLM or the simulator refuses."""
    n = _integer(body, "n", 1)
    assert n is not None
    if n < 1:
        raise RequestRejected(f"n must be at least 1, got {n}.", "n")
    if n > MAX_N:
        raise RequestRejected(f"n must be at most {MAX_N} in the simulator, got {n}.", "n")
    best_of = _integer(body, "best_of", None)
    if best_of is not None and best_of > 1:
        raise RequestRejected("vLLM V1 does not yet support best_of.", "best_of")
    if _boolean(body, "use_beam_search"):
        raise _unsupported("use_beam_search")
    if body.get("prompt_logprobs") is not None:
        raise _unsupported("prompt_logprobs")
    if body.get("stop_token_ids"):
        raise _unsupported("stop_token_ids", " (it has no token ids)")
    if not chat and body.get("suffix") is not None:
        raise RequestRejected("suffix is not currently supported", "suffix")
    if chat:
        max_tokens = _integer(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", None)
    else:
        max_tokens = _integer(body, "max_tokens", COMPLETIONS_MAX_TOKENS if "max_tokens" not in body else None)
    echo = _boolean(body, "echo")
    prompt_only = not chat and echo and max_tokens == 0
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestRejected("seed must be an integer", "seed")
    return Sampling(n=n, max_tokens=1 if prompt_only else max_tokens, prompt_only=prompt_only, stop=_stop(body),
                    include_stop=_boolean(body, "include_stop_str_in_output"), logprobs=_logprobs(body, chat),
                    echo=echo, structure=_structure(body), seed=seed)
