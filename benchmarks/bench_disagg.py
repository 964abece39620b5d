"""Benchmark 9: colocated against disaggregated serving on the same four simulated GPUs (issue 15).

Four simulators of Llama-3.1-8B on L4 (the plan's flags: 33,296 KV tokens,
max-num-seqs 256; 69 ms decode steps at batch 1, 0.27 ms per prefill token),
behind one router at its default strategy, with the ceiling the operator
derives from the plan. Layouts, all on four engines:

- `colocated`: four engines at vLLM's default step budget on L4
  (--max-num-batched-tokens 2048): chunked prefill, long prompts share steps
  with decoding sequences.
- `colocated-tuned`: the same with the step budget the planner picks for a
  colocated engine (`tensorfleet plan`: a small prefill chunk beside the decode
  batch, so steps stay under the ITL target).
- `disagg-PxD`: P prefill engines and D decode engines (P + D = 4), every engine
  with `--kv-transfer-config` (NixlConnector, kv_both) and a side channel of
  its own; the router gets the prefill engines as --prefill-backend. The split
  is the planner's disaggregated pools at the benchmark's rate, scaled to four.

Workloads (seeded, one chat turn per request, unique prompts so nothing is
prefix-cached, lengths uniform within +-20%): `prompt-heavy`, 2,000-token
prompts and 100-token answers; `decode-heavy`, 200-token prompts and 500-token
answers. Capacity is measured first (colocated, closed loop: generated tokens
per second over a window / mean answer length). The offered rate is the one
the planner sizes four colocated GPUs for (the highest rate at which
`planner/sizing.py` answers 4 GPUs), capped at 80% of the measured capacity;
requests arrive open-loop (Poisson) at that rate for every layout. Engines
restart between runs.

Targets: TTFT p99 <= 2 s and ITL p99 <= 100 ms (simulated). ITL: the gaps
between consecutive streamed tokens of one answer; the p50/p99 in the tables
pool every gap of every answer (what the planner's ITL p99 models: a step).
Goodput: requests/s (simulated) answered with TTFT <= 2 s and their own p99 gap
<= 100 ms. Fallback share: the router's prefill outcomes other than `remote`
over all. The planner's prediction for each layout at four engines and the
benchmark's rate comes from the pieces of planner/sizing.py (step roofline,
Little's-law batch, Poisson margin, Erlang C); its own recommendation for the
rate (`tensorfleet plan -o json`) is printed beside it.

The simulators run at --time-scale 1 (real time): a 100 ms target is 100 ms of
wall clock, so the load generator's and router's scheduling jitter on a small
machine is a small share of it. Figures are simulated seconds all the same
(wall / time scale).

    python benchmarks/bench_disagg.py [--quick] [--workloads prompt-heavy] [--seconds 100] [--seeds 2] ...
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from common import (
    ACCELERATOR,
    HOST,
    MODEL,
    MODEL_ID,
    Cluster,
    Proc,
    cluster,
    engine_flags,
    free_port,
    metric_sum,
    percentile,
    scrape,
    scrape_all,
    stream_chat,
    table,
    wait_healthy,
    write_results,
)
from workload import random_words

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.planner import Plan, make_plan, sizing

ENGINES = 4
TTFT_TARGET = 2.0   # seconds, simulated
ITL_TARGET = 0.1    # seconds between tokens, simulated
SPREAD = 0.2        # lengths uniform within +-20% of the mean
LOAD_CAP = 0.8      # never offer more than this share of the measured capacity
WARM_FRACTION = 0.25
KV_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
PREFILL_METRIC = contract.ROUTER_METRIC_PREFILL + "_total"
GENERATED = contract.VLLM_METRIC_GENERATION_TOKENS + "_total"


@dataclass(frozen=True)
class Shape:
    name: str
    prompt_tokens: int
    output_tokens: int
    time_scale: float     # wall seconds per simulated second: slower where more tokens stream


WORKLOADS = {
    "prompt-heavy": Shape("prompt-heavy", 2000, 100, 1.0),
    "decode-heavy": Shape("decode-heavy", 200, 500, 1.0),
}


# --- the plan and the planner ----------------------------------------------------------


def manifest() -> dict[str, Any]:
    return {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "bench"},
            "spec": {"model": {"name": MODEL_ID, "maxModelLen": 8192}, "accelerator": {"type": ACCELERATOR},
                     "engine": {"kind": "simulator"}}}


def plan_and_engine() -> tuple[Plan, sizing.Engine]:
    spec = load_inference_service(manifest()).spec
    plan = make_plan(spec)
    arch = sizing.model_arch(spec, None)
    assert arch is not None, "the catalog knows Llama-3.1-8B"
    return plan, sizing.engine_for(plan, arch)


def size(engine: sizing.Engine, shape: Shape, rate: float) -> sizing.Sizing:
    return sizing.size(sizing.Workload(shape.prompt_tokens, shape.output_tokens, rate=rate),
                       sizing.Targets(TTFT_TARGET, ITL_TARGET), engine, engine)


def planner_rate(engine: sizing.Engine, shape: Shape, gpus: int = ENGINES) -> float:
    """The highest rate (to 0.05 requests/s) at which the planner sizes a colocated fleet of GPUS or fewer."""
    rate, step = 0.05, 0.05
    while rate < 100:
        layout = size(engine, shape, rate + step).colocated[0]
        if not layout.feasible or layout.gpus > gpus:
            return round(rate, 2)
        rate += step
    return rate


def plan_cli(shape: Shape, rate: float) -> dict[str, Any]:
    """`tensorfleet plan -o json` for the case: what a user sees."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(manifest(), f)  # JSON is YAML
        path = f.name
    try:
        out = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "plan", "-f", path, "-o", "json",
                              "--rate", f"{rate:g}", "--prompt-tokens", str(shape.prompt_tokens),
                              "--output-tokens", str(shape.output_tokens), "--ttft-p99", str(TTFT_TARGET),
                              "--itl-p99", str(ITL_TARGET)], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    finally:
        os.unlink(path)
    return json.loads(out)["sizing"]


