"""Structured output for the simulator: the JSON that `response_format` (or vLLM's `structured_outputs` json, choice
and json_object) asks for, written whole and valid from the request's random generator and then emitted token by
token; schemas outside what it can generate are refused with 400. Design: docs/simulator.md#structured-output."""

from __future__ import annotations

import json
import math
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensorfleet.sim.engine import WORDS, RequestRejected

UNSUPPORTED_KEYWORDS = (
    "pattern", "patternProperties", "propertyNames", "multipleOf", "uniqueItems", "contains", "minContains",
    "maxContains", "prefixItems", "additionalItems", "allOf", "oneOf", "not", "if", "then", "else",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems",
    "minProperties", "maxProperties", "$dynamicRef", "$recursiveRef",
)
FORMATS = ("date", "date-time", "time", "email", "uuid", "uri", "hostname", "ipv4", "ipv6")
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
MAX_DEPTH = 64        # nesting a generated document may reach before a schema counts as endless
OPTIONAL_DEPTH = 4    # below this depth only required properties and minItems items are written
_PARAM = "response_format"


class SchemaError(RequestRejected):
    """A schema the simulator cannot generate an instance of: answered 400, like vLLM's grammar errors."""

    def __init__(self, detail: str, where: str) -> None:
        super().__init__(f"The provided JSON schema contains features not supported by the simulator: {detail} "
                         f"(at {where or '#'}).", _PARAM)


def _word(rng: random.Random) -> str:
    return WORDS[rng.randrange(len(WORDS))].strip()


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(low, high)))


def json_object(rng: random.Random) -> str:
    """A small JSON object: what `response_format: {"type": "json_object"}` gets."""
    value: dict[str, Any] = {}
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(3)
        value[_word(rng)] = _words(rng, 1, 4) if kind == 0 else rng.randint(0, 1000) if kind == 1 else rng.random() < 0.5
    return json.dumps(value)


@dataclass(frozen=True)
class _Range:
    low: tuple[float, bool] | None   # (bound, exclusive)
    high: tuple[float, bool] | None

    def admits(self, value: float) -> bool:
        if self.low is not None and (value < self.low[0] or (self.low[1] and value == self.low[0])):
            return False
        return self.high is None or not (value > self.high[0] or (self.high[1] and value == self.high[0]))


