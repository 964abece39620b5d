"""`tensorfleet sim calibrate`: measure a running vLLM (any: GPU or CPU) with a short, bounded sweep of prefill,
decode and sustained-load points, fit the simulator's step time to it (relative least squares, non-negative terms)
and write the profile `tensorfleet sim --profile` loads. Design:
docs/real-engine.md#calibrating-the-simulator-against-a-real-engine."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorfleet import contract
from tensorfleet.sim.profile import Profile, StepModel, resilient_profile

# aiohttp and promtext (prometheus_client) are the sim extra's: imported where they are used, so that the
# command line, which reads Sweep's defaults, builds without them.
if TYPE_CHECKING:
    import aiohttp

    from tensorfleet import promtext

PROFILE_KIND = "tensorfleet-sim-profile"
PROFILE_VERSION = 1
# Prompts are random token ids in this range: ids every tokenizer has (the tests' tiny model has 1,024), above
# the few special tokens vocabularies start with.
TOKEN_IDS = (16, 1000)
# A decode point counts when every request has at least this share of its tokens (and MIN_WINDOW_TOKENS) in the
# window: a window shorter than that is one burst of the engine's HTTP side, not a measurement.
MIN_WINDOW_SHARE = 0.25
MIN_WINDOW_TOKENS = 4
TERMS = ("overhead_s", "per_decode_seq_s", "per_prefill_token_s", "per_context_token_s", "first_token_s",
         "first_token_busy_s")
# Dropped first when the sweep cannot tell the terms apart.
DROP_ORDER = ("per_context_token_s", "first_token_busy_s", "first_token_s", "per_prefill_token_s", "per_decode_seq_s",
              "overhead_s")
SUSTAINED_MIN_STEPS = 8  # engine steps a sustained window must hold to be averaged
BACKGROUND_PROMPT = 64  # prompt tokens of the requests decoding behind busy prefill points
PROBE_ATTEMPTS = 5  # of a busy prefill probe a background request finished in, or of a decode point with no window

_METRIC_PREFILL = "vllm:request_prefill_time_seconds"


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


# --- measuring -----------------------------------------------------------------------------------------------


@dataclass
class CalibrationClient:
    session: aiohttp.ClientSession
    url: str
    model: str
    headers: dict[str, str]
    timeout: float
    rng: random.Random

    def prompt(self, tokens: int) -> list[int]:
        return [self.rng.randrange(*TOKEN_IDS) for _ in range(tokens)]

    async def get(self, path: str) -> tuple[int, str]:
        import aiohttp

        try:
            async with self.session.get(self.url + path, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise CalibrationError(f"GET {self.url}{path}: {exc.__class__.__name__}: {exc}") from None

    async def metrics(self) -> list[promtext.Sample]:
        from tensorfleet import promtext

        status, text = await self.get(contract.METRICS_PATH)
        if status != 200:
            return []
        try:
            return promtext.samples(text)
        except ValueError:
            return []

    async def stream(self, tokens: int, max_tokens: int, marks: list[tuple[float, int]] | None = None
                     ) -> list[tuple[float, int]]:
        """One streamed completion of a fresh prompt of TOKENS token ids: (seconds after sending, completion
        tokens so far) of each event that carries tokens, appended to MARKS as they come when given."""
        import aiohttp

        from tensorfleet.httpapi import post_resending_once

        body = {"model": self.model, "prompt": self.prompt(tokens), "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        marks = [] if marks is None else marks
        start = time.perf_counter()

        def restart(_: BaseException) -> None:
            nonlocal start
            start = time.perf_counter()

        try:
            # Sent once more if a pooled connection was closed under it: nothing reached the engine, so the
            # resent request measures the same thing (its clock restarted).
            async with await post_resending_once(
                    self.session, self.url + "/v1/completions", on_resend=restart, json=body, headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status != 200:
                    raise CalibrationError(f"POST {self.url}/v1/completions: {resp.status} "
                                           f"{(await resp.text())[:300]}")
                await token_marks(resp, start, marks)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise CalibrationError(f"POST {self.url}/v1/completions: {exc.__class__.__name__}: {exc}") from None
        if not marks:
            raise CalibrationError(f"{self.url}/v1/completions streamed no tokens with usage (is it vLLM? "
                                   "continuous_usage_stats is needed)")
        return marks


async def token_marks(resp: aiohttp.ClientResponse, start: float, marks: list[tuple[float, int]]) -> None:
    """Read a streamed completion (asked with `continuous_usage_stats`) to its end, appending to MARKS (seconds after
    START, completion tokens so far) for each event that brings tokens: the engine may merge several into one."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter() - start
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: {"):
                continue
            data = json.loads(event[6:])
            done = (data.get("usage") or {}).get("completion_tokens")
            if data.get("choices") and isinstance(done, int) and (not marks or done > marks[-1][1]):
                marks.append((now, done))


def _mean_delta(before: list[promtext.Sample], after: list[promtext.Sample], name: str) -> float | None:
    """The mean of a histogram's observations between two scrapes, or None."""
    from tensorfleet import promtext

    count = promtext.total(after, name + "_count") - promtext.total(before, name + "_count")
    if count <= 0:
        return None
    return (promtext.total(after, name + "_sum") - promtext.total(before, name + "_sum")) / count


async def _watch(client: CalibrationClient, stop: asyncio.Event) -> tuple[int, int]:
    """The most requests running and waiting seen on /metrics until STOP is set."""
    from tensorfleet import promtext

    running = waiting = 0
    while not stop.is_set():
        samples = await client.metrics()
        running = max(running, int(promtext.total(samples, contract.VLLM_METRIC_RUNNING)))
        waiting = max(waiting, int(promtext.total(samples, contract.VLLM_METRIC_WAITING)))
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass
    return running, waiting


def _tokens_at(marks: Sequence[tuple[float, int]], t: float) -> float:
    """Completion tokens at time T, interpolated between a request's events."""
    for (t0, k0), (t1, k1) in itertools.pairwise(marks):
        if t0 <= t <= t1:
            return k0 + (k1 - k0) * (t - t0) / (t1 - t0) if t1 > t0 else float(k1)
    return float(marks[-1][1] if t > marks[-1][0] else marks[0][1])


def decode_window(runs: Sequence[Sequence[tuple[float, int]]], prompt_tokens: int
                  ) -> tuple[float, int, int, float] | None:
    """(step seconds, context tokens of the batch, requests used, window seconds) from N requests started
    together: in the window where every one has its first token and none has finished, the slope of each one's
    tokens over time (least squares through its events). None when the window is too short to measure (for any
    request, under MIN_WINDOW_SHARE of its tokens)."""
    start = max(marks[0][0] for marks in runs)
    end = min(marks[-1][0] for marks in runs)
    if end <= start:
        return None
    slopes = []
    for marks in runs:
        inside = [(t, k) for t, k in marks if start <= t <= end]
        if len(inside) < 2 or inside[-1][1] - inside[0][1] < max(MIN_WINDOW_TOKENS, MIN_WINDOW_SHARE * marks[-1][1]):
            return None
        if len(inside) >= 3:
            slopes.append(statistics.linear_regression([float(k) for _, k in inside], [t for t, _ in inside]).slope)
        else:
            (t0, k0), (t1, k1) = inside
            slopes.append((t1 - t0) / (k1 - k0))
    if not slopes:
        return None
    middle = (start + end) / 2
    context = sum(prompt_tokens + _tokens_at(marks, middle) for marks in runs)
    return statistics.mean(slopes), round(context), len(slopes), end - start


class _Background:
    """COUNT requests decoding behind the busy prefill probes, each restarted as soon as it finishes (a fast engine
    generates a whole context window in seconds): `turns` counts the requests each slot has started, so a probe
    can tell whether every one decoded through it (none was prefilling or between requests meanwhile)."""

    def __init__(self, client: CalibrationClient, count: int, max_tokens: int) -> None:
        self.client, self.max_tokens = client, max_tokens
        self.marks: list[list[tuple[float, int]]] = [[] for _ in range(count)]
        self.turns = [0] * count
        self.tasks = [asyncio.create_task(self._slot(i)) for i in range(count)]

    async def _slot(self, i: int) -> None:
        while True:
            self.marks[i] = []
            self.turns[i] += 1
            await self.client.stream(BACKGROUND_PROMPT, self.max_tokens, self.marks[i])

    async def decoding(self) -> tuple[int, ...]:
        """Wait until every request has its first token; the slots' turns then (a background request that failed
        raises here)."""
        while not all(self.marks):
            for task in self.tasks:
                if task.done():
                    task.result()
            await asyncio.sleep(0.005)
        return tuple(self.turns)

    def context(self) -> int:
        return sum(BACKGROUND_PROMPT + marks[-1][1] for marks in self.marks if marks)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _prefill_point(client: CalibrationClient, tokens: int, sweep: Sweep, budget: int | None, room: int,
                         background: int = 0) -> PrefillPoint | None:
    """The median TTFT of `prefill_repeats` requests of TOKENS prompt tokens and max_tokens 1, one at a time; with
    BACKGROUND requests decoding through each (a probe during which one of them finished is sent again, up to
    PROBE_ATTEMPTS times). None when the background kept turning over."""
    busy = _Background(client, background, min(room, 8192) - BACKGROUND_PROMPT)
    samples, contexts = [], []
    try:
        first = await busy.decoding()
        before = await client.metrics()
        for _ in range(sweep.prefill_repeats):
            for _attempt in range(PROBE_ATTEMPTS):
                turns = await busy.decoding()
                # At a random moment, as requests arrive: not right after the last answer, in step with the engine
                # (and, idle, after a pause long enough for the engine's host to go quiet, as between real requests).
                await asyncio.sleep(client.rng.uniform(0.0, sweep.probe_pause_s))
                context = busy.context()
                ttft = (await client.stream(tokens, 1))[0][0]
                if tuple(busy.turns) == turns:
                    samples.append(ttft)
                    contexts.append(context)
                    break
            else:
                return None
        after = await client.metrics()
        # vLLM observes a request's prefill time when it finishes: one that finished in between is in the delta.
        engine_mean = _mean_delta(before, after, _METRIC_PREFILL) if await busy.decoding() == first else None
    finally:
        await busy.stop()
    chunks = math.ceil(tokens / max(budget - background, 1)) if budget else 1
    return PrefillPoint(tokens, chunks, statistics.median(samples), tuple(samples),
                        engine_mean, background,
                        round(statistics.median(contexts)) if contexts else 0)


async def _decode_point(client: CalibrationClient, concurrency: int, tokens: int, sweep: Sweep
                        ) -> tuple[DecodePoint | None, int, int]:
    """A decode point (None when its window was too short), and the most requests running and waiting."""
    before = await client.metrics()
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(client, stop))
    try:
        runs = await asyncio.gather(*(client.stream(tokens, sweep.decode_tokens) for _ in range(concurrency)))
    finally:
        stop.set()
        running, waiting = await watcher
    after = await client.metrics()
    window = decode_window(runs, tokens)
    if window is None:
        return None, running, waiting
    itl, context, used, seconds = window
    return DecodePoint(concurrency, tokens, context, itl, used, seconds,
                       _mean_delta(before, after, contract.VLLM_METRIC_ITL), running, waiting), running, waiting


