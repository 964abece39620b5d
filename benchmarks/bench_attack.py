"""Benchmark 5: attacks. Hostile clients next to legitimate ones, and an engine that hangs.

Every server is its own process on loopback (`tensorfleet sim`, `tensorfleet
router` with its production defaults), so the router's memory is its own RSS.
Engines: Llama-3.1-8B on L4 as in bench_routing.py, at --time-scale 0.1.

Attack: 3 engines behind a least-pending router. Legitimate traffic: 8
closed-loop clients streaming short chats (32-token answers). One run without
an attack, then the same with an attacker process (its own process, so its
CPU does not stall the clients' event loop) sending 20 requests/s open-loop,
in turn: a malformed HTTP head, a gzip body, a 1 MiB gzip bomb (about 1 GiB
inflated), an absolute-form target, a head sent one byte a second, a body sent
one kilobyte a second, a connection that sends nothing, a body over the 16 MiB
limit announced by Content-Length, a chunked body that runs past the limit,
and JSON nested 100,000 deep; halfway through, also a burst of 12 bodies of
15.9 MiB at once (just under the limit, never-ending JSON). Goals: no
legitimate request fails, legitimate p99 latency within 2x of the attack-free
run, router RSS under 200 MiB.

Hang: 4 engines; 8 streaming and 8 non-streaming closed-loop clients; a third
of the way in one engine gets SIGSTOP and stays stopped. Goals: no request
fails (those waiting on the stopped engine for their first byte move to
another; a stream already flowing from it is resumed on another engine as a
continuation, router/resume.py), and no request waits more than 10 s beyond
its normal latency for its first byte. Every stream that completed is checked
whole: its text is ANSWER_TOKENS tokens (the simulator's tokenizer) and its
usage says so, so a resumption that repeated or lost text would show.

    python benchmarks/bench_attack.py [--quick] [--scenario attack|hang]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import signal
import subprocess
import sys
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
from bench_routing import MODEL_FLAGS
from common import (
    MODEL,
    Proc,
    StreamResult,
    cluster,
    metric_sum,
    percentile,
    scrape,
    stream_chat,
    table,
    wait_healthy,
    write_results,
)

from tensorfleet.sim.tokenizer import count_tokens

TIME_SCALE = 0.1
ANSWER_TOKENS = 32
LEGIT_CLIENTS = 8
ATTACK_RPS = 20.0
MAX_BODY = 16 * 1024 * 1024  # the router's default --max-body-bytes


def legit_messages(rng: random.Random) -> list[dict[str, Any]]:
    words = " ".join("".join(rng.choices("abcdefghij", k=5)) for _ in range(rng.randint(20, 200)))
    return [{"role": "user", "content": f"Summarise: {words}"}]


# --- the attacker (run as its own process: `bench_attack.py --attacker URL`) -------------------------------------

def _head(target: str = "/v1/chat/completions", **headers: str) -> bytes:
    lines = [f"POST {target} HTTP/1.1", "Host: router", "Content-Type: application/json",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _bomb() -> bytes:
    """About 1 MiB of gzip that inflates to 1 GiB of zeros."""
    out = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"\0" * (1 << 20)
    return b"".join([*(out.compress(block) for _ in range(1024)), out.flush()])


Sender = Callable[[asyncio.StreamWriter], Coroutine[Any, Any, None]]


def attack_kinds() -> dict[str, Sender]:
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    zipped, bomb = gzip.compress(chat), _bomb()
    deep = b"[" * 100_000 + b"]" * 100_000

    async def send(writer: asyncio.StreamWriter, *parts: bytes) -> None:
        for part in parts:
            writer.write(part)
            await writer.drain()

    async def malformed(w: asyncio.StreamWriter) -> None:
        await send(w, b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nBad Header\r\n\r\n")

    async def gzip_body(w: asyncio.StreamWriter) -> None:
        await send(w, _head(Content_Encoding="gzip", Content_Length=str(len(zipped))), zipped)

    async def gzip_bomb(w: asyncio.StreamWriter) -> None:
        await send(w, _head(Content_Encoding="gzip", Content_Length=str(len(bomb))), bomb)

    async def absolute_form(w: asyncio.StreamWriter) -> None:
        await send(w, _head("http://attacker.example/v1/chat/completions", Content_Length=str(len(chat))), chat)

    async def slow_head(w: asyncio.StreamWriter) -> None:
        await send(w, b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nX-Slow: ")
        while True:
            await asyncio.sleep(1.0)
            await send(w, b"a")

    async def slow_body(w: asyncio.StreamWriter) -> None:
        await send(w, _head(Content_Length=str(1 << 20)), b'{"model": "' + MODEL.encode() + b'", "pad": "')
        while True:
            await asyncio.sleep(1.0)
            await send(w, b"a" * 1024)

    async def idle(_: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    async def oversized_length(w: asyncio.StreamWriter) -> None:
        await send(w, _head(Content_Length=str(MAX_BODY + (1 << 20))))
        block = b"a" * (1 << 20)
        while True:
            await send(w, block)

    async def oversized_chunked(w: asyncio.StreamWriter) -> None:
        await send(w, _head(Transfer_Encoding="chunked"))
        block = b"a" * (1 << 20)
        while True:
            await send(w, b"%x\r\n" % len(block) + block + b"\r\n")

    async def deep_json(w: asyncio.StreamWriter) -> None:
        await send(w, _head(Content_Length=str(len(deep))), deep)

    big = b'{"model": "' + MODEL.encode() + b'", "pad": "' + b"a" * (MAX_BODY - (100 << 10))

    async def big_body(w: asyncio.StreamWriter) -> None:
        await send(w, _head(Content_Length=str(len(big))), big)

    return {"malformed": malformed, "gzip_body": gzip_body, "gzip_bomb": gzip_bomb, "absolute_form": absolute_form,
            "slow_head": slow_head, "slow_body": slow_body, "idle": idle, "oversized_length": oversized_length,
            "oversized_chunked": oversized_chunked, "deep_json": deep_json, "big_body": big_body}


async def attack_once(host: str, port: int, sender: Sender) -> tuple[str, float]:
    """One hostile request: (the router's status code, or what happened to the connection; seconds until then)."""
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return "refused", time.perf_counter() - start
    sending = asyncio.create_task(sender(writer))
    try:
        line = await asyncio.wait_for(reader.readline(), 120)
        outcome = line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"
    except (ConnectionError, OSError):
        outcome = "reset"
    except TimeoutError:
        outcome = "no answer in 120s"
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        writer.close()
    return outcome, time.perf_counter() - start


async def attacker(url: str, rate: float, seconds: float) -> dict[str, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    kinds = attack_kinds()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    seconds_to_close: dict[str, list[float]] = defaultdict(list)

    async def one(kind: str) -> None:
        outcome, took = await attack_once(host, int(port), kinds[kind])
        outcomes[kind][outcome] += 1
        seconds_to_close[kind].append(took)

    tasks = []
    names = [name for name in kinds if name != "big_body"]
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one(names[i % len(names)])))
        if i == int(rate * seconds) // 2:
            tasks += [asyncio.create_task(one("big_body")) for _ in range(12)]
    # The slow ones end when the router cuts them (header and body timeouts: 10 s, 30 s).
    await asyncio.wait(tasks, timeout=40)
    unfinished = sum(1 for t in tasks if not t.done())
    for task in tasks:
        task.cancel()
    return {"sent": len(tasks), "unfinished_after_40s": unfinished,
            "outcomes": {k: dict(v) for k, v in outcomes.items()},
            "seconds_until_answer_max": {k: max(v) for k, v in seconds_to_close.items()}}


