"""vLLM's request-body validation, so the simulator refuses the bodies vLLM refuses with the errors vLLM gives:
pydantic models of the fields it reads with vLLM 0.19.1's types and `before` validators, in lax mode, and vLLM's
error bodies. Design: docs/simulator.md#requests-refused-as-vllm-refuses-them."""

from __future__ import annotations

import json
from dataclasses import field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import TypedDict  # pydantic reads typing's only from Python 3.12


class RequestRejected(ValueError):
    """A request the engine can never serve, and vLLM's answer to it: STATUS (400), the error body's `param` (None
    where vLLM's is null: for its plain ValueErrors) and `type_` (vLLM's "BadRequestError"; "Bad Request" for a
    body that does not validate)."""

    def __init__(self, message: str, param: str | None = None, *, type_: str = "BadRequestError",
                 status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.type_ = type_
        self.status = status


BODY_ERROR_TYPE = "Bad Request"  # FastAPI's error type for a body that does not validate
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def validation_text(message: str, parameter: str | None = None, value: Any = None) -> str:
    """vLLM's VLLMValidationError as text: the message, then the parameter and the value it names."""
    extras = [f"{name}={v}" for name, v in (("parameter", parameter), ("value", value)) if v is not None]
    return f"{message} ({', '.join(extras)})" if extras else message


class VLLMValidationError(ValueError):
    """vLLM's own validation error (vllm/exceptions.py): its text names the parameter, and so does the error
    body's `param`; its repr (pydantic puts it in the message) is the class name and the bare message."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        return validation_text(super().__str__(), self.parameter, self.value)


def rejected(message: str, parameter: str | None = None, value: Any = None) -> RequestRejected:
    """A VLLMValidationError raised once the request is read: 400, its text, `param` the parameter."""
    return RequestRejected(validation_text(message, parameter, value), parameter)


def _errors_text(errors: list[dict[str, Any]]) -> str:
    count = len(errors)
    return f"{count} validation error{'' if count == 1 else 's'}:\n" + "\n".join(f"  {e!r}" for e in errors)


def body_rejected(errors: list[dict[str, Any]]) -> RequestRejected:
    """What FastAPI and vLLM answer for a body whose validation failed with ERRORS (pydantic's, `loc` from the
    body's root)."""
    param = None
    for error in errors:
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, VLLMValidationError):
            param = cause.parameter
            break
    return RequestRejected(_errors_text(errors), param, type_=BODY_ERROR_TYPE)


def json_rejected(exc: json.JSONDecodeError) -> RequestRejected:
    """A body that is not JSON, as FastAPI refuses it."""
    return body_rejected([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                           "input": {}, "ctx": {"error": exc.msg}}])


class Request(BaseModel):
    """What vLLM's OpenAIBaseModel allows: any other field (vLLM logs and ignores it). Its wrap validator is
    there for its name, which pydantic writes in the location of an error inside a union of such models."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def __log_extra_fields__(cls, data: Any, handler: Any) -> Any:
        return handler(data)


class StreamOptions(Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaResponseFormat(Request):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuralTagResponseFormat(Request):
    type: Literal["structural_tag"]
    format: Any


class LegacyStructuralTag(Request):
    begin: str
    structural_tag_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class LegacyStructuralTagResponseFormat(Request):
    type: Literal["structural_tag"]
    structures: list[LegacyStructuralTag]
    triggers: list[str]


# vLLM's AnyResponseFormat.
AnyResponseFormat = ResponseFormat | StructuralTagResponseFormat | LegacyStructuralTagResponseFormat


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams (vllm/sampling_params.py): one constraint, refused at validation otherwise
    (its message lists every field, as vLLM's does)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    _backend: str | None = field(default=None, init=False)
    _backend_was_auto: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        count = sum(getattr(self, name) is not None
                    for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag"))
        if count > 1:
            raise ValueError(f"You can only use one kind of structured outputs constraint but multiple are specified: "
                             f"{self.__dict__}")
        if count < 1:
            raise ValueError(f"You must use one kind of structured outputs constraint but none are specified: "
                             f"{self.__dict__}")


def _check_response_format(data: Any) -> Any:
    response_format = data.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema" \
            and response_format.get("json_schema") is None:
        raise VLLMValidationError("When response_format type is 'json_schema', the 'json_schema' field must be "
                                  "provided.", parameter="response_format")
    return data


def _check_stream_options(data: Any) -> Any:
    if data.get("stream_options") and not data.get("stream"):
        raise VLLMValidationError("Stream options can only be defined when `stream=True`.", parameter="stream_options")
    return data


def _check_prompt_logprobs(data: Any) -> None:
    if (prompt_logprobs := data.get("prompt_logprobs")) is not None:
        if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise VLLMValidationError("`prompt_logprobs` are not available when `stream=True`.",
                                      parameter="prompt_logprobs")
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise VLLMValidationError("`prompt_logprobs` must be a positive value or -1.",
                                      parameter="prompt_logprobs", value=prompt_logprobs)


def _structured_count(data: Any) -> int:
    kwargs = data.get("structured_outputs")
    return sum(kwargs.get(k) is not None for k in ("json", "regex", "choice")) if isinstance(kwargs, dict) else 0


class _Sampling(Request):
    """The fields both endpoints share, with vLLM's types."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    response_format: AnyResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ChatRequest(_Sampling):
    """vLLM's ChatCompletionRequest, the fields the simulator reads; its `before` validators in vLLM's order."""

    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="before")
    @classmethod
    def validate_response_format(cls, data: Any) -> Any:
        return _check_response_format(data)

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        return _check_stream_options(data)

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        _check_prompt_logprobs(data)
        if (top_logprobs := data.get("top_logprobs")) is not None:
            if top_logprobs < 0 and top_logprobs != -1:
                raise VLLMValidationError("`top_logprobs` must be a positive value or -1.", parameter="top_logprobs",
                                          value=top_logprobs)
            if (top_logprobs == -1 or top_logprobs > 0) and not data.get("logprobs"):
                raise VLLMValidationError("when using `top_logprobs`, `logprobs` must be set to true.",
                                          parameter="top_logprobs")
        return data

    @model_validator(mode="before")
    @classmethod
    def check_structured_outputs_count(cls, data: Any) -> Any:
        if _structured_count(data) > 1:
            raise ValueError("You can only use one kind of constraints for structured outputs ('json', 'regex' or "
                             "'choice').")
        return data

    @model_validator(mode="before")
    @classmethod
    def check_generation_prompt(cls, data: Any) -> Any:
        if data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return data