async def _sustained_point(client: CalibrationClient, concurrency: int, sweep: Sweep, room: int) -> SustainedPoint | str:
    """CONCURRENCY requests at all times for a warm-up and then `sustained_s` (longer, up to four times, until
    the engine has run SUSTAINED_MIN_STEPS steps); why not, when the engine does not publish its steps
    (vllm:iteration_tokens_total) or ran too few."""
    from tensorfleet import promtext

    prompts = (min(sweep.contexts), max(sweep.contexts))
    answers = (max(1, sweep.decode_tokens // 8), 2 * sweep.decode_tokens)

    async def worker() -> None:
        while True:
            prompt = min(client.rng.randint(*prompts), room - answers[1])
            await client.stream(max(prompt, 1), client.rng.randint(*answers))

    steps_family = "vllm:iteration_tokens_total_count"
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.sleep(min(2.0, sweep.sustained_s / 2))
        before, started = await client.metrics(), time.perf_counter()
        if not promtext.select(before, steps_family):
            return "the engine publishes no step count (vllm:iteration_tokens_total)"
        # The window, longer where the engine ran too few steps in it to average (a stall of a busy host, or a
        # compile for a new shape): up to four windows in all.
        after, seconds = before, 0.0
        while seconds < 4 * sweep.sustained_s and (
                seconds < sweep.sustained_s
                or promtext.total(after, steps_family) - promtext.total(before, steps_family) < SUSTAINED_MIN_STEPS):
            await asyncio.sleep(sweep.sustained_s / 2)
            after, seconds = await client.metrics(), time.perf_counter() - started
            for t in tasks:
                failed = t.exception() if t.done() else None
                if failed is not None:
                    raise failed
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def delta(name: str) -> float:
        return promtext.total(after, name) - promtext.total(before, name)

    steps = round(delta(steps_family))
    if steps < SUSTAINED_MIN_STEPS:
        return f"the engine ran {steps} steps in {seconds:.1f} s (stalled, or its host shared with other work)"
    generated = round(delta(contract.VLLM_METRIC_GENERATION_TOKENS + "_total"))
    prompt = round(delta(contract.VLLM_METRIC_PROMPT_TOKENS + "_total"))
    per_step = generated / steps
    context = per_step * (sum(prompts) / 2 + sum(answers) / 4)
    return SustainedPoint(concurrency, seconds, steps, generated, prompt, seconds / steps, per_step, prompt / steps,
                          context)


async def identify(client: CalibrationClient, model: str | None) -> tuple[dict[str, Any], Capacity]:
    """The engine's identity and what it publishes of its capacity."""
    from tensorfleet import promtext

    status, text = await client.get("/v1/models")
    if status != 200:
        raise CalibrationError(f"GET {client.url}/v1/models: {status} {text[:300]}")
    try:
        entries = [m for m in json.loads(text)["data"] if isinstance(m, dict)]
    except (ValueError, KeyError, TypeError):
        raise CalibrationError(f"GET {client.url}/v1/models: not an OpenAI model list: {text[:300]}") from None
    entry = next((m for m in entries if m.get("id") == model), None) if model else \
        next((m for m in entries if m.get("parent") is None), None)
    if entry is None:
        names = ", ".join(str(m.get("id")) for m in entries)
        raise CalibrationError(f"{client.url} serves no model {model!r} (it serves: {names})" if model
                               else f"{client.url} serves no base model (it serves: {names})")
    version = None
    status, text = await client.get("/version")
    if status == 200:
        try:
            version = json.loads(text).get("version")
        except (ValueError, AttributeError):
            pass
    samples = await client.metrics()
    config = next(iter(promtext.select(samples, contract.VLLM_METRIC_CACHE_CONFIG)), None)
    labels = dict(config.labels) if config is not None else {}

    def number(value: Any) -> int | None:
        try:
            return int(value) if value not in (None, "", "None") else None
        except (TypeError, ValueError):
            return None

    engine = {"url": client.url, "version": version, "model": entry.get("id"), "root": entry.get("root"),
              "max_model_len": entry.get("max_model_len"), "cache_config": labels}
    capacity = Capacity(max_model_len=number(entry.get("max_model_len")), block_size=number(labels.get("block_size")),
                        num_gpu_blocks=number(labels.get("num_gpu_blocks")))
    return engine, capacity


async def measure(url: str, model: str | None = None, sweep: Sweep | None = None, *,
                  max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                  api_key: str | None = None, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run the sweep against the engine at URL and fit it; the profile document (`document`)."""
    import aiohttp

    sweep = sweep or Sweep()
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    notes: list[str] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=0, keepalive_timeout=contract.ENGINE_CLIENT_KEEP_ALIVE_S)) as session:
        client = CalibrationClient(session, url.rstrip("/"), model or "", headers, sweep.request_timeout_s,
                                   random.Random(sweep.seed))
        engine, capacity = await identify(client, model)
        client.model = str(engine["model"])
        capacity = replace(capacity, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                           max_num_seqs_source="given" if max_num_seqs else "")
        say(f"engine: vLLM {engine['version']} serving {engine['model']!r} at {client.url}; "
            f"max-model-len {capacity.max_model_len}, {capacity.num_gpu_blocks} KV blocks of {capacity.block_size}")
        room = (capacity.max_model_len or 1 << 30) - 1
        for k in range(sweep.warmup):
            await client.stream(min(256 * (k + 1), room - 8), 8)
        deadline = started + sweep.time_limit_s
        prefill: list[PrefillPoint] = []
        for tokens in sorted({min(t, room) for t in sweep.prompt_lengths}):
            if time.monotonic() > deadline:
                notes.append(f"time limit ({sweep.time_limit_s:g} s) reached: prefill stopped before {tokens} tokens")
                break
            for background in sorted({0, sweep.prefill_background}):
                measured = await _prefill_point(client, tokens, sweep, capacity.max_num_batched_tokens, room,
                                                background)
                if measured is None:
                    notes.append(f"prefill {tokens} tokens behind {background} decoding: a background request "
                                 f"finished during each of {PROBE_ATTEMPTS} probes; not measured")
                    continue
                prefill.append(measured)
                say(f"prefill {tokens:6d} tokens{f' behind {background} decoding' if background else ''}: TTFT "
                    f"{measured.ttft_s * 1e3:8.2f} ms (median of {len(measured.samples)})")
        decode: list[DecodePoint] = []
        limit = capacity.max_num_seqs
        points = [(context, concurrency) for context in sorted({min(c, room - sweep.decode_tokens)
                                                                for c in sweep.contexts})
                  for concurrency in sorted(set(sweep.concurrencies))]
        for context, concurrency in points:
            if limit is not None and concurrency > limit:
                continue
            if time.monotonic() > deadline:
                notes.append(f"time limit ({sweep.time_limit_s:g} s) reached: decode stopped before batch "
                             f"{concurrency} at {context} tokens")
                break
            for _ in range(sweep.repeats):
                # A busy host can starve the engine's HTTP side until it sends a request's tokens in one or two
                # merged events: no window, so the point is taken again.
                for _attempt in range(PROBE_ATTEMPTS):
                    point, running, waiting = await _decode_point(client, concurrency, context, sweep)
                    if point is not None or (running < concurrency and waiting > 0):
                        break
                if running < concurrency and waiting > 0 and capacity.max_num_seqs is None:
                    # More sequences than the engine runs at once: that is its max-num-seqs.
                    limit = running
                    capacity = replace(capacity, max_num_seqs=running, max_num_seqs_source="learned")
                    say(f"decode batch {concurrency}: at most {running} run at once: max-num-seqs {running}")
                    break
                if point is None:
                    notes.append(f"decode batch {concurrency} at {context} tokens: no window where all decode "
                                 f"in {PROBE_ATTEMPTS} tries (more decode tokens?)")
                    continue
                decode.append(point)
                say(f"decode batch {concurrency:3d}, prompt {context:5d}: ITL {point.itl_s * 1e3:7.3f} ms "
                    f"(the engine's own mean {(point.engine_itl_s or 0) * 1e3:.3f} ms)")
        sustained: list[SustainedPoint] = []
        # The largest batch the sweep asks for that the engine runs at once (measured or not: a decode window
        # lost to the engine's HTTP side does not make the engine's batch smaller).
        top = max((c for c in sweep.concurrencies if limit is None or c <= limit), default=0)
        for concurrency in sorted({max(1, top // 4), max(1, top // 2), top}) if top and sweep.sustained_s > 0 else ():
            if time.monotonic() > deadline:
                notes.append(f"time limit ({sweep.time_limit_s:g} s) reached: no sustained point at {concurrency}")
                break
            held = await _sustained_point(client, concurrency, sweep, room)
            if isinstance(held, str):
                notes.append(f"sustained {concurrency}: not measured: {held}")
                continue
            sustained.append(held)
            say(f"sustained {concurrency:3d}: mean step {held.step_s * 1e3:7.3f} ms over {held.steps} steps "
                f"({held.decode_seqs:.1f} decoding, {held.prefill_tokens:.0f} prefill tokens a step)")
    if not decode or not prefill:
        raise CalibrationError(f"the sweep measured {len(decode)} decode and {len(prefill)} prefill points; the fit "
                               "needs at least one of each (a longer --time-limit?)")
    result = fit(decode, prefill, sustained)
    notes.append(f"sweep took {time.monotonic() - started:.1f} s")
    return document(engine, capacity, sweep, decode, prefill, result, notes, sustained)
