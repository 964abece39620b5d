"""Bytes of a manifest file -> its YAML documents, as kubectl reads them: `parse_manifests` returns the documents or
raises ManifestError with one line, within fixed bounds of size, encoding, nesting, nodes (aliases counted as what
they expand to) and duplicate keys, checked on the event stream before anything is built.
Design: docs/api.md#reading-a-manifest-file."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

import yaml

MAX_INPUT_BYTES = 3 * 1024 * 1024
MAX_DEPTH = 64
MAX_NODES = 20_000   # an InferenceService has a few hundred; a file of dozens fits

# libyaml when PyYAML was built with it (its wheels are): the same YAML, ten times faster.
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _ManifestLoader(_Loader):  # type: ignore[misc,valid-type]  # CSafeLoader or SafeLoader, chosen at import
    """Safe loading, with YAML timestamps left as the strings they are written as."""


def _timestamp_as_text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> str:
    return str(loader.construct_scalar(node))


_ManifestLoader.add_constructor("tag:yaml.org,2002:timestamp", _timestamp_as_text)

_NULLS = {"", "~", "null", "Null", "NULL"}
_MERGE_KEY = "<<"


class ManifestError(ValueError):
    """The input cannot be read as YAML documents; the message is one line."""


# --- encoding --------------------------------------------------------------------------

_BOMS = (  # longest first: the UTF-32 LE mark starts with the UTF-16 LE one
    (codecs.BOM_UTF32_BE, "utf-32-be", "UTF-32"),
    (codecs.BOM_UTF32_LE, "utf-32-le", "UTF-32"),
    (codecs.BOM_UTF8, "utf-8", "UTF-8"),
    (codecs.BOM_UTF16_BE, "utf-16-be", "UTF-16"),
    (codecs.BOM_UTF16_LE, "utf-16-le", "UTF-16"),
)


def _encoding(data: bytes) -> tuple[str, str, int]:
    """(codec, name for messages, bytes of byte-order mark to skip)."""
    for bom, codec, name in _BOMS:
        if data.startswith(bom):
            return codec, name, len(bom)
    # No mark: YAML 1.2 section 5.2 tells the encodings apart by where the
    # zero bytes of the first (ASCII) character fall.
    head = data[:4]
    if len(head) == 4 and head[:3] == b"\0\0\0" and head[3]:
        return "utf-32-be", "UTF-32", 0
    if len(head) == 4 and head[0] and head[1:] == b"\0\0\0":
        return "utf-32-le", "UTF-32", 0
    if len(head) >= 2 and head[0] == 0 and head[1]:
        return "utf-16-be", "UTF-16", 0
    if len(head) >= 2 and head[0] and head[1] == 0:
        return "utf-16-le", "UTF-16", 0
    return "utf-8", "UTF-8", 0


def decode(data: bytes) -> str:
    """The text of a manifest: UTF-8, or UTF-16/32 by byte-order mark; ManifestError naming the bad byte."""
    codec, name, skip = _encoding(data)
    try:
        return data[skip:].decode(codec)
    except UnicodeDecodeError as exc:
        start = skip + exc.start
        before = data[skip:start]
        newline = "\n".encode(codec)
        line = before.count(newline) + 1
        column_bytes = before[before.rfind(newline) + len(newline):] if newline in before else before
        column = len(column_bytes.decode(codec, errors="replace")) + 1
        bad = data[start:start + min(exc.end - exc.start, 4)].hex(" ").upper()
        hint = ("save the file as UTF-8 (or UTF-16 with a byte-order mark)" if name == "UTF-8"
                else f"the file starts like {name} but is not; save it as UTF-8")
        raise ManifestError(f"not {name} text: byte {bad} at line {line}, column {column} cannot be decoded; {hint}") from None


# --- the event pre-pass --------------------------------------------------------------


@dataclass
class _Frame:
    """An open mapping or sequence."""

    mapping: bool
    anchor: str | None
    line: int
    nodes: int = 1                    # nodes inside, aliases expanded, this one included
    index: int = 0                    # sequences: the next item's index
    key: str | None = None            # mappings: the key whose value comes next
    expect_key: bool = True           # mappings: the next node is a key
    keys: dict[str, int] = field(default_factory=dict)   # key -> line it first appeared on


@dataclass
class _Scan:
    documents: int = 0                 # non-empty documents so far
    duplicate: tuple[int, str, str] | None = None   # (document, path, message) of the first duplicate key


def _path(frames: list[_Frame], leaf: str | None = None) -> str:
    parts: list[str] = []
    for frame in frames:
        if frame.mapping:
            if frame.key is not None and not frame.expect_key:
                parts.append(_short_key(frame.key))
        else:
            parts.append(f"[{frame.index}]")
    if leaf is not None:
        parts.append(_short_key(leaf))
    out = ""
    for part in parts:
        out += part if part.startswith("[") or not out else f".{part}"
    return out or "(document)"


def _short_key(key: str) -> str:
    text = key if key.isprintable() else repr(key)[1:-1]
    return text if len(text) <= 40 else f"{text[:32]}...({len(key)} characters)"


def _where(event: yaml.Event) -> str:
    mark = event.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "an unknown place"


def _plain(event: yaml.ScalarEvent) -> bool:
    return event.tag is None and bool(event.implicit[0]) and not event.style


def _scan(text: str) -> _Scan:
    """Check the bounds and duplicate keys on the event stream; raise ManifestError at the first bound crossed."""
    scan = _Scan()
    frames: list[_Frame] = []
    anchors: dict[str, int] = {}          # anchor -> nodes it stands for
    scalar_anchors: dict[str, str] = {}   # anchor of a scalar -> its text (an aliased key)
    open_anchors: set[str] = set()
    total = 0
    document_empty = True
    for event in yaml.parse(text, Loader=_ManifestLoader):
        if isinstance(event, yaml.DocumentStartEvent):
            anchors, scalar_anchors, document_empty = {}, {}, True
            continue
        if isinstance(event, yaml.DocumentEndEvent):
            scan.documents += 0 if document_empty else 1
            continue
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            done = frames.pop()
            if done.anchor is not None:
                anchors[done.anchor] = done.nodes
                open_anchors.discard(done.anchor)
            if frames:
                frames[-1].nodes += done.nodes
                _advance(frames[-1])
            continue
        if not isinstance(event, yaml.NodeEvent):
            continue   # stream start and end
        # A node: a scalar, an alias, or the start of a mapping or sequence.
        if not frames and isinstance(event, yaml.ScalarEvent) and _plain(event) and event.value in _NULLS:
            continue   # an empty document
        document_empty = False
        parent = frames[-1] if frames else None
        if isinstance(event, yaml.AliasEvent):
            name = event.anchor or ""
            if name in open_anchors:
                raise ManifestError(f"{_where(event)}: alias *{name} refers to a node that contains it; "
                                    "recursive YAML has no JSON form")
            nodes = anchors.get(name)
            if nodes is None:
                raise ManifestError(f"{_where(event)}: alias *{name} refers to no anchor &{name} before it")
        else:
            nodes = 1
        total += nodes
        if total > MAX_NODES:
            raise ManifestError(
                f"{_where(event)}: more than {MAX_NODES:,} values in the file, counting each alias as the values it "
                "repeats; an InferenceService has a few hundred (is this an alias bomb?)"
            )
        if parent is not None and parent.mapping and parent.expect_key:
            key = None
            if isinstance(event, yaml.ScalarEvent):
                key = event.value
            elif isinstance(event, yaml.AliasEvent):
                key = scalar_anchors.get(event.anchor or "")
            if key is not None and not (key == _MERGE_KEY and isinstance(event, yaml.ScalarEvent) and _plain(event)):
                first = parent.keys.get(key)
                if first is not None and scan.duplicate is None:
                    line = event.start_mark.line + 1 if event.start_mark is not None else 0
                    message = (f"duplicate key (lines {first} and {line}): the API server refuses a field given "
                               "twice, and which value would win is not what you see; keep one")
                    scan.duplicate = (scan.documents, _path(frames, key), message)
                parent.keys.setdefault(key, event.start_mark.line + 1 if event.start_mark is not None else 0)
        if isinstance(event, yaml.CollectionStartEvent):
            if len(frames) >= MAX_DEPTH:
                raise ManifestError(f"{_where(event)}: nested more than {MAX_DEPTH} levels deep; "
                                    "an InferenceService needs a handful")
            if parent is not None and parent.mapping and parent.expect_key:
                parent.key = None   # a mapping or list as a key: no JSON form; the schema check says so
            frames.append(_Frame(isinstance(event, yaml.MappingStartEvent), event.anchor,
                                 event.start_mark.line + 1 if event.start_mark is not None else 0))
            if event.anchor is not None:
                open_anchors.add(event.anchor)
            continue
        if isinstance(event, yaml.ScalarEvent) and event.anchor is not None:
            anchors[event.anchor] = 1
            scalar_anchors[event.anchor] = event.value
        if parent is not None:
            parent.nodes += nodes
            if parent.mapping and parent.expect_key:
                parent.key = event.value if isinstance(event, yaml.ScalarEvent) else (
                    scalar_anchors.get(event.anchor or "") if isinstance(event, yaml.AliasEvent) else None)
                parent.expect_key = False
            else:
                _advance(parent)
    return scan


def _advance(frame: _Frame) -> None:
    """A node finished inside `frame`: the next is a key, or the next item."""
    if frame.mapping:
        if frame.expect_key:
            frame.expect_key = False   # a mapping or list used as a key just ended
        else:
            frame.expect_key = True
    else:
        frame.index += 1


def _yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"not valid YAML{where}: {problem}"


def parse_manifests(data: bytes, label: str) -> list[tuple[str, Any]]:
    """(label, document) for each non-empty YAML document; `label[i]` when there are several."""
    if len(data) > MAX_INPUT_BYTES:
        raise ManifestError(f"{label}: larger than {MAX_INPUT_BYTES // (1024 * 1024)} MiB, the most the API server "
                            "accepts in one request; an InferenceService is a few KiB")
    try:
        text = decode(data)
    except ManifestError as exc:
        raise ManifestError(f"{label}: {exc}") from None
    try:
        scan = _scan(text)
    except ManifestError as exc:
        raise ManifestError(f"{label}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ManifestError(f"{label}: {_yaml_error(exc)}") from None
    if scan.duplicate is not None:
        index, path, message = scan.duplicate
        raise ManifestError(f"{label if scan.documents == 1 else f'{label}[{index}]'}: {path}: {message}")
    try:
        documents = [d for d in yaml.load_all(text, Loader=_ManifestLoader) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{label}: {_yaml_error(exc)}") from None
    if not documents:
        raise ManifestError(f"{label}: no InferenceService in the file")
    if len(documents) == 1:
        return [(label, documents[0])]
    return [(f"{label}[{index}]", document) for index, document in enumerate(documents)]
