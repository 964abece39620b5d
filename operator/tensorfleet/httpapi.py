"""OpenAI-compatible HTTP pieces shared by the router and the engine simulator: error bodies in OpenAI's shape,
server-sent events, the one retry of a POST, a rate-limited log, and `ServerLimits`, the bounds for a server facing
untrusted clients. Imported only by the long-running commands, so aiohttp is a top-level import here. Design:
docs/security.md#clients-of-the-router."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("tensorfleet")

# The `type` OpenAI and vLLM put in the error body for each status.
ERROR_TYPES: Mapping[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    408: "BadRequestError",
    413: "BadRequestError",
    415: "BadRequestError",
    422: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

SSE_CONTENT_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"


def error_body(status: int, message: str, *, type_: str | None = None, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error shape, which vLLM uses too: `{"error": {"message", "type", "param", "code"}}`. Clients (the
    openai SDK, LangChain, curl users) parse it; a plain-text 500 breaks them."""
    return {"error": {
        "message": message,
        "type": type_ or ERROR_TYPES.get(status, "APIError"),
        "param": param,
        "code": status if code is None else code,
    }}


def error_response(status: int, message: str, *, type_: str | None = None, param: str | None = None,
                   code: str | int | None = None, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(error_body(status, message, type_=type_, param=param, code=code)).encode(),
        content_type="application/json",
        headers=headers,
    )


def sse_event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def post_resending_once(session: aiohttp.ClientSession, url: str, *,
                              on_resend: Callable[[BaseException], None] | None = None,
                              **kwargs: Any) -> aiohttp.ClientResponse:
    """POST, and once more on a new connection if the peer hung up before answering anything.

    A server's keep-alive clock starts when it has sent an answer and ours when we have read it, so on a busy
    host a pooled connection can close under the next request: nothing reached the peer, so sending again is
    safe, and no fault of the peer's. A peer that did die refuses the new connection (ClientConnectorError),
    which the caller sees as it should."""
    try:
        return await session.post(url, **kwargs)
    except aiohttp.ClientConnectorError:
        raise
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        if on_resend is not None:
            on_resend(exc)
    return await session.post(url, **kwargs)


def install_fast_loop() -> bool:
    """Use uvloop when the `fast` extra is installed; returns whether it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


# --- untrusted clients -------------------------------------------------------------

class RateLimitedLog(logging.Filter):
    """A logger filter for lines clients can trigger at will: at most `burst` lines at once, then
    `per_second`; the next line that passes says how many were dropped. A record with a traceback
    (aiohttp's "Error handling request" for a malformed request) becomes one INFO line naming the
    exception: the client's mistake, not the server's error. Malformed requests must not fill the
    disk or hide real errors."""

    def __init__(self, *, per_second: float = 1.0, burst: int = 10, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.per_second = per_second
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.last = clock()
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        downgrade = bool(record.exc_info and record.exc_info[1] is not None)
        if downgrade and not logging.getLogger(record.name).isEnabledFor(logging.INFO):
            return False
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.last) * self.per_second)
        self.last = now
        if self.tokens < 1.0:
            self.suppressed += 1
            return False
        self.tokens -= 1.0
        message = record.getMessage()
        if downgrade:
            assert record.exc_info is not None and record.exc_info[1] is not None
            exc = record.exc_info[1]
            detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            message += f": {exc.__class__.__name__}" + (f": {detail[:200]}" if detail else "")
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        if self.suppressed:
            message += f" ({self.suppressed} similar lines dropped)"
            self.suppressed = 0
        record.msg, record.args = message, None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def rate_limited_logger(name: str, *, per_second: float = 1.0, burst: int = 10) -> logging.Logger:
    """The logger NAME with a RateLimitedLog filter (added once)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RateLimitedLog) for f in logger.filters):
        logger.addFilter(RateLimitedLog(per_second=per_second, burst=burst))
    return logger


