"""Benchmark 10: the simulator calibrated against a real vLLM, and the same trace sent to both.

A real vLLM (its CPU build serving the tests' tiny model: tensorfleet.testing.realvllm, docs/real-engine.md)
is started with ENGINE_ARGS and calibrated (`tensorfleet sim calibrate`'s sweep, sim/probe.py, in
process); its capacity is measured (closed loop at max-num-seqs concurrent requests of the trace's mix:
generated tokens/s over a window / mean answer); then one seeded trace per load (open loop, Poisson
arrivals at 30/60/90% of that capacity, for `--seconds`) is sent to it. The real engine is stopped, a
`tensorfleet sim --profile` of that calibration is started on its own, and it gets the same capacity run and
the same traces. Requests are /v1/completions streams of random token ids (prompts 64-1,024 tokens, answers
16-256, uniform; distinct prompts, so the prefix cache plays no part) with `ignore_eos` and continuous usage
stats, so both engines compute exactly the same tokens.

Figures per engine and load: TTFT p50/p99 (the first event with a token, as the client sees it); ITL p50/p99
over requests, each request's ITL its decode time over its tokens after the first (vLLM's time per output
token: the CPU engine merges several tokens into one event when its HTTP side falls behind, so gaps between
events are not gaps between tokens); throughput (generated tokens/s and answers/s from the first request sent
to the last answer); preemptions (vllm:num_preemptions_total over the run); the mean and max of
vllm:num_requests_waiting scraped every 0.5 s. Goal: p50 TTFT, p50 ITL and throughput of the simulator
within 20% of the real engine's at each load.

    python benchmarks/bench_calibration.py [--quick] [--seconds 60] [--loads 0.3,0.6,0.9]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from common import MODEL, RESULTS, cluster, percentile, table, wait_healthy, write_results

from tensorfleet import contract, promtext
from tensorfleet.sim import calibrate, probe
from tensorfleet.testing import realvllm

ENGINE_ARGS = ["--max-model-len", "2048", "--max-num-seqs", "16", "--max-num-batched-tokens", "2048"]
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 16, 2048
PROMPT_TOKENS = (64, 1024)
OUTPUT_TOKENS = (16, 256)
LOADS = (0.3, 0.6, 0.9)
GOAL = 0.20
SCRAPE_SECONDS = 0.5
PNG = Path(__file__).resolve().parent / "calibration.png"


@dataclass
class Req:
    at: float            # seconds after the run starts
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    req: Req
    sent: float = 0.0                      # perf_counter when sent
    marks: list[tuple[float, int]] = field(default_factory=list)  # (seconds after sending, tokens so far)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.marks[0][0] if self.marks else None

    @property
    def itl(self) -> float | None:
        if len(self.marks) < 2 or self.marks[-1][1] <= self.marks[0][1]:
            return None
        return (self.marks[-1][0] - self.marks[0][0]) / (self.marks[-1][1] - self.marks[0][1])

    @property
    def tokens(self) -> int:
        return self.marks[-1][1] if self.marks else 0


@dataclass
class Cpu:
    """CPU seconds so far: the whole machine's busy time (/proc/stat), the engine's (vLLM's API server and
    engine core; the simulator's process), and this client's."""

    at: float
    machine: float
    engine: float
    client: float

    @classmethod
    def now(cls, engine_seconds: Callable[[], float]) -> Cpu:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait
        own = os.times()
        return cls(time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), engine_seconds(), own.user + own.system)

    def cores_since(self, before: Cpu) -> dict[str, float]:
        """Cores used between BEFORE and now: by the engine, by this client, and by everything else on the
        machine (other people's work, which skews the figures)."""
        span = max(self.at - before.at, 1e-9)
        engine, client = (self.engine - before.engine) / span, (self.client - before.client) / span
        return {"engine_cores": engine, "client_cores": client,
                "other_cores": max(0.0, (self.machine - before.machine) / span - engine - client)}


def group_cpu_seconds(group: int) -> float:
    """CPU seconds of every process in process group GROUP (a real vLLM: its API server and engine core)."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[2]) == group:
            ticks += int(stat[11]) + int(stat[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_quiet(engine_seconds: Callable[[], float], max_other: float, timeout: float) -> float:
    """Wait (up to TIMEOUT s) until other work on the machine uses under MAX_OTHER cores over 5 s: a real CPU
    engine needs about a core and a half at load, and on a two-core machine anything else slows it down. The
    cores other work used in the last 5 s (the caller records it either way)."""
    deadline = time.monotonic() + timeout
    while True:
        before = Cpu.now(engine_seconds)
        time.sleep(5.0)
        other = Cpu.now(engine_seconds).cores_since(before)["other_cores"]
        if other < max_other or time.monotonic() > deadline:
            return other
        print(f"  waiting for the machine: other work uses {other:.2f} cores", flush=True)


def request(rng: random.Random, at: float = 0.0) -> Req:
    return Req(at, [rng.randrange(*probe.TOKEN_IDS) for _ in range(rng.randint(*PROMPT_TOKENS))],
               rng.randint(*OUTPUT_TOKENS))


def trace(seed: int, rate: float, seconds: float) -> list[Req]:
    """Poisson arrivals at RATE for SECONDS, each request's lengths and tokens drawn from SEED."""
    rng = random.Random(seed)
    out: list[Req] = []
    at = rng.expovariate(rate)
    while at < seconds:
        out.append(request(rng, at))
        at += rng.expovariate(rate)
    return out


async def send(session: aiohttp.ClientSession, url: str, model: str, outcome: Outcome) -> None:
    body = {"model": model, "prompt": outcome.req.prompt, "max_tokens": outcome.req.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    outcome.sent = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=600)) as resp:
            if resp.status != 200:
                outcome.error = f"{resp.status} {(await resp.text())[:200]}"
                return
            await probe.token_marks(resp, outcome.sent, outcome.marks)
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome.error = f"{exc.__class__.__name__}: {exc}"
    if outcome.error is None and outcome.tokens != outcome.req.max_tokens:
        outcome.error = f"{outcome.tokens} tokens of {outcome.req.max_tokens}"


async def gauges(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    names = (contract.VLLM_METRIC_WAITING, contract.VLLM_METRIC_RUNNING, contract.VLLM_METRIC_PREEMPTIONS + "_total")
    async with session.get(url + contract.METRICS_PATH) as resp:
        parsed = promtext.samples(await resp.text(), names=names)
    return {name: promtext.total(parsed, name) for name in names}


async def run_trace(url: str, model: str, reqs: Sequence[Req], engine_seconds: Callable[[], float]) -> dict[str, Any]:
    """Send REQS at their times; the figures of the run."""
    outcomes = [Outcome(r) for r in reqs]
    samples: list[dict[str, float]] = []
    loadavg_start = os.getloadavg()[0]
    cpu = Cpu.now(engine_seconds)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        before = await gauges(session, url)
        start = time.perf_counter()
        done = asyncio.Event()

        async def scrape() -> None:
            while not done.is_set():
                samples.append(await gauges(session, url))
                try:
                    await asyncio.wait_for(done.wait(), SCRAPE_SECONDS)
                except TimeoutError:
                    pass

        async def later(outcome: Outcome) -> None:
            await asyncio.sleep(max(0.0, start + outcome.req.at - time.perf_counter()))
            await send(session, url, model, outcome)

        scraper = asyncio.create_task(scrape())
        await asyncio.gather(*(later(o) for o in outcomes))
        end = time.perf_counter()
        done.set()
        await scraper
        after = await gauges(session, url)
    figures = summarize(outcomes, start, end, samples,
                        after[contract.VLLM_METRIC_PREEMPTIONS + "_total"] - before[contract.VLLM_METRIC_PREEMPTIONS + "_total"])
    # Other work on the machine's cores moves every figure: the 1-minute load average before and after the run
    # (this run's own processes count in it too), and the cores each part used.
    return {**figures, "loadavg_1m": [loadavg_start, os.getloadavg()[0]], **Cpu.now(engine_seconds).cores_since(cpu)}


def summarize(outcomes: Sequence[Outcome], start: float, end: float, samples: Sequence[dict[str, float]],
              preemptions: float) -> dict[str, Any]:
    good = [o for o in outcomes if o.error is None]
    ttfts = [o.ttft for o in good if o.ttft is not None]
    itls = [o.itl for o in good if o.itl is not None]
    last = max((o.sent + o.marks[-1][0] for o in good if o.marks), default=end)
    span = max(last - start, 1e-9)
    waiting = [s[contract.VLLM_METRIC_WAITING] for s in samples]
    running = [s[contract.VLLM_METRIC_RUNNING] for s in samples]
    return {
        "requests": len(outcomes), "failed": len(outcomes) - len(good),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
        "tokens_per_s": sum(o.tokens for o in good) / span, "answers_per_s": len(good) / span, "span_s": span,
        "preemptions": preemptions,
        "waiting_mean": statistics.mean(waiting) if waiting else float("nan"),
        "waiting_max": max(waiting, default=float("nan")),
        "running_mean": statistics.mean(running) if running else float("nan"),
        # Every request: [arrival s, prompt tokens, answer tokens, TTFT s, ITL s] (None where it failed).
        "requests_detail": [[round(o.req.at, 4), len(o.req.prompt), o.req.max_tokens,
                             None if o.ttft is None else round(o.ttft, 5), None if o.itl is None else round(o.itl, 6)]
                            for o in outcomes],
    }


async def capacity(url: str, model: str, seconds: float, warm: float, seed: int, engine_seconds: Callable[[], float]
                   ) -> dict[str, Any]:
    """Closed loop, MAX_NUM_SEQS requests of the trace's mix at all times: generated tokens/s over [warm,
    warm + seconds], and requests/s at the mix's mean answer."""
    rng = random.Random(seed)
    start = time.perf_counter()
    stop_at = start + warm + seconds
    cpu = Cpu.now(engine_seconds)
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker() -> None:
            while time.perf_counter() < stop_at:
                outcome = Outcome(request(rng))
                outcomes.append(outcome)
                await send(session, url, model, outcome)

        await asyncio.gather(*(worker() for _ in range(MAX_NUM_SEQS)))
    lo, hi = start + warm, stop_at
    tokens = 0.0
    for o in outcomes:
        for (t0, k0), (t1, k1) in zip([(0.0, 0), *o.marks], o.marks):
            a, b = o.sent + t0, o.sent + t1
            if b <= a:
                continue
            overlap = max(0.0, min(b, hi) - max(a, lo))
            tokens += (k1 - k0) * overlap / (b - a)
    per_s = tokens / seconds
    mean_answer = sum(OUTPUT_TOKENS) / 2
    return {"tokens_per_s": per_s, "rps": per_s / mean_answer, "window_s": seconds, "warm_s": warm,
            "concurrency": MAX_NUM_SEQS, "failed": sum(o.error is not None for o in outcomes),
            **Cpu.now(engine_seconds).cores_since(cpu)}


def load_seed(seed: int, load: float) -> int:
    return seed * 1000 + round(load * 100)


def real_side(args: argparse.Namespace, loads: Sequence[float], profile_path: Path) -> dict[str, Any]:
    realvllm.vllm_python()  # fail now, with the reason, where no real vLLM is installed
    with realvllm.engine(ENGINE_ARGS) as engine:
        print(f"real vLLM at {engine.url} ({' '.join(ENGINE_ARGS)}); calibrating...", flush=True)
        # realvllm starts vLLM in a session of its own: its processes are that group.
        group = functools.partial(group_cpu_seconds, engine.process.pid)
        quiet_at_calibration = wait_quiet(group, args.quiet_cores, args.quiet_wait)
        sweep = calibrate.Sweep(concurrencies=(1, 2, 4, 8, 16), repeats=2 if args.quick else 3,
                                time_limit_s=40.0 if args.quick else 150.0)
        started = time.monotonic()
        doc = asyncio.run(probe.measure(engine.url, sweep=sweep, max_num_seqs=MAX_NUM_SEQS,
                                            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                            say=lambda line: print("  " + line, flush=True)))
        calibrate.write(profile_path, doc)
        fitted = calibrate.parse(doc).step
        print(f"  {fitted.describe()}; largest error {doc['fit']['max_relative_error']:.0%} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
        wait_quiet(group, args.quiet_cores, args.quiet_wait)
        cap = asyncio.run(capacity(engine.url, realvllm.SERVED_NAME, args.capacity_seconds, 5.0, args.seed, group))
        print(f"  capacity: {cap['tokens_per_s']:.0f} tokens/s, {cap['rps']:.2f} requests/s (engine cores "
              f"{cap['engine_cores']:.2f}, other work {cap['other_cores']:.2f})", flush=True)
        runs = {}
        for load in loads:
            reqs = trace(load_seed(args.seed, load), load * cap["rps"], args.seconds)
            wait_quiet(group, args.quiet_cores, args.quiet_wait)
            runs[load] = asyncio.run(run_trace(engine.url, realvllm.SERVED_NAME, reqs, group))
            print(f"  load {load:.0%}: {describe(runs[load])}", flush=True)
    return {"profile": doc, "capacity": cap, "runs": runs, "other_cores_before_calibration": quiet_at_calibration}


def sim_side(args: argparse.Namespace, loads: Sequence[float], profile_path: Path, rps: float) -> dict[str, Any]:
    with cluster("calibration") as c:
        sim = c.sim("calibrated", "--profile", str(profile_path))
        asyncio.run(wait_healthy(sim))
        print(f"simulator with --profile {profile_path.name} at {sim.url}", flush=True)
        group = sim.cpu_seconds
        wait_quiet(group, args.quiet_cores, args.quiet_wait)
        cap = asyncio.run(capacity(sim.url, MODEL, args.capacity_seconds, 5.0, args.seed, group))
        print(f"  capacity: {cap['tokens_per_s']:.0f} tokens/s, {cap['rps']:.2f} requests/s (engine cores "
              f"{cap['engine_cores']:.2f}, other work {cap['other_cores']:.2f})", flush=True)
        runs = {}
        for load in loads:
            reqs = trace(load_seed(args.seed, load), load * rps, args.seconds)
            wait_quiet(group, args.quiet_cores, args.quiet_wait)
            runs[load] = asyncio.run(run_trace(sim.url, MODEL, reqs, group))
            print(f"  load {load:.0%}: {describe(runs[load])}", flush=True)
    return {"capacity": cap, "runs": runs}


def describe(run: dict[str, Any]) -> str:
    return (f"{run['requests']} requests, TTFT p50 {run['ttft_p50_s'] * 1e3:.0f} ms, ITL p50 "
            f"{run['itl_p50_s'] * 1e3:.1f} ms, {run['tokens_per_s']:.0f} tokens/s, waiting mean "
            f"{run['waiting_mean']:.2f}, failed {run['failed']}; cores: engine {run['engine_cores']:.2f}, client "
            f"{run['client_cores']:.2f}, other work {run['other_cores']:.2f}")


def ratio(sim: float, real: float) -> float:
    return sim / real if real and not math.isnan(real) else float("nan")


def plot(loads: Sequence[float], real: dict[float, dict[str, Any]], sim: dict[float, dict[str, Any]],
         path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [load * 100 for load in loads]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("TTFT, ms", "ttft", 1e3), ("ITL (time per output token), ms", "itl", 1e3)]
    for ax, (label, key, scale) in zip(axes[0], panels):
        for runs, name, colour in ((real, "real vLLM", "tab:blue"), (sim, "simulator", "tab:orange")):
            ax.plot(x, [runs[lo][f"{key}_p50_s"] * scale for lo in loads], marker="o", color=colour,
                    label=f"{name} p50")
            ax.plot(x, [runs[lo][f"{key}_p99_s"] * scale for lo in loads], marker="^", ls="--", color=colour,
                    label=f"{name} p99")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    for ax, (label, key) in zip(axes[1], (("throughput, generated tokens/s", "tokens_per_s"),
                                          ("vllm:num_requests_waiting, mean (max dotted)", "waiting_mean"))):
        for runs, name, colour in ((real, "real vLLM", "tab:blue"), (sim, "simulator", "tab:orange")):
            ax.plot(x, [runs[lo][key] for lo in loads], marker="o", color=colour, label=name)
            if key == "waiting_mean":
                ax.plot(x, [runs[lo]["waiting_max"] for lo in loads], marker=".", ls=":", color=colour)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    for ax in axes.flat:
        ax.set_xlabel("offered load, % of the real engine's measured capacity")
        ax.set_xticks(x)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test, not figures)")
    parser.add_argument("--seconds", type=float, help="seconds of arrivals per load (default 60; quick 15)")
    parser.add_argument("--capacity-seconds", type=float, help="capacity window (default 30; quick 10)")
    parser.add_argument("--loads", default=",".join(map(str, LOADS)), help="fractions of capacity (default 0.3,0.6,0.9)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quiet-cores", type=float, default=0.25,
                        help="before each run, wait until other work uses fewer cores than this (default 0.25)")
    parser.add_argument("--quiet-wait", type=float, default=300.0,
                        help="at most this many seconds of waiting per run, then run anyway (default 300)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    args.seconds = args.seconds or (15.0 if args.quick else 60.0)
    args.capacity_seconds = args.capacity_seconds or (10.0 if args.quick else 30.0)
    loads = [float(v) for v in args.loads.split(",")]
    name = "calibration-quick" if args.quick else "calibration"
    RESULTS.mkdir(parents=True, exist_ok=True)
    profile_path = RESULTS / f"{name}-profile.json"
    loadavg_start = list(os.getloadavg())
    started = time.monotonic()
    real = real_side(args, loads, profile_path)
    sim = sim_side(args, loads, profile_path, real["capacity"]["rps"])
    rows, comparison = [], []
    for load in loads:
        r, s = real["runs"][load], sim["runs"][load]
        for label, run in (("real vLLM", r), ("simulator", s)):
            rows.append([f"{load:.0%}", label, run["requests"], run["ttft_p50_s"] * 1e3, run["ttft_p99_s"] * 1e3,
                         run["itl_p50_s"] * 1e3, run["itl_p99_s"] * 1e3, run["tokens_per_s"], run["answers_per_s"],
                         int(run["preemptions"]), run["waiting_mean"], run["waiting_max"], run["failed"],
                         run["engine_cores"], run["other_cores"]])
        ratios = {key: ratio(s[key], r[key]) for key in ("ttft_p50_s", "itl_p50_s", "tokens_per_s")}
        comparison.append({"load": load, **{f"{k}_ratio": v for k, v in ratios.items()},
                           "within_goal": all(abs(v - 1) <= GOAL for v in ratios.values())})
    print()
    print(f"capacity (closed loop, {MAX_NUM_SEQS} at once): real {real['capacity']['tokens_per_s']:.0f} tokens/s "
          f"({real['capacity']['rps']:.2f} requests/s), simulator {sim['capacity']['tokens_per_s']:.0f} tokens/s "
          f"({sim['capacity']['rps']:.2f} requests/s)")
    print(table(["load", "engine", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "tokens/s",
                 "answers/s", "preemptions", "waiting mean", "waiting max", "failed", "engine cores",
                 "other work cores"], rows))
    print()
    print(table(["load", "TTFT p50 sim/real", "ITL p50 sim/real", "throughput sim/real", f"all within {GOAL:.0%}"],
                [[f"{c['load']:.0%}", c["ttft_p50_s_ratio"], c["itl_p50_s_ratio"], c["tokens_per_s_ratio"],
                  "yes" if c["within_goal"] else "no"] for c in comparison]))
    profile = real["profile"]["fit"]
    if not args.no_plot:
        png = PNG if not args.quick else RESULTS / f"{name}.png"
        plot(loads, real["runs"], sim["runs"], png,
             f"Real vLLM (CPU, tiny model) against the simulator calibrated on it; same trace per load\n"
             f"fit: {calibrate.parse(real['profile']).step.describe()}")
        print(f"wrote {png}")
    path = write_results(name, {
        "engine_args": ENGINE_ARGS, "seconds": args.seconds, "loads": loads, "seed": args.seed,
        "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "loadavg_at_start": loadavg_start,
        "wall_s": time.monotonic() - started, "goal": GOAL, "fit": {k: v for k, v in profile.items() if k != "rows"},
        "profile_path": str(profile_path),
        "real": {"capacity": real["capacity"], "runs": {str(k): v for k, v in real["runs"].items()},
                 "other_cores_before_calibration": real["other_cores_before_calibration"]},
        "sim": {"capacity": sim["capacity"], "runs": {str(k): v for k, v in sim["runs"].items()}},
        "comparison": comparison})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
