"""Benchmark 6: autoscaling signals under a load ramp (issue 13).

A fleet of real `tensorfleet sim` processes, one per replica, behind a real
`tensorfleet router` that discovers them through EndpointSlices in the API
emulator of the operator tests; an autoscaler that follows the Kubernetes HPA
controller's algorithm (hpa_model.py) on metrics sampled as Prometheus would;
the operator's own scale-to-zero decision (controller/idle.py `decide`) on the
router's demand Lease. Three signals, and the old one behind both routers:

  engine-waiting  Pods metric vllm:num_requests_waiting, AverageValue 4; router
                  concurrency per engine = max-num-seqs: the HPA and the router
                  as they were before issue 13 ("today's")
  combined        Object metric router pending + router burst + engine
                  waiting, AverageValue 4 (the operator's HPA); router ceiling
                  per engine = what the KV cache holds at 2048 tokens a request
                  (the plan's engine_concurrency), bursting to max-num-seqs
                  while an engine reports room (the new default router)
  kv              Pods metric vllm:kv_cache_usage_perc, AverageValue 0.8; router
                  as for combined
  engine-waiting-kv-router
                  the old signal behind the new router: the queue is the
                  router's, vLLM's stays short (the blind spot combined closes)
  combined-ceiling (on request) the combined signal without the burst: the
                  KV ceiling holds, and requests beyond it wait at the router

Everything runs at TIME_SCALE wall seconds per simulated second (0.2: five
simulated seconds per wall second): the engines' steps and load time, the HPA's and Prometheus'
periods, the router's timeouts, the clients' think times. Figures are in
simulated seconds. The same seeded workload and ramp for every signal:
light load, a step to a multiple of one replica's measured capacity, hold,
back to light, then nothing until the fleet is at zero (scaleToZeroAfterSeconds
IDLE_SECONDS, shorter than the default 900 s so that a run takes minutes, not
hours: the cold start does not depend on it), then one request (the cold start).

The simulated cluster (the pods, Prometheus, the HPA, the operator's zero, the clock) is
autoscaling_cluster.py; this script defines the signals and the ramp, runs them and reports.

    python benchmarks/bench_autoscaling.py [--quick] [--seeds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from autoscaling_cluster import (
    LEASE,
    LEASES,
    NAME,
    NAMESPACE,
    SERVICE,
    SYNC_SECONDS,
    TIME_SCALE,
    Clock,
    Control,
    Fleet,
    Pod,
    Prometheus,
    Signal,
    spawn,
)
from common import (
    ACCELERATOR,
    HOST,
    MODEL,
    MODEL_ID,
    RESULTS,
    cluster,
    engine_flags,
    free_port,
    metric_sum,
    percentile,
    stream_chat,
    table,
    wait_healthy,
    write_results,
)
from workload import DEFAULT_SHAPE, Record, Workload, closed_loop, ok, run_session

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.api.models import InferenceServiceSpec
from tensorfleet.planner import Plan, make_plan
from tensorfleet.testing import operator_harness

MAX_REPLICAS = 8
KV_TARGET = 0.8
TTFT_TARGET = 2.0            # seconds; see the README for why
OTHER_TARGETS = (1.0, 5.0)   # the share within these too, to show how much the choice matters
WINDOW = 60.0                # seconds per point of the p99-over-time series
LIGHT, PEAK = 0.5, 2.5       # offered load, in units of one replica's capacity
PHASES = ((300.0, LIGHT), (600.0, PEAK), (300.0, LIGHT))   # (seconds, load)
IDLE_SECONDS = 300           # spec.autoscaling.scaleToZeroAfterSeconds
COLD_PROBE_AFTER = IDLE_SECONDS + 200.0   # seconds after the load ends: the cold-start request (drained by then)
MEAN_TURNS = DEFAULT_SHAPE.mean_turns
SIGNALS = ("engine-waiting", "combined", "kv", "engine-waiting-kv-router")
EXTRA_SIGNALS: tuple[str, ...] = ("combined-ceiling",)
# Router flags that are times: the production default, compressed like everything else.
ROUTER_TIMES = {"--queue-timeout": 30.0, "--health-interval": 2.0, "--first-byte-timeout": 30.0,
                "--stream-idle-timeout": 30.0}
# A health check's timeout is a fault detector, not a modelled duration: compressed to 0.2 s it would eject
# engines for this 2-core machine's scheduling hiccups. It is kept at 1 s wall; ejections are reported.
HEALTH_TIMEOUT_WALL = 1.0


def inference_service() -> InferenceServiceSpec:
    doc = {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
           "metadata": {"name": NAME, "namespace": NAMESPACE},
           "spec": {"model": {"name": MODEL_ID, "maxModelLen": 8192}, "accelerator": {"type": ACCELERATOR},
                    "engine": {"kind": "simulator"},
                    "autoscaling": {"minReplicas": 0, "maxReplicas": MAX_REPLICAS,
                                    "scaleToZeroAfterSeconds": IDLE_SECONDS}}}
    return load_inference_service(doc).spec


def signals(spec: InferenceServiceSpec, plan: Plan) -> dict[str, Signal]:
    assert spec.autoscaling is not None
    target = float(spec.autoscaling.target_pending_requests)
    kv_fit = plan.engine_concurrency(spec.router.typical_request_tokens)
    burst = plan.max_num_seqs if plan.max_num_seqs > kv_fit else 0  # as render/router.py gives the default router
    return {
        "engine-waiting": Signal("engine-waiting", "pods", contract.VLLM_METRIC_WAITING, target, plan.max_num_seqs),
        "combined": Signal("combined", "object", contract.HPA_METRIC_PENDING, target, kv_fit, burst),
        "kv": Signal("kv", "pods", contract.VLLM_METRIC_KV_CACHE_USAGE, KV_TARGET, kv_fit, burst),
        "engine-waiting-kv-router": Signal("engine-waiting-kv-router", "pods", contract.VLLM_METRIC_WAITING, target,
                                           kv_fit, burst),
        # The combined signal behind a router whose ceiling holds (no burst): the first measurement of issue 13.
        "combined-ceiling": Signal("combined-ceiling", "object", contract.HPA_METRIC_PENDING, target, kv_fit),
    }


# --- load ---------------------------------------------------------------------------------------------

def schedule(phases: Sequence[tuple[float, float]], capacity: float) -> list[tuple[float, float, float]]:
    """(start, end, requests per simulated second) per phase."""
    out, t = [], 0.0
    for seconds, load in phases:
        out.append((t, t + seconds, load * capacity))
        t += seconds
    return out


async def offer(url: str, workload: Workload, plan: list[tuple[float, float, float]], clock: Clock,
                records: list[Record]) -> None:
    """Sessions arriving as a Poisson process whose rate follows PLAN; no new turn after the last phase."""
    rng = random.Random(workload.seed + 2)
    end = plan[-1][1]
    stop_at = clock.wall0 + end * TIME_SCALE
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = []
        for start, stop, rps in plan:
            t = start
            while True:
                t += rng.expovariate(rps / MEAN_TURNS)
                if t >= stop:
                    break
                await clock.until(t)
                tasks.append(asyncio.create_task(run_session(http, url, workload.session(), records, TIME_SCALE,
                                                             stop_at)))
        await asyncio.gather(*tasks)


async def loop_lag(stop: asyncio.Event, clock: Clock, out: list[tuple[float, float]]) -> None:
    """How late this process's event loop wakes (it runs the clients; a late loop inflates their TTFT), in
    wall seconds, by simulated time."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.05)
        out.append((clock.of(t), time.perf_counter() - t - 0.05))


