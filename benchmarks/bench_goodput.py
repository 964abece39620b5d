"""Benchmark 7: goodput by routing strategy, load, workload and router replicas (issue 14).

Four simulators of Llama-3.1-8B on L4, started with the flags the operator's
plan gives them (33,296 KV tokens) and publishing KV events as the operator
configures them, at --time-scale 0.25; figures are in simulated seconds. The
router runs as the operator deploys it: its per-engine ceiling is the plan's
KV-derived default (`engine_concurrency` at 2048 tokens a request), subscribed
to every engine's KV events (`--kv-events`), everything else at its defaults.
`cache-aware-before` is the default strategy of another checkout (`--before
DIR`, the router before issue 37 rebuilt it: it places by what it remembers
sending, and takes no KV events). With two replicas, two router
processes, each turn of a session sent to one of them at random (seeded by the
session and turn, so every strategy sees the same split), as a Service spreads
connections; each knows the other (`--peer`), as the operator's `--peer-service`
makes them (router/peers.py).

Workloads (workload.py): `prefix`, multi-turn chat sessions whose tenants share
system prompts, each re-sending its conversation; `prefix-free`, one turn per
session with a system prompt of its own, so nothing is shared. Capacity is
measured first per workload (closed loop, 16 sessions per engine, least-pending);
sessions then arrive open-loop (Poisson) at each multiple of it, and go on
arriving after the run's window until every request sent in it has its answer
(workload.open_loop's `sustain`), so each is served under the load it was sent
into; only the window's requests count. Engines restart between runs, with cold
caches. `--model`, `--accelerator`, `--max-model-len` and `--shape` plan other
engines (the operator's planner sizes their KV cache, batch and the router's
ceiling) and draw another workload, to see routing where it was not tuned.

Goodput: requests per second answered with a first token within TTFT_TARGET
(and, separately, with a mean inter-token time within ITL_TARGET); a failed
request is never good. At best: the requests per second whose first token could
be in time at all, whatever the placement: computing only what no earlier
request's prompt or answer held, on an idle engine (the simulators' step model). Router CPU: user + system time of the router
process(es) over the run, per request. Prefix-cache hit rate: from the engines'
own counters; its maximum for the run's requests is what one engine with an
unbounded cache would hit (each prompt's leading full blocks that an earlier
request's prompt or answer holds); pooled LRU, what one engine holding
all four caches together would hit, evicting the least recently used idle
block, with the run's timing (the reference once the caches are full).

    python benchmarks/bench_goodput.py [--quick] [--seeds 3] [--loads 1.0 1.2] ... [--resume]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import (
    ACCELERATOR,
    HOST,
    MODEL_ID,
    cache_totals,
    cluster,
    engine_flags,
    free_port,
    metric_sum,
    percentile,
    scrape_all,
    table,
    wait_healthy,
    write_results,
)
from workload import DEFAULT_SHAPE, Record, Shape, Workload, closed_loop, ok, open_loop

from tensorfleet import contract, engine_settings, vllm_defaults
from tensorfleet.api import load_inference_service
from tensorfleet.planner import Plan, make_plan
from tensorfleet.router.yielding import YIELD_OUTCOMES
from tensorfleet.sim.profile import Profile, make_profile

TIME_SCALE = 0.25
ENGINES = 4
BEFORE = "cache-aware-before"   # the default strategy of the --before checkout
STRATEGIES = ("round-robin", "least-pending", "prefix-aware", "cache-aware", BEFORE)
BASELINES = ("round-robin", "least-pending")
LOADS = (0.5, 0.8, 1.0, 1.2, 1.5)
WORKLOADS = ("prefix", "prefix-free")
TTFT_TARGET = 0.5   # seconds: the target
ITL_TARGET = 0.1    # seconds per output token after the first (the simulated L4 decodes a step in 69 ms at batch 1)
MAX_MODEL_LEN = 8192  # spec.model.maxModelLen unless --max-model-len
WARM_FRACTION = 0.2  # the first fifth of each run's arrivals is left out of the figures


def plan_of(model: str = MODEL_ID, accelerator: str = ACCELERATOR, max_model_len: int = MAX_MODEL_LEN) -> Plan:
    """The operator's plan for the engines (raises SpecError, naming the field, where the planner refuses it)."""
    doc = {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "bench"},
           "spec": {"model": {"name": model, "maxModelLen": max_model_len}, "accelerator": {"type": accelerator},
                    "engine": {"kind": "simulator"}}}
    return make_plan(load_inference_service(doc).spec)


