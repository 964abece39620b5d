"""Real simulator, router and gateway servers on 127.0.0.1 for tests, on free ports: in the test's event loop (`sim`,
`router`, `router_pair`, `gateway`: fast, their state can be inspected) or as processes a test can kill or signal (`spawn_sim`,
`sim_process`, `spawn_router`), with helpers to talk to them (`post_chat`, `raw_exchange`) and misbehaving engines (`fake_engine`).
Design: docs/architecture.md#how-it-is-tested.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from tensorfleet import contract, promtext
from tensorfleet.gateway.app import Gateway
from tensorfleet.gateway.config import GatewayConfig
from tensorfleet.gateway.table import ModelTable
from tensorfleet.httpapi import start_site
from tensorfleet.router.app import Router, RouterConfig
from tensorfleet.router.backends import BreakerPolicy
from tensorfleet.router.clients import client_limits
from tensorfleet.sim.engine import Engine
from tensorfleet.sim.kvtransfer import TransferConfig
from tensorfleet.sim.profile import Profile, make_profile
from tensorfleet.sim.server import SimConfig, SimServer
from tensorfleet.testing.wait import eventually

MODEL = "test-model"
# L4 + Llama-3.1-8B decode steps are ~70 ms simulated; x0.01 makes them 0.7 ms.
FAST = 0.01


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningSim:
    server: SimServer
    runner: web.AppRunner
    url: str

    @property
    def engine(self) -> Engine:
        assert self.server.engine is not None
        return self.server.engine


@dataclass
class RunningRouter:
    router: Router
    runner: web.AppRunner
    url: str


@dataclass
class RunningGateway:
    gateway: Gateway
    runner: web.AppRunner
    url: str


def small_profile(**capacity: Any) -> Profile:
    return replace(make_profile(), **capacity) if capacity else make_profile()


@asynccontextmanager
async def sim(*, profile: Profile | None = None, time_scale: float = FAST, startup_delay: float = 0.0,
              port: int = 0, seed: int = 0, kv_transfer: TransferConfig | None = None,
              stream_interval: int = 1, prompt_tokens_details: bool = False,
              served_name: str = MODEL) -> AsyncIterator[RunningSim]:
    server = SimServer(profile or make_profile(), SimConfig(served_model_name=served_name,
                                                            model="meta-llama/Llama-3.1-8B",
                                                            startup_delay=startup_delay, time_scale=time_scale,
                                                            seed=seed, kv_transfer=kv_transfer,
                                                            bind_host="127.0.0.1", stream_interval=stream_interval,
                                                            prompt_tokens_details=prompt_tokens_details))
    runner = await start_site(server.app(), "127.0.0.1", port)
    bound = runner.addresses[0][1]
    try:
        yield RunningSim(server, runner, f"http://127.0.0.1:{bound}")
    finally:
        await runner.cleanup()


@asynccontextmanager
async def router(backends: list[str], *, first_round: bool = True, port: int = 0,
                 **options: Any) -> AsyncIterator[RunningRouter]:
    """A router in front of BACKENDS, serving with the limits the real router process has (Router.limits), handed
    over once its first health round is done (every engine it starts with checked once), so which engine takes
    the first requests does not depend on which check happened to answer first; `first_round=False` hands it
    over at once."""
    options.setdefault("model", MODEL)
    options.setdefault("health_interval", 0.1)
    options.setdefault("breaker", BreakerPolicy(failure_threshold=3, ejection_seconds=0.3, max_ejection_seconds=1.0))
    options.setdefault("backend_header", True)
    config = RouterConfig(static_backends=tuple(backends), **options)
    instance = Router(config)
    runner = await start_site(instance.app(), "127.0.0.1", port, limits=client_limits(instance.config))
    bound = runner.addresses[0][1]
    try:
        if first_round:
            await eventually(lambda: all(b.breaker.checked for b in instance.pool), timeout=10)
        yield RunningRouter(instance, runner, f"http://127.0.0.1:{bound}")
    finally:
        await runner.cleanup()


@asynccontextmanager
async def router_pair(backends: list[str], **options: Any) -> AsyncIterator[tuple[RunningRouter, RunningRouter]]:
    """Two router replicas in front of BACKENDS, each the other's peer (router/peers.py), both with OPTIONS."""
    port_a, port_b = free_port(), free_port()
    async with router(backends, port=port_a, peers=(f"http://127.0.0.1:{port_b}",), **options) as a, \
            router(backends, port=port_b, peers=(f"http://127.0.0.1:{port_a}",), **options) as b:
        yield a, b


@asynccontextmanager
async def gateway(table: ModelTable, **options: Any) -> AsyncIterator[RunningGateway]:
    """A gateway over TABLE (the test fills it, and calls `changes.changed()` after changing it), serving with the
    limits the real gateway process has."""
    options.setdefault("backend_header", True)
    instance = Gateway(GatewayConfig(**options), table)
    runner = await start_site(instance.app(), "127.0.0.1", 0, limits=client_limits(instance.config))
    try:
        yield RunningGateway(instance, runner, f"http://127.0.0.1:{runner.addresses[0][1]}")
    finally:
        await runner.cleanup()