def split_of(sized: dict[str, Any]) -> tuple[int, int]:
    """The planner's disaggregated pools scaled to ENGINES engines, at least one of each."""
    pools = {p["role"]: p["replicas"] for p in sized["disaggregated"]["pools"]}
    prefill, decode = pools.get("prefill", 1), pools.get("decode", 1)
    p = min(ENGINES - 1, max(1, round(ENGINES * prefill / (prefill + decode))))
    return p, ENGINES - p


def colocated_budget(sized: dict[str, Any]) -> int:
    return int(sized["colocated"][0]["pools"][0]["maxNumBatchedTokens"])


def settle(engine: sizing.Engine, shape: Shape, rate: float, chunk: int) -> float:
    """The mean decode batch of one engine at RATE (Little's law: b = rate x O x step(b)), as the planner
    settles it."""
    ctx = shape.prompt_tokens + shape.output_tokens / 2
    b = 1.0
    for _ in range(200):
        nxt = rate * shape.output_tokens * engine.step_seconds(max(b, 1), max(b, 1) * ctx, chunk)
        if abs(nxt - b) < 1e-6:
            break
        b = nxt if nxt < 10_000 else math.inf
        if math.isinf(b):
            break
    return max(b, 1.0)


def predict(engine: sizing.Engine, shape: Shape, rate: float, prefill: int, decode: int,
            budget: int) -> dict[str, float]:
    """The planner's model at a fixed fleet: TTFT p99 and ITL p99 (the step at the p99 batch) for PREFILL
    prefill engines beside DECODE decode engines (prefill 0: colocated, DECODE engines with step BUDGET)."""
    P, O = shape.prompt_tokens, shape.output_tokens
    ctx = P + O / 2
    if prefill == 0:
        # Every step carries a prefill chunk (the planner's rule), of what the budget leaves beside the batch,
        # at most one prompt.
        chunk = min(P, budget)
        for _ in range(20):
            b = settle(engine, shape, rate / decode, chunk)
            chunk = max(1, min(P, budget - math.ceil(b)))
        b99 = b + sizing.Z99 * math.sqrt(b)
        step = engine.step_seconds(b, b * ctx, chunk)
        mu = chunk / (P * step)
        ttft = math.ceil(P / chunk) * step + sizing.wait_p99(decode, rate, mu)
        itl = engine.step_seconds(b99, b99 * ctx, chunk)
    else:
        b = settle(engine, shape, rate / decode, 0)
        b99 = b + sizing.Z99 * math.sqrt(b)
        decode_step = engine.step_seconds(b, b * ctx, 0)
        chunk = min(P, engine.max_num_batched_tokens)
        pstep = engine.step_seconds(0, 0, chunk)
        mu = chunk / (P * pstep)
        transfer = P * engine.kv_bytes_per_token_per_gpu / (sizing.DEFAULT_LINK_GBPS * 1e9 / 8)
        ttft = math.ceil(P / chunk) * pstep + sizing.wait_p99(prefill, rate, mu) + transfer + decode_step
        itl = engine.step_seconds(b99, b99 * ctx, 0)
    return {"ttft_p99_s": ttft, "itl_p99_s": itl, "mean_batch": b}