# --- one run ------------------------------------------------------------------------------------------

async def run_signal(signal: Signal, seed: int, capacity: float, phases: Sequence[tuple[float, float]],
                     spec: InferenceServiceSpec, plan: Plan, startup_delay_wall: float) -> dict[str, Any]:
    tag = f"autoscaling-{signal.name}-{seed}"
    load_plan = schedule(phases, capacity)
    load_end = load_plan[-1][1]
    rng = random.Random(seed)  # the HPA's and each scrape's phase: the same for every signal of a seed
    hpa_phase = rng.uniform(0, SYNC_SECONDS)
    cpu_before, wall_before = cpu_seconds(), time.perf_counter()
    async with operator_harness.cluster() as c:
        await c.upsert(*LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                 "metadata": {"name": LEASE, "namespace": NAMESPACE}})
        with cluster(tag) as procs:
            router = procs.router(
                [], "--service", SERVICE, "--namespace", NAMESPACE, "--kube-api", c.url, "--demand-lease", LEASE,
                "--max-concurrency-per-backend", str(signal.concurrency),
                *(["--burst-concurrency-per-backend", str(signal.burst)] if signal.burst else []),
                "--cold-start-timeout", f"{cold_start_timeout(plan) * TIME_SCALE:g}",
                "--health-timeout", f"{HEALTH_TIMEOUT_WALL:g}",
                "--prefill-tokens-per-second", f"{1000.0 / TIME_SCALE:g}",
                *(x for flag, seconds in ROUTER_TIMES.items() for x in (flag, f"{seconds * TIME_SCALE:g}")))
            await wait_healthy(router)
            clock = Clock()
            assert spec.engine is not None
            fleet = Fleet(c, clock, plan, tag, startup_delay_wall, float(spec.engine.termination_grace_period_seconds))
            prometheus = Prometheus(clock, fleet, router.url, rng)
            control = Control(clock, fleet, prometheus, signal, spec, c, hpa_phase)
            stop = asyncio.Event()
            fleet_task = asyncio.create_task(fleet.run(stop))
            # Warm: one replica Ready before the load starts (the clock restarts at the load's start).
            while fleet.ready_count() < 1:
                await asyncio.sleep(0.1)
            await asyncio.sleep(3 * ROUTER_TIMES["--health-interval"] * TIME_SCALE)
            shift = time.perf_counter() - clock.wall0
            clock.wall0 += shift
            clock.epoch0 += shift
            for p in fleet.pods:
                p.started -= shift / TIME_SCALE
                p.loaded -= shift / TIME_SCALE
                p.next_probe -= shift / TIME_SCALE
                p.ready = p.ready - shift / TIME_SCALE if p.ready is not None else None
            tasks = [asyncio.create_task(t) for t in (prometheus.run(stop), control.run(stop))]
            lag: list[tuple[float, float]] = []
            tasks.append(asyncio.create_task(loop_lag(stop, clock, lag)))
            timeline: list[dict[str, Any]] = []
            tasks.append(asyncio.create_task(sample(stop, clock, fleet, control, prometheus, load_plan, timeline)))
            records: list[Record] = []
            await offer(router.url, Workload(seed=seed), load_plan, clock, records)
            loaded_until = clock.now()
            # Idle until the fleet is at zero, then one request: the cold start.
            probe_at = load_end + COLD_PROBE_AFTER
            await clock.until(probe_at)
            at_zero = not fleet.pods
            cold = await cold_start(router.url, clock, Workload(seed=seed + 1000))
            await clock.sleep(30)
            router_text = await asyncio.wait_for(_text(router.url), 10)
            stop.set()
            await asyncio.gather(*tasks, fleet_task, return_exceptions=True)
            router.stop()  # first: engines stopping under a live router would be ejected, noise in its log
            fleet.stop_all()
            cpu = cpu_seconds() - cpu_before
            wall = time.perf_counter() - wall_before
    run = analyse(signal, seed, records, clock, fleet, control, load_plan, loaded_until, probe_at, at_zero, cold,
                  timeline, lag, router_text)
    run["cpu_cores_used"] = cpu / wall  # this process and every process it started, over the run's wall time
    run["loadavg_at_end"] = os.getloadavg()  # other work on the machine shows here
    return run


