"""Benchmark 1: what the router costs.

One simulator at --time-scale 0 (no simulated GPU time: every microsecond of
latency is software) is loaded by the same generator directly and through the
router (the default strategy): wrk for throughput and latency (non-streaming
and streaming, several concurrency levels), an async Python client for
streaming time to first token at concurrency 1, and a long wrk run of 200k+
requests through the router with its resident memory sampled as it goes.

Goals (issue 4): through-router throughput >= 50% of direct; p50 added latency
< 1 ms at low concurrency; router memory growth < 10 MB over 200k requests.

Then the router's CPU per request by strategy (issue 14: the default may cost at
most 20% more than least-pending did), for the short chat above and for a chat
the size of a multi-turn conversation (a 1,600-character system prompt, a
6,000-character document, two turns): a router per strategy, wrk at 16
connections, the router process's user + system CPU time over the run divided
by the requests it answered.

And the gateway's cost (issue 38: at most 1 ms added at the p50 and 0.3 ms of CPU per request): the same wrk
loads on one router directly and through a gateway in front of it (`--gateway-only`), and the gateway process's
CPU per request.

    python benchmarks/bench_overhead.py [--quick] [--strategies least-pending cache-aware] [--gateway-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp
from common import (
    HOST,
    MODEL,
    Proc,
    cluster,
    free_port,
    percentile,
    stream_chat,
    table,
    wait_healthy,
    write_results,
    wrk,
)
from workload import random_words

from tensorfleet import contract, engine_settings

BODY: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
                        "max_tokens": 16}


def conversation_body() -> dict[str, Any]:
    import random

    rng = random.Random(7)
    return {"model": MODEL, "max_tokens": 16, "messages": [
        {"role": "system", "content": random_words(rng, 320)},
        {"role": "user", "content": "Document:\n" + random_words(rng, 1200) + "\n\n" + random_words(rng, 20) + "?"},
        {"role": "assistant", "content": random_words(rng, 100)},
        {"role": "user", "content": random_words(rng, 30) + "?"}]}


def cpu_per_request(engine_url: str, strategies: list[str], seconds: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    bodies = {"short chat": BODY, "conversation": conversation_body()}
    for strategy in strategies:
        with cluster(f"overhead-cpu-{strategy}") as c:
            router = c.router([engine_url], "--max-concurrency-per-backend", "256", strategy=strategy)
            asyncio.run(wait_healthy(router))
            time.sleep(2.5)
            for name, body in bodies.items():
                text = json.dumps(body)
                wrk(router.url, connections=16, seconds=2, body=text)  # warm
                before = router.cpu_seconds()
                result = wrk(router.url, connections=16, seconds=seconds, body=text)
                cpu = router.cpu_seconds() - before
                rows.append({"strategy": strategy, "body": name, "body_bytes": len(text), "requests": result.requests,
                             "router_rps": result.rps, "cpu_ms_per_request": 1000 * cpu / max(result.requests, 1),
                             "errors": result.non_2xx + result.errors})
                print(f"  {strategy:13} {name:12} {rows[-1]['cpu_ms_per_request']:.3f} ms CPU/request "
                      f"({result.rps:.0f} rps)", flush=True)
    return rows


def cpu_with_kv_events(seconds: float) -> list[dict[str, Any]]:
    """The default strategy's CPU per request in front of two engines, placing by what it remembers sending (as
    before) and by the engines' KV events (each request's token ids asked of an engine's /tokenize first)."""
    rows: list[dict[str, Any]] = []
    bodies = {"short chat": BODY, "conversation": conversation_body()}
    with cluster("overhead-cpu-kv") as c:
        ports = [(free_port(), free_port()) for _ in range(2)]
        engines = [c.sim(f"engine-{i}", "--kv-events-config", engine_settings.kv_events_config(*pair),
                         time_scale=0.0) for i, pair in enumerate(ports)]
        asyncio.run(wait_healthy(*engines))
        endpoints = [arg for engine, (pub, replay) in zip(engines, ports, strict=True)
                     for arg in ("--kv-events-endpoint", f"{engine.url}=tcp://{HOST}:{pub},tcp://{HOST}:{replay}")]
        for label, extra in (("remembered", []), ("KV events", ["--kv-events", *endpoints])):
            router = c.router(engines, "--max-concurrency-per-backend", "256", *extra,
                              strategy=contract.DEFAULT_ROUTER_STRATEGY)
            asyncio.run(wait_healthy(router))
            time.sleep(2.5)
            for name, body in bodies.items():
                text = json.dumps(body)
                wrk(router.url, connections=16, seconds=2, body=text)  # warm
                before = router.cpu_seconds()
                result = wrk(router.url, connections=16, seconds=seconds, body=text)
                cpu = router.cpu_seconds() - before
                rows.append({"placement": label, "body": name, "requests": result.requests, "router_rps": result.rps,
                             "cpu_ms_per_request": 1000 * cpu / max(result.requests, 1),
                             "errors": result.non_2xx + result.errors})
                print(f"  {label:10} {name:12} {rows[-1]['cpu_ms_per_request']:.3f} ms CPU/request "
                      f"({result.rps:.0f} rps)", flush=True)
            router.stop()
    return rows


