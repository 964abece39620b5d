"""The calibration's measuring side: a short, bounded sweep of prefill probes (idle and behind decoding
requests), decode points and sustained closed loops against a running vLLM, each point read from the tokens'
arrival times and the engine's own metrics; `measure` runs it and hands the points to `calibrate`'s fit. Design:
docs/real-engine.md#calibrating-the-simulator-against-a-real-engine."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tensorfleet import contract
from tensorfleet.sim.calibrate import (
    CalibrationError,
    Capacity,
    DecodePoint,
    PrefillPoint,
    SustainedPoint,
    Sweep,
    document,
    fit,
)

# aiohttp and promtext (prometheus_client) are the sim extra's: imported where they are used.
if TYPE_CHECKING:
    import aiohttp

    from tensorfleet import promtext

# Prompts are random token ids in this range: ids every tokenizer has (the tests' tiny model has 1,024), above
# the few special tokens vocabularies start with.
TOKEN_IDS = (16, 1000)
# A decode point counts when every request has at least this share of its tokens (and MIN_WINDOW_TOKENS) in the
# window: a window shorter than that is one burst of the engine's HTTP side, not a measurement.
MIN_WINDOW_SHARE = 0.25
MIN_WINDOW_TOKENS = 4
SUSTAINED_MIN_STEPS = 8  # engine steps a sustained window must hold to be averaged
BACKGROUND_PROMPT = 64  # prompt tokens of the requests decoding behind busy prefill points
PROBE_ATTEMPTS = 5  # of a busy prefill probe a background request finished in, or of a decode point with no window

_METRIC_PREFILL = "vllm:request_prefill_time_seconds"


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