class JsonSchema:
    """A schema checked for what the simulator can generate; `generate` writes an instance of it."""

    def __init__(self, schema: Any) -> None:
        if not isinstance(schema, Mapping):
            raise RequestRejected("The JSON schema must be a JSON object.", _PARAM)
        self.root = schema
        self._check(schema, "#", set())

    # --- checking ------------------------------------------------------------------------------------------
    def _resolve(self, ref: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"$ref {ref!r} (only references inside the schema, starting with #)", where)
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or part not in node:
                raise SchemaError(f"$ref {ref!r} points at nothing", where)
            node = node[part]
        if not isinstance(node, Mapping):
            raise SchemaError(f"$ref {ref!r} points at something that is not a schema", where)
        return node

    def _check(self, schema: Any, where: str, refs: set[str]) -> None:
        if isinstance(schema, bool):
            if not schema:
                raise SchemaError("false (a schema nothing matches)", where)
            return
        if not isinstance(schema, Mapping):
            raise SchemaError("a schema that is not an object", where)
        for keyword in UNSUPPORTED_KEYWORDS:
            if keyword in schema:
                raise SchemaError(keyword, where)
        if "$ref" in schema:
            ref = schema["$ref"]
            target = self._resolve(ref, where)
            if ref not in refs:  # each reference is checked once; a recursive one is not followed again
                self._check(target, ref, refs | {ref})
        for key in ("$defs", "definitions"):
            defs = schema.get(key)
            if isinstance(defs, Mapping):
                for name, sub in defs.items():
                    self._check(sub, f"{where}/{key}/{name}", refs)
        types = self._types(schema, where)
        if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
            raise SchemaError("enum that is not a non-empty list", where)
        any_of = schema.get("anyOf")
        if any_of is not None:
            if not isinstance(any_of, list) or not any_of:
                raise SchemaError("anyOf that is not a non-empty list", where)
            for i, sub in enumerate(any_of):
                self._check(sub, f"{where}/anyOf/{i}", refs)
        properties = schema.get("properties", {})
        if not isinstance(properties, Mapping):
            raise SchemaError("properties that is not an object", where)
        for name, sub in properties.items():
            self._check(sub, f"{where}/properties/{name}", refs)
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError("required that is not a list of names", where)
        extra = schema.get("additionalProperties", True)
        missing = [r for r in required if r not in properties]
        if missing and extra is False:
            raise SchemaError(f"required {missing} not among the properties, with additionalProperties false",
                              where)
        if isinstance(extra, Mapping):
            self._check(extra, f"{where}/additionalProperties", refs)
        items = schema.get("items")
        if items is not None:
            self._check(items, f"{where}/items", refs)
        self._count_bounds(schema, "minItems", "maxItems", where)
        low, high = self._count_bounds(schema, "minLength", "maxLength", where)
        fmt = schema.get("format")
        if fmt is not None and "string" in types:
            if fmt not in FORMATS:
                raise SchemaError(f"format {fmt!r}", where)
            if low or high is not None:
                raise SchemaError("format with minLength or maxLength", where)
        if types & {"integer", "number"}:
            self._number_range(schema, "integer" in types and "number" not in types, where)

    def _types(self, schema: Mapping[str, Any], where: str) -> set[str]:
        kind = schema.get("type")
        if kind is None:
            return set()
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
            raise SchemaError(f"type {kind!r}", where)
        return set(kinds)

    @staticmethod
    def _count_bounds(schema: Mapping[str, Any], low_key: str, high_key: str, where: str) -> tuple[int, int | None]:
        low, high = schema.get(low_key, 0), schema.get(high_key)
        for key, value in ((low_key, low), (high_key, high)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise SchemaError(f"{key} {value!r}", where)
        if high is not None and low > high:
            raise SchemaError(f"{low_key} {low} above {high_key} {high}", where)
        return low, high

    @staticmethod
    def _number_range(schema: Mapping[str, Any], integer: bool, where: str) -> _Range:
        """The values allowed; SchemaError if there are none. Integer bounds are made inclusive integers."""
        bounds: dict[str, float] = {}
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = schema.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SchemaError(f"{key} {value!r} (a number is needed)", where)
            bounds[key] = float(value)
        low: tuple[float, bool] | None = None   # (bound, exclusive)
        high: tuple[float, bool] | None = None
        for key, exclusive in (("minimum", False), ("exclusiveMinimum", True)):
            if key in bounds:
                edge = (bounds[key], exclusive)
                low = edge if low is None or (edge[0], edge[1]) > (low[0], low[1]) else low
        for key, exclusive in (("maximum", False), ("exclusiveMaximum", True)):
            if key in bounds:
                edge = (bounds[key], exclusive)
                high = edge if high is None or (edge[0], not edge[1]) < (high[0], not high[1]) else high
        if integer:
            if low is not None:
                low = (math.floor(low[0]) + 1.0 if low[1] else float(math.ceil(low[0])), False)
            if high is not None:
                high = (math.ceil(high[0]) - 1.0 if high[1] else float(math.floor(high[0])), False)
        if low is not None and high is not None and (
                low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))):
            raise SchemaError("numeric bounds no value meets", where)
        return _Range(low, high)

    # --- generating ----------------------------------------------------------------------------------------
    def generate(self, rng: random.Random) -> str:
        """An instance of the schema, as compact JSON text with spaces after separators (json.dumps' default)."""
        return json.dumps(self._value(self.root, rng, 0, "#"))

    def _value(self, schema: Any, rng: random.Random, depth: int, where: str) -> Any:
        if depth > MAX_DEPTH:
            raise SchemaError("recursion with no end (every instance would be infinite)", where)
        if isinstance(schema, bool) or not schema:
            return _words(rng, 1, 3)  # any value will do
        if "$ref" in schema:
            return self._value(self._resolve(schema["$ref"], where), rng, depth + 1, schema["$ref"])
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return schema["enum"][rng.randrange(len(schema["enum"]))]
        if "anyOf" in schema:
            branches = schema["anyOf"]
            chosen = next((b for b in branches if not (isinstance(b, Mapping) and b.get("type") == "null")),
                          branches[0])
            return self._value(chosen, rng, depth + 1, f"{where}/anyOf")
        kinds = schema.get("type")
        if isinstance(kinds, list):
            kind = next((k for k in kinds if k != "null"), "null")
        elif isinstance(kinds, str):
            kind = kinds
        elif "properties" in schema or "required" in schema or "additionalProperties" in schema:
            kind = "object"
        elif "items" in schema or "minItems" in schema or "maxItems" in schema:
            kind = "array"
        else:
            kind = "string"
        if kind == "object":
            return self._object(schema, rng, depth, where)
        if kind == "array":
            return self._array(schema, rng, depth, where)
        if kind == "string":
            return self._string(schema, rng)
        if kind in ("integer", "number"):
            return self._number(schema, rng, kind == "integer", where)
        if kind == "boolean":
            return rng.random() < 0.5
        return None

    def _object(self, schema: Mapping[str, Any], rng: random.Random, depth: int, where: str) -> dict[str, Any]:
        properties: Mapping[str, Any] = schema.get("properties", {})
        required = schema.get("required", [])
        out: dict[str, Any] = {}
        for name, sub in properties.items():
            if name in required or depth < OPTIONAL_DEPTH:
                out[name] = self._value(sub, rng, depth + 1, f"{where}/properties/{name}")
        extra = schema.get("additionalProperties", True)
        for name in required:
            if name not in out:  # required but not described: any value the additional properties allow
                sub = extra if isinstance(extra, Mapping) else {}
                out[name] = self._value(sub, rng, depth + 1, f"{where}/additionalProperties")
        return out

    def _array(self, schema: Mapping[str, Any], rng: random.Random, depth: int, where: str) -> list[Any]:
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if depth < OPTIONAL_DEPTH:
            top = low + 3 if high is None else min(high, low + 3)
            count = rng.randint(max(low, min(1, top)), top)
        else:
            count = low
        items = schema.get("items", {})
        return [self._value(items, rng, depth + 1, f"{where}/items") for _ in range(count)]

    def _string(self, schema: Mapping[str, Any], rng: random.Random) -> str:
        fmt = schema.get("format")
        if fmt == "date":
            return f"20{rng.randint(10, 30)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        if fmt == "time":
            return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"
        if fmt == "date-time":
            return (f"20{rng.randint(10, 30)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
                    f"T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z")
        if fmt == "email":
            return f"{_word(rng)}.{_word(rng)}@example.com"
        if fmt == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if fmt == "uri":
            return f"https://example.com/{_word(rng)}/{_word(rng)}"
        if fmt == "hostname":
            return f"{_word(rng)}.example.com"
        if fmt == "ipv4":
            return f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
        if fmt == "ipv6":
            return f"fd00::{rng.getrandbits(16):x}:{rng.getrandbits(16):x}"
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        text = _words(rng, 1, 4)
        while len(text) < low:
            text += " " + _word(rng)
        return text if high is None else text[:high]

    def _number(self, schema: Mapping[str, Any], rng: random.Random, integer: bool, where: str) -> int | float:
        allowed = self._number_range(schema, integer, where)
        low = allowed.low[0] if allowed.low else None
        high = allowed.high[0] if allowed.high else None
        if low is None:
            low = (high if high is not None else 100.0) - 100.0
        if high is None:
            high = low + 100.0
        if integer:
            return rng.randint(int(low), int(high))
        value = round(low + (high - low) * rng.uniform(0.1, 0.9), 3)
        return value if allowed.admits(value) else (low + high) / 2


def choices_of(choices: Any) -> Sequence[str]:
    """The choices of vLLM's `structured_outputs.choice`: a non-empty list of strings (refused as vLLM refuses
    an empty one)."""
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise RequestRejected("structured_outputs.choice must be a list of strings.", "structured_outputs")
    if not choices:
        raise RequestRejected(f"Choice '{choices}' cannot be an empty list")
    return choices
