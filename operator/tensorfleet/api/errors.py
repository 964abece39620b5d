"""Errors a user can fix, each naming the field, the value and the fix. Design: docs/api.md."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from tensorfleet.api.base import DNS_1035_PATTERN, DNS_1123_LABEL_PATTERN, ENV_NAME_PATTERN, QUANTITY_PATTERN

PATTERN_MEANINGS = {
    DNS_1035_PATTERN: "is not a DNS-1035 label: use lowercase letters, digits and '-', starting with a letter",
    DNS_1123_LABEL_PATTERN: "is not a DNS-1123 label: use lowercase letters, digits and '-'",
    QUANTITY_PATTERN: "is not a Kubernetes quantity such as 500Gi or 16G",
    ENV_NAME_PATTERN: "is not a valid environment variable name",
}


# Longest repr of a user's value an error message quotes; longer ones are cut.
MAX_QUOTED = 60


def quote(value: Any) -> str:
    """repr() of a value for a one-line message: escaped, and cut short when long."""
    text = repr(value)
    if len(text) <= MAX_QUOTED:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[:MAX_QUOTED - 10]}...{size}"


def one_line(message: str, limit: int = 1000) -> str:
    """A message as one readable line: control characters and line breaks escaped, cut at `limit` characters."""
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in message)
    if len(text) > limit:
        text = f"{text[:limit - 40]}... ({len(text) - limit + 40} more characters)"
    return text


class SpecError(ValueError):
    """A spec that cannot be served. `field` is a dotted path such as `spec.parallelism.tensor`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def path_part(key: Any) -> str:
    """A key as one part of a dotted field path: printable, and cut short when long."""
    text = str(key)
    text = text if text.isprintable() else repr(text)[1:-1]
    return text if len(text) <= 40 else f"{text[:32]}...({len(text)} characters)"


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{path_part(part)}" if out else path_part(part)
    return out


def _describe(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; `kubectl explain inferenceservice.spec` lists the fields)"
    if kind == "missing":
        return "required field is missing"
    if kind == "literal_error":
        return f"{quote(error['input'])} is not one of {error['ctx']['expected']}"
    if kind == "string_pattern_mismatch":
        pattern = error["ctx"]["pattern"]
        return f"{quote(error['input'])} {PATTERN_MEANINGS.get(pattern, 'does not match ' + pattern)}"
    message = error["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    if kind in {"string_too_long", "string_too_short", "greater_than_equal",
                "less_than_equal", "greater_than", "less_than", "too_long", "too_short"}:
        message = f"{quote(error['input'])}: {message}"
    return message


def from_validation_error(exc: ValidationError, prefix: str = "") -> SpecError:
    """Turn pydantic's report into one SpecError: the first problem, and how many more there are."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    # Errors raised by a model validator carry the model's own path; that is the field to name.
    inner = _path(loc)
    joint = "" if inner.startswith("[") else "."
    field = (f"{prefix}{joint}{inner}" if prefix and inner else prefix or inner) or "(document)"
    message = _describe(first)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return SpecError(field, message)
