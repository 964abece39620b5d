"""Shared plumbing for the benchmarks: processes on loopback, load, figures.

Every server runs as its own process (`tensorfleet sim`, `tensorfleet router`)
on 127.0.0.1, as in production, so the router's costs are not hidden in the
load generator's event loop. Nothing here talks to anything but loopback.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from tensorfleet import contract, promtext

if TYPE_CHECKING:
    from tensorfleet.planner import Plan

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
MODEL = "bench"
HOST = "127.0.0.1"
# The model and GPU the planner-driven benchmarks (autoscaling, goodput) simulate.
MODEL_ID, ACCELERATOR = "meta-llama/Llama-3.1-8B-Instruct", "L4"


def engine_flags(plan: Plan) -> list[str]:
    """What the operator passes a simulator pod of the plan's model and GPU (MODEL_ID on ACCELERATOR unless a
    benchmark plans another)."""
    return ["--model", plan.model, "--accelerator", plan.accelerator, "--tensor-parallel-size", str(plan.tensor),
            "--max-model-len", str(plan.max_model_len), "--max-num-seqs", str(plan.max_num_seqs),
            "--kv-cache-tokens", str(plan.kv_cache_tokens)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_bytes(self) -> int:
        """Resident memory of the process, from /proc (Linux)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self) -> float:
        """User plus system CPU time of the process so far, from /proc (Linux)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """The processes of one benchmark run; all stopped on exit."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.procs: list[Proc] = []
        self.logs = RESULTS / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def _spawn(self, name: str, args: Sequence[str], port: int, source: Path | None = None) -> Proc:
        """Run `tensorfleet ARGS`: this checkout's, or the package of another checkout at SOURCE (its repository
        root), with this environment's dependencies."""
        log = self.logs / f"{self.tag}-{name}.log"
        command = [sys.executable, "-m", "tensorfleet.cli", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if source is not None:
            env["PYTHONPATH"] = str(source / "operator")
        process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
        proc = Proc(name, f"http://{HOST}:{port}", process, log)
        self.procs.append(proc)
        return proc

    def sim(self, name: str, *extra: str, time_scale: float = 1.0, port: int | None = None) -> Proc:
        port = port or free_port()
        return self._spawn(name, ["sim", "--host", HOST, "--port", str(port), "--served-model-name", MODEL,
                                  "--time-scale", str(time_scale), "--log-level", "warning", *extra], port)

    def router(self, backends: Sequence[Proc | str], *extra: str, strategy: str = "least-pending",
               port: int | None = None, source: Path | None = None) -> Proc:
        # --backend-header: results record which engine answered; --drain-delay 0: nothing to drain at the end.
        port = port or free_port()
        args = ["router", "--host", HOST, "--port", str(port), "--model", MODEL, "--strategy", strategy,
                "--log-level", "warning", "--backend-header", "--drain-delay", "0", *extra]
        for backend in backends:
            args += ["--backend", backend if isinstance(backend, str) else backend.url]
        # The port in the log's name: two replicas of one strategy must not write one file.
        return self._spawn(f"router-{strategy}-{port}", args, port, source)

    def gateway(self, routers: Sequence[Proc], *extra: str, port: int | None = None) -> Proc:
        """A gateway serving MODEL from ROUTERS (--route: no Kubernetes API; two routers are one traffic group)."""
        port = port or free_port()
        args = ["gateway", "--host", HOST, "--port", str(port), "--log-level", "warning", "--drain-delay", "0",
                *(arg for router in routers for arg in ("--route", f"{MODEL}={router.url}")), *extra]
        return self._spawn("gateway", args, port)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()


@contextmanager
def cluster(tag: str) -> Iterator[Cluster]:
    c = Cluster(tag)
    try:
        yield c
    finally:
        c.close()


def _all_engines_taken(health: str) -> bool:
    """A router's /health body: every engine it was given is healthy; any other body (an engine's): True."""
    try:
        body = json.loads(health)
    except ValueError:
        return True
    if not isinstance(body, dict) or "backends" not in body:
        return True
    return bool(body.get("healthy", 0) >= body["backends"])


async def wait_healthy(*procs: Proc, timeout: float = 30.0) -> None:
    """Wait until each process answers /health with 200, and a router until it has taken every engine it was
    given (a router answers requests 503 while its engines refuse connections, as they do while they bind)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        for proc in procs:
            while True:
                if proc.process.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited: {proc.log.read_text()[-2000:]}")
                try:
                    async with session.get(proc.url + "/health") as resp:
                        if resp.status == 200 and _all_engines_taken(await resp.text()):
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{proc.name} not healthy after {timeout}s")
                await asyncio.sleep(0.05)


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        return await resp.text()


async def scrape_all(urls: Sequence[str]) -> list[str]:
    """Each URL's /metrics, scraped together."""
    return list(await asyncio.gather(*(scrape(u) for u in urls)))


async def cache_totals(urls: Sequence[str]) -> tuple[float, float]:
    """The engines' prefix-cache hits and queries (tokens), summed over URLS."""
    texts = await scrape_all(urls)
    return (sum(metric_sum(t, contract.VLLM_METRIC_PREFIX_CACHE_HITS + "_total") for t in texts),
            sum(metric_sum(t, contract.VLLM_METRIC_PREFIX_CACHE_QUERIES + "_total") for t in texts))


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of NAME whose labels include LABELS (0 when none)."""
    return promtext.total(text, name, **labels)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class StreamResult:
    status: int
    text: str = ""
    ttft: float | None = None       # first content token
    total: float = 0.0
    tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None         # transport or mid-stream error
    started: bool = False            # the client received any byte of the answer
    done: bool = False               # the stream ended with [DONE]
    backend: str = ""
    sent_at: float = 0.0
    token_times: list[float] = field(default_factory=list)  # seconds after sending, of each content event


async def stream_chat(session: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]], max_tokens: int,
                      headers: dict[str, str] | None = None, timeout: float = 300.0,
                      model: str = MODEL) -> StreamResult:
    """One streaming chat request for MODEL; times the first token, every content event and the whole answer."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = StreamResult(status=0, sent_at=start)
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            result.status = resp.status
            result.backend = resp.headers.get("x-tensorfleet-backend", "")
            if resp.status != 200:
                await resp.read()
                result.total = time.perf_counter() - start
                return result
            buffer = b""
            parts: list[str] = []
            async for chunk in resp.content.iter_any():
                result.started = True
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if event == b"data: [DONE]":
                        result.done = True
                        continue
                    if not event.startswith(b"data: "):
                        continue
                    data = json.loads(event[6:])
                    if "error" in data:
                        result.error = data["error"]["message"]
                        continue
                    if data.get("usage"):
                        result.tokens = data["usage"]["completion_tokens"]
                        details = data["usage"].get("prompt_tokens_details") or {}
                        result.cached_tokens = details.get("cached_tokens", 0)
                    for choice in data.get("choices", []):
                        content = choice.get("delta", {}).get("content")
                        if content:
                            result.token_times.append(time.perf_counter() - start)
                            if result.ttft is None:
                                result.ttft = result.token_times[0]
                            parts.append(content)
            result.text = "".join(parts)
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.error = f"{exc.__class__.__name__}: {exc}"
    result.total = time.perf_counter() - start
    return result


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import uvloop  # noqa: F401 - imported only to learn whether it is installed
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    # Other work on the machine skews every figure; the load average says how much there was.
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "kernel": platform.release(),
            "event_loop": loop, "wrk": shutil.which("wrk") is not None, "loadavg_at_end": os.getloadavg()}


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **payload}
    path.write_text(json.dumps(payload, indent=2))
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


# --- wrk ---------------------------------------------------------------------------

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def _seconds(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not match:
        raise ValueError(text)
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass
class WrkResult:
    requests: int
    rps: float
    p50: float
    p99: float
    non_2xx: int
    errors: int
    raw: str = field(repr=False, default="")


def wrk(url: str, *, connections: int, seconds: float, body: str, path: str = "/v1/chat/completions",
        threads: int = 1) -> WrkResult:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk")
    env = {**os.environ, "WRK_BODY": body, "WRK_PATH": path}
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s",
                          "-s", str(ROOT / "post.lua"), url], capture_output=True, text=True, env=env, check=True).stdout
    latency = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.MULTILINE))
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]  # wrk always prints this line
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]  # wrk always prints this line
    non_2xx = int(re.search(r"NON2XX (\d+)", out).group(1))  # type: ignore[union-attr]  # wrk always prints this line
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = sum(int(g) for g in socket_errors.groups()) if socket_errors else 0
    return WrkResult(requests, rps, _seconds(latency["50"]), _seconds(latency["99"]), non_2xx, errors, out)