@asynccontextmanager
async def fake_engine(handle: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> AsyncIterator[tuple[str, list[str]]]:
    """An engine stand-in whose /health and /metrics answer 200 (so it joins a router's pool at its first check)
    and whose other requests HANDLE answers: its URL, and a log with the path of each of those requests, and
    "closed" after one whose connection was closed while HANDLE was still at it (the router hung up)."""
    calls: list[str] = []

    async def serve(request: web.Request) -> web.StreamResponse:
        if request.path in (contract.HEALTH_PATH, contract.METRICS_PATH):
            return web.Response()
        calls.append(request.path)
        try:
            return await handle(request)
        except asyncio.CancelledError:
            calls.append("closed")
            raise

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", serve)
    runner = await start_site(app, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", calls
    finally:
        await runner.cleanup()


async def engine_error(_: web.Request) -> web.Response:
    """A `fake_engine` handler: the OpenAI-style 500 vLLM answers after a CUDA fault."""
    return web.json_response({"error": {"message": "CUDA error: an illegal memory access",
                                        "type": "InternalServerError", "param": None, "code": 500}}, status=500)


@dataclass(frozen=True)
class Reply:
    """A whole answer, as a test reads it."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def backend(self) -> str:
        """The engine that answered (contract.BACKEND_HEADER); "" when the router answered itself."""
        return self.headers.get(contract.BACKEND_HEADER, "")

    def json(self) -> Any:
        return json.loads(self.body)


async def post_chat(client: aiohttp.ClientSession, url: str, body: Mapping[str, Any], *,
                    headers: Mapping[str, str] | None = None) -> Reply:
    """POST BODY to URL's /v1/chat/completions, with HEADERS, and read the whole answer."""
    async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        return Reply(resp.status, resp.headers.copy(), await resp.read())


def chat(content: str, max_tokens: int = 8, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, **extra}


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, data) of each SSE event as it arrives."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield time.monotonic(), line[6:].decode()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of NAME whose labels include LABELS."""
    return promtext.value(text, name, **labels)


@contextmanager
def _spawned(command: list[str], *, stdout: Any, stderr: Any, env: Mapping[str, str] | None = None
             ) -> Iterator[subprocess.Popen[bytes]]:
    """COMMAND as its own process (unbuffered output, ENV added to ours); SIGKILLed on exit if still running."""
    process = subprocess.Popen(command, stdout=stdout, stderr=stderr,
                               env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        if process.stderr:
            process.stderr.close()


@contextmanager
def spawn_sim(port: int, *args: str, served_name: str = MODEL, env: Mapping[str, str] | None = None,
              log: Any = subprocess.PIPE) -> Iterator[subprocess.Popen[bytes]]:
    """`tensorfleet sim` as its own process on PORT, serving SERVED_NAME, with ENV added to ours (such as
    VLLM_ALLOW_RUNTIME_LORA_UPDATING); killed on exit. LOG: where its log goes (a pipe, or a file)."""
    command = [sys.executable, "-m", "tensorfleet.cli", "sim", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", served_name, *args]
    with _spawned(command, stdout=subprocess.DEVNULL, stderr=log, env=env) as process:
        yield process


@asynccontextmanager
async def sim_process(*args: str) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """`spawn_sim` on a free port with ARGS, handed over once it answers /health: its URL and its process."""
    port = free_port()
    with spawn_sim(port, *args) as process:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url)
        yield url, process


@contextmanager
def spawn_router(port: int, backends: list[str], *args: str, log: Any = subprocess.DEVNULL
                 ) -> Iterator[subprocess.Popen[bytes]]:
    """`tensorfleet router` as its own process on PORT in front of BACKENDS (so signals reach it as in a pod);
    killed on exit. LOG: where its output goes (a file, or DEVNULL)."""
    command = [sys.executable, "-m", "tensorfleet.cli", "router", "--host", "127.0.0.1", "--port", str(port),
               "--model", MODEL, "--backend-header", *(f"--backend={url}" for url in backends), *args]
    with _spawned(command, stdout=log, stderr=subprocess.STDOUT) as process:
        yield process


async def raw_exchange(url: str, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send DATA as is on a new connection to URL's host and port, and return every byte received until the
    server closes the connection (or TIMEOUT passes: then what came, and b"<open>" appended): bytes no HTTP client
    library would send (malformed heads, absolute-form targets, slow senders)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if data:
            writer.write(data)
            await writer.drain()
        received = b""
        try:
            async with asyncio.timeout(timeout):
                while chunk := await reader.read(65536):
                    received += chunk
        except TimeoutError:
            received += b"<open>"
        except ConnectionResetError:
            pass
        return received
    finally:
        writer.close()


async def wait_healthy(url: str, timeout: float = 20.0) -> None:
    async with aiohttp.ClientSession() as session:
        async def ok() -> bool:
            try:
                async with session.get(url + "/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False
        await eventually(ok, timeout=timeout, interval=0.05)


def idle_connection_lifetime(url: str, bound: float) -> float:
    """Seconds until the server at URL closes a keep-alive connection left idle after one answered GET of
    /health (at most BOUND: then BOUND)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as conn:
        conn.sendall(f"GET {contract.HEALTH_PATH} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += conn.recv(4096)
        if not answer.startswith(b"HTTP/1.1 200"):
            raise AssertionError(f"GET {url}{contract.HEALTH_PATH}: {answer[:200]!r}")
        idle = time.monotonic()  # /health's answer has no body: the connection is idle from here
        conn.settimeout(bound)
        try:
            rest = conn.recv(4096)
        except TimeoutError:
            return bound
        if rest:
            raise AssertionError(f"{url} sent more after /health's answer: {rest[:200]!r}")
        return time.monotonic() - idle