def engine_profile(plan: Plan) -> Profile:
    """The simulators' step model, as engine_flags starts them."""
    return make_profile(plan.model, plan.accelerator, tensor=plan.tensor, max_model_len=plan.max_model_len,
                        max_num_seqs=plan.max_num_seqs, kv_cache_tokens=plan.kv_cache_tokens)


def ceiling(plan: Plan) -> int:
    """The router's per-engine ceiling the operator derives from the plan (router_flags)."""
    return plan.engine_concurrency(2048)


def router_flags(plan: Plan) -> list[str]:
    """The operator's router flags that matter here: the KV-derived ceiling per engine, the engines' prefill
    budget per step."""
    return ["--max-concurrency-per-backend", str(ceiling(plan)),
            "--prompt-queue-tokens", str(plan.batched_tokens)]


def peer_flags(ports: Sequence[int], own: int) -> list[str]:
    """--peer for every other router replica."""
    return [arg for port in ports if port != own for arg in ("--peer", f"http://{HOST}:{port}")]


def itl(r: Record) -> float | None:
    """Mean seconds between output tokens after the first (simulated); None with fewer than two tokens."""
    result = r.result
    if result.ttft is None or result.tokens < 2:
        return None
    return (result.total - result.ttft) / (result.tokens - 1) / TIME_SCALE


def figures(records: list[Record], start: float, seconds: float, bounds: dict[int, float]) -> dict[str, Any]:
    """The run's figures over the requests sent in its window; BOUNDS: each request's least possible time to its
    first token (`ttft_bounds`)."""
    lo, hi = start + seconds * WARM_FRACTION, start + seconds
    inside = [r for r in records if lo <= r.result.sent_at < hi]
    answered = [r for r in inside if ok(r)]
    ttfts = [r.result.ttft / TIME_SCALE for r in answered if r.result.ttft is not None]
    good_ttft = [r for r in answered if r.result.ttft is not None and r.result.ttft / TIME_SCALE <= TTFT_TARGET]
    itls = [x for x in (itl(r) for r in answered) if x is not None]
    good_itl = [r for r in answered if (x := itl(r)) is not None and x <= ITL_TARGET]
    sim_seconds = (hi - lo) / TIME_SCALE
    n = len(inside)
    return {
        "requests": n, "answered": len(answered), "failed": n - len(answered),
        "goodput_ttft_rps": len(good_ttft) / sim_seconds, "share_ttft": len(good_ttft) / n if n else float("nan"),
        "goodput_itl_rps": len(good_itl) / sim_seconds, "share_itl": len(good_itl) / n if n else float("nan"),
        "throughput_rps": len(answered) / sim_seconds,
        # The most any placement could have in time: the requests whose bound is within the target.
        "ttft_bound_rps": sum(bounds[id(r)] <= TTFT_TARGET for r in inside) / sim_seconds,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
        # Every answered request's TTFT, for percentiles over all seeds together (`group`).
        "ttfts_s": [round(t, 4) for t in ttfts],
    }


def workload_of(name: str, seed: int, shape: Shape) -> Workload:
    return Workload(seed=seed, shared=name == "prefix", shape=shape)


def measure_capacity(plan: Plan, workload: str, shape: Shape, seconds: float) -> float:
    """Simulated requests/s the fleet answers in closed loop (as many sessions per engine as the router's
    ceiling: 16 on the default plan) through least-pending."""
    with cluster(f"goodput-capacity-{workload}") as c:
        engines = [c.sim(f"engine{i}", *engine_flags(plan), time_scale=TIME_SCALE) for i in range(ENGINES)]
        router = c.router(engines, *router_flags(plan), strategy="least-pending")
        asyncio.run(wait_healthy(*engines, router))
        time.sleep(2.5)
        records, start = asyncio.run(closed_loop(router.url, workload_of(workload, 1, shape), ENGINES * ceiling(plan), seconds,
                                                 TIME_SCALE))
    lo = start + seconds * 0.25
    done = [r for r in records if r.result.sent_at >= lo and ok(r)]
    return len(done) / (seconds * 0.75 / TIME_SCALE)


