"""The one reader of Prometheus text (exposition format 0.0.4) in Tensorfleet: whatever reads a /metrics page (the
router scraping vLLM, the worker draining its engine, tests, benchmarks, e2e) goes through here. prometheus_client's
parser reads it; this module flattens the families into samples keyed by the name each has on the wire, and raises
ValueError for text that does not parse. Design: docs/architecture.md#processes-and-what-crosses-between-them."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Sample", "samples", "select", "total", "value"]


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


# The suffixes a sample's name adds to its family's (`# TYPE` names the family).
_SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count", "_gsum", "_gcount", "_info")
_NAME_END = re.compile(r"[{ \t]")  # where a sample line's metric name ends: at its labels or its value


def samples(text: str, names: Collection[str] | None = None) -> list[Sample]:
    """Every sample in TEXT, in the order they appear, named as on the wire: a counter as
    `vllm:prompt_tokens_total`, a histogram as its `_bucket` (with an `le` label), `_sum` and `_count`; names may
    hold colons. Values are floats, `NaN` and `+Inf` included: callers decide what a NaN means to them.
    prometheus_client names every counter's samples with `_total`, so `# TYPE foo counter` with a sample `foo 1`
    reads as `foo_total`; every exporter we read (vLLM, our own processes) writes the `_total` itself.

    NAMES, when given, keeps only those samples, and hands the parser only their families' lines (picked by the
    metric name a line starts with, nothing more): the parser is pure Python, and the router reads four of vLLM's
    hundreds of lines every health interval per engine (the simulator's 157-line page: 2.6 ms whole, 0.19 ms for
    those four). A page with none of them is parsed whole (an HTML error page still raises); a page with them is
    not checked past their lines.

    Raises ValueError when TEXT is not Prometheus text (an HTML error page, a
    truncated answer, a line that does not parse): the caller treats it as any other failed scrape.
    """
    if names is not None:
        text = _pick(text, names) or text
    try:
        return [Sample(s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples
                if names is None or s.name in names]
    # prometheus_client raises ValueError for what it cannot read; the others
    # are there so that no input it mishandles escapes as anything else.
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        detail = str(exc) or "a line does not parse"
        raise ValueError(f"malformed Prometheus text: {detail}") from exc


def _pick(text: str, names: Collection[str]) -> str | None:
    """The lines of TEXT that belong to the families of NAMES (their `# HELP` and `# TYPE` lines and samples),
    or None when there is no sample among them."""
    families = set(names)
    for name in names:
        families.update(name[:-len(suffix)] for suffix in _SUFFIXES if name.endswith(suffix))
    kept: list[str] = []
    found = False
    for line in text.splitlines():
        line = line.lstrip(" \t")  # as the parser reads a line
        if line.startswith("#"):
            words = line.split(None, 3)
            if len(words) > 2 and words[1] in ("HELP", "TYPE") and words[2] in families:
                kept.append(line)
            continue
        metric = _NAME_END.split(line, 1)[0]
        if metric and metric in families:
            kept.append(line)
            found = True
    return "\n".join(kept) + "\n" if found else None


def select(source: str | Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    """The samples named NAME whose labels include LABELS (other labels may be
    there too), in order. SOURCE is the text or samples already parsed."""
    parsed = samples(source) if isinstance(source, str) else source
    return [s for s in parsed if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def value(source: str | Iterable[Sample], name: str, **labels: str) -> float | None:
    """The value of the first sample `select` finds; None when there is none."""
    found = select(source, name, **labels)
    return found[0].value if found else None


def total(source: str | Iterable[Sample], name: str, **labels: str) -> float:
    """The sum of the values of the samples `select` finds; 0.0 when there is none."""
    return sum((s.value for s in select(source, name, **labels)), 0.0)