# --- the requests ---------------------------------------------------------------------


@dataclass
class Ask:
    at: float             # simulated seconds after the start
    prompt: str
    max_tokens: int


def _spread(rng: random.Random, mean: int) -> int:
    return max(1, round(rng.uniform(mean * (1 - SPREAD), mean * (1 + SPREAD))))


def requests_for(shape: Shape, rate: float, seconds: float, seed: int) -> list[Ask]:
    """Poisson arrivals at RATE for SECONDS (simulated), bounded in count; prompts unique."""
    rng = random.Random(f"{shape.name}/{seed}")
    out: list[Ask] = []
    at = 0.0
    limit = int(rate * seconds * 3) + 10
    while len(out) < limit:
        at += rng.expovariate(rate)
        if at >= seconds:
            break
        out.append(Ask(at, f"Request {len(out)}. " + random_words(rng, _spread(rng, shape.prompt_tokens)),
                       _spread(rng, shape.output_tokens)))
    return out


@dataclass
class Answer:
    sent: float                      # simulated seconds after the start
    status: int = 0
    ttft: float | None = None        # simulated seconds
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    done: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and self.ttft is not None


async def stream(http: aiohttp.ClientSession, url: str, ask: Ask, scale: float, timeout: float) -> Answer:
    """One streaming chat; every content event's arrival is timed (common.stream_chat), in simulated seconds."""
    result = await stream_chat(http, url, [{"role": "user", "content": ask.prompt}], ask.max_tokens,
                               timeout=timeout, model=MODEL)
    times = result.token_times
    return Answer(sent=ask.at, status=result.status, ttft=times[0] / scale if times else None,
                  gaps=[(later - earlier) / scale for earlier, later in itertools.pairwise(times)],
                  tokens=result.tokens, done=result.done, error=result.error)


async def open_loop(url: str, asks: Sequence[Ask], scale: float, drain: float) -> list[Answer]:
    """Send ASKS at their times (wall = simulated x SCALE); wait at most DRAIN wall seconds after the last."""
    timeout = drain + 5
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        start = time.perf_counter()
        tasks = []
        for ask in asks:
            await asyncio.sleep(max(0.0, start + ask.at * scale - time.perf_counter()))
            tasks.append(asyncio.create_task(stream(http, url, ask, scale, timeout)))
        done, pending = await asyncio.wait(tasks, timeout=drain) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() if t in done and not t.cancelled() else Answer(sent=a.at, error="unfinished")
            for t, a in zip(tasks, asks, strict=True)]