def gateway_overhead(seconds: float, levels: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """wrk on a router directly and through a gateway before it (the matrix's columns: direct = the router,
    router = the gateway), then the gateway's CPU per request for the short chat and the conversation."""
    with cluster("overhead-gateway") as c:
        engine = c.sim("engine", time_scale=0.0)
        router = c.router([engine], "--max-concurrency-per-backend", "256", strategy=contract.DEFAULT_ROUTER_STRATEGY)
        asyncio.run(wait_healthy(engine, router))
        gateway = c.gateway([router])
        asyncio.run(wait_healthy(gateway))
        time.sleep(2.5)
        print("wrk, a router (cache-aware, one simulator at --time-scale 0) directly vs through the gateway:")
        rows = run_wrk_matrix(router.url, gateway.url, seconds, levels)
        cpu: list[dict[str, Any]] = []
        for name, body in {"short chat": BODY, "conversation": conversation_body()}.items():
            text = json.dumps(body)
            wrk(gateway.url, connections=16, seconds=2, body=text)  # warm
            before, router_before = gateway.cpu_seconds(), router.cpu_seconds()
            result = wrk(gateway.url, connections=16, seconds=seconds, body=text)
            requests = max(result.requests, 1)
            cpu.append({"body": name, "requests": result.requests, "gateway_rps": result.rps,
                        "gateway_cpu_ms_per_request": 1000 * (gateway.cpu_seconds() - before) / requests,
                        "router_cpu_ms_per_request": 1000 * (router.cpu_seconds() - router_before) / requests,
                        "errors": result.non_2xx + result.errors})
            print(f"  {name:12} gateway {cpu[-1]['gateway_cpu_ms_per_request']:.3f} ms CPU/request, router "
                  f"{cpu[-1]['router_cpu_ms_per_request']:.3f} ({result.rps:.0f} rps)", flush=True)
    return rows, cpu


def run_wrk_matrix(direct: str, routed: str, seconds: float, levels: list[int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for stream in (False, True):
        body = json.dumps({**BODY, "stream": stream})
        for connections in levels:
            d = wrk(direct, connections=connections, seconds=seconds, body=body)
            r = wrk(routed, connections=connections, seconds=seconds, body=body)
            rows.append({
                "mode": "stream" if stream else "json", "connections": connections,
                "direct_rps": d.rps, "router_rps": r.rps, "ratio": r.rps / d.rps,
                "direct_p50_ms": d.p50 * 1e3, "router_p50_ms": r.p50 * 1e3, "added_p50_ms": (r.p50 - d.p50) * 1e3,
                "direct_p99_ms": d.p99 * 1e3, "router_p99_ms": r.p99 * 1e3,
                "errors": d.non_2xx + d.errors + r.non_2xx + r.errors,
            })
            print(f"  {rows[-1]['mode']:6} c={connections:<3} direct {d.rps:7.0f} rps  router {r.rps:7.0f} rps",
                  flush=True)
    return rows


async def ttft(direct: str, routed: str, count: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for label, url in (("direct", direct), ("router", routed)):
            for _ in range(50):  # warm connections and code paths
                await stream_chat(session, url, BODY["messages"], 16)
            samples = []
            for _ in range(count):
                result = await stream_chat(session, url, BODY["messages"], 16)
                assert result.status == 200 and result.ttft is not None, result
                samples.append(result.ttft)
            out[f"{label}_ttft_p50_ms"] = percentile(samples, 50) * 1e3
            out[f"{label}_ttft_p99_ms"] = percentile(samples, 99) * 1e3
    out["added_ttft_p50_ms"] = out["router_ttft_p50_ms"] - out["direct_ttft_p50_ms"]
    return out


def memory(router: Proc, routed: str, target: int, chunk_seconds: float) -> dict[str, Any]:
    body = json.dumps(BODY)
    warm = wrk(routed, connections=32, seconds=5, body=body)
    start_rss = router.rss_bytes()
    done, samples, errors = 0, [(0, start_rss)], 0
    started = time.monotonic()
    while done < target:
        result = wrk(routed, connections=32, seconds=chunk_seconds, body=body)
        done += result.requests
        errors += result.non_2xx + result.errors
        samples.append((done, router.rss_bytes()))
        print(f"  {done:>7} requests  router RSS {samples[-1][1] / 2**20:6.1f} MiB", flush=True)
    return {
        "warmup_requests": warm.requests, "requests": done, "errors": errors,
        "seconds": time.monotonic() - started,
        "rss_after_warmup_mib": start_rss / 2**20, "rss_end_mib": samples[-1][1] / 2**20,
        "rss_growth_mib": (samples[-1][1] - start_rss) / 2**20,
        "rss_max_mib": max(s[1] for s in samples) / 2**20,
        "samples": [{"requests": n, "rss_mib": rss / 2**20} for n, rss in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test, not figures)")
    parser.add_argument("--strategies", nargs="*", default=["least-pending", contract.DEFAULT_ROUTER_STRATEGY],
                        choices=contract.ROUTER_STRATEGIES, help="strategies whose CPU per request is measured")
    parser.add_argument("--cpu-only", action="store_true", help="only the CPU per request by strategy")
    parser.add_argument("--kv-only", action="store_true",
                        help="only the default strategy's CPU per request with and without the engines' KV events")
    parser.add_argument("--gateway-only", action="store_true",
                        help="only the gateway's added latency and CPU per request, in front of one router")
    args = parser.parse_args()
    seconds = 3 if args.quick else 10
    levels = [1, 16, 64]
    if args.gateway_only:
        rows, cpu = gateway_overhead(seconds, levels)
        print(table(["mode", "conns", "router rps", "gateway rps", "ratio", "router p50 ms", "gateway p50 ms",
                     "added p50 ms", "router p99 ms", "gateway p99 ms", "errors"],
                    [[r["mode"], r["connections"], r["direct_rps"], r["router_rps"], r["ratio"], r["direct_p50_ms"],
                      r["router_p50_ms"], r["added_p50_ms"], r["direct_p99_ms"], r["router_p99_ms"], r["errors"]]
                     for r in rows]))
        print(table(["body", "requests", "gateway rps", "gateway CPU ms/request", "router CPU ms/request", "errors"],
                    [[r["body"], r["requests"], r["gateway_rps"], r["gateway_cpu_ms_per_request"],
                      r["router_cpu_ms_per_request"], r["errors"]] for r in cpu]))
        added = max(r["added_p50_ms"] for r in rows if r["connections"] == 1)
        worst = max(r["gateway_cpu_ms_per_request"] for r in cpu)
        print(f"issue 38: added p50 at one connection {added:.3f} ms (goal <= 1), gateway CPU per request "
              f"{worst:.3f} ms (goal <= 0.3)")
        path = write_results("overhead-gateway", {"quick": args.quick, "wrk": rows, "cpu": cpu})
        print(f"wrote {path}")
        return
    if args.kv_only:
        print("router CPU per request, cache-aware in front of two engines, by what it places by:")
        kv_rows = cpu_with_kv_events(seconds)
        print(table(["placement", "body", "requests", "router rps", "CPU ms/request", "errors"],
                    [[r["placement"], r["body"], r["requests"], r["router_rps"], r["cpu_ms_per_request"],
                      r["errors"]] for r in kv_rows]))
        path = write_results("overhead-kv", {"quick": args.quick, "cpu": kv_rows})
        print(f"wrote {path}")
        return
    if args.cpu_only:
        with cluster("overhead-engine") as c:
            engine = c.sim("engine", time_scale=0.0)
            asyncio.run(wait_healthy(engine))
            print("router CPU per request, by strategy (wrk, 16 connections):")
            cpu_rows = cpu_per_request(engine.url, args.strategies, seconds)
        print(table(["strategy", "body", "body bytes", "requests", "router rps", "CPU ms/request", "errors"],
                    [[r["strategy"], r["body"], r["body_bytes"], r["requests"], r["router_rps"],
                      r["cpu_ms_per_request"], r["errors"]] for r in cpu_rows]))
        path = write_results("overhead-cpu", {"quick": args.quick, "cpu": cpu_rows})
        print(f"wrote {path}")
        return
    with cluster("overhead") as c:
        engine = c.sim("engine", time_scale=0.0)
        router = c.router([engine], "--max-concurrency-per-backend", "256",
                          strategy=contract.DEFAULT_ROUTER_STRATEGY)
        asyncio.run(wait_healthy(engine, router))
        time.sleep(2.5)  # a health/scrape round so the router has seen the engine
        print("wrk, one simulator at --time-scale 0, direct vs through the router:")
        rows = run_wrk_matrix(engine.url, router.url, seconds, levels)
        print("streaming TTFT at concurrency 1 (Python client):")
        latency = asyncio.run(ttft(engine.url, router.url, 200 if args.quick else 1000))
        print("router memory over a long run:")
        mem = memory(router, router.url, 20_000 if args.quick else 200_000, 5 if args.quick else 20)
        router_rss = router.rss_bytes()
        print("router CPU per request, by strategy (wrk, 16 connections):")
        cpu_rows = cpu_per_request(engine.url, args.strategies, seconds)
    print()
    print(table(["mode", "conns", "direct rps", "router rps", "ratio", "direct p50 ms", "router p50 ms",
                 "added p50 ms", "direct p99 ms", "router p99 ms", "errors"],
                [[r["mode"], r["connections"], r["direct_rps"], r["router_rps"], r["ratio"], r["direct_p50_ms"],
                  r["router_p50_ms"], r["added_p50_ms"], r["direct_p99_ms"], r["router_p99_ms"], r["errors"]]
                 for r in rows]))
    print()
    print(table(["stream TTFT (c=1)", "direct p50 ms", "router p50 ms", "added p50 ms", "direct p99 ms",
                 "router p99 ms"],
                [["", latency["direct_ttft_p50_ms"], latency["router_ttft_p50_ms"], latency["added_ttft_p50_ms"],
                  latency["direct_ttft_p99_ms"], latency["router_ttft_p99_ms"]]]))
    print()
    print(table(["requests", "errors", "RSS after warm-up MiB", "RSS end MiB", "growth MiB", "max MiB"],
                [[mem["requests"], mem["errors"], mem["rss_after_warmup_mib"], mem["rss_end_mib"],
                  mem["rss_growth_mib"], mem["rss_max_mib"]]]))
    print()
    print(table(["strategy", "body", "body bytes", "requests", "router rps", "CPU ms/request", "errors"],
                [[r["strategy"], r["body"], r["body_bytes"], r["requests"], r["router_rps"], r["cpu_ms_per_request"],
                  r["errors"]] for r in cpu_rows]))
    worst = min(r["ratio"] for r in rows)
    low = max(r["added_p50_ms"] for r in rows if r["connections"] == 1)
    goals = {
        "throughput_ratio_min": worst, "throughput_goal_met": worst >= 0.5,
        "added_p50_ms_c1_max": low, "latency_goal_met": low < 1.0 and latency["added_ttft_p50_ms"] < 1.0,
        "memory_growth_mib": mem["rss_growth_mib"], "memory_goal_met": mem["rss_growth_mib"] < 10 * 1e6 / 2**20,
    }
    print()
    print(json.dumps(goals, indent=2))
    path = write_results("overhead", {"quick": args.quick, "wrk": rows, "ttft": latency, "memory": mem, "cpu": cpu_rows,
                                      "router_rss_final_mib": router_rss / 2**20, "goals": goals})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
