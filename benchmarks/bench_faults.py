"""Benchmark 3: faults. An engine killed under load, and 5x overload.

Same fleet and workload as bench_routing.py (4 simulated L4 engines at
--time-scale 0.25, multi-turn streaming chat; times in simulated seconds).

Kill: the workload at 60% of capacity through a least-pending router; a third
of the way in one engine process gets SIGKILL. Every request is classified:
answered in full, refused before any byte (goal: zero), or cut mid-stream
(expected for the requests that engine was generating; each must end with an
explicit error event, none silently truncated).

Overload: 1x capacity, then 5x. The router runs with a per-engine ceiling and
a queue sized for this workload (--max-concurrency-per-backend 16: a little
more than the ~13 of these conversations one engine's KV cache holds at once;
--max-queue 32: about two seconds of the fleet's throughput). Reported: how
fast 429s come back (client side and the router's own histogram), admitted
requests' latency in each half of the overload next to the 1x figures, and
memory.

    python benchmarks/bench_faults.py [--quick] [--capacity-rps R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from bench_routing import ENGINES, MEAN_TURNS, MODEL_FLAGS, TIME_SCALE, measure_capacity
from common import RESULTS, cluster, metric_sum, percentile, scrape, table, wait_healthy, write_results
from workload import Record, Workload, open_loop

CEILING, QUEUE = 16, 32


def classify(records: list[Record]) -> dict[str, int]:
    out = {"ok": 0, "refused_before_first_byte": 0, "cut_mid_stream_with_error_event": 0, "silently_truncated": 0}
    for record in records:
        r = record.result
        if r.status == 200 and r.done and not r.error:
            out["ok"] += 1
        elif r.status != 200 or not r.started:
            out["refused_before_first_byte"] += 1
        elif r.error:
            out["cut_mid_stream_with_error_event"] += 1
        else:
            out["silently_truncated"] += 1
    return out


def capacity_rps(given: float | None, quick: bool) -> float:
    """Fleet capacity in simulated requests/s: given, from bench_routing's
    results, or measured now."""
    if given:
        return given
    saved = RESULTS / "routing.json"
    if saved.exists():
        data = json.loads(saved.read_text())
        if not data.get("quick") or quick:
            return float(data["capacity"]["throughput_rps"])
    return float(measure_capacity(seconds=40.0 if quick else 120.0, concurrency=ENGINES * 16)["throughput_rps"])


def kill_test(rps: float, seconds: float) -> dict[str, Any]:
    workload = Workload(seed=3)
    with cluster("faults-kill") as c:
        engines = [c.sim(f"engine{i}", *MODEL_FLAGS, time_scale=TIME_SCALE) for i in range(ENGINES)]
        router = c.router(engines, strategy="least-pending")
        asyncio.run(wait_healthy(*engines, router))
        time.sleep(2.5)
        victim = engines[1]
        killed_at: list[float] = []

        async def main() -> tuple[list[Record], float]:
            async def killer() -> None:
                await asyncio.sleep(seconds / 3)
                killed_at.append(time.perf_counter())
                victim.kill()

            task = asyncio.create_task(killer())
            records, start = await open_loop(router.url, workload, rps * 0.6 / TIME_SCALE / MEAN_TURNS, seconds,
                                             TIME_SCALE)
            await task
            return records, start

        records, start = asyncio.run(main())
        metrics = asyncio.run(scrape(router.url))
    after_kill = [r for r in records if r.result.sent_at >= killed_at[0]]
    sent_to_victim_after = sum(1 for r in after_kill if r.result.backend == victim.url)
    in_flight_at_kill = [r for r in records if r.result.sent_at < killed_at[0] <= r.result.sent_at + r.result.total
                         and r.result.backend == victim.url]
    return {
        "requests": len(records),
        **classify(records),
        "victim_requests_in_flight_at_kill": len(in_flight_at_kill),
        "answered_by_victim_after_kill": sent_to_victim_after,
        "router_retries": metric_sum(metrics, "tensorfleet_router_retries_total"),
        "router_ejections": metric_sum(metrics, "tensorfleet_router_backend_ejections_total"),
        "router_stream_errors": metric_sum(metrics, "tensorfleet_router_stream_errors_total"),
        "killed_after_s": (killed_at[0] - start),
    }


def latency(records: list[Record], lo: float, hi: float) -> dict[str, float]:
    ok = [r.result for r in records if lo <= r.result.sent_at < hi and r.result.status == 200 and r.result.ttft]
    return {
        "admitted": len(ok),
        "ttft_p50_s": percentile([r.ttft / TIME_SCALE for r in ok], 50),  # type: ignore[operator]  # answered requests have a ttft
        "ttft_p99_s": percentile([r.ttft / TIME_SCALE for r in ok], 99),  # type: ignore[operator]  # answered requests have a ttft
        "e2e_p99_s": percentile([r.total / TIME_SCALE for r in ok], 99),
    }


def overload_test(rps: float, seconds: float) -> dict[str, Any]:
    workload = Workload(seed=4)
    with cluster("faults-overload") as c:
        engines = [c.sim(f"engine{i}", *MODEL_FLAGS, time_scale=TIME_SCALE) for i in range(ENGINES)]
        router = c.router(engines, "--max-concurrency-per-backend", str(CEILING), "--max-queue", str(QUEUE),
                          strategy="least-pending")
        asyncio.run(wait_healthy(*engines, router))
        time.sleep(2.5)
        rss: dict[str, float] = {"router_before_mib": router.rss_bytes() / 2**20}
        base, base_start = asyncio.run(open_loop(router.url, workload, rps / TIME_SCALE / MEAN_TURNS, seconds,
                                                 TIME_SCALE))
        rss["router_after_1x_mib"] = router.rss_bytes() / 2**20
        peak = {"pending": 0.0, "router_rss_mib": 0.0}

        async def sample(stop: asyncio.Event) -> None:
            while not stop.is_set():
                text = await scrape(router.url)
                peak["pending"] = max(peak["pending"], metric_sum(text, "tensorfleet_router_pending_requests"))
                peak["router_rss_mib"] = max(peak["router_rss_mib"], router.rss_bytes() / 2**20)
                await asyncio.sleep(0.5)

        async def overload() -> tuple[list[Record], float]:
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample(stop))
            result = await open_loop(router.url, workload, 5 * rps / TIME_SCALE / MEAN_TURNS, seconds, TIME_SCALE)
            stop.set()
            await sampler
            return result

        over, over_start = asyncio.run(overload())
        rss["router_after_5x_mib"] = router.rss_bytes() / 2**20
        rss["engines_after_5x_mib"] = sum(e.rss_bytes() for e in engines) / 2**20
        metrics = asyncio.run(scrape(router.url))
    refused = [r.result for r in over if r.result.status == 429]
    refused_ms = [r.total * 1e3 for r in refused]
    under_10ms = metric_sum(metrics, "tensorfleet_router_request_duration_seconds_bucket", code="429", le="0.01")
    total_429 = metric_sum(metrics, "tensorfleet_router_request_duration_seconds_count", code="429")
    half = seconds / 2
    return {
        "ceiling_per_engine": CEILING, "max_queue": QUEUE,
        "offered_1x_rps": rps, "offered_5x_rps": 5 * rps,
        "requests_5x": len(over), "refused_429": len(refused),
        "other_errors_5x": sum(1 for r in over if r.result.status not in (200, 429) or r.result.error),
        "client_429_p50_ms": percentile(refused_ms, 50), "client_429_p99_ms": percentile(refused_ms, 99),
        "router_429_under_10ms": under_10ms / total_429 if total_429 else float("nan"),
        "at_1x": latency(base, base_start + seconds * 0.2, base_start + seconds),
        "at_5x_first_half": latency(over, over_start, over_start + half),
        "at_5x_second_half": latency(over, over_start + half, over_start + seconds),
        "peak_router_pending": peak["pending"], "peak_router_rss_mib": peak["router_rss_mib"], **rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--capacity-rps", type=float, help="fleet capacity in simulated requests/s")
    args = parser.parse_args()
    seconds = 30.0 if args.quick else 90.0
    rps = capacity_rps(args.capacity_rps, args.quick)
    print(f"fleet capacity {rps:.2f} requests/s (simulated)", flush=True)
    print("killing an engine under 60% load...", flush=True)
    kill = kill_test(rps, seconds)
    print(json.dumps(kill, indent=2), flush=True)
    print("overload: 1x then 5x capacity...", flush=True)
    over = overload_test(rps, seconds / 1.5)
    print()
    print(table(["kill under 60% load", "requests", "ok", "refused before 1st byte", "cut mid-stream (error event)",
                 "silently truncated", "retries"],
                [["", kill["requests"], kill["ok"], kill["refused_before_first_byte"],
                  kill["cut_mid_stream_with_error_event"], kill["silently_truncated"], kill["router_retries"]]]))
    print()
    print(table(["overload 5x", "requests", "429s", "client 429 p50 ms", "client 429 p99 ms", "router 429 < 10 ms",
                 "peak pending", "router RSS before/after/peak MiB"],
                [["", over["requests_5x"], over["refused_429"], over["client_429_p50_ms"], over["client_429_p99_ms"],
                  f"{over['router_429_under_10ms']:.1%}", over["peak_router_pending"],
                  f"{over['router_before_mib']:.1f} / {over['router_after_5x_mib']:.1f} / {over['peak_router_rss_mib']:.1f}"]]))
    print()
    print(table(["admitted", "requests", "TTFT p50 s", "TTFT p99 s", "e2e p99 s"],
                [[name, over[key]["admitted"], over[key]["ttft_p50_s"], over[key]["ttft_p99_s"], over[key]["e2e_p99_s"]]
                 for name, key in (("1x", "at_1x"), ("5x, first half", "at_5x_first_half"),
                                   ("5x, second half", "at_5x_second_half"))]))
    goals = {
        "kill_refused_before_first_byte": kill["refused_before_first_byte"],
        "kill_goal_met": kill["refused_before_first_byte"] == 0 and kill["silently_truncated"] == 0,
        "overload_429_p99_ms_client": over["client_429_p99_ms"],
        "overload_429_under_10ms_router": over["router_429_under_10ms"],
    }
    print(json.dumps(goals, indent=2))
    path = write_results("faults", {"quick": args.quick, "time_scale": TIME_SCALE, "capacity_rps": rps,
                                    "kill": kill, "overload": over, "goals": goals})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