async def closed_loop_tokens(url: str, engines: Sequence[Proc], shape: Shape, concurrency: int, warm: float,
                             window: float, seed: int) -> float:
    """Generated tokens per simulated second over WINDOW after WARM (simulated), CONCURRENCY requests always in
    flight; bounded by the time it runs."""
    rng = random.Random(f"capacity/{shape.name}/{seed}")
    scale = shape.time_scale
    stop_at = time.perf_counter() + (warm + window) * scale

    async def worker(http: aiohttp.ClientSession, index: int) -> None:
        n = 0
        while time.perf_counter() < stop_at and n < 10_000:
            n += 1
            ask = Ask(0.0, f"Worker {index} request {n}. " + random_words(rng, _spread(rng, shape.prompt_tokens)),
                      _spread(rng, shape.output_tokens))
            await stream(http, url, ask, scale, timeout=max(1.0, stop_at - time.perf_counter()) + 1)

    async def tokens() -> float:
        texts = await scrape_all([e.url for e in engines])
        return sum(metric_sum(t, GENERATED) for t in texts)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        workers = [asyncio.create_task(worker(http, i)) for i in range(concurrency)]
        await asyncio.sleep(warm * scale)
        before, t0 = await tokens(), time.perf_counter()
        await asyncio.sleep(window * scale)
        after, t1 = await tokens(), time.perf_counter()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return (after - before) / ((t1 - t0) / scale)


