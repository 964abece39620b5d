"""Benchmark 2: routing quality of each strategy on a 4-engine simulated fleet.

Four simulators (Llama-3.1-8B on L4: 33k KV tokens, 69 ms decode steps and
0.27 ms per prefill token at batch 1, from the planner), run at --time-scale
0.25 (4x faster than the modelled GPU; figures below are converted back to
simulated seconds). First the fleet's capacity is measured: the workload in
closed loop with least-pending routing, as many sessions as keep every engine
saturated. Then the workload (workload.py) is offered open-loop at 50%, 80% and
100% of that request rate through the router with each strategy; engines are
restarted between runs so every run starts with cold caches.

Goals (issue 4): least-pending p99 TTFT <= half of round-robin's at 80% load;
prefix-aware prefix-cache hit rate >= 2x round-robin's, with p99 TTFT within
10% of least-pending's.

    python benchmarks/bench_routing.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from typing import Any

from common import cache_totals, cluster, percentile, table, wait_healthy, write_results
from workload import DEFAULT_SHAPE, Record, Workload, closed_loop, open_loop

TIME_SCALE = 0.25
ENGINES = 4
STRATEGIES = ("round-robin", "least-pending", "session", "prefix-aware")
LOADS = (0.5, 0.8, 1.0)
MODEL_FLAGS = ("--model", "meta-llama/Llama-3.1-8B-Instruct", "--accelerator", "L4", "--max-model-len", "8192")
MEAN_TURNS = DEFAULT_SHAPE.mean_turns


def summarise(records: list[Record], start: float, window: tuple[float, float]) -> dict[str, Any]:
    lo, hi = start + window[0], start + window[1]
    inside = [r.result for r in records if lo <= r.result.sent_at < hi]
    ok = [r for r in inside if r.status == 200 and not r.error and r.ttft is not None]
    ttft = [r.ttft / TIME_SCALE for r in ok]  # type: ignore[operator]  # ok holds only answered requests, whose ttft is set
    e2e = [r.total / TIME_SCALE for r in ok]
    seconds = (window[1] - window[0]) / TIME_SCALE
    return {
        "requests": len(inside), "ok": len(ok), "failed": len(inside) - len(ok),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "throughput_rps": len(ok) / seconds,
        "tokens_per_s": sum(r.tokens for r in ok) / seconds,
        "per_engine": dict(Counter(r.backend for r in ok)),
    }


def measure_capacity(seconds: float, concurrency: int) -> dict[str, Any]:
    workload = Workload(seed=1)
    with cluster("routing-capacity") as c:
        engines = [c.sim(f"engine{i}", *MODEL_FLAGS, time_scale=TIME_SCALE) for i in range(ENGINES)]
        router = c.router(engines, strategy="least-pending")
        asyncio.run(wait_healthy(*engines, router))
        time.sleep(2.5)
        records, start = asyncio.run(closed_loop(router.url, workload, concurrency, seconds, TIME_SCALE))
    warm = seconds * 0.25
    stats = summarise(records, start, (warm, seconds))
    return {"concurrency": concurrency, "seconds": seconds, **stats}


def run_one(strategy: str, load: float, rps: float, seconds: float) -> dict[str, Any]:
    workload = Workload(seed=2)  # the same sessions for every strategy and load
    with cluster(f"routing-{strategy}-{int(load * 100)}") as c:
        engines = [c.sim(f"engine{i}", *MODEL_FLAGS, time_scale=TIME_SCALE) for i in range(ENGINES)]
        router = c.router(engines, strategy=strategy)
        asyncio.run(wait_healthy(*engines, router))
        time.sleep(2.5)
        urls = [e.url for e in engines]
        before = asyncio.run(cache_totals(urls))
        sessions_per_second = rps / MEAN_TURNS
        records, start = asyncio.run(open_loop(router.url, workload, sessions_per_second, seconds, TIME_SCALE))
        after = asyncio.run(cache_totals(urls))
    hits, queries = after[0] - before[0], after[1] - before[1]
    stats = summarise(records, start, (seconds * 0.2, seconds))
    return {"strategy": strategy, "load": load, "offered_rps": rps * TIME_SCALE,
            "hit_rate": hits / queries if queries else 0.0, **stats}


def hit_ceiling(sessions: int) -> float:
    """The prefix-cache hit rate of this workload with perfect affinity and an
    unbounded cache: every token any earlier prompt or answer computed hits.
    No router can beat it; each session's document is new on its first turn."""
    from tensorfleet.prompts import block_hashes, render_chat
    from tensorfleet.sim.engine import Engine
    from tensorfleet.sim.profile import make_profile
    from tensorfleet.sim.tokenizer import tokenize

    profile = make_profile("meta-llama/Llama-3.1-8B-Instruct", "L4")
    engine = Engine(profile, clock=time.monotonic)  # used only to draw the simulator's answers
    size = profile.block_size
    seen: set[int] = set()
    hits = queries = 0
    workload = Workload(seed=2)
    for _ in range(sessions):
        plan = workload.session()
        messages: list[dict[str, Any]] = [{"role": "system", "content": plan.system}]
        for index, turn in enumerate(plan.turns):
            content = (f"Document:\n{plan.document}\n\n" if index == 0 and plan.document else "") + turn.question
            messages.append({"role": "user", "content": content})
            tokens = tokenize(render_chat(messages))
            hashes = block_hashes(tokens, size)
            cached = 0
            for h in hashes[: (len(tokens) - 1) // size]:
                if h not in seen:
                    break
                cached += 1
            hits += cached * size
            queries += len(tokens)
            answer = engine.submit(tokens, turn.max_tokens).output_words
            engine.waiting.clear()
            seen.update(block_hashes([*tokens, *answer], size)[: (len(tokens) + len(answer) - 1) // size])
            messages.append({"role": "assistant", "content": "".join(answer)})
    return hits / queries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test, not figures)")
    parser.add_argument("--seconds", type=float, help="wall seconds of arrivals per run")
    parser.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    parser.add_argument("--loads", nargs="*", type=float, default=list(LOADS))
    parser.add_argument("--capacity-rps", type=float, help="skip the capacity run (wall-clock requests/s)")
    parser.add_argument("--ceiling-only", action="store_true", help="print the workload's best possible hit rate")
    args = parser.parse_args()
    ceiling = hit_ceiling(300)
    print(f"best possible prefix-cache hit rate of this workload (perfect affinity, unbounded cache): {ceiling:.1%}")
    if args.ceiling_only:
        return
    seconds = args.seconds or (30.0 if args.quick else 120.0)
    if args.capacity_rps:
        capacity = {"throughput_rps": args.capacity_rps * TIME_SCALE, "given": True}
    else:
        print("measuring fleet capacity (closed loop, least-pending)...", flush=True)
        capacity = measure_capacity(seconds=40.0 if args.quick else 120.0, concurrency=ENGINES * 16)
        print(f"  capacity {capacity['throughput_rps']:.2f} requests/s (simulated time), "
              f"{capacity['tokens_per_s']:.0f} tokens/s", flush=True)
    wall_rps = capacity["throughput_rps"] / TIME_SCALE
    rows = []
    for load in args.loads:
        for strategy in args.strategies:
            row = run_one(strategy, load, wall_rps * load, seconds)
            rows.append(row)
            print(f"  {strategy:13} {int(load * 100):3}%  TTFT p50 {row['ttft_p50_s']:.2f}s p99 {row['ttft_p99_s']:.2f}s  "
                  f"e2e p99 {row['e2e_p99_s']:.1f}s  {row['throughput_rps']:.2f} req/s  hit {row['hit_rate']:.1%}  "
                  f"failed {row['failed']}", flush=True)
    print()
    print(f"fleet: {ENGINES} simulated L4 engines (Llama-3.1-8B), capacity {capacity['throughput_rps']:.2f} req/s; "
          "times in simulated seconds")
    print(table(["strategy", "load", "requests", "TTFT p50 s", "TTFT p99 s", "e2e p99 s", "req/s", "tokens/s",
                 "prefix hit", "failed"],
                [[r["strategy"], f"{int(r['load'] * 100)}%", r["requests"], r["ttft_p50_s"], r["ttft_p99_s"],
                  r["e2e_p99_s"], r["throughput_rps"], r["tokens_per_s"], f"{r['hit_rate']:.1%}", r["failed"]]
                 for r in rows]))
    goals = evaluate(rows)
    for key, value in goals.items():
        print(f"  {key}: {value}")
    path = write_results("routing", {"quick": args.quick, "time_scale": TIME_SCALE, "engines": ENGINES,
                                     "hit_rate_ceiling": ceiling,
                                     "seconds_per_run": seconds, "capacity": capacity, "runs": rows, "goals": goals})
    print(f"wrote {path}")


def evaluate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def get(strategy: str, load: float) -> dict[str, Any] | None:
        return next((r for r in rows if r["strategy"] == strategy and r["load"] == load), None)

    goals: dict[str, Any] = {}
    rr, lp = get("round-robin", 0.8), get("least-pending", 0.8)
    if rr and lp:
        goals["lp_rr_p99_ttft_ratio_80"] = lp["ttft_p99_s"] / rr["ttft_p99_s"]
        goals["lp_p99_ttft_at_most_half_rr_80"] = goals["lp_rr_p99_ttft_ratio_80"] <= 0.5
    for load in (0.5, 0.8, 1.0):
        rr, lp, pa = get("round-robin", load), get("least-pending", load), get("prefix-aware", load)
        if rr and pa and lp:
            tag = int(load * 100)
            goals[f"pa_rr_hit_ratio_{tag}"] = pa["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
            goals[f"pa_lp_p99_ttft_ratio_{tag}"] = pa["ttft_p99_s"] / lp["ttft_p99_s"]
            goals[f"pa_goal_met_{tag}"] = (goals[f"pa_rr_hit_ratio_{tag}"] >= 2.0
                                           and goals[f"pa_lp_p99_ttft_ratio_{tag}"] <= 1.1)
    return goals


if __name__ == "__main__":
    main()