@dataclass(frozen=True)
class ServerLimits:
    """Bounds for a server facing untrusted clients (None: aiohttp's behaviour).

    header_timeout: seconds from a request head's first byte to its end, and from a new connection to
        its first request's first byte; past it (by up to a quarter more: a sweep enforces it) the
        connection gets 408 and is closed (slowloris).
    idle_timeout: seconds a keep-alive connection may sit between requests before it is closed.
    decompress: whether aiohttp decodes `Content-Encoding` request bodies before the handler reads them;
        False hands the handler the bytes as sent, so it can refuse them unread.
    client_error_log: a logger name; aiohttp's lines about malformed requests go there, rate-limited
        and without tracebacks.
    lingering_time: seconds the rest of an unread request body is still read (and dropped) after the
        answer, so the client can send it and read the answer; then the connection is closed.
    """

    header_timeout: float | None = None
    idle_timeout: float | None = None
    decompress: bool = True
    client_error_log: str | None = None
    lingering_time: float | None = None

    def handler_options(self) -> dict[str, Any]:
        """Keyword arguments for aiohttp's per-connection RequestHandler."""
        options: dict[str, Any] = {}
        if self.idle_timeout is not None:
            options["keepalive_timeout"] = self.idle_timeout
        if not self.decompress:
            options["auto_decompress"] = False
        if self.client_error_log:
            options["logger"] = rate_limited_logger(self.client_error_log)
        if self.lingering_time is not None:
            options["lingering_time"] = self.lingering_time
        return options


_HEAD_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n")


class _Connection(asyncio.Protocol):
    """One client connection: aiohttp's RequestHandler behind a deadline on the request head.

    aiohttp has no timeout on reading a request head, only on the idle time between requests, so a
    client that sends one header byte at a time holds its connection (and the buffered head) for as
    long as it likes. The deadline starts at the connection's opening and at the first byte of each
    later request; the guard's middleware ends it when the head has been parsed. The guard's sweep
    enforces it (no timer per request: a request costs one clock read here)."""

    def __init__(self, inner: asyncio.Protocol, guard: _HeadGuard) -> None:
        self.inner = inner
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.awaiting_head = True
        self.head_since: float | None = None  # loop time of the awaited head's first byte (or of the opening)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream server's transports are Transports
        self.head_since = self.guard.added(self, transport)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.awaiting_head and self.head_since is None:
            self.head_since = self.guard.clock()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.guard.connections.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def head_done(self) -> None:
        self.awaiting_head = False
        self.head_since = None

    def request_done(self) -> None:
        self.awaiting_head = True  # the next request's first byte starts its deadline

    def expire(self) -> None:
        """The head is late: answer 408 and close."""
        transport = self.transport
        self.head_since = None
        if transport is None or transport.is_closing():
            return
        body = json.dumps(error_body(408, f"the request head did not arrive within {self.guard.timeout:g}s")).encode()
        transport.write(_HEAD_TIMEOUT_RESPONSE % len(body) + body)
        transport.close()
        if self.guard.log is not None:
            self.guard.log.info("closed a connection from %s: no complete request head within %gs",
                                transport.get_extra_info("peername"), self.guard.timeout)


class _HeadGuard:
    """Connections' head deadlines: wraps the server's protocol factory, a middleware marks heads parsed, and a
    sweep (every quarter of the timeout, while there are connections) closes those whose head is late."""

    def __init__(self, timeout: float, log: logging.Logger | None) -> None:
        self.timeout = timeout
        self.log = log
        self.connections: dict[asyncio.BaseTransport, _Connection] = {}
        self.clock: Callable[[], float] = time.monotonic
        self._sweeper: asyncio.Task[None] | None = None

    def added(self, connection: _Connection, transport: asyncio.BaseTransport) -> float:
        """Track a new connection; the loop time its first head's deadline counts from."""
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        self.connections[transport] = connection
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep(), name="head-timeout-sweep")
        return loop.time()

    async def _sweep(self) -> None:
        """Close connections whose head is late, until none is left to watch."""
        while self.connections:
            await asyncio.sleep(self.timeout / 4)
            deadline = self.clock() - self.timeout
            for connection in [c for c in self.connections.values() if c.awaiting_head and c.head_since is not None
                               and c.head_since <= deadline]:
                connection.expire()

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        """Ends the head deadline of the request's connection while its handler runs."""
        connection = self.connections.get(request.transport) if request.transport is not None else None
        if connection is not None:
            connection.head_done()
        try:
            return await handler(request)
        finally:
            if connection is not None:
                connection.request_done()