# --- the fleets -----------------------------------------------------------------------


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """VALUES in the environment while a process is spawned (Popen copies it)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def kv_sim(c: Cluster, name: str, flags: Sequence[str], scale: float, seed: int) -> Proc:
    with environment(VLLM_NIXL_SIDE_CHANNEL_HOST=HOST, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())):
        return c.sim(name, *flags, "--kv-transfer-config", KV_CONFIG, "--seed", str(seed), time_scale=scale)


def router_flags(plan: Plan) -> list[str]:
    """The per-engine ceiling the operator derives from the plan (render/router.py)."""
    ceiling = plan.engine_concurrency(2048)
    return ["--max-concurrency-per-backend", str(ceiling),
            *(["--burst-concurrency-per-backend", str(plan.max_num_seqs)] if plan.max_num_seqs > ceiling else [])]


@contextmanager
def fleet(tag: str, plan: Plan, shape: Shape, prefill: int, budget: int | None, seed: int,
          prefill_ceiling: int = 0) -> Iterator[tuple[Proc, list[Proc]]]:
    """(router, engines) of one layout: PREFILL 0 is colocated (with step BUDGET, None: vLLM's default)."""
    flags = engine_flags(plan) + (["--max-num-batched-tokens", str(budget)] if budget else [])
    scale = shape.time_scale
    with cluster(tag) as c:
        if prefill:
            prefills = [kv_sim(c, f"prefill{i}", flags, scale, seed * 10 + i) for i in range(prefill)]
            decodes = [kv_sim(c, f"decode{i}", flags, scale, seed * 10 + prefill + i) for i in range(ENGINES - prefill)]
            extra = [arg for p in prefills for arg in ("--prefill-backend", p.url)]
            if prefill_ceiling:
                extra += ["--prefill-max-concurrency-per-backend", str(prefill_ceiling)]
        else:
            prefills = []
            decodes = [c.sim(f"engine{i}", *flags, "--seed", str(seed * 10 + i), time_scale=scale)
                       for i in range(ENGINES)]
            extra = []
        router = c.router(decodes, *router_flags(plan), *extra, strategy=contract.DEFAULT_ROUTER_STRATEGY)
        engines = [*prefills, *decodes]
        asyncio.run(wait_healthy(*engines, router))
        time.sleep(3.0)  # the router's first health checks of both pools
        yield router, engines


def prefill_outcomes(text: str) -> dict[str, float]:
    out = {}
    for outcome in ("remote", "saturated", "unavailable", "failed", "no-params", "unsupported"):
        value = metric_sum(text, PREFILL_METRIC, outcome=outcome)
        if value:
            out[outcome] = value
    return out


# --- one run --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    name: str
    prefill: int          # 0: colocated
    budget: int | None    # colocated step budget (None: vLLM's default)
    prefill_ceiling: int = 0  # the router's prefill halves per prefill engine (0: its default, the decode ceiling)


def summarise(answers: list[Answer], shape: Shape, seconds: float, outcomes: dict[str, float]) -> dict[str, Any]:
    # Left out: the first quarter of the arrivals, at least one answer's length (the batches fill up).
    lo, hi = min(seconds / 2, max(seconds * WARM_FRACTION, shape.output_tokens * 0.08)), seconds
    inside = [a for a in answers if lo <= a.sent < hi]
    ok = [a for a in inside if a.ok]
    window = hi - lo
    ttft = [a.ttft for a in ok if a.ttft is not None]
    gaps = [g for a in ok for g in a.gaps]
    good = [a for a in ok if a.ttft is not None and a.ttft <= TTFT_TARGET
            and (not a.gaps or percentile(a.gaps, 99) <= ITL_TARGET)]
    total = sum(outcomes.values())
    return {
        "requests": len(inside), "ok": len(ok), "failed": len(inside) - len(ok),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
        "throughput_rps": len(ok) / window, "goodput_rps": len(good) / window,
        "good_share": len(good) / len(inside) if inside else float("nan"),
        "tokens_per_s": sum(a.tokens for a in ok) / window,
        "prefill_outcomes": outcomes,
        "fallback_share": (total - outcomes.get("remote", 0.0)) / total if total else float("nan"),
    }


def run_one(plan: Plan, shape: Shape, layout: Layout, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    asks = requests_for(shape, rate, seconds, seed)
    # After the last arrival: a decode-heavy answer takes ~O x 0.1 s; let every one finish, bounded.
    drain = (3 * TTFT_TARGET + 2.5 * shape.output_tokens * ITL_TARGET + 30) * shape.time_scale
    with fleet(f"disagg-{shape.name}-{layout.name}", plan, shape, layout.prefill, layout.budget, seed,
               layout.prefill_ceiling) as (router, _):
        before = prefill_outcomes(asyncio.run(scrape(router.url)))
        answers = asyncio.run(open_loop(router.url, asks, shape.time_scale, drain))
        after = prefill_outcomes(asyncio.run(scrape(router.url)))
    outcomes = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {"workload": shape.name, "layout": layout.name, "seed": seed, "offered_rps": rate,
            **summarise(answers, shape, seconds, {k: v for k, v in outcomes.items() if v})}


def measure_capacity(plan: Plan, shape: Shape, quick: bool) -> dict[str, Any]:
    per_engine = min(plan.max_num_seqs, plan.kv_cache_tokens // (shape.prompt_tokens + shape.output_tokens) + 4)
    warm = 10.0 if quick else 2.0 * shape.output_tokens * 0.08 / 2 + 10
    window = 15.0 if quick else 40.0
    with fleet(f"disagg-capacity-{shape.name}", plan, shape, 0, None, 1) as (router, engines):
        tokens = asyncio.run(closed_loop_tokens(router.url, engines, shape, ENGINES * per_engine, warm, window, 1))
    return {"concurrency": ENGINES * per_engine, "warm_s": warm, "window_s": window, "tokens_per_s": tokens,
            "rps": tokens / shape.output_tokens}


def mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test, not figures)")
    parser.add_argument("--seconds", type=float, help="simulated seconds of arrivals per run (default 100)")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--layouts", nargs="*", default=["colocated", "colocated-tuned", "disagg"],
                        choices=["colocated", "colocated-tuned", "disagg", "disagg-1x3", "disagg-2x2", "disagg-3x1"],
                        help="disagg: the planner's split; disagg-PxD: that split")
    parser.add_argument("--prefill-ceiling", type=int, default=0,
                        help="also run each disaggregated layout with this --prefill-max-concurrency-per-backend")
    parser.add_argument("--rate", type=float, help="offered requests/s (simulated), skipping the choice")
    parser.add_argument("--results", default="disagg", help="results/NAME.json (default: disagg)")
    parser.add_argument("--capacity-rps", type=float, help="skip the capacity run (simulated requests/s)")
    args = parser.parse_args()
    seconds = args.seconds or (30.0 if args.quick else 100.0)
    plan, engine = plan_and_engine()
    rows: list[dict[str, Any]] = []
    cases: list[dict[str, Any]] = []
    for name in args.workloads:
        shape = WORKLOADS[name]
        fits = planner_rate(engine, shape)
        if args.capacity_rps or args.rate:
            capacity: dict[str, Any] = {"rps": args.capacity_rps or float("nan"), "given": True}
        else:
            print(f"{name}: measuring capacity (colocated, closed loop)...", flush=True)
            capacity = measure_capacity(plan, shape, args.quick)
        rate = args.rate or round(min(fits, LOAD_CAP * capacity["rps"]) if not math.isnan(capacity["rps"]) else fits, 2)
        sized = plan_cli(shape, rate)
        split = split_of(sized)
        budget = colocated_budget(sized)
        pools = ", ".join(f"{p['role']} {p['replicas']}" for p in sized["disaggregated"]["pools"])
        print(f"{name}: capacity {capacity['rps']:.2f} req/s; the planner sizes 4 colocated GPUs for {fits:.2f} "
              f"req/s; offered {rate:.2f} req/s; planner at that rate: colocated {sized['colocated'][0]['gpus']} "
              f"GPUs (budget {budget}), disaggregated {sized['disaggregated']['gpus']} GPUs "
              f"({pools}); "
              f"choice {sized['choice']}", flush=True)
        layouts = []
        for wanted in args.layouts:
            if wanted == "colocated":
                layouts.append(Layout("colocated", 0, None))
            elif wanted == "colocated-tuned":
                layouts.append(Layout(f"colocated-tuned-{budget}", 0, budget))
            else:
                p = split[0] if wanted == "disagg" else int(wanted.split("-")[1].split("x")[0])
                layouts.append(Layout(f"disagg-{p}x{ENGINES - p}", p, None))
                if args.prefill_ceiling:
                    layouts.append(Layout(f"disagg-{p}x{ENGINES - p}-ceil{args.prefill_ceiling}", p, None,
                                          args.prefill_ceiling))
        layouts = list({lay.name: lay for lay in layouts}.values())
        predictions = {}
        for lay in layouts:
            predictions[lay.name] = predict(engine, shape, rate, lay.prefill, ENGINES - lay.prefill,
                                            lay.budget or engine.max_num_batched_tokens)
        cases.append({"workload": name, "prompt_tokens": shape.prompt_tokens, "output_tokens": shape.output_tokens,
                      "time_scale": shape.time_scale, "capacity": capacity, "planner_rate_4_gpus": fits,
                      "offered_rps": rate, "planner": sized, "predictions": predictions})
        for lay in layouts:
            for seed in range(1, args.seeds + 1):
                started = time.monotonic()
                row = run_one(plan, shape, lay, rate, seconds, seed)
                rows.append(row)
                print(f"  {name:12} {lay.name:22} seed {seed}: TTFT p50 {row['ttft_p50_s']:.2f} p99 "
                      f"{row['ttft_p99_s']:.2f} s  ITL p50 {row['itl_p50_s'] * 1e3:.0f} p99 "
                      f"{row['itl_p99_s'] * 1e3:.0f} ms  goodput {row['goodput_rps']:.2f}/{row['throughput_rps']:.2f} "
                      f"req/s  fallback {row['fallback_share']:.1%}  failed {row['failed']}  "
                      f"({time.monotonic() - started:.0f} s wall)", flush=True)
    print()
    print(f"{ENGINES} simulated L4 GPUs (Llama-3.1-8B); targets TTFT p99 {TTFT_TARGET:g} s, ITL p99 "
          f"{ITL_TARGET * 1e3:g} ms; times in simulated seconds; {args.seeds} seed(s), means")
    summary = []
    for case in cases:
        for name in case["predictions"]:
            runs = [r for r in rows if r["workload"] == case["workload"] and r["layout"] == name]
            if not runs:
                continue
            keys = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "goodput_rps", "throughput_rps",
                    "fallback_share", "good_share")
            agg = {k: mean([r[k] for r in runs]) for k in keys}
            agg["failed"] = sum(r["failed"] for r in runs)
            agg["requests"] = sum(r["requests"] for r in runs)
            summary.append({"workload": case["workload"], "layout": name, "offered_rps": case["offered_rps"], **agg,
                            "predicted": case["predictions"][name]})
    print(table(["workload", "layout", "rate", "TTFT p50", "TTFT p99", "ITL p50 ms", "ITL p99 ms", "goodput",
                 "req/s", "good", "fallback", "failed"],
                [[s["workload"], s["layout"], s["offered_rps"], s["ttft_p50_s"], s["ttft_p99_s"],
                  s["itl_p50_s"] * 1e3, s["itl_p99_s"] * 1e3, s["goodput_rps"], s["throughput_rps"],
                  f"{s['good_share']:.0%}", "-" if math.isnan(s["fallback_share"]) else f"{s['fallback_share']:.1%}",
                  f"{s['failed']}/{s['requests']}"] for s in summary]))
    print()
    print("planner (planner/sizing.py's model at 4 engines and the offered rate) against measured p99s")
    print(table(["workload", "layout", "pred TTFT p99", "meas TTFT p99", "pred ITL p99 ms", "meas ITL p99 ms",
                 "TTFT within 20%", "ITL within 20%"],
                [[s["workload"], s["layout"], s["predicted"]["ttft_p99_s"], s["ttft_p99_s"],
                  s["predicted"]["itl_p99_s"] * 1e3, s["itl_p99_s"] * 1e3,
                  _within(s["predicted"]["ttft_p99_s"], s["ttft_p99_s"]),
                  _within(s["predicted"]["itl_p99_s"], s["itl_p99_s"])] for s in summary]))
    for case in cases:
        sized = case["planner"]
        c, d = sized["colocated"][0], sized["disaggregated"]
        print(f"  tensorfleet plan, {case['workload']} at {case['offered_rps']:g} req/s: colocated {c['gpus']} GPUs "
              f"(TTFT p99 {c['ttftP99Seconds']} s, ITL p99 {c['itlP99Seconds']} s), disaggregated {d['gpus']} GPUs "
              f"(TTFT p99 {d['ttftP99Seconds']} s, ITL p99 {d['itlP99Seconds']} s); choice {sized['choice']}")
    path = write_results(args.results, {"quick": args.quick, "engines": ENGINES, "accelerator": ACCELERATOR,
                                    "model": MODEL_ID, "targets": {"ttft_p99_s": TTFT_TARGET, "itl_p99_s": ITL_TARGET},
                                    "seconds_per_run": seconds, "seeds": args.seeds, "cases": cases, "runs": rows,
                                    "summary": summary})
    print(f"wrote {path}")


def _within(predicted: float, measured: float) -> str:
    if math.isnan(measured) or not math.isfinite(predicted):
        return "-"
    ratio = measured / predicted if predicted else math.inf
    return f"{'yes' if abs(ratio - 1) <= 0.2 else 'no'} ({ratio:.2f}x)"


if __name__ == "__main__":
    main()