def cpu_seconds() -> float:
    """CPU time of this process (the clients, the HPA model, the API emulator) and of its reaped children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def cold_start_timeout(plan: Plan) -> float:
    """The operator's default --cold-start-timeout: twice the plan's load time, within 120-1800 s."""
    return float(min(1800, max(120, 2 * plan.load_seconds)))


async def _text(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + contract.METRICS_PATH) as resp:
        return await resp.text()


async def cold_start(url: str, clock: Clock, workload: Workload) -> dict[str, Any]:
    plan = workload.session()
    messages = [{"role": "system", "content": plan.system}, {"role": "user", "content": plan.turns[0].question}]
    sent = clock.now()
    async with aiohttp.ClientSession() as http:
        result = await stream_chat(http, url, messages, plan.turns[0].max_tokens, timeout=600)
    return {"sent_at": sent, "status": result.status, "error": result.error,
            "ttft_s": result.ttft / TIME_SCALE if result.ttft is not None else None,
            "total_s": result.total / TIME_SCALE}


async def sample(stop: asyncio.Event, clock: Clock, fleet: Fleet, control: Control, prometheus: Prometheus,
                 load_plan: list[tuple[float, float, float]], out: list[dict[str, Any]]) -> None:
    while not stop.is_set():
        now = clock.now()
        offered = next((rps for start, end, rps in load_plan if start <= now < end), 0.0)
        engines = prometheus.engine.values()
        out.append({"t": now, "offered_rps": offered, "pods": len(fleet.pods), "live": len(fleet.live()),
                    "ready": fleet.ready_count(), "spec_replicas": control.spec_replicas, "idle": control.idle,
                    "router_pending": prometheus.router_pending,
                    "engine_waiting": sum(e[contract.VLLM_METRIC_WAITING] for e in engines)})
        await clock.sleep(2.0)


# --- figures ------------------------------------------------------------------------------------------

def ttft(r: Record) -> float:
    assert r.result.ttft is not None
    return r.result.ttft / TIME_SCALE


def reversals(events: Sequence[tuple[float, int, int]]) -> int:
    directions = [1 if b > a else -1 for _, a, b in events]
    return sum(1 for x, y in itertools.pairwise(directions) if x != y)


def replica_seconds(pods: Sequence[Pod], start: float, end: float) -> float:
    total = 0.0
    for p in pods:
        lo, hi = max(p.started, start), min(p.stopped if p.stopped is not None else end, end)
        total += max(0.0, hi - lo)
    return total


def analyse(signal: Signal, seed: int, records: list[Record], clock: Clock, fleet: Fleet, control: Control,
            load_plan: list[tuple[float, float, float]], loaded_until: float, probe_at: float, at_zero: bool,
            cold: dict[str, Any], timeline: list[dict[str, Any]], lag: list[tuple[float, float]],
            router_text: str) -> dict[str, Any]:
    load_end = load_plan[-1][1]
    sent = [(clock.of(r.result.sent_at), r) for r in records]
    good = [r for _, r in sent if ok(r) and ttft(r) <= TTFT_TARGET]
    statuses: dict[str, int] = {}
    for _, r in sent:
        if not ok(r):
            key = str(r.result.status) if r.result.status != 200 else "stream error"
            statuses[key] = statuses.get(key, 0) + 1
    windows = []
    for lo in range(0, int(load_end), int(WINDOW)):
        inside = [r for t, r in sent if lo <= t < lo + WINDOW]
        answered = [ttft(r) for r in inside if ok(r)]
        windows.append({"t": lo, "requests": len(inside), "ttft_p99_s": percentile(answered, 99),
                        "within_target": sum(1 for r in inside if ok(r) and ttft(r) <= TTFT_TARGET) / len(inside)
                        if inside else float("nan")})
    peak_start = load_plan[1][0] if len(load_plan) > 1 else 0.0
    before = sum(1 for p in fleet.history if p.ready is not None and p.ready <= peak_start
                 and (p.stopped is None or p.stopped > peak_start))
    new_ready = sorted(p.ready for p in fleet.history if p.ready is not None and p.ready > peak_start)
    first_up = next((t for t, a, b in control.scale_events if b > a and t >= peak_start), None)
    answered = [ttft(r) for _, r in sent if ok(r)]
    first_light = [ttft(r) for t, r in sent if ok(r) and t < load_plan[0][1]]
    return {
        "signal": signal.name, "seed": seed, "metric": signal.metric, "target": signal.target,
        "router_concurrency": signal.concurrency,
        "router_burst": signal.burst,
        "requests": len(sent), "answered": len(answered), "failed": len(sent) - len(answered), "failures": statuses,
        "within_target": len(good), "share_within_target": len(good) / len(sent) if sent else float("nan"),
        "goodput_rps": len(good) / load_end,
        "share_within": {f"{x:g}": sum(1 for _, r in sent if ok(r) and ttft(r) <= x) / len(sent) if sent else None
                         for x in (TTFT_TARGET, *OTHER_TARGETS)},
        "first_phase_ttft_p50_s": percentile(first_light, 50), "first_phase_ttft_p99_s": percentile(first_light, 99),
        "ttft_p50_s": percentile(answered, 50), "ttft_p99_s": percentile(answered, 99),
        "replica_minutes_load": replica_seconds(fleet.history, 0.0, load_end) / 60,
        "replica_minutes_run": replica_seconds(fleet.history, 0.0, probe_at) / 60,
        "peak_replicas": max((s["pods"] for s in timeline), default=0),
        "ready_before_peak": before,
        "hpa_first_scale_up_s": first_up - peak_start if first_up is not None else None,
        "overload_to_ready_s": new_ready[0] - peak_start if new_ready else None,
        "scale_events": control.scale_events, "reversals": reversals(control.scale_events),
        "zero_events": control.zero_events, "at_zero_before_probe": at_zero, "cold_start": cold,
        "loaded_until_s": loaded_until,
        "windows": windows, "timeline": timeline,
        # Every request: simulated send time, TTFT (None: failed), HTTP status, the engine that answered.
        "requests_log": [(round(t, 2), round(ttft(r), 3) if ok(r) else None, r.result.status, r.result.backend)
                         for t, r in sent],
        "router": {"retries": metric_sum(router_text, contract.ROUTER_METRIC_RETRIES + "_total"),
                   "ejections": metric_sum(router_text, contract.ROUTER_METRIC_EJECTIONS + "_total")},
        # While the load runs: a wall-clock lag L adds up to L / TIME_SCALE simulated seconds to a TTFT.
        "loop_lag_p99_ms": percentile([x for t, x in lag if t < load_end], 99) * 1000,
        "loop_lag_max_ms": max((x for t, x in lag if t < load_end), default=0.0) * 1000,
    }


# --- capacity and calibration ----------------------------------------------------------------------

def measure_capacity(plan: Plan, seconds: float) -> dict[str, Any]:
    """One replica's throughput on this workload: closed loop, 16 sessions, through a router (as benchmark 2)."""
    workload = Workload(seed=1)
    with cluster("autoscaling-capacity") as c:
        port = free_port()
        started = time.perf_counter()
        engine = spawn("autoscaling-capacity", "engine", ["sim", "--host", HOST, "--port", str(port),
                                                          "--served-model-name", MODEL, *engine_flags(plan),
                                                          "--time-scale", str(TIME_SCALE), "--log-level", "warning"],
                       f"http://{HOST}:{port}")
        c.procs.append(engine)
        asyncio.run(wait_healthy(engine))
        process_start = time.perf_counter() - started  # the Python process's own start, before any load time
        router = c.router([engine], "--max-concurrency-per-backend", str(plan.max_num_seqs))
        asyncio.run(wait_healthy(router))
        time.sleep(0.5)
        records, start = asyncio.run(closed_loop(router.url, workload, 16, seconds, TIME_SCALE))
    lo = start + seconds * 0.25
    inside = [r for r in records if r.result.sent_at >= lo and ok(r)]
    sim_seconds = (seconds * 0.75) / TIME_SCALE
    return {"sessions": 16, "seconds_wall": seconds, "throughput_rps": len(inside) / sim_seconds,
            "tokens_per_s": sum(r.result.tokens for r in inside) / sim_seconds,
            "process_start_wall_s": process_start}