class _GuardedFactory:
    """aiohttp's Server as a protocol factory whose connections are wrapped; everything else passes through."""

    def __init__(self, server: Any, guard: _HeadGuard) -> None:
        self._server = server
        self._guard = guard

    def __call__(self) -> asyncio.Protocol:
        return _Connection(self._server(), self._guard)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class _GuardedRunner(web.AppRunner):
    """An AppRunner whose sites serve wrapped connections (sites take their protocol factory from `server`)."""

    def __init__(self, app: web.Application, guard: _HeadGuard, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._guard = guard

    @property
    def server(self) -> Any:
        server = super().server
        return None if server is None else _GuardedFactory(server, self._guard)

    async def cleanup(self) -> None:
        await super().cleanup()
        self._guard.stop()


async def start_site(app: web.Application, host: str, port: int, *, limits: ServerLimits | None = None
                     ) -> web.AppRunner:
    """Serve `app`; the caller owns the runner (`await runner.cleanup()`).

    handler_cancellation: a client that hangs up cancels its handler, which is
    how a disconnect reaches the engine and frees its GPU time (and how the
    router's counters go back down). aiohttp leaves it off by default.
    """
    limits = limits or ServerLimits()
    options: dict[str, Any] = {"handler_cancellation": True, "access_log": None, "shutdown_timeout": 5.0,
                               **limits.handler_options()}
    runner: web.AppRunner
    if limits.header_timeout is not None:
        guard = _HeadGuard(limits.header_timeout, logging.getLogger(limits.client_error_log)
                           if limits.client_error_log else None)
        app.middlewares.insert(0, guard.middleware)
        runner = _GuardedRunner(app, guard, **options)
    else:
        runner = web.AppRunner(app, **options)
    await runner.setup()
    # reuse_address: a restarted process can bind at once despite TIME_WAIT.
    site = web.TCPSite(runner, host, port, backlog=2048, reuse_address=True)
    await site.start()
    return runner


def run_server(make_app: Callable[[], Awaitable[web.Application]], host: str, port: int,
               describe: str, *, limits: ServerLimits | None = None,
               drain: Callable[[web.AppRunner], Coroutine[Any, Any, None]] | None = None) -> int:
    """Run an app until SIGTERM/SIGINT (what Kubernetes sends), then drain.

    `drain`, when given, runs between the signal and the runner's cleanup (which stops accepting and
    cancels what is left after a few seconds); a second signal cuts it short.
    """
    fast = install_fast_loop()

    async def main() -> None:
        app = await make_app()
        runner = await start_site(app, host, port, limits=limits)
        log.info("%s listening on %s:%d (event loop: %s)", describe, host, port, "uvloop" if fast else "asyncio")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        if drain is not None:
            stop.clear()
            draining = asyncio.create_task(drain(runner), name="drain")
            again = asyncio.create_task(stop.wait(), name="second-signal")
            await asyncio.wait({draining, again}, return_when=asyncio.FIRST_COMPLETED)
            again.cancel()
            if not draining.done():
                log.warning("%s: second signal, stopping without finishing the drain", describe)
                draining.cancel()
            await asyncio.gather(draining, again, return_exceptions=True)
        log.info("%s shutting down", describe)
        await runner.cleanup()

    asyncio.run(main())
    return 0


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
