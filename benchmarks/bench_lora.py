"""Benchmark 8: LoRA adapters, adapter-aware routing against least-pending (issue 16).

Four simulators of Llama-3.1-8B on L4 (benchmark 2's flags), each started with
vLLM's LoRA flags: `--enable-lora --max-loras 4 --max-cpu-loras 8` and the same
20 rank-16 adapters (`--lora-modules`, each a directory with a PEFT
adapter_config.json). Bringing an adapter into one of an engine's 4 GPU slots
stalls the step that first runs it for LOAD_SECONDS from disk (a rank-16 adapter
on every linear layer of an 8B model is ~84 MB of bf16) or SWAP_SECONDS from the
engine's CPU cache of 8; a batch holds at most 4 distinct adapters, and a
request whose adapter would be a fifth waits. Runs at --time-scale TIME_SCALE;
every figure is in simulated seconds.

Workload: single-turn streaming chats, each for one adapter (the OpenAI `model`)
drawn from a Zipf distribution (exponent ZIPF_S) over the 20 adapters, which
adapter is most popular shuffled per seed; prompts of PROMPT_TOKENS random
words, none shared, answers log-normal like benchmark 2's (median 100, 8-600
tokens). Capacity is measured first: the same workload in closed loop (16 per
engine) through least-pending, the baseline. Requests then arrive open-loop
(Poisson) at LOAD x that rate, at most --requests of them within --seconds, for
each strategy in turn, the same requests for each; engines restart between runs
(cold slots and caches). The first WARM_FRACTION of the arrival window is left
out of every figure; adapter loads are the engines' own counters
(`tensorfleet_sim_lora_loads_total{tier}`) over the same window.

Goal (issue 16): adapter-aware routing (cache-aware, the router's default) cuts
adapter loads and p99 TTFT against least-pending.

    python benchmarks/bench_lora.py [--quick] [--seeds 3] [--capacity-rps R]
    python benchmarks/bench_lora.py --capacity-table   # closed-loop capacity: base model, adapters per strategy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import string
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from common import (
    MODEL,
    Proc,
    StreamResult,
    cluster,
    metric_sum,
    percentile,
    scrape_all,
    stream_chat,
    table,
    wait_healthy,
    write_results,
)
from workload import ANSWER_MEDIAN, ANSWER_RANGE, ANSWER_SIGMA

from tensorfleet import contract

TIME_SCALE = 0.25
ENGINES = 4
MODEL_FLAGS = ("--model", "meta-llama/Llama-3.1-8B-Instruct", "--accelerator", "L4", "--max-model-len", "8192")
ADAPTERS = 20
RANK = 16
MAX_LORAS = 4        # GPU slots per engine: distinct adapters in one batch
MAX_CPU_LORAS = 8    # adapters an engine keeps in host memory
LOAD_SECONDS = 0.25  # disk -> GPU slot: ~84 MB of safetensors read, parsed and copied
SWAP_SECONDS = 0.02  # CPU cache -> GPU slot: a PCIe copy plus vLLM's slot bookkeeping
ZIPF_S = 1.1
PROMPT_TOKENS = (50, 1000)
STRATEGIES = ("least-pending", "prefix-aware", "cache-aware")
BASELINE, ADAPTER_AWARE = "least-pending", contract.DEFAULT_ROUTER_STRATEGY
LOAD = 0.75
WARM_FRACTION = 0.2
LOADS_METRIC = contract.SIM_METRIC_LORA_LOADS + "_total"
TIERS = ("disk", "cpu")


def adapter_names() -> list[str]:
    return [f"lora-{i:02d}" for i in range(ADAPTERS)]


def make_adapters(root: Path) -> list[str]:
    """ADAPTERS PEFT adapter directories (only their config: the simulator reads the rank); --lora-modules values."""
    modules = []
    for name in adapter_names():
        path = root / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "base_model_name_or_path": MODEL_FLAGS[1], "r": RANK, "lora_alpha": 2 * RANK,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))
        modules.append(f"{name}={path}")
    return modules


def engine_flags(modules: Sequence[str]) -> list[str]:
    return [*MODEL_FLAGS, "--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(RANK),
            "--max-cpu-loras", str(MAX_CPU_LORAS), "--lora-load-seconds", str(LOAD_SECONDS),
            "--lora-swap-seconds", str(SWAP_SECONDS), "--lora-modules", *modules]


# --- workload ------------------------------------------------------------------------------------

@dataclass
class Call:
    at: float       # wall seconds after the first arrival
    adapter: str
    prompt: str
    max_tokens: int


@dataclass
class Done:
    call: Call
    result: StreamResult


def zipf_weights(n: int, s: float) -> list[float]:
    return [1 / (rank + 1) ** s for rank in range(n)]


class Requests:
    """An endless seeded stream of requests: adapters by Zipf popularity (the order shuffled by the seed); with
    BASE, the same requests for the base model."""

    def __init__(self, seed: int, base: bool = False) -> None:
        self.rng = random.Random(seed)
        self.popularity = adapter_names()
        self.rng.shuffle(self.popularity)   # most popular first
        self.weights = zipf_weights(ADAPTERS, ZIPF_S)
        self.base = base

    def next(self, at: float = 0.0) -> Call:
        rng = self.rng
        words = " ".join("".join(rng.choices(string.ascii_lowercase, k=4)) for _ in range(rng.randint(*PROMPT_TOKENS)))
        answer = rng.lognormvariate(0, ANSWER_SIGMA) * ANSWER_MEDIAN
        adapter = rng.choices(self.popularity, self.weights)[0]
        return Call(at, MODEL if self.base else adapter, words, int(min(max(answer, ANSWER_RANGE[0]), ANSWER_RANGE[1])))


def arrivals(seed: int, rate: float, count: int, seconds: float) -> list[Call]:
    """At most COUNT requests at Poisson times of RATE per wall second within SECONDS."""
    requests, gaps = Requests(seed), random.Random(seed + 1)
    calls: list[Call] = []
    at = 0.0
    while len(calls) < count:
        at += gaps.expovariate(rate)
        if at >= seconds:
            break
        calls.append(requests.next(at))
    return calls


async def stream(http: aiohttp.ClientSession, url: str, call: Call, timeout: float = 300.0) -> StreamResult:
    """One streaming chat for CALL's adapter (its name is the model)."""
    return await stream_chat(http, url, [{"role": "user", "content": call.prompt}], call.max_tokens,
                             timeout=timeout, model=call.adapter)


