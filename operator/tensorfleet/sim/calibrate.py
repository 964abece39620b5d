"""`tensorfleet sim calibrate`'s fit and file: the sweep's points (measured by `probe` against a running vLLM, GPU
or CPU), the simulator's step time fitted to them (relative least squares, non-negative terms), and the profile
`tensorfleet sim --profile` loads, written and read back. Design:
docs/real-engine.md#calibrating-the-simulator-against-a-real-engine."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tensorfleet.sim.profile import Profile, StepModel, resilient_profile

PROFILE_KIND = "tensorfleet-sim-profile"
PROFILE_VERSION = 1
TERMS = ("overhead_s", "per_decode_seq_s", "per_prefill_token_s", "per_context_token_s", "first_token_s",
         "first_token_busy_s")
# Dropped first when the sweep cannot tell the terms apart.
DROP_ORDER = ("per_context_token_s", "first_token_busy_s", "first_token_s", "per_prefill_token_s", "per_decode_seq_s",
              "overhead_s")


class CalibrationError(Exception):
    """The engine could not be measured, or a profile file is not one."""


@dataclass(frozen=True)
class Sweep:
    """What the calibration measures: prefill probes (idle, and behind `prefill_background` decoding requests),
    decode points (N requests at once per context) and sustained closed loops; the defaults take a minute or two,
    and no new point starts after `time_limit_s`."""

    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    contexts: tuple[int, ...] = (64, 1024)        # prompt tokens of the decode points
    decode_tokens: int = 128                      # tokens each decode request generates
    prompt_lengths: tuple[int, ...] = (16, 128, 512, 1024, 2048)  # prefill points
    repeats: int = 3                              # of each decode point
    prefill_repeats: int = 5                      # of each prefill length (they are quick)
    probe_pause_s: float = 0.2                    # before each prefill request: a random pause up to this
    sustained_s: float = 6.0                      # the window of each sustained point (0: none)
    prefill_background: int = 2                   # requests decoding behind the busy prefill points (0: none)
    warmup: int = 3                               # requests sent first and not measured
    time_limit_s: float = 150.0                   # no new point starts after this
    seed: int = 0                                 # of the prompts' token ids
    request_timeout_s: float = 120.0


@dataclass(frozen=True)
class Capacity:
    """What the engine holds; None where it could not be learned (the simulator's default applies)."""

    max_model_len: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs_source: str = ""   # "given", "learned" or ""

    @property
    def kv_cache_tokens(self) -> int | None:
        if self.block_size is None or self.num_gpu_blocks is None:
            return None
        return self.block_size * self.num_gpu_blocks


@dataclass(frozen=True)
class DecodePoint:
    concurrency: int
    prompt_tokens: int
    context_tokens: int      # summed over the batch, at the middle of the window
    itl_s: float             # mean step time while all `concurrency` sequences decode
    requests: int            # requests whose events fell in the window
    window_s: float
    engine_itl_s: float | None = None  # the engine's own vllm:inter_token_latency_seconds mean over the point
    max_running: int = 0
    max_waiting: int = 0


@dataclass(frozen=True)
class PrefillPoint:
    prompt_tokens: int
    chunks: int              # steps the prompt takes
    ttft_s: float            # median over the samples
    samples: tuple[float, ...] = ()
    engine_prefill_s: float | None = None  # vLLM's own request_prefill_time_seconds mean (scheduled -> first token)
    background: int = 0                    # requests decoding meanwhile (0: the engine idle)
    background_context: int = 0            # their context tokens, summed, at the median probe


@dataclass(frozen=True)
class SustainedPoint:
    concurrency: int
    seconds: float           # the window
    steps: int               # engine steps in it (vllm:iteration_tokens_total)
    generated_tokens: int
    prompt_tokens: int
    step_s: float            # the mean step: seconds / steps
    decode_seqs: float       # per step: generated tokens
    prefill_tokens: float    # per step: prompt tokens
    context_tokens: float    # per step: the decoding sequences' context (mean prompt + half the mean answer each)


@dataclass(frozen=True)
class FitRow:
    kind: str                # "decode", "prefill" or "sustained"
    features: tuple[float, ...]
    measured_s: float


@dataclass(frozen=True)
class Fit:
    model: StepModel
    dropped: tuple[str, ...]           # terms held at 0, and why
    rows: tuple[dict[str, Any], ...]   # every measurement with the model's prediction
    max_relative_error: float
    mean_relative_error: float


# --- the fit -------------------------------------------------------------------------------------------------


def solve(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float] | None:
    """Least squares: the x minimising |rows x - targets|, by the normal equations (columns scaled to 1 first,
    so seconds and tokens of very different sizes do not matter) and Gaussian elimination with partial pivoting.
    None when the columns are linearly dependent (a pivot vanishes)."""
    if not rows:
        return None
    width = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(width)]
    a = [[v / s for v, s in zip(r, scale)] for r in rows]
    normal = [[sum(r[i] * r[j] for r in a) for j in range(width)] + [sum(r[i] * y for r, y in zip(a, targets))]
              for i in range(width)]
    norm = max((abs(v) for row in normal for v in row[:width]), default=0.0)
    for col in range(width):
        pivot = max(range(col, width), key=lambda i: abs(normal[i][col]))
        if abs(normal[pivot][col]) <= 1e-10 * max(norm, 1e-300):
            return None
        normal[col], normal[pivot] = normal[pivot], normal[col]
        for i in range(width):
            if i != col:
                factor = normal[i][col] / normal[col][col]
                for j in range(col, width + 1):
                    normal[i][j] -= factor * normal[col][j]
    return [normal[i][width] / normal[i][i] / scale[i] for i in range(width)]


