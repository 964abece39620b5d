"""Check a document the way the API server checks it against the CRD, before the lenient models read it:
`check_document` walks the generated structural schema, drops nulls it does not allow and refuses unknown fields,
wrong types and out-of-bounds values; schema defaults and CEL rules are left to the models' twin validators.
Design: docs/api.md#checking-a-document-as-the-api-server-does."""

from __future__ import annotations

import copy
import difflib
import functools
import math
import re
from typing import Any

from pydantic.alias_generators import to_camel

from tensorfleet.api.crd import crd
from tensorfleet.api.errors import PATTERN_MEANINGS, SpecError, path_part, quote

INT64 = 2**63
_STRING: dict[str, Any] = {"type": "string"}
_STRING_MAP: dict[str, Any] = {"type": "object", "additionalProperties": _STRING}
_ANY_OBJECTS: dict[str, Any] = {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
# ObjectMeta as the API server reads it (the CRD says only `metadata: {type: object}`).
OBJECT_META: dict[str, Any] = {
    "type": "object",
    "properties": {
        **{name: _STRING for name in ("name", "generateName", "namespace", "selfLink", "uid", "resourceVersion",
                                      "creationTimestamp", "deletionTimestamp")},
        "generation": {"type": "integer"},
        "deletionGracePeriodSeconds": {"type": "integer"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
        "finalizers": {"type": "array", "items": _STRING},
        "ownerReferences": _ANY_OBJECTS,
        "managedFields": _ANY_OBJECTS,
    },
}
_EXPECTED = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
             "object": "a mapping of fields", "array": "a list"}
# Extra words for a string where a list belongs, by field.
_LIST_HINTS = {"spec.engine.args": "one flag or value per item, not one shell string"}
_BOOLEAN_WORDS = {"true", "false", "yes", "no", "on", "off", "y", "n"}
_NUMBER = re.compile(r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")
MAX_PROBLEMS = 100   # counted and reported as "and N more"; the walk stops collecting beyond


@functools.cache
def _root() -> dict[str, Any]:
    schema = copy.deepcopy(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = OBJECT_META
    return schema


def _kind(value: Any) -> str:
    """What a value is, in the words of a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {quote(value)}"
    if isinstance(value, str):
        return f"the string {quote(value)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a YAML {type(value).__name__} value"


def _explain(path: str) -> str:
    parts = [part for part in re.sub(r"\[\d+\]", "", path).split(".") if part]
    return ".".join(["inferenceservice", *parts])


class _Walk:
    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []
        self.count = 0

    def problem(self, path: str, message: str) -> None:
        self.count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append((path or "(document)", message))

    def value(self, value: Any, schema: dict[str, Any], path: str) -> Any:
        """The value as the API server would keep it; problems recorded on the way."""
        expected = schema.get("type")
        if expected is not None and not self._typed(value, expected, path):
            return value
        if isinstance(value, dict):
            return self._object(value, schema, path)
        if isinstance(value, list):
            return self._array(value, schema, path)
        self._scalar(value, schema, path)
        return value

    def _typed(self, value: Any, expected: str, path: str) -> bool:
        message: str | None = None
        if expected == "integer":
            if isinstance(value, int) and not isinstance(value, bool):
                if not -INT64 <= value < INT64:
                    message = f"{quote(value)} is out of range for a 64-bit integer"
            elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
                pass   # JSON has one number type; 2.0 is the integer 2
            elif isinstance(value, float) and math.isfinite(value):
                message = f"{quote(value)} is not a whole number; expected an integer"
            else:
                message = self._wrong(value, expected)
        elif expected == "number":
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if isinstance(value, float) and not math.isfinite(value):
                    message = f"{quote(value)} is not a finite number (JSON has no NaN or infinity)"
            else:
                message = self._wrong(value, expected)
        elif expected == "string":
            if not isinstance(value, str):
                message = self._wrong(value, expected)
        elif expected == "boolean":
            if not isinstance(value, bool):
                message = self._wrong(value, expected)
        elif expected == "object":
            if not isinstance(value, dict):
                message = self._wrong(value, expected)
        elif expected == "array" and not isinstance(value, list):
            message = self._wrong(value, expected)
            if isinstance(value, str):
                message += f" ({_LIST_HINTS.get(path, 'one `- item` per line')})"
        if message is not None:
            self.problem(path, message)
        return message is None

    @staticmethod
    def _wrong(value: Any, expected: str) -> str:
        want = _EXPECTED.get(expected, expected)
        if isinstance(value, str) and expected in ("integer", "number") and _NUMBER.match(value):
            return (f"{quote(value)} is a string; expected {want}: write {value.strip()} without quotes "
                    "(the API server does not turn strings into numbers)")
        if isinstance(value, str) and expected == "boolean" and value.strip().lower() in _BOOLEAN_WORDS:
            return f"{quote(value)} is a string; expected {want}, without quotes"
        if expected == "string" and isinstance(value, bool):
            return (f"got {_kind(value)}; expected a string: quote the value (YAML reads unquoted "
                    "true/false/yes/no/on/off as booleans)")
        if expected == "string" and isinstance(value, (int, float)):
            return f"got {_kind(value)}; expected a string: quote the value"
        if isinstance(value, float) and not math.isfinite(value):
            return f"got {quote(value)}, which JSON cannot carry; expected {want}"
        return f"got {_kind(value)}; expected {want}"

    def _object(self, value: dict[Any, Any], schema: dict[str, Any], path: str) -> dict[str, Any]:
        properties: dict[str, Any] = schema.get("properties", {})
        extra: dict[str, Any] | None = schema.get("additionalProperties") if isinstance(
            schema.get("additionalProperties"), dict) else None
        preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        if preserve and not properties and extra is None:
            return value
        out: dict[str, Any] = {}
        for raw_key, child in value.items():
            key = _json_key(raw_key)
            child_path = f"{path}.{path_part(key)}" if path else path_part(key)
            if key is None:
                self.problem(f"{path}[{quote(raw_key)}]" if path else quote(raw_key),
                             f"a field name must be a string, not {_kind(raw_key)}")
                continue
            child_schema = properties.get(key, extra)
            if child_schema is None:
                if preserve:
                    out[key] = child
                else:
                    self.problem(child_path, self._unknown(key, properties, path))
                continue
            if child is None and not child_schema.get("nullable"):
                continue   # the API server drops a null it does not allow, as if the field were left out
            out[key] = self.value(child, child_schema, child_path)
        for name in schema.get("required", []):
            if name not in out:
                self.problem(f"{path}.{name}" if path else name, "required field is missing")
        return out

    @staticmethod
    def _unknown(key: str, properties: dict[str, Any], path: str) -> str:
        camel = to_camel(key)
        if camel != key and camel in properties:
            hint = f" (fields are camelCase: {camel})"
        else:
            close = difflib.get_close_matches(key, list(properties), n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
        where = f"; `kubectl explain {_explain(path)}` lists the fields" if properties else ""
        return f"unknown field{hint}{where}"

    def _array(self, value: list[Any], schema: dict[str, Any], path: str) -> list[Any]:
        items = schema.get("items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            self.problem(path, f"{len(value)} items; at most {schema['maxItems']}")
        if "minItems" in schema and len(value) < schema["minItems"]:
            self.problem(path, f"{len(value)} items; at least {schema['minItems']}")
        out = [self.value(item, items, f"{path}[{index}]") if isinstance(items, dict) else item
               for index, item in enumerate(value)]
        list_type = schema.get("x-kubernetes-list-type")
        if list_type == "map":
            keys = schema.get("x-kubernetes-list-map-keys", [])
            seen: dict[tuple[Any, ...], int] = {}
            for index, item in enumerate(out):
                if isinstance(item, dict):
                    identity = tuple(_hashable(item.get(key)) for key in keys)
                    if identity in seen:
                        named = ", ".join(f"{key} {quote(item.get(key))}" for key in keys)
                        self.problem(f"{path}[{index}]", f"duplicate entry: {named} is also item {seen[identity]}")
                    seen.setdefault(identity, index)
        elif list_type == "set":
            seen_values: dict[Any, int] = {}
            for index, item in enumerate(out):
                identity = _hashable(item)
                if identity in seen_values:
                    self.problem(f"{path}[{index}]", f"duplicate entry: {quote(item)} is also item {seen_values[identity]}")
                seen_values.setdefault(identity, index)
        return out

    def _scalar(self, value: Any, schema: dict[str, Any], path: str) -> None:
        if "enum" in schema and value not in schema["enum"]:
            self.problem(path, f"{quote(value)} is not one of: {', '.join(str(option) for option in schema['enum'])}")
            return
        if isinstance(value, str):
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                self.problem(path, f"{quote(value)} is {len(value)} characters; at most {schema['maxLength']}")
            elif "minLength" in schema and len(value) < schema["minLength"]:
                self.problem(path, "must not be empty" if schema["minLength"] == 1
                             else f"{quote(value)} is shorter than {schema['minLength']} characters")
            elif "pattern" in schema and not re.search(schema["pattern"], value):
                meaning = PATTERN_MEANINGS.get(schema["pattern"], f"does not match {schema['pattern']}")
                self.problem(path, f"{quote(value)} {meaning}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if "minimum" in schema and value < schema["minimum"]:
                self.problem(path, f"{quote(value)} must be greater than or equal to {schema['minimum']}")
            elif "maximum" in schema and value > schema["maximum"]:
                self.problem(path, f"{quote(value)} must be less than or equal to {schema['maximum']}")


def _json_key(key: Any) -> str | None:
    """A mapping key as JSON has it: YAML numbers and booleans become strings, as kubectl converts them."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        return str(key).lower()
    if isinstance(key, (int, float)):
        return str(key)
    return None


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def check_document(document: dict[str, Any]) -> dict[str, Any]:
    """The document as the API server would accept it, or SpecError naming the first problem (and how many more)."""
    walk = _Walk()
    # The API server ignores status on the main resource; metadata is checked as ObjectMeta (OBJECT_META).
    without_status = {key: value for key, value in document.items() if key != "status"}
    checked = walk.value(without_status, _root(), "")
    if walk.problems:
        path, message = walk.problems[0]
        if walk.count > 1:
            more = walk.count - 1
            message += f" (and {more} more problem{'s' if more > 1 else ''})"
        raise SpecError(path, message)
    return checked
