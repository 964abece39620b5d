"""The one reader of Prometheus text (exposition format 0.0.4) in Tensorfleet.

Whatever reads a /metrics page (the router scraping vLLM, the worker draining
its engine, tests, benchmarks, e2e) goes through here; nothing else parses the
format by hand. The parsing itself is prometheus_client's own
(`prometheus_client.parser.text_string_to_metric_families`); this module
flattens its families into samples keyed by the name each sample has on the
wire: a counter reads as `vllm:prompt_tokens_total`, a histogram as its
`_bucket` (with an `le` label), `_sum` and `_count`. Names may hold colons
(`vllm:num_requests_waiting`). Values are floats, `NaN` and `+Inf` included;
callers decide what a NaN means to them.

One difference from the raw wire: prometheus_client names every counter's
samples with `_total`, so a counter declared as `# TYPE foo counter` whose
sample is `foo 1` reads as `foo_total`. Every exporter we read (vLLM, our own
processes; all prometheus_client) writes the `_total` itself.

Text that does not parse raises ValueError: a scrape that returns it has
failed, and the caller treats it as it treats any other failed scrape.

A caller that wants a few metrics of a large page (the router reads four of
vLLM's hundreds of lines every health interval, per engine) names them:
`samples(text, names=...)` hands the parser only those families' lines
(prometheus_client's parser is pure Python: the simulator's 157-line page
takes 2.6 ms whole, 0.19 ms for the router's four). Lines are picked by the
metric name they start with, nothing more; what is picked is parsed as above.
So a page with none of the named metrics is parsed whole (an HTML error page
still raises), while a page with them is not checked past their lines.
"""

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
    """Every sample in TEXT, in the order they appear; only those named NAMES
    when given (see the module docstring).

    Raises ValueError when TEXT is not Prometheus text (an HTML error page, a
    truncated answer, a line that does not parse).
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
