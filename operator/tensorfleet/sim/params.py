"""A completion request's sampling parameters, checked the way vLLM's OpenAI server checks them, after the body
passed `validation.py`: what the simulator honours, what it refuses with 400 as vLLM 0.19.1 does (with vLLM's
messages, in its order), and what only the simulator cannot do, refused rather than ignored. Design:
docs/simulator.md#requests-refused-as-vllm-refuses-them."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tensorfleet.sim.structured import JsonSchema, choices_of, json_object
from tensorfleet.sim.validation import RequestRejected, StructuredOutputsParams, rejected

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_N = 16384      # vLLM's VLLM_MAX_N_SEQUENCES default: choices per request (each is an engine request)
MAX_N_ENV = "VLLM_MAX_N_SEQUENCES"
VOCAB_SIZE = 128256  # what logprobs -1 ("every token") asks for: Llama 3's vocabulary
COMPLETIONS_MAX_TOKENS = 16  # vLLM's default for /v1/completions (chat: the rest of the context)
# vLLM's structured-output constraints (StructuredOutputsParams), and those the simulator can follow.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
FOLLOWED = ("json", "choice", "json_object")

Structure = Callable[[random.Random], str]


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"   # what the request called it (chat's max_completion_tokens)
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


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise RequestRejected(f"{name} must be a number", name)
    return float(value)


def _boolean(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestRejected(f"{name} must be a boolean", name)
    return value


def _unsupported(name: str, why: str = "") -> RequestRejected:
    return RequestRejected(f"{name} is not supported by the simulator{why}", name)


def max_n() -> int:
    try:
        return int(os.environ.get(MAX_N_ENV, MAX_N))
    except ValueError:
        return MAX_N


def check_sampling(body: Mapping[str, Any], n: int, max_tokens: int | None, stop: tuple[str, ...],
                   logprobs: int | None) -> None:
    """vLLM's SamplingParams checks (vllm/sampling_params.py `_verify_args`, then `_validate_logprobs`), in their
    order, with their messages: plain ValueErrors (`param` null) and VLLMValidationErrors (`param` set)."""
    if n < 1:
        raise RequestRejected(f"n must be at least 1, got {n}.")
    if n > (limit := max_n()):
        raise RequestRejected(f"n must be at most {limit}, got {n}. To increase this limit, set the {MAX_N_ENV} "
                              "environment variable.")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= (penalty := _number(body, name, 0.0)) <= 2.0:
            raise RequestRejected(f"{name} must be in [-2, 2], got {penalty}.")
    if (repetition := _number(body, "repetition_penalty", 1.0)) <= 0.0:
        raise RequestRejected(f"repetition_penalty must be greater than zero, got {repetition}.")
    if (temperature := _number(body, "temperature", 1.0)) < 0.0:
        raise rejected(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if not 0.0 < (top_p := _number(body, "top_p", 1.0)) <= 1.0:
        raise rejected(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = _integer(body, "top_k", 0)
    assert top_k is not None
    if top_k < -1:
        raise RequestRejected(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= (min_p := _number(body, "min_p", 0.0)) <= 1.0:
        raise RequestRejected(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens is not None and max_tokens < 1:
        raise rejected(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    min_tokens = _integer(body, "min_tokens", 0)
    assert min_tokens is not None
    if min_tokens < 0:
        raise RequestRejected(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:
        raise RequestRejected(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    if any(not s for s in stop):
        raise RequestRejected("stop cannot contain an empty string.")
    if logprobs:
        wanted = VOCAB_SIZE if logprobs == -1 else logprobs
        if wanted > MAX_LOGPROBS:
            raise rejected(f"Requested sample logprobs of {wanted}, which is greater than max allowed: "
                           f"{MAX_LOGPROBS}", "logprobs", wanted)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestRejected("stop must be a string or a list of strings", "stop")
    return tuple(stop)


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """The alternatives per token asked for (vLLM's SamplingParams.logprobs): chat's top_logprobs when logprobs
    is true, completions' logprobs; None for none. The ranges are checked by validation.py and check_sampling."""
    if chat:
        top = _integer(body, "top_logprobs", 0)
        return (top or 0) if _boolean(body, "logprobs") else None
    return _integer(body, "logprobs", None)


def _schema(value: Any, param: str) -> JsonSchema:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestRejected("Invalid JSON grammar specification.", param) from None
    return JsonSchema(value)


def _constraints(body: Mapping[str, Any]) -> tuple[StructuredOutputsParams | None, bool]:
    """The request's structured-output constraint as vLLM builds it: `structured_outputs`, with what
    `response_format` asks for put over it (json_object; json_schema's schema as `json`; a structural tag), and
    whether response_format gave it. RequestRejected with vLLM's error where the two make more than one."""
    structured = body.get("structured_outputs")
    params = None
    if isinstance(structured, Mapping):
        params = StructuredOutputsParams(**{k: v for k, v in structured.items() if not k.startswith("_")})
    response_format = body.get("response_format")
    kwargs: dict[str, Any] = {}
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        if kind == "json_object":
            kwargs["json_object"] = True
        elif kind == "json_schema":
            kwargs["json"] = (response_format.get("json_schema") or {}).get("schema")
        elif kind == "structural_tag":
            raise _unsupported("response_format", " with type structural_tag")
    if kwargs:
        try:
            if params is not None:
                # As vLLM's own replace() (vllm/config/utils.py) does it: the fields in order, the new ones over.
                kwargs = {**{f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}, **kwargs}
            params = StructuredOutputsParams(**kwargs)
        except ValidationError as exc:
            raise RequestRejected(str(exc)) from None
    return params, bool(kwargs)


def _structure(body: Mapping[str, Any]) -> Structure | None:
    params, from_response_format = _constraints(body)
    if params is None:
        return None
    kind = next(name for name in CONSTRAINTS if getattr(params, name) is not None)
    if kind not in FOLLOWED:
        raise RequestRejected(f"structured_outputs.{kind} is not supported by the simulator (only json, choice "
                              "and json_object are, and response_format's json_object and json_schema)",
                              "structured_outputs")
    if kind == "json_object":
        return json_object
    if kind == "json":
        return _schema(params.json, "response_format" if from_response_format else "structured_outputs").generate
    options = choices_of(params.choice)
    return lambda rng: options[rng.randrange(len(options))]


def parse(body: Mapping[str, Any], *, chat: bool) -> Sampling:
    """The request's sampling parameters; RequestRejected (400) for what vLLM or the simulator refuses. BODY is
    as validation.validate leaves it (vLLM's types)."""
    n = _integer(body, "n", 1)
    assert n is not None
    if _boolean(body, "use_beam_search"):
        raise _unsupported("use_beam_search")
    if body.get("prompt_logprobs") is not None:
        raise _unsupported("prompt_logprobs")
    if body.get("stop_token_ids"):
        raise _unsupported("stop_token_ids", " (it has no token ids)")
    if not chat and body.get("suffix") is not None:
        raise RequestRejected("suffix is not currently supported")
    param = "max_tokens"
    if chat:
        max_tokens = _integer(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", None)
        else:
            param = "max_completion_tokens"
    else:
        max_tokens = _integer(body, "max_tokens", COMPLETIONS_MAX_TOKENS if "max_tokens" not in body else None)
    echo = _boolean(body, "echo")
    prompt_only = not chat and echo and max_tokens == 0
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestRejected("seed must be an integer", "seed")
    stop = _stop(body)
    logprobs = _logprobs(body, chat)
    check_sampling(body, n, None if prompt_only else max_tokens, stop, logprobs)
    return Sampling(n=n, max_tokens=1 if prompt_only else max_tokens, max_tokens_param=param,
                    prompt_only=prompt_only, stop=stop, include_stop=_boolean(body, "include_stop_str_in_output"),
                    logprobs=logprobs, echo=echo, structure=_structure(body), seed=seed)