# --- report -------------------------------------------------------------------------------------------

def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, sd


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name in (*SIGNALS, *EXTRA_SIGNALS):
        mine = [r for r in runs if r["signal"] == name]
        if not mine:
            continue
        row: dict[str, Any] = {"signal": name, "seeds": len(mine)}
        for key in ("share_within_target", "goodput_rps", "ttft_p50_s", "ttft_p99_s", "replica_minutes_load",
                    "replica_minutes_run", "overload_to_ready_s", "hpa_first_scale_up_s", "reversals", "failed",
                    "requests", "peak_replicas", "first_phase_ttft_p99_s", "cpu_cores_used", "loop_lag_p99_ms"):
            row[key] = mean_sd([r[key] for r in mine])
        row["cold_start_s"] = mean_sd([r["cold_start"]["ttft_s"] for r in mine])
        row["retries"] = mean_sd([r["router"]["retries"] for r in mine])
        for x in OTHER_TARGETS:
            row[f"share_within_{x:g}"] = mean_sd([r["share_within"][f"{x:g}"] for r in mine])
        out.append(row)
    return out


def fmt(pair: tuple[float, float], digits: int = 2, pct: bool = False) -> str:
    m, sd = pair
    if math.isnan(m):
        return "-"
    if pct:
        return f"{m:.1%} ± {sd:.1%}"
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def evaluate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["signal"]: r for r in rows}
    if "combined" not in by or "engine-waiting" not in by:
        return {}
    c, e = by["combined"], by["engine-waiting"]
    extra_load = c["replica_minutes_load"][0] / e["replica_minutes_load"][0] - 1
    extra_run = c["replica_minutes_run"][0] / e["replica_minutes_run"][0] - 1
    better = c["share_within_target"][0] > e["share_within_target"][0]
    return {"combined_share": c["share_within_target"][0], "engine_waiting_share": e["share_within_target"][0],
            "combined_beats_engine_waiting": better,
            "extra_replica_minutes_load": extra_load, "extra_replica_minutes_run": extra_run,
            "done_when_met_run": better and extra_run <= 0.10, "done_when_met_load": better and extra_load <= 0.10}