# --- legitimate clients and measurements ---------------------------------------------------------------------------

async def sample_rss(proc: Proc, stop: asyncio.Event, peak: list[float]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], proc.rss_bytes() / 2**20)
        await asyncio.sleep(0.1)


async def legit_load(url: str, seconds: float, seed: int, *, clients: int = LEGIT_CLIENTS,
                     streaming: bool = True, log: list[tuple[bool, StreamResult]] | None = None) -> list[StreamResult]:
    """Closed-loop clients for `seconds`; each StreamResult with its sent_at (perf_counter)."""
    results: list[StreamResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        stop_at = time.perf_counter() + seconds

        async def client(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.perf_counter() < stop_at:
                messages = legit_messages(rng)
                result = (await stream_chat(http, url, messages, ANSWER_TOKENS, timeout=120.0) if streaming
                          else await plain_chat(http, url, messages, ANSWER_TOKENS))
                results.append(result)
                if log is not None:
                    log.append((streaming, result))

        await asyncio.gather(*(client(i) for i in range(clients)))
    return results


async def plain_chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]], max_tokens: int
                     ) -> StreamResult:
    """One non-streamed chat; its `ttft` is when the whole answer arrived (its first byte)."""
    start = time.perf_counter()
    result = StreamResult(status=0, sent_at=start)
    try:
        async with http.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                 "max_tokens": max_tokens},
                             timeout=aiohttp.ClientTimeout(total=120)) as resp:
            result.status = resp.status
            result.backend = resp.headers.get("x-tensorfleet-backend", "")
            body = await resp.json(content_type=None)
            result.ttft = time.perf_counter() - start
            result.started = result.done = resp.status == 200
            if resp.status != 200:
                result.error = str(body.get("error", body))[:200]
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{exc.__class__.__name__}: {exc}"
    result.total = time.perf_counter() - start
    return result