def kv_events_ports() -> tuple[int, int]:
    return free_port(), free_port()


Keyed = tuple[Record, int, list[int], list[int]]   # a request, its prompt's tokens, its prompt's and its whole blocks


def keyed(records: Sequence[Record], block_size: int) -> list[Keyed]:
    """RECORDS in the order sent, each with its prompt's length in tokens and the chained keys of the full blocks
    of its prompt, and of its prompt and answer, as an engine's prefix cache keys them."""
    from tensorfleet.prompts import render_chat
    from tensorfleet.sim.tokenizer import tokenize

    def blocks(tokens: list[str]) -> list[int]:
        keys, parent = [], 0
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash((parent, tuple(tokens[start:start + block_size])))
            keys.append(parent)
        return keys

    out = []
    for record in sorted(records, key=lambda r: r.result.sent_at):
        if record.messages:
            prompt = tokenize(render_chat(record.messages))
            out.append((record, len(prompt), blocks(prompt), blocks(prompt + tokenize(record.result.text))))
    return out


def best_cache(requests: Sequence[Keyed], block_size: int) -> list[tuple[Record, int, int]]:
    """Each request with its prompt's tokens and the most of them one engine with an unbounded cache would hold:
    its leading full blocks that an earlier request's prompt, or its prompt and answer, held."""
    held: set[int] = set()
    best = []
    for record, tokens, prompt, whole in requests:
        run = next((i for i, key in enumerate(prompt) if key not in held), len(prompt))
        best.append((record, tokens, run * block_size))
        held.update(prompt)
        held.update(whole)
    return best


def pooled_hit_rate(requests: Sequence[Keyed], block_size: int, capacity_blocks: int) -> float:
    """The prefix-cache hit rate of one engine holding every engine's KV cache together (CAPACITY_BLOCKS) and
    evicting the least recently used idle block, with the run's timing: each request's blocks held from its send to
    its end (answered requests only). A reference for a fleet whose caches are full, not a bound: four caches
    placed well can beat one pooled LRU."""
    events = []   # (time, 1 at its send or 0 at its end, request)
    for i, (record, _, _, _) in enumerate(requests):
        if record.result.ttft is not None:
            events += [(record.result.sent_at, 1, i), (record.result.sent_at + record.result.total, 0, i)]
    pinned: dict[int, int] = {}            # block -> requests holding it
    idle: OrderedDict[int, None] = OrderedDict()   # cached blocks no request holds, least recently used first
    hits = queries = 0
    for _, start, i in sorted(events):
        _, tokens, prompt, whole = requests[i]
        if not start:
            for key in whole:
                pinned[key] -= 1
                if not pinned[key]:
                    del pinned[key]
                    idle[key] = None
            continue
        run = next((n for n, key in enumerate(prompt) if key not in pinned and key not in idle), len(prompt))
        hits, queries = hits + run * block_size, queries + tokens
        for key in whole:
            idle.pop(key, None)
            pinned[key] = pinned.get(key, 0) + 1
        while len(pinned) + len(idle) > capacity_blocks and idle:
            idle.popitem(last=False)
    return hits / queries if queries else 0.0


def max_hit_rate(best: Sequence[tuple[Record, int, int]]) -> float:
    """The prefix-cache hit rate of the best cache (`best_cache`) over the run's prompts."""
    queries = sum(tokens for _, tokens, _ in best)
    return sum(cached for _, _, cached in best) / queries if queries else 0.0


def ttft_bounds(best: Sequence[tuple[Record, int, int]], profile: Profile) -> dict[int, float]:
    """Per request (by id of its record): the least time to its first token, in simulated seconds, that any
    placement could give it: the steps computing what the best cache lacks (at least one token), chunked by the
    engine's step budget, on an idle engine."""
    bounds = {}
    for record, tokens, cached in best:
        left, seconds = max(tokens - cached, 1), 0.0
        while left > 0:
            chunk = min(left, profile.max_num_batched_tokens)
            seconds += profile.step_seconds(0, 0, chunk)
            left -= chunk
        bounds[id(record)] = seconds
    return bounds


