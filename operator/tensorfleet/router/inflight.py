"""What the router has in flight with its engines: the connections, the requests (for the drain) and each attempt on an
engine, so the watchdog, an ejection as unresponsive or the shutdown can end an attempt wherever it is: before its
first byte, mid-stream, or by dropping a client that reads nothing. Design: docs/routing.md#timeouts-and-shutdown.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp

from tensorfleet import contract
from tensorfleet.router.backends import Backend
from tensorfleet.router.clients import Requests
from tensorfleet.router.config import RouterConfig


class Interrupted(Exception):
    """Set on an engine stream's reader to end its relay: `stalled`, `unresponsive` or `shutdown`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Attempt:
    """One request on one engine, visible to the watchdog, to ejections and to the shutdown."""

    backend: Backend
    loop: asyncio.AbstractEventLoop
    timer: asyncio.Timeout | None = None      # while waiting for the engine's first byte
    upstream: aiohttp.ClientResponse | None = None
    client: asyncio.Transport | None = None
    streaming: bool = False                   # relaying a stream: the client has bytes
    writing: bool = False                     # waiting for the client to take a chunk
    last: float = 0.0                         # the stream's last progress (loop time)
    reason: str | None = field(default=None)  # why it was interrupted

    def interrupt(self, reason: str) -> None:
        """End the attempt: before its first byte through its timer (TimeoutError), mid-stream through its reader
        (Interrupted) or, when the client is the one not reading, by dropping the client."""
        if self.reason is not None:
            return
        self.reason = reason
        if self.timer is not None:
            self.timer.reschedule(self.loop.time())
        elif self.streaming and self.writing:
            if self.client is not None:
                self.client.abort()
        elif self.streaming and self.upstream is not None:
            self.upstream.content.set_exception(Interrupted(reason))


class InFlight(Requests):
    """The engine connections (one session, open while the app runs), the inference requests being handled (for
    the drain and the demand Lease) and their attempts on engines. One is shared by the router's parts: router/app.py
    counts requests and drains, fleet.py interrupts the attempts of an engine ejected as unresponsive, proxy.py
    registers each attempt and streams through it."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__()
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self.attempts: set[Attempt] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None
        return self._session

    def open(self) -> None:
        """Start taking traffic: in the app's event loop, as it starts."""
        self._loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=contract.ENGINE_CLIENT_KEEP_ALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout,
                                        sock_connect=self.config.connect_timeout)
        # Bytes pass through untouched: no decompression, no added User-Agent. No cookie jar: the session is
        # shared by every client, so a cookie an engine (or a proxy before it) set must not ride on others' requests.
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                              skip_auto_headers=("User-Agent",), cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def now(self) -> float:
        """The event loop's clock, which the attempts' timers and the streams' progress are measured on."""
        assert self._loop is not None
        return self._loop.time()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    def engine_unresponsive(self, backend: Backend) -> None:
        """BACKEND was ejected for not answering its health check: nothing will come from it, so requests waiting
        for its first byte go elsewhere now, and its streams that have been quiet as long as its health check end."""
        if self._loop is None:
            return
        now = self.now()
        for attempt in [a for a in self.attempts if a.backend is backend]:
            if attempt.timer is not None or (attempt.streaming and not attempt.writing
                                              and now - attempt.last >= self.config.health_timeout):
                attempt.interrupt("unresponsive")

    def interrupt(self, reason: str) -> None:
        """End every attempt (the shutdown grace is over)."""
        for attempt in list(self.attempts):
            attempt.interrupt(reason)

    async def watchdog(self) -> None:
        """End streams that stalled: the engine sent nothing, or the client took nothing, for the idle timeout;
        and streams of an engine ejected as unresponsive that have been quiet as long as its health check (it
        was ejected after they last heard from it)."""
        limit = self.config.stream_idle_timeout
        hung = self.config.health_timeout
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = self.now()
            for attempt in [a for a in self.attempts if a.streaming]:
                quiet = now - attempt.last
                if quiet > limit:
                    attempt.interrupt("stalled")
                elif (quiet >= hung and not attempt.writing and attempt.backend.breaker.unresponsive
                      and not attempt.backend.healthy):
                    attempt.interrupt("unresponsive")