def failed(result: StreamResult) -> bool:
    return result.status != 200 or result.error is not None or not result.done


def latency(results: list[StreamResult]) -> dict[str, float]:
    ok = [r for r in results if not failed(r)]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "ttft_p50_ms": percentile([r.ttft * 1e3 for r in ok if r.ttft], 50),
            "ttft_p99_ms": percentile([r.ttft * 1e3 for r in ok if r.ttft], 99),
            "e2e_p50_ms": percentile([r.total * 1e3 for r in ok], 50),
            "e2e_p99_ms": percentile([r.total * 1e3 for r in ok], 99)}


def attack_test(seconds: float) -> dict[str, Any]:
    with cluster("attack") as c:
        engines = [c.sim(f"engine{i}", *MODEL_FLAGS, time_scale=TIME_SCALE) for i in range(3)]
        asyncio.run(wait_healthy(*engines))  # before the router: its first health check finds them all up
        router = c.router(engines, strategy="least-pending")
        asyncio.run(wait_healthy(router))
        time.sleep(2.5)
        asyncio.run(legit_load(router.url, 5.0, seed=99))  # warm-up, not measured
        rss_start = router.rss_bytes() / 2**20

        async def run(with_attack: bool, seed: int) -> tuple[list[StreamResult], float, dict[str, Any] | None]:
            peak = [0.0]
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_rss(router, stop, peak))
            attack = None
            if with_attack:
                attack = await asyncio.create_subprocess_exec(
                    sys.executable, __file__, "--attacker", router.url, "--rate", str(ATTACK_RPS),
                    "--seconds", str(seconds), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                assert attack.stdin is not None and attack.stdout is not None
                assert (await attack.stdout.readline()).strip() == b"ready"
                attack.stdin.write(b"go\n")
                await attack.stdin.drain()
            results = await legit_load(router.url, seconds, seed=seed)
            report = None
            if attack is not None:
                out, _ = await attack.communicate()
                report = json.loads(out)
            stop.set()
            await sampler
            return results, peak[0], report

        base, base_peak, _ = asyncio.run(run(False, seed=1))
        attacked, attack_peak, report = asyncio.run(run(True, seed=1))
        metrics = asyncio.run(scrape(router.url))
        rss_end = router.rss_bytes() / 2**20
    refusals = {code: metric_sum(metrics, "tensorfleet_router_requests_total", backend="none", code=code)
                for code in ("400", "404", "408", "413", "415", "503")}
    return {
        "attack_free": latency(base), "under_attack": latency(attacked), "attacker": report,
        "router_rss_mib": {"after_warmup": rss_start, "peak_attack_free": base_peak, "peak_under_attack": attack_peak,
                           "end": rss_end},
        "router_refusals_by_code": refusals,
        "engines_healthy_at_end": metric_sum(metrics, "tensorfleet_router_backend_healthy"),
        "ejections": metric_sum(metrics, "tensorfleet_router_backend_ejections_total"),
    }


def hang_test(seconds: float) -> dict[str, Any]:
    with cluster("attack-hang") as c:
        engines = [c.sim(f"engine{i}", *MODEL_FLAGS, time_scale=TIME_SCALE) for i in range(4)]
        asyncio.run(wait_healthy(*engines))
        router = c.router(engines, strategy="least-pending")
        asyncio.run(wait_healthy(router))
        time.sleep(2.5)
        victim = engines[1]
        log: list[tuple[bool, StreamResult]] = []
        marks: dict[str, float] = {}

        async def main() -> None:
            async def stopper() -> None:
                await asyncio.sleep(seconds / 3)
                marks["stopped"] = time.perf_counter()
                victim.process.send_signal(signal.SIGSTOP)
                while True:
                    text = await scrape(router.url)
                    if metric_sum(text, "tensorfleet_router_backend_healthy", backend=victim.url) == 0:
                        marks["ejected"] = time.perf_counter()
                        return
                    await asyncio.sleep(0.1)

            task = asyncio.create_task(stopper())
            marks["start"] = time.perf_counter()
            await asyncio.gather(legit_load(router.url, seconds, seed=7, streaming=True, log=log),
                                 legit_load(router.url, seconds, seed=8, streaming=False, log=log))
            await task

        asyncio.run(main())
        metrics = asyncio.run(scrape(router.url))
        victim.kill()
    stopped = marks["stopped"]
    out: dict[str, Any] = {"stopped_after_s": stopped - marks["start"], "ejected_after_stop_s": marks["ejected"] - stopped,
                           "router_retries": {reason: metric_sum(metrics, "tensorfleet_router_retries_total",
                                                                 reason=reason)
                                              for reason in ("unresponsive", "timeout", "connect", "upstream", "status")},
                           "router_stream_errors": metric_sum(metrics, "tensorfleet_router_stream_errors_total"),
                           "router_stream_resumptions": {
                               reason: metric_sum(metrics, "tensorfleet_router_stream_resumptions_total", reason=reason)
                               for reason in ("unresponsive", "stalled", "failed")}}
    for streaming in (True, False):
        results = [r for s, r in log if s == streaming]
        before = [r for r in results if r.sent_at + r.total < stopped and not failed(r)]
        normal = percentile([r.ttft for r in before if r.ttft], 50)
        # Every request in flight at the stop or sent after it: how much longer than normal its first byte took.
        affected = [r for r in results if r.sent_at + r.total >= stopped]
        excess = [(r.ttft if r.ttft is not None else r.total) - normal for r in affected]
        out["streaming" if streaming else "non_streaming"] = {
            "requests": len(results),
            "failed_before_first_byte": sum(1 for r in results if failed(r) and not r.started),
            "cut_mid_stream_with_error_event": sum(1 for r in results if r.started and r.error is not None),
            "silently_truncated": sum(1 for r in results if r.started and r.error is None and not r.done),
            # A completed stream whose text or usage is not the whole answer: text lost or sent twice.
            "wrong_length": sum(1 for r in results if streaming and not failed(r)
                                and (count_tokens(r.text) != ANSWER_TOKENS or r.tokens != ANSWER_TOKENS)),
            "failed": sum(1 for r in results if failed(r)),
            "normal_first_byte_p50_ms": normal * 1e3,
            "affected_requests": len(affected),
            "max_first_byte_excess_s": max(excess, default=0.0),
            # The whole answer: for a resumed stream, the pause between the engine stopping and the continuation.
            "max_e2e_excess_s": max((r.total - percentile([b.total for b in before], 50) for r in affected
                                     if not failed(r)), default=0.0),
            "first_byte_excess_over_10s": sum(1 for e in excess if e > 10.0),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scenario", choices=("attack", "hang"), help="run only this scenario (default: both)")
    parser.add_argument("--attacker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=ATTACK_RPS, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=30.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attacker:
        print(json.dumps(asyncio.run(attacker(args.attacker, args.rate, args.seconds))), flush=True)
        return
    goals: dict[str, Any] = {}
    payload: dict[str, Any] = {"quick": args.quick, "time_scale": TIME_SCALE}
    if args.scenario in (None, "attack"):
        seconds = 10.0 if args.quick else 30.0
        print(f"attack: {seconds:g}s without, then {seconds:g}s with {ATTACK_RPS:g} hostile requests/s...", flush=True)
        attack = attack_test(seconds)
        print(json.dumps(attack, indent=2), flush=True)
        base, under = attack["attack_free"], attack["under_attack"]
        print()
        print(table(["legitimate clients", "requests", "failed", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms",
                     "e2e p99 ms"],
                    [[name, r["requests"], r["failed"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["e2e_p50_ms"],
                      r["e2e_p99_ms"]] for name, r in (("attack-free", base), ("under attack", under))]))
        print()
        ratio = under["e2e_p99_ms"] / base["e2e_p99_ms"]
        peak = attack["router_rss_mib"]["peak_under_attack"]
        goals.update({"attack_legit_failed": under["failed"], "attack_e2e_p99_ratio": ratio,
                      "attack_router_peak_rss_mib": peak,
                      "attack_goal_met": under["failed"] == 0 and ratio <= 2.0 and peak < 200})
        payload.update({"attack_rps": ATTACK_RPS, "attack": attack})
    if args.scenario in (None, "hang"):
        hang_seconds = 15.0 if args.quick else 45.0
        print(f"hang: {hang_seconds:g}s, one of four engines stopped after {hang_seconds / 3:g}s...", flush=True)
        hang = hang_test(hang_seconds)
        print(json.dumps(hang, indent=2), flush=True)
        print()
        print(table(["hang", "requests", "failed", "failed before 1st byte", "cut mid-stream (error event)",
                     "silently truncated", "wrong length", "max first-byte excess s", "ejected after s"],
                    [[name, hang[key]["requests"], hang[key]["failed"], hang[key]["failed_before_first_byte"],
                      hang[key]["cut_mid_stream_with_error_event"], hang[key]["silently_truncated"],
                      hang[key]["wrong_length"], hang[key]["max_first_byte_excess_s"], hang["ejected_after_stop_s"]]
                     for name, key in (("streaming", "streaming"), ("non-streaming", "non_streaming"))]))
        streaming, plain = hang["streaming"], hang["non_streaming"]
        goals.update({
            "hang_failed": streaming["failed"] + plain["failed"],
            "hang_wrong_length": streaming["wrong_length"],
            "hang_max_first_byte_excess_s": max(streaming["max_first_byte_excess_s"],
                                                plain["max_first_byte_excess_s"]),
            "hang_stream_resumptions": sum(hang["router_stream_resumptions"].values()),
        })
        goals["hang_goal_met"] = (goals["hang_failed"] == 0 and goals["hang_wrong_length"] == 0
                                  and streaming["silently_truncated"] == 0
                                  and goals["hang_max_first_byte_excess_s"] <= 10.0)
        payload["hang"] = hang
    print(json.dumps(goals, indent=2))
    path = write_results("attack" if args.scenario is None else f"attack-{args.scenario}", {**payload, "goals": goals})
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