def fit_rows(decode: Sequence[DecodePoint], prefill: Sequence[PrefillPoint],
             sustained: Sequence[SustainedPoint] = ()) -> list[FitRow]:
    """One row per decode point (the median of its repeats), prefill length and sustained point, its features in
    TERMS order, for a model linear in what a vLLM step holds:

        decode point        overhead + per_decode_seq x N + per_context_token x context
        prefill, idle       first_token + chunks x overhead + per_prefill_token x prompt
        prefill, B decoding first_token_busy + (chunks + 0.5) x (overhead + per_decode_seq x B
                            + per_context_token x context) + per_prefill_token x prompt
        sustained           overhead + per_decode_seq x decoding + per_prefill_token x prefill
                            + per_context_token x context, each per step

    `chunks` is the steps a prompt takes (ceil(prompt / max-num-batched-tokens) when that is known, less the B
    decode tokens when busy, else 1); behind B decoding requests a probe waits half the step in progress, then
    shares its steps with them."""
    repeats: dict[tuple[int, int], list[DecodePoint]] = {}
    for point in decode:
        repeats.setdefault((point.concurrency, point.prompt_tokens), []).append(point)
    rows = [FitRow("decode", (1.0, float(n), 0.0, statistics.median(p.context_tokens for p in points), 0.0, 0.0),
                   statistics.median(p.itl_s for p in points))
            for (n, _), points in repeats.items()]
    for p in prefill:
        if p.background:
            steps = p.chunks + 0.5  # half the step in progress, then the prompt's own, each with the decodes
            features = (steps, steps * p.background, float(p.prompt_tokens), steps * p.background_context, 0.0, 1.0)
        else:
            features = (float(p.chunks), 0.0, float(p.prompt_tokens), 0.0, 1.0, 0.0)
        rows.append(FitRow("prefill", features, p.ttft_s))
    rows += [FitRow("sustained", (1.0, p.decode_seqs, p.prefill_tokens, p.context_tokens, 0.0, 0.0), p.step_s)
             for p in sustained]
    return rows