def run_one(plan: Plan, workload: str, strategy: str, replicas: int, load: float, capacity: float, seed: int,
            seconds: float, before: Path | None = None, shape: Shape = DEFAULT_SHAPE) -> dict[str, Any]:
    tag = f"goodput-{workload}-{strategy}-{replicas}r-{int(load * 100)}-s{seed}"
    with cluster(tag) as c:
        # Every engine publishes its KV events, as the operator configures an engine of a full-attention model.
        events = [kv_events_ports() for _ in range(ENGINES)]
        engines = [c.sim(f"engine{i}", *engine_flags(plan), "--kv-events-config",
                         engine_settings.kv_events_config(*pair), time_scale=TIME_SCALE)
                   for i, pair in enumerate(events)]
        # The routers of this checkout subscribe to them, as the operator renders them; the one before does not.
        subscribe = [] if strategy == BEFORE else ["--kv-events", *(
            arg for engine, (pub, replay) in zip(engines, events, strict=True)
            for arg in ("--kv-events-endpoint", f"{engine.url}=tcp://{HOST}:{pub},tcp://{HOST}:{replay}"))]
        name = contract.DEFAULT_ROUTER_STRATEGY if strategy == BEFORE else strategy
        # Replicas know each other as the operator's --peer-service makes them (router/peers.py).
        ports = [free_port() for _ in range(replicas)]
        routers = [c.router(engines, *router_flags(plan), *peer_flags(ports, port), *subscribe, strategy=name,
                            port=port, source=before if strategy == BEFORE else None)
                   for port in ports]
        asyncio.run(wait_healthy(*engines, *routers))
        time.sleep(2.5)  # every router has scraped every engine
        urls = [e.url for e in engines]
        before_totals = asyncio.run(cache_totals(urls))
        cpu_before = sum(r.cpu_seconds() for r in routers)
        turns = shape.mean_turns if workload == "prefix" else 1
        sessions_per_second = capacity * load / TIME_SCALE / turns  # wall seconds
        target: str | list[str] = routers[0].url if replicas == 1 else [r.url for r in routers]
        records, start = asyncio.run(open_loop(target, workload_of(workload, seed, shape), sessions_per_second, seconds,
                                               TIME_SCALE, sustain=True))
        cpu = sum(r.cpu_seconds() for r in routers) - cpu_before
        after = asyncio.run(cache_totals(urls))
        # How the slots the replicas left each other ended (none with one router, nor before the change).
        router_texts = asyncio.run(scrape_all([r.url for r in routers])) if replicas > 1 else []
    yields = {outcome: sum(metric_sum(t, contract.ROUTER_METRIC_PEER_YIELDS + "_total", outcome=outcome)
                           for t in router_texts) for outcome in YIELD_OUTCOMES}
    requests = keyed(records, vllm_defaults.BLOCK_SIZE)   # the simulators' block size (engine_flags)
    best = best_cache(requests, vllm_defaults.BLOCK_SIZE)
    hits, queries = after[0] - before_totals[0], after[1] - before_totals[1]
    return {"workload": workload, "strategy": strategy, "replicas": replicas, "load": load, "seed": seed,
            "hit_rate": hits / queries if queries else 0.0,
            "max_hit_rate": max_hit_rate(best),
            "pooled_hit_rate": pooled_hit_rate(requests, vllm_defaults.BLOCK_SIZE,
                                               ENGINES * plan.kv_cache_tokens // vllm_defaults.BLOCK_SIZE),
            "router_cpu_ms_per_request": 1000 * cpu / len(records) if records else float("nan"),
            "slots_left_to_peers": yields,
            **figures(records, start, seconds, ttft_bounds(best, engine_profile(plan)))}


# --- report --------------------------------------------------------------------------------------

def group(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and range over seeds, per workload, load, strategy and replica count."""
    keys = sorted({(r["workload"], r["load"], r["replicas"], r["strategy"]) for r in runs},
                  key=lambda k: (WORKLOADS.index(k[0]), k[1], k[2], STRATEGIES.index(k[3])))
    rows = []
    for workload, load, replicas, strategy in keys:
        mine = [r for r in runs if (r["workload"], r["load"], r["replicas"], r["strategy"]) ==
                (workload, load, replicas, strategy)]
        row: dict[str, Any] = {"workload": workload, "load": load, "replicas": replicas, "strategy": strategy,
                               "seeds": len(mine)}
        for key in ("goodput_ttft_rps", "share_ttft", "goodput_itl_rps", "share_itl", "throughput_rps", "ttft_bound_rps",
                    "ttft_p50_s", "ttft_p99_s", "itl_p99_s", "hit_rate", "max_hit_rate", "pooled_hit_rate",
                    "router_cpu_ms_per_request",
                    "failed"):
            values = [r[key] for r in mine if key in r]   # runs saved before max_hit_rate was kept lack it
            if not values:
                continue
            row[key] = statistics.median(values)
            row[key + "_range"] = (min(values), max(values))
        # A run's p99 is its few slowest requests (about 5 in a 60 s run at 80% load), and one slow burst moves
        # it far: the p99 of every seed's requests together is the steadier figure. Runs saved before the
        # per-request TTFTs were kept have none.
        pooled = [t for r in mine for t in r.get("ttfts_s") or ()]
        if pooled and all(r.get("ttfts_s") for r in mine):
            row["ttft_p99_pooled_s"] = percentile(pooled, 99)
        rows.append(row)
    return rows


def evaluate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 37's goals, where the rows to judge them were run."""
    def get(workload: str, load: float, strategy: str, replicas: int = 1) -> dict[str, Any] | None:
        return next((r for r in rows if (r["workload"], r["load"], r["strategy"], r["replicas"]) ==
                     (workload, load, strategy, replicas)), None)

    default = contract.DEFAULT_ROUTER_STRATEGY
    goals: dict[str, Any] = {}
    for load in (1.0, 1.2):
        d, rr = get("prefix", load, default), get("prefix", load, "round-robin")
        if d and rr and rr["goodput_ttft_rps"]:
            ratio = d["goodput_ttft_rps"] / rr["goodput_ttft_rps"]
            goals[f"prefix_{int(load * 100)}_default_over_rr"] = round(ratio, 2)
            goals[f"prefix_{int(load * 100)}_at_least_2x"] = ratio >= 2.0
            if d.get("ttft_bound_rps"):
                # What no placement could beat: the requests that could be in time at all, over round-robin's.
                goals[f"prefix_{int(load * 100)}_bound_over_rr"] = round(d["ttft_bound_rps"] / rr["goodput_ttft_rps"], 2)
                goals[f"prefix_{int(load * 100)}_default_of_bound"] = round(d["goodput_ttft_rps"] / d["ttft_bound_rps"], 3)
    for key, name in (("goodput_ttft_rps", "ttft"), ("goodput_itl_rps", "itl")):
        below = []
        for load in sorted({r["load"] for r in rows}):
            d, rr = get("prefix-free", load, default), get("prefix-free", load, "round-robin")
            if d and rr:
                below.append(f"{int(load * 100)}%: {d[key]:.2f} vs {rr[key]:.2f}")
                goals.setdefault(f"prefix_free_{name}_never_below_rr", True)
                goals[f"prefix_free_{name}_never_below_rr"] &= d[key] >= rr[key]
        if below:
            goals[f"prefix_free_{name}_default_vs_rr"] = ", ".join(below)
    ratios = {}
    for r in rows:
        if r["strategy"] == default and r["replicas"] == 2:
            one = get(r["workload"], r["load"], default)
            if one and one["goodput_ttft_rps"]:
                ratios[f"{r['workload']} {int(r['load'] * 100)}%"] = round(
                    r["goodput_ttft_rps"] / one["goodput_ttft_rps"], 3)
    if ratios:
        goals["two_replicas_goodput_over_one"] = ratios
        goals["two_replicas_within_5pct"] = all(v >= 0.95 for v in ratios.values())
    one_router = [r for r in rows if r["workload"] == "prefix" and r["strategy"] == default and r["replicas"] == 1]
    hits = {f"{int(r['load'] * 100)}%": round(r["hit_rate"] / r["max_hit_rate"], 3) for r in one_router
            if r.get("max_hit_rate")}
    if hits:
        goals["prefix_hit_rate_over_max"] = hits
        goals["prefix_hit_rate_at_least_95pct_of_max"] = all(v >= 0.95 for v in hits.values())
        pooled = {f"{int(r['load'] * 100)}%": round(r["hit_rate"] / r["pooled_hit_rate"], 3) for r in one_router
                  if r.get("pooled_hit_rate")}
        if pooled:
            goals["prefix_hit_rate_over_pooled_lru"] = pooled
    cpu = {}
    for r in rows:
        old = get(r["workload"], r["load"], BEFORE, r["replicas"])
        if r["strategy"] == default and old and old["router_cpu_ms_per_request"]:
            cpu[f"{r['workload']} {int(r['load'] * 100)}% {r['replicas']}r"] = round(
                r["router_cpu_ms_per_request"] / old["router_cpu_ms_per_request"], 2)
    if cpu:
        goals["router_cpu_over_before"] = cpu
    return goals


def plot(rows: list[dict[str, Any]], path: str, fleet: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    colours = {"round-robin": "tab:red", "least-pending": "tab:orange", "prefix-aware": "tab:green",
               "cache-aware": "tab:blue", "session": "tab:purple", BEFORE: "tab:gray"}
    for ax, workload in zip(axes[0], workloads, strict=True):
        for strategy in STRATEGIES:
            for replicas, style in ((1, "-"), (2, "--")):
                mine = sorted((r for r in rows if (r["workload"], r["strategy"], r["replicas"]) ==
                               (workload, strategy, replicas)), key=lambda r: r["load"])
                if not mine:
                    continue
                x = [r["load"] * 100 for r in mine]
                y = [r["goodput_ttft_rps"] for r in mine]
                lo = [r["goodput_ttft_rps"] - r["goodput_ttft_rps_range"][0] for r in mine]
                hi = [r["goodput_ttft_rps_range"][1] - r["goodput_ttft_rps"] for r in mine]
                ax.errorbar(x, y, yerr=[lo, hi], ls=style, marker="o", ms=3, capsize=2, color=colours[strategy],
                            label=f"{strategy}{'' if replicas == 1 else ', 2 routers'}")
        ax.set_title(f"{workload} workload")
        ax.set_xlabel("offered load, % of measured capacity")
        ax.set_ylabel(f"goodput: requests/s with TTFT <= {TTFT_TARGET * 1000:.0f} ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Goodput by routing strategy\n{fleet}; median of seeds, bars: range",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_saved(name: str, seconds: float, setup: dict[str, Any]) -> dict[str, Any] | None:
    """The results file a --resume run continues, refused where its runs are not comparable with this one's
    (SETUP: the engines' model, GPU and context, the workload's shape)."""
    from common import RESULTS

    path = RESULTS / f"{name}.json"
    if not path.exists():
        return None
    saved: dict[str, Any] = json.loads(path.read_text())
    if saved.get("quick") or saved.get("seconds_per_run") != seconds or saved.get("time_scale") != TIME_SCALE:
        raise SystemExit(f"bench_goodput: {path} holds runs of {saved.get('seconds_per_run')} s at time scale "
                         f"{saved.get('time_scale')} (quick={saved.get('quick')}); this run is {seconds:g} s at "
                         f"{TIME_SCALE:g}: pass the same --seconds, or another --name")
    # Files saved before these were options hold the defaults.
    theirs = {**default_setup(), **saved.get("setup", {})}
    for key, value in setup.items():
        if theirs[key] != value:
            raise SystemExit(f"bench_goodput: {path} holds runs with {key} {theirs[key]!r}; this run has "
                             f"{value!r}: pass the same, or another --name")
    return saved


def default_setup() -> dict[str, Any]:
    return {"model": MODEL_ID, "accelerator": ACCELERATOR, "max_model_len": MAX_MODEL_LEN, "shape": ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed, short runs (a smoke test, not figures)")
    parser.add_argument("--seconds", type=float, help="wall seconds of arrivals per run (default 60)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--strategies", nargs="*", choices=STRATEGIES,
                        help=f"default: all ({BEFORE} only with --before)")
    parser.add_argument("--before", type=Path, metavar="DIR",
                        help=f"a checkout of the router to compare as {BEFORE} (its repository root; "
                             "e.g. `git worktree add DIR 9beb7d3`, before issue 37)")
    parser.add_argument("--two-router-strategies", nargs="*", choices=STRATEGIES,
                        default=[*BASELINES, contract.DEFAULT_ROUTER_STRATEGY],
                        help="the strategies (of --strategies) also run behind two routers")
    parser.add_argument("--loads", nargs="*", type=float, default=list(LOADS))
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--replicas", nargs="*", type=int, default=[1, 2], choices=(1, 2))
    parser.add_argument("--capacity", nargs="*", default=[], metavar="WORKLOAD=RPS",
                        help="skip a capacity run: simulated requests/s of the fleet on that workload")
    parser.add_argument("--model", default=MODEL_ID, help=f"the engines' model, from the catalog (default {MODEL_ID})")
    parser.add_argument("--accelerator", default=ACCELERATOR,
                        help=f"the engines' GPU, as spec.accelerator.type (default {ACCELERATOR}); the planner "
                             "sizes the KV cache, the batch and the router's ceiling for it")
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                        help=f"spec.model.maxModelLen (default {MAX_MODEL_LEN})")
    parser.add_argument("--shape", default="", metavar="KEY=VALUE,...",
                        help="the workload's sizes where not workload.py's defaults, e.g. "
                             "`tenants=8,system_tokens=1500,doc_tokens=0-6000,turns=2-8,answer_median=200`; keys: "
                             + ", ".join(f.name for f in dataclasses.fields(Shape)))
    parser.add_argument("--name", default="goodput", help="results/NAME.json (and NAME.png)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in results/NAME.json (and its measured capacities), run only "
                             "the missing ones; the report covers them all")
    args = parser.parse_args()
    if args.strategies is None:
        args.strategies = [s for s in STRATEGIES if s != BEFORE or args.before is not None]
    if BEFORE in args.strategies and args.before is None:
        parser.error(f"{BEFORE} needs --before DIR")
    if args.before is not None and not (args.before / "operator" / "tensorfleet" / "router").is_dir():
        parser.error(f"--before {args.before}: not a checkout of this repository (no operator/tensorfleet/router)")
    seconds = args.seconds or (20.0 if args.quick else 60.0)
    seeds = [1] if args.quick else list(range(1, args.seeds + 1))
    try:
        shape = Shape.parse(args.shape)
        plan = plan_of(args.model, args.accelerator, args.max_model_len)
    except ValueError as exc:   # SpecError and the planner's refusals name the field
        parser.error(str(exc))
    setup = {"model": args.model, "accelerator": args.accelerator, "max_model_len": args.max_model_len,
             "shape": shape.describe()}
    fleet = (f"{ENGINES} simulated {plan.accelerator}{f' x{plan.tensor}' if plan.tensor > 1 else ''} engines "
             f"({plan.model}, {plan.kv_cache_tokens:,} KV tokens)" + (f", workload {setup['shape']}" if setup["shape"] else ""))
    print(fleet, flush=True)
    saved = load_saved(args.name, seconds, setup) if args.resume and not args.quick else None
    given = {k: float(v) for k, v in (x.split("=", 1) for x in args.capacity)}
    capacity: dict[str, float] = dict(saved["capacity"]) if saved else {}
    for workload, rps in given.items():
        if workload in capacity and capacity[workload] != rps:
            raise SystemExit(f"bench_goodput: --capacity {workload}={rps:g} differs from the {capacity[workload]:g} "
                             f"the resumed runs were offered load against")
        capacity[workload] = rps
    for workload in args.workloads:
        if workload not in capacity:
            print(f"measuring the fleet's capacity on the {workload} workload...", flush=True)
            capacity[workload] = measure_capacity(plan, workload, shape, 30.0 if args.quick else 90.0)
        print(f"  {workload}: {capacity[workload]:.2f} requests/s (simulated)", flush=True)
    runs: list[dict[str, Any]] = list(saved["runs"]) if saved else []
    done = {(r["workload"], r["strategy"], r["replicas"], r["load"], r["seed"]) for r in runs}
    if saved:
        print(f"resuming {len(runs)} run(s) from results/{args.name}.json", flush=True)

    def save(name: str = args.name) -> Path:
        rows = group(runs)
        return write_results(name, {"quick": args.quick, "time_scale": TIME_SCALE, "engines": ENGINES, "setup": setup,
                                         "seconds_per_run": seconds, "capacity": capacity,
                                         "ceiling": ceiling(plan), "ttft_target_s": TTFT_TARGET,
                                         "itl_target_s": ITL_TARGET, "rows": rows, "goals": evaluate(rows),
                                         "runs": runs})

    for workload in args.workloads:
        for load in args.loads:
            for seed in seeds:
                for replicas in args.replicas:
                    for strategy in args.strategies:
                        if replicas == 2 and strategy not in args.two_router_strategies:
                            continue
                        if (workload, strategy, replicas, load, seed) in done:
                            continue
                        try:
                            run = run_one(plan, workload, strategy, replicas, load, capacity[workload], seed,
                                          seconds, args.before, shape)
                        except RuntimeError as exc:
                            # A port free_port() picked was taken before a process bound it: once more, on others.
                            # (CPython says "Address already in use", uvloop "address already in use".)
                            if "address already in use" not in str(exc).lower():
                                raise
                            print(f"  {workload} {int(load * 100)}% s{seed} {replicas}r {strategy}: a port was "
                                  "taken before it was bound; once more", flush=True)
                            run = run_one(plan, workload, strategy, replicas, load, capacity[workload], seed,
                                          seconds, args.before, shape)
                        runs.append(run)
                        print(f"  {workload:11} {int(load * 100):3}% s{seed} {replicas}r {strategy:13} "
                              f"good(TTFT) {run['goodput_ttft_rps']:.2f}/s {run['share_ttft']:.0%} "
                              f"(at best {run['ttft_bound_rps']:.2f}/s)  "
                              f"good(ITL) {run['goodput_itl_rps']:.2f}/s  TTFT p50 {run['ttft_p50_s']:.2f} "
                              f"p99 {run['ttft_p99_s']:.2f}  hit {run['hit_rate']:.0%} of {run['max_hit_rate']:.0%} "
                              f"(pooled LRU {run['pooled_hit_rate']:.0%})  "
                              f"cpu {run['router_cpu_ms_per_request']:.2f} ms/req  failed {run['failed']}"
                              + "".join(f"  slots left to a peer {n:.0f} {outcome}"
                                        for outcome, n in run.get("slots_left_to_peers", {}).items() if n),
                              flush=True)
                        if not args.quick:
                            save()  # a long matrix survives an interruption: --resume goes on from here
    rows = group(runs)
    seed_counts = sorted({r["seeds"] for r in rows})
    print()
    print(f"{fleet}; router ceiling {ceiling(plan)} per engine; "
          f"targets: TTFT {TTFT_TARGET:g} s, ITL {ITL_TARGET:g} s; {seconds:g} s per run; median over "
          f"{'/'.join(map(str, seed_counts))} seed(s), simulated time")
    print(table(["workload", "load", "routers", "strategy", "goodput TTFT/s", "share TTFT", "at best TTFT/s",
                 "goodput ITL/s",
                 "share ITL", "TTFT p50 s", "TTFT p99 s", "p99 all seeds s", "prefix hit", "max hit", "pooled LRU hit",
                 "router CPU ms/req", "failed"],
                [[r["workload"], f"{int(r['load'] * 100)}%", r["replicas"], r["strategy"], r["goodput_ttft_rps"],
                  f"{r['share_ttft']:.0%}", r.get("ttft_bound_rps", "-"), r["goodput_itl_rps"], f"{r['share_itl']:.0%}", r["ttft_p50_s"],
                  r["ttft_p99_s"], r.get("ttft_p99_pooled_s", "-"), f"{r['hit_rate']:.1%}",
                  f"{r['max_hit_rate']:.1%}" if "max_hit_rate" in r else "-",
                  f"{r['pooled_hit_rate']:.1%}" if "pooled_hit_rate" in r else "-",
                  r["router_cpu_ms_per_request"], r["failed"]]
                 for r in rows]))
    goals = evaluate(rows)
    for key, value in goals.items():
        print(f"  {key}: {value}")
    if not args.quick and len(rows) > 1:
        from common import RESULTS

        png = RESULTS.parent / f"{args.name}.png" if args.name == "goodput" else RESULTS / f"{args.name}.png"
        plot(rows, str(png), fleet)
        print(f"wrote {png}")
    path = save(args.name + "-quick" if args.quick else args.name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