class CompletionRequest(_Sampling):
    """vLLM's CompletionRequest, the fields the simulator reads; its `before` validators in vLLM's order."""

    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    suffix: str | None = None

    @model_validator(mode="before")
    @classmethod
    def validate_response_format(cls, data: Any) -> Any:
        return _check_response_format(data)

    @model_validator(mode="before")
    @classmethod
    def check_structured_outputs_count(cls, data: Any) -> Any:
        if _structured_count(data) > 1:
            raise VLLMValidationError("You can only use one kind of constraints for structured outputs ('json', "
                                      "'regex' or 'choice').", parameter="structured_outputs")
        return data

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        _check_prompt_logprobs(data)
        if (logprobs := data.get("logprobs")) is not None and logprobs < 0:
            raise VLLMValidationError("`logprobs` must be a positive value.", parameter="logprobs", value=logprobs)
        return data

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        return _check_stream_options(data)

    @model_validator(mode="before")
    @classmethod
    def validate_prompt_and_prompt_embeds(cls, data: Any) -> Any:
        prompt, embeds = data.get("prompt"), data.get("prompt_embeds")
        if (prompt is None or prompt == "") and (embeds is None or embeds == []):
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return data


class LoadLoraRequest(Request):
    """vLLM's LoadLoRAAdapterRequest."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraRequest(Request):
    """vLLM's UnloadLoRAAdapterRequest."""

    lora_name: str
    lora_int_id: int | None = Field(default=None)


class TokenizeCompletionRequest(Request):
    """vLLM's TokenizeCompletionRequest."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class ChatMessage(TypedDict, total=False):
    """A message as vLLM types it (a TypedDict: its keys count toward pydantic's choice in a union)."""

    role: str
    content: Any


class TokenizeChatRequest(Request):
    """vLLM's TokenizeChatRequest, its fields in its order (the errors of a body that fits neither list them so)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def check_generation_prompt(cls, data: Any) -> Any:
        if data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise VLLMValidationError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return data


class OneOf:
    """A body vLLM types as a union of models: it is whichever one pydantic's smart mode picks (as FastAPI reads
    it), and the fields only the others declare are dropped (the picked model ignores them)."""

    def __init__(self, *models: type[Request]) -> None:
        self.models = models
        union: Any = models[0]
        for model in models[1:]:
            union = union | model
        self.adapter: TypeAdapter[Any] = TypeAdapter(union)


# vLLM's TokenizeRequest: a body with both `prompt` and messages is a chat (the messages' keys count).
TOKENIZE = OneOf(TokenizeCompletionRequest, TokenizeChatRequest)
Schema = type[Request] | OneOf


def validate(schema: Schema, body: dict[str, Any]) -> dict[str, Any]:
    """BODY as vLLM reads it: the declared fields it sent, coerced as pydantic's lax mode coerces them (nested
    models as dicts), the others as sent. RequestRejected with vLLM's error where the body does not validate."""
    try:
        parsed = schema.adapter.validate_python(body) if isinstance(schema, OneOf) else schema.model_validate(body)
    except ValidationError as exc:
        errors: list[dict[str, Any]] = []
        for error in exc.errors(include_url=False):
            found: dict[str, Any] = dict(error)
            errors.append({key: ("body", *found["loc"]) if key == "loc" else found[key]
                           for key in ("type", "loc", "msg", "input", "ctx") if key in found})
        raise body_rejected(errors) from None
    fields = set(type(parsed).model_fields)
    declared = parsed.model_fields_set & fields
    out = {**body, **parsed.model_dump(include=declared, by_alias=True)}
    if isinstance(schema, OneOf):
        for other in schema.models:
            for name in set(other.model_fields) - fields:
                out.pop(name, None)
    return out