def fit(decode: Sequence[DecodePoint], prefill: Sequence[PrefillPoint],
        sustained: Sequence[SustainedPoint] = ()) -> Fit:
    """The StepModel that best fits the measurements: least squares on relative errors (each row divided by its
    measurement, so a 5 ms ITL counts as much as a 500 ms TTFT), with non-negative coefficients: a term that fits
    negative (noise on a term that does not matter on that engine) is dropped and the rest refitted, and so is a
    term no measurement tells apart (one context length only: context tokens move with N)."""
    rows = [r for r in fit_rows(decode, prefill, sustained) if r.measured_s > 0]
    if not rows:
        raise CalibrationError("nothing was measured: no decode or prefill point to fit")
    active = [t for t in TERMS if any(r.features[TERMS.index(t)] for r in rows)]
    dropped = [f"{t}: the sweep has no measurement it appears in" for t in TERMS if t not in active]
    while True:
        if not active:
            raise CalibrationError("no term of the step model could be fitted to the measurements")
        index = [TERMS.index(t) for t in active]
        weighted = [[r.features[i] / r.measured_s for i in index] for r in rows]
        solution = solve(weighted, [1.0] * len(rows)) if len(rows) >= len(active) else None
        if solution is None:
            term = next(t for t in DROP_ORDER if t in active)
            active.remove(term)
            dropped.append(f"{term}: the sweep cannot tell it from the other terms")
            continue
        negative = min(range(len(active)), key=lambda k: solution[k])
        if solution[negative] < 0:
            dropped.append(f"{active[negative]}: fitted negative ({solution[negative]:.3g}), held at 0")
            active.pop(negative)
            continue
        break
    values = dict.fromkeys(TERMS, 0.0)
    values.update(zip(active, solution))
    busy = any(r.features[TERMS.index("first_token_busy_s")] for r in rows)
    model = StepModel(overhead_s=values["overhead_s"], per_decode_seq_s=values["per_decode_seq_s"],
                      per_prefill_token_s=values["per_prefill_token_s"],
                      per_context_token_s=values["per_context_token_s"], first_token_s=values["first_token_s"],
                      first_token_busy_s=values["first_token_busy_s"] if busy else None)
    report = []
    errors = []
    for r in rows:
        predicted = sum(values[t] * x for t, x in zip(TERMS, r.features))
        error = predicted / r.measured_s - 1.0
        errors.append(abs(error))
        report.append({"kind": r.kind, **dict(zip(("steps", "decode_seqs", "prefill_tokens", "context_tokens",
                                                    "first_token", "first_token_busy"), r.features)),
                       "measured_s": r.measured_s, "predicted_s": predicted, "relative_error": error})
    return Fit(model, tuple(dropped), tuple(report), max(errors), statistics.mean(errors))


# --- the profile file ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """A profile file, read back."""

    step: StepModel
    capacity: Capacity
    engine: Mapping[str, Any]
    document: Mapping[str, Any] = field(repr=False)

    @property
    def source(self) -> str:
        e = self.engine
        return f"vLLM {e.get('version') or '?'} serving {e.get('model') or '?'} at {e.get('url') or '?'}"

    def profile(self, model: str | None = None, accelerator: str | None = None, *, tensor: int | None = None,
                max_model_len: int | None = None, max_num_seqs: int | None = None,
                kv_cache_tokens: int | None = None, max_num_batched_tokens: int | None = None,
                block_size: int | None = None) -> Profile:
        """The simulator's Profile: the capacity the flags give, else the profile's, else the simulator's
        defaults; the step time fitted. MODEL and ACCELERATOR name the catalog facts the rest of the simulator
        still uses (the KV bytes a disaggregated transfer moves); the model's name defaults to the engine's."""
        cap = self.capacity
        base = resilient_profile(
            model, accelerator, tensor=tensor,
            max_model_len=max_model_len or cap.max_model_len,
            max_num_seqs=max_num_seqs or cap.max_num_seqs,
            kv_cache_tokens=kv_cache_tokens or cap.kv_cache_tokens,
            max_num_batched_tokens=max_num_batched_tokens or cap.max_num_batched_tokens,
            block_size=block_size or cap.block_size,
        )
        name = model or str(self.engine.get("root") or self.engine.get("model") or base.model)
        return replace(base, model=name, fitted=self.step, source=self.source)