def plot(runs: list[dict[str, Any]], seed: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"engine-waiting": "tab:red", "combined": "tab:blue", "kv": "tab:green",
               "engine-waiting-kv-router": "tab:purple"}
    # Lines that coincide would hide each other: each signal's is drawn a hair apart.
    offsets = {"engine-waiting": 0.06, "combined": 0.0, "kv": -0.06, "engine-waiting-kv-router": -0.12}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True, height_ratios=[3, 2])
    load_axis = top.twinx()
    drawn_load = False
    peak_load = 1.0
    for run in runs:
        if run["seed"] != seed:
            continue
        tl = run["timeline"]
        minutes = [s["t"] / 60 for s in tl]
        shift = offsets[run["signal"]]
        top.step(minutes, [s["pods"] + shift for s in tl], where="post", color=colours[run["signal"]], lw=1.8,
                 label=f"{run['signal']}: engine pods")
        top.step(minutes, [s["ready"] + shift for s in tl], where="post", color=colours[run["signal"]], lw=0.8,
                 ls=":", label=f"{run['signal']}: Ready")
        if not drawn_load:
            load_axis.fill_between(minutes, [s["offered_rps"] for s in tl], step="post", color="0.85", zorder=0)
            drawn_load = True
        w = run["windows"]
        bottom.plot([(x["t"] + WINDOW / 2) / 60 for x in w], [x["ttft_p99_s"] for x in w], marker="o", ms=3,
                    color=colours[run["signal"]], label=run["signal"])
        cold = run["cold_start"]
        if cold.get("ttft_s") is not None:
            top.axvline(cold["sent_at"] / 60, color="0.5", lw=0.6, ls="--")
        peak_load = max(s["offered_rps"] for s in tl)
    top.set_ylim(-0.3, MAX_REPLICAS + 2.7)  # room for the legend above the lines
    load_axis.set_ylim(0, peak_load * (MAX_REPLICAS + 2.7) / MAX_REPLICAS)
    top.set_zorder(load_axis.get_zorder() + 1)
    top.patch.set_visible(False)
    top.set_ylabel("engine replicas")
    load_axis.set_ylabel("offered load, requests/s (grey)")
    top.set_title(f"Replicas over a load ramp, by HPA signal (seed {seed}; L4 Llama-3.1-8B simulators)")
    top.legend(loc="upper right", fontsize=7, ncol=3)
    bottom.axhline(TTFT_TARGET, color="0.3", lw=0.8, ls="--")
    bottom.set_yscale("log")
    bottom.set_ylabel(f"p99 TTFT per {int(WINDOW)} s window, s")
    bottom.set_xlabel("simulated minutes (dashed line: the cold-start request)")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def png_path(name: str) -> Path:
    return RESULTS.parent / f"{name}.png" if name == "autoscaling" else RESULTS / f"{name}.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed, a short ramp (a smoke test, not figures)")
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds")
    parser.add_argument("--first-seed", type=int, default=1,
                        help="the first seed (seeds run from it upward; the results file names them)")
    parser.add_argument("--signals", nargs="*", default=list(SIGNALS), choices=(*SIGNALS, *EXTRA_SIGNALS))
    parser.add_argument("--capacity-rps", type=float, help="skip the capacity run (simulated requests/s of one replica)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--replot", metavar="JSON", help="only draw the PNG again from a results file")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        png = png_path(saved["benchmark"])
        plot(saved["runs"], saved["runs"][0]["seed"], str(png))
        print(f"wrote {png}")
        return
    spec = inference_service()
    plan = make_plan(spec)
    sigs = signals(spec, plan)
    phases = ((60.0, LIGHT), (240.0, PEAK), (60.0, LIGHT)) if args.quick else PHASES
    seeds = [1] if args.quick else list(range(args.first_seed, args.first_seed + args.seeds))
    print(f"plan: {plan.kv_cache_tokens} KV tokens, max-num-seqs {plan.max_num_seqs}, load {plan.load_seconds} s; "
          f"router concurrency: {', '.join(f'{s.name} {s.concurrency}' for s in sigs.values())}", flush=True)
    if args.capacity_rps:
        capacity = {"throughput_rps": args.capacity_rps, "given": True, "process_start_wall_s": 1.0}
    else:
        print("measuring one replica's capacity (closed loop, 16 sessions)...", flush=True)
        capacity = measure_capacity(plan, 30.0 if args.quick else 60.0)
        print(f"  {capacity['throughput_rps']:.3f} requests/s, {capacity['tokens_per_s']:.0f} tokens/s (simulated); "
              f"a simulator process starts in {capacity['process_start_wall_s']:.2f} s wall", flush=True)
    rps = capacity["throughput_rps"]
    # Only the full default run writes the figures the README shows.
    name = ("autoscaling-quick" if args.quick else "autoscaling") if args.signals == list(SIGNALS) \
        else "autoscaling-" + "+".join(args.signals)
    if not args.quick and seeds[0] != 1:
        name += f"-seeds{seeds[0]}-{seeds[-1]}"
    # The load time a pod takes is the plan's; the simulator's own process start is part of it.
    startup_delay_wall = max(0.0, plan.load_seconds * TIME_SCALE - capacity["process_start_wall_s"])
    runs = []
    for seed in seeds:
        for signal_name in args.signals:
            started = time.monotonic()
            run = asyncio.run(run_signal(sigs[signal_name], seed, rps, phases, spec, plan, startup_delay_wall))
            runs.append(run)
            print(f"  seed {seed} {signal_name:14} within {TTFT_TARGET:g}s: {run['share_within_target']:.1%} "
                  f"({run['goodput_rps']:.2f}/s)  TTFT p99 {run['ttft_p99_s']:.1f}s  "
                  f"replica-min {run['replica_minutes_load']:.1f} / {run['replica_minutes_run']:.1f}  "
                  f"peak {run['peak_replicas']}  ready after {run['overload_to_ready_s']}  "
                  f"reversals {run['reversals']}  failed {run['failed']} {run['failures']}  "
                  f"cold {run['cold_start']['ttft_s']}  lag p99 {run['loop_lag_p99_ms']:.0f} ms  "
                  f"({time.monotonic() - started:.0f} s wall)", flush=True)
    rows = summary(runs)
    print()
    print(f"one replica: {rps:.3f} requests/s; ramp {', '.join(f'{s:g}s x{x:g}' for s, x in phases)}; "
          f"TTFT target {TTFT_TARGET:g} s; figures in simulated time, mean ± sd over {len(seeds)} seed(s)")
    print(table(["signal", "within target", "goodput/s", "TTFT p99 s", "replica-min (load)", "replica-min (run)",
                 "overload->Ready s", "reversals", "failed", "cold start s"],
                [[r["signal"], fmt(r["share_within_target"], pct=True), fmt(r["goodput_rps"]),
                  fmt(r["ttft_p99_s"], 1), fmt(r["replica_minutes_load"], 1), fmt(r["replica_minutes_run"], 1),
                  fmt(r["overload_to_ready_s"], 0), fmt(r["reversals"], 1), fmt(r["failed"], 0),
                  fmt(r["cold_start_s"], 0)] for r in rows]))
    print(table(["signal", *(f"within {x:g} s" for x in OTHER_TARGETS), "TTFT p99 s, first light phase",
                 "router retries", "CPU cores used", "client loop lag p99 ms"],
                [[r["signal"], *(fmt(r[f"share_within_{x:g}"], pct=True) for x in OTHER_TARGETS),
                  fmt(r["first_phase_ttft_p99_s"]), fmt(r["retries"], 0), fmt(r["cpu_cores_used"]),
                  fmt(r["loop_lag_p99_ms"], 0)] for r in rows]))
    goals = evaluate(rows)
    for key, value in goals.items():
        print(f"  {key}: {value}")
    if not args.no_plot:
        png = png_path(name)
        plot(runs, seeds[0], str(png))
        print(f"wrote {png}")
    path = write_results(name, {
        "quick": args.quick, "time_scale": TIME_SCALE, "phases": phases, "ttft_target_s": TTFT_TARGET,
        "capacity": capacity, "startup_delay_wall_s": startup_delay_wall,
        "plan": {"kv_cache_tokens": plan.kv_cache_tokens, "max_num_seqs": plan.max_num_seqs,
                 "load_seconds": plan.load_seconds},
        "signals": {k: vars(v) for k, v in sigs.items()},
        "summary": rows, "goals": goals, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