def ok(d: Done) -> bool:
    return d.result.status == 200 and not d.result.error and d.result.ttft is not None and d.result.done


async def load_totals(engines: Sequence[Proc]) -> dict[str, float]:
    """Adapters brought into GPU slots so far, summed over the engines, by the tier they came from."""
    texts = await scrape_all([e.url for e in engines])
    return {tier: sum(metric_sum(t, LOADS_METRIC, tier=tier) for t in texts) for tier in TIERS}


async def open_loop(url: str, calls: Sequence[Call], engines: Sequence[Proc], window: tuple[float, float],
                    drain_seconds: float) -> tuple[list[Done], float, list[dict[str, float]]]:
    """Send CALLS at their times; the engines' load counters at the window's two ends (wall seconds after the
    start); wait up to DRAIN_SECONDS after the last arrival."""
    done: list[Done] = []
    counters: list[dict[str, float]] = []

    async def one(call: Call) -> None:
        await asyncio.sleep(max(0.0, start + call.at - time.perf_counter()))
        done.append(Done(call, await stream(http, url, call)))

    async def sample() -> None:
        for at in window:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            counters.append(await load_totals(engines))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        start = time.perf_counter()
        sampler = asyncio.create_task(sample())
        tasks = [asyncio.create_task(one(c)) for c in calls]
        await sampler
        _finished, pending = await asyncio.wait(tasks, timeout=drain_seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return done, start, counters


async def closed_loop(url: str, requests: Requests, concurrency: int, seconds: float) -> tuple[list[Done], float]:
    """CONCURRENCY clients sending REQUESTS back to back for SECONDS: saturates the fleet."""
    done: list[Done] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        start = time.perf_counter()

        async def worker() -> None:
            while time.perf_counter() < start + seconds:
                call = requests.next()
                done.append(Done(call, await stream(http, url, call)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, start


# --- runs ----------------------------------------------------------------------------------------

def measure_capacity(modules: Sequence[str], seconds: float, strategy: str = BASELINE,
                     base: bool = False) -> dict[str, Any]:
    """Simulated requests/s the fleet answers in closed loop (16 per engine) through STRATEGY (BASE: the same
    requests for the base model, no adapter), and their TTFT."""
    with cluster(f"lora-capacity-{strategy}{'-base' if base else ''}") as c:
        engines = [c.sim(f"engine{i}", *engine_flags(modules), time_scale=TIME_SCALE) for i in range(ENGINES)]
        router = c.router(engines, strategy=strategy)
        asyncio.run(wait_healthy(*engines, router))
        time.sleep(2.5)
        done, start = asyncio.run(closed_loop(router.url, Requests(0, base), ENGINES * 16, seconds))
    lo = start + seconds * 0.25
    answered = [d for d in done if d.result.sent_at >= lo and ok(d)]
    ttfts = [d.result.ttft / TIME_SCALE for d in answered if d.result.ttft is not None]
    sim_seconds = seconds * 0.75 / TIME_SCALE
    return {"strategy": strategy, "model": "base" if base else "adapters", "rps": len(answered) / sim_seconds,
            "tokens_per_s": sum(d.result.tokens for d in answered) / sim_seconds,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


def capacity_table(modules: Sequence[str], seconds: float, strategies: Sequence[str]) -> None:
    """Closed-loop capacity of the base model and of the adapter workload under each strategy."""
    rows = [measure_capacity(modules, seconds, BASELINE, base=True)]
    rows += [measure_capacity(modules, seconds, s) for s in strategies]
    print(table(["model", "strategy", "req/s", "tokens/s", "TTFT p50 s", "TTFT p99 s"],
                [[r["model"], r["strategy"], r["rps"], r["tokens_per_s"], r["ttft_p50_s"], r["ttft_p99_s"]]
                 for r in rows]))
    path = write_results("lora-capacity", {"time_scale": TIME_SCALE, "seconds": seconds, "rows": rows})
    print(f"wrote {path}")


def run_one(modules: Sequence[str], strategy: str, seed: int, calls: Sequence[Call], span: float) -> dict[str, Any]:
    """CALLS through a router with STRATEGY, on fresh engines; figures over the arrivals' SPAN (wall seconds) less
    its first WARM_FRACTION."""
    window = (span * WARM_FRACTION, span)  # wall seconds after the start
    with cluster(f"lora-{strategy}-s{seed}") as c:
        engines = [c.sim(f"engine{i}", *engine_flags(modules), time_scale=TIME_SCALE) for i in range(ENGINES)]
        router = c.router(engines, strategy=strategy)
        asyncio.run(wait_healthy(*engines, router))
        time.sleep(2.5)  # the router has scraped every engine
        done, start, counters = asyncio.run(open_loop(router.url, calls, engines, window, drain_seconds=120.0))
        total = asyncio.run(load_totals(engines))
    return {"strategy": strategy, "seed": seed, **figures(done, start, window, counters),
            "loads_whole_run": total, "loadavg_at_end": os.getloadavg()[0]}


def figures(done: list[Done], start: float, window: tuple[float, float],
            counters: list[dict[str, float]]) -> dict[str, Any]:
    lo, hi = start + window[0], start + window[1]
    inside = [d for d in done if lo <= d.result.sent_at < hi]
    answered = [d for d in inside if ok(d)]
    ttfts = [d.result.ttft / TIME_SCALE for d in answered if d.result.ttft is not None]
    sim_seconds = (window[1] - window[0]) / TIME_SCALE
    minutes = sim_seconds / 60
    loads = {tier: (counters[1][tier] - counters[0][tier]) / minutes for tier in TIERS}
    served: dict[str, set[str]] = defaultdict(set)
    for d in answered:
        served[d.result.backend].add(d.call.adapter)
    return {
        "requests": len(inside), "answered": len(answered), "failed": len(inside) - len(answered),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "loads_per_min": loads["disk"] + loads["cpu"], "disk_loads_per_min": loads["disk"],
        "cpu_loads_per_min": loads["cpu"],
        "throughput_rps": len(answered) / sim_seconds,
        "tokens_per_s": sum(d.result.tokens for d in answered) / sim_seconds,
        "adapters_per_engine": statistics.mean(len(s) for s in served.values()) if served else float("nan"),
    }


# --- report --------------------------------------------------------------------------------------

KEYS = ("ttft_p50_s", "ttft_p99_s", "loads_per_min", "disk_loads_per_min", "cpu_loads_per_min", "throughput_rps",
        "tokens_per_s", "adapters_per_engine", "failed", "requests")


def group(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and range over seeds, per strategy."""
    rows = []
    for strategy in dict.fromkeys(r["strategy"] for r in runs):
        mine = [r for r in runs if r["strategy"] == strategy]
        row: dict[str, Any] = {"strategy": strategy, "seeds": len(mine)}
        for key in KEYS:
            values = [r[key] for r in mine]
            row[key] = statistics.median(values)
            row[key + "_range"] = (min(values), max(values))
        rows.append(row)
    return rows


def evaluate(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["strategy"]: r for r in rows}
    aware, base = by.get(ADAPTER_AWARE), by.get(BASELINE)
    if not aware or not base:
        return {}
    pairs = [(a, b) for a in runs if a["strategy"] == ADAPTER_AWARE
             for b in runs if b["strategy"] == BASELINE and b["seed"] == a["seed"]]
    goals: dict[str, Any] = {
        "loads_ratio": round(aware["loads_per_min"] / base["loads_per_min"], 3) if base["loads_per_min"] else None,
        "ttft_p99_ratio": round(aware["ttft_p99_s"] / base["ttft_p99_s"], 3),
        "throughput_ratio": round(aware["throughput_rps"] / base["throughput_rps"], 3),
        "fewer_loads_every_seed": all(a["loads_per_min"] < b["loads_per_min"] for a, b in pairs),
        "lower_ttft_p99_every_seed": all(a["ttft_p99_s"] < b["ttft_p99_s"] for a, b in pairs),
    }
    goals["met"] = goals["fewer_loads_every_seed"] and goals["lower_ttft_p99_every_seed"]
    return goals


def spread(row: dict[str, Any], key: str, fmt: str) -> str:
    lo, hi = row[key + "_range"]
    value = format(row[key], fmt)
    return value if row["seeds"] == 1 else f"{value} ({format(lo, fmt)}-{format(hi, fmt)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed, short runs (a smoke test, not figures)")
    parser.add_argument("--seconds", type=float, help="wall seconds of arrivals per run (default 90)")
    parser.add_argument("--requests", type=int, default=2000, help="most requests per run")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--load", type=float, default=LOAD, help="offered load, a multiple of the measured capacity")
    parser.add_argument("--strategies", nargs="*", default=list(STRATEGIES), choices=contract.ROUTER_STRATEGIES)
    parser.add_argument("--capacity-rps", type=float, help="skip the capacity run: the fleet's simulated requests/s")
    parser.add_argument("--capacity-table", action="store_true",
                        help="only measure closed-loop capacity: the base model, then the adapters per strategy")
    args = parser.parse_args()
    seconds = args.seconds or (20.0 if args.quick else 90.0)
    seeds = [1] if args.quick else list(range(1, args.seeds + 1))
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        modules = make_adapters(Path(tmp))
        if args.capacity_table:
            capacity_table(modules, 30.0 if args.quick else 60.0, args.strategies)
            return
        if args.capacity_rps:
            capacity = args.capacity_rps
        else:
            print("measuring fleet capacity (closed loop, least-pending)...", flush=True)
            capacity = measure_capacity(modules, 30.0 if args.quick else 60.0)["rps"]
        print(f"  capacity {capacity:.2f} requests/s (simulated); offering {args.load:.0%} of it", flush=True)
        rate = capacity * args.load / TIME_SCALE  # wall requests/s
        runs = []
        for seed in seeds:
            calls = arrivals(seed, rate, args.requests, seconds)
            span = calls[-1].at if len(calls) == args.requests else seconds  # the count bound cut arrivals short
            for strategy in args.strategies:
                run = run_one(modules, strategy, seed, calls, span)
                runs.append(run)
                print(f"  s{seed} {strategy:13} TTFT p50 {run['ttft_p50_s']:.2f}s p99 {run['ttft_p99_s']:.2f}s  "
                      f"loads/min {run['disk_loads_per_min']:.0f} disk + {run['cpu_loads_per_min']:.0f} cpu  "
                      f"{run['throughput_rps']:.2f} req/s {run['tokens_per_s']:.0f} tok/s  "
                      f"adapters/engine {run['adapters_per_engine']:.1f}  failed {run['failed']}", flush=True)
    rows = group(runs)
    print()
    print(f"{ENGINES} simulated L4 engines (Llama-3.1-8B), {ADAPTERS} rank-{RANK} adapters, max-loras {MAX_LORAS}, "
          f"max-cpu-loras {MAX_CPU_LORAS}, load {LOAD_SECONDS:g} s from disk / {SWAP_SECONDS:g} s from CPU; "
          f"Zipf s={ZIPF_S}; {args.load:.0%} of {capacity:.2f} req/s; median (range) over {len(seeds)} seed(s), "
          "simulated time")
    print(table(["strategy", "requests", "TTFT p50 s", "TTFT p99 s", "loads/min", "disk/min", "cpu/min", "req/s",
                 "tokens/s", "adapters/engine", "failed"],
                [[r["strategy"], r["requests"], spread(r, "ttft_p50_s", ".2f"), spread(r, "ttft_p99_s", ".2f"),
                  spread(r, "loads_per_min", ".0f"), spread(r, "disk_loads_per_min", ".0f"),
                  spread(r, "cpu_loads_per_min", ".0f"), spread(r, "throughput_rps", ".2f"),
                  spread(r, "tokens_per_s", ".0f"), r["adapters_per_engine"], r["failed"]] for r in rows]))
    goals = evaluate(runs, rows)
    for key, value in goals.items():
        print(f"  {key}: {value}")
    path = write_results("lora", {
        "quick": args.quick, "time_scale": TIME_SCALE, "engines": ENGINES, "adapters": ADAPTERS, "rank": RANK,
        "max_loras": MAX_LORAS, "max_cpu_loras": MAX_CPU_LORAS, "lora_load_seconds": LOAD_SECONDS,
        "lora_swap_seconds": SWAP_SECONDS, "zipf_s": ZIPF_S, "prompt_tokens": PROMPT_TOKENS, "load": args.load,
        "capacity_rps": capacity, "seconds_per_run": seconds, "max_requests": args.requests,
        "rows": rows, "goals": goals, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