def document(engine: Mapping[str, Any], capacity: Capacity, sweep: Sweep, decode: Sequence[DecodePoint],
             prefill: Sequence[PrefillPoint], result: Fit, notes: Sequence[str] = (),
             sustained: Sequence[SustainedPoint] = ()) -> dict[str, Any]:
    """The profile file's content: `kind` PROFILE_KIND, `version` PROFILE_VERSION, the engine's identity (URL,
    release, model, cache config), its capacity, the sweep, the raw measurements and the fitted constants with
    each measurement's prediction and the largest relative error. `load` reads it back."""
    return {
        "kind": PROFILE_KIND,
        "version": PROFILE_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "engine": dict(engine),
        "capacity": {**asdict(capacity), "kv_cache_tokens": capacity.kv_cache_tokens},
        "sweep": asdict(sweep),
        "measurements": {"decode": [asdict(p) for p in decode], "prefill": [asdict(p) for p in prefill],
                         "sustained": [asdict(p) for p in sustained]},
        "fit": {
            "model": "step = overhead_s + per_decode_seq_s x decode seqs + per_prefill_token_s x prefill tokens "
                     "+ per_context_token_s x context tokens of the decoding seqs; a request's first step waits "
                     "first_token_s (first_token_busy_s while others run) more (least squares on relative errors, "
                     "non-negative)",
            **asdict(result.model),
            "dropped": list(result.dropped),
            "max_relative_error": result.max_relative_error,
            "mean_relative_error": result.mean_relative_error,
            "rows": list(result.rows),
        },
        "notes": list(notes),
    }


def write(path: str | Path, doc: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def _optional_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CalibrationError(f"capacity.{name} must be a positive integer or null, got {value!r}")
    return value


def parse(doc: Any, label: str = "profile") -> Calibration:
    """A Calibration from a profile document; CalibrationError naming what is wrong."""
    if not isinstance(doc, dict) or doc.get("kind") != PROFILE_KIND:
        raise CalibrationError(f"{label}: not a simulator profile (no \"kind\": \"{PROFILE_KIND}\"); "
                               "write one with `tensorfleet sim calibrate`")
    if doc.get("version") != PROFILE_VERSION:
        raise CalibrationError(f"{label}: profile version {doc.get('version')!r}; this simulator reads version "
                               f"{PROFILE_VERSION} (calibrate again)")
    fitted = doc.get("fit")
    if not isinstance(fitted, dict):
        raise CalibrationError(f"{label}: no \"fit\" object")
    values: dict[str, float | None] = {}
    for term in TERMS:
        value = fitted.get(term)
        if value is None and term == "first_token_busy_s":  # not measured
            values[term] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise CalibrationError(f"{label}: fit.{term} must be a non-negative number, got {value!r}")
        values[term] = float(value)
    cap = doc.get("capacity") or {}
    if not isinstance(cap, dict):
        raise CalibrationError(f"{label}: \"capacity\" must be an object")
    try:
        capacity = Capacity(**{name: _optional_int(cap.get(name), name) for name in (
            "max_model_len", "block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens")},
            max_num_seqs_source=str(cap.get("max_num_seqs_source") or ""))
    except CalibrationError as exc:
        raise CalibrationError(f"{label}: {exc}") from None
    engine = doc.get("engine")
    step = StepModel(**{t: v for t, v in values.items() if v is not None})  # busy, when absent: as idle (None)
    return Calibration(step, capacity, engine if isinstance(engine, dict) else {}, doc)


def load(path: str | Path) -> Calibration:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise CalibrationError(f"{path}: not JSON: {exc}") from None
    return parse(doc, str(path))
