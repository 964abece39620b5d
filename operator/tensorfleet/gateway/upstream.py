"""One request from the gateway to an InferenceService's router: wait for a ready router (a new InferenceService's
router is starting), send the body to the least busy one (another on a refused connection: nothing reached it),
and relay the answer, whole or as a stream, with its status and the headers that matter to clients; a stream whose
tokens count against a key's limit is read on its way through (router/relay.py). Design:
docs/gateway.md#forwarding.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from tensorfleet import contract
from tensorfleet.gateway.config import GatewayConfig
from tensorfleet.gateway.table import ModelTable, Service
from tensorfleet.gateway.watch import Changes
from tensorfleet.httpapi import SSE_CONTENT_TYPE, post_resending_once
from tensorfleet.router.clients import RETRY_AFTER_SECONDS, ClientGone, ClientMetrics, reject, stream_error
from tensorfleet.router.relay import RelayedStream
from tensorfleet.router.tenants import UsageMeter

log = logging.getLogger("tensorfleet.gateway")

_RELAYED_HEADERS = ("Content-Type", "Content-Encoding", "X-Request-Id", "Retry-After", "WWW-Authenticate")


class Upstream:
    """The routers' connections (one session while the app runs) and the requests in flight on each router."""

    def __init__(self, config: GatewayConfig, table: ModelTable, changes: Changes, metrics: ClientMetrics) -> None:
        self.config = config
        self.table = table
        self.changes = changes
        self.metrics = metrics
        self.busy: dict[str, int] = {}
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=contract.ENGINE_CLIENT_KEEP_ALIVE_S)
        # Bytes pass through untouched; no cookie jar: the session is shared by every client.
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              skip_auto_headers=("User-Agent",), cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def routers(self, service: Service) -> tuple[str, ...]:
        """SERVICE's ready routers, least busy first, once it has any; () if none is ready within the cold-start
        timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.cold_start_timeout
        while not (urls := self.table.router_urls(service.key)):
            left = deadline - loop.time()
            if left <= 0:
                return ()
            await self.changes.wait(left)
        return tuple(sorted(urls, key=lambda url: self.busy.get(url, 0)))

    async def forward(self, request: web.Request, service: Service, path: str, data: bytes | bytearray,
                      headers: dict[str, str], *, start: float, relay: RelayedStream | None = None,
                      meter: UsageMeter | None = None) -> web.StreamResponse:
        """Send the request to one of SERVICE's routers and relay its answer to the client."""
        cfg = self.config
        assert self._session is not None
        urls = await self.routers(service)
        if not urls:
            return reject(self.metrics, 503, f"no router of InferenceService {service.label} became ready within "
                                             f"{cfg.cold_start_timeout:g}s; retry later",
                          headers={"Retry-After": RETRY_AFTER_SECONDS})
        timeout = aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout, sock_connect=cfg.connect_timeout,
                                        sock_read=cfg.first_byte_timeout)
        refused: list[str] = []
        for url in urls:
            self.busy[url] = self.busy.get(url, 0) + 1
            try:
                try:
                    upstream = await post_resending_once(self._session, url + path, data=data, headers=headers,
                                                         timeout=timeout)
                except aiohttp.ClientConnectorError as exc:
                    log.warning("router %s of %s: %s; trying another", url, service.label, exc)
                    refused.append(url)
                    continue
                except (aiohttp.ClientError, TimeoutError) as exc:
                    log.warning("router %s of %s failed before answering: %s", url, service.label, exc)
                    return reject(self.metrics, 502, f"the router of InferenceService {service.label} failed before "
                                                     "answering; retry the request",
                                  headers={"Retry-After": RETRY_AFTER_SECONDS})
                async with upstream:
                    return await self._relay(request, upstream, service, start, relay, meter)
            finally:
                self.busy[url] -= 1
                if not self.busy[url]:
                    del self.busy[url]
        return reject(self.metrics, 503, f"the routers of InferenceService {service.label} refused the connection; "
                                         "retry the request", headers={"Retry-After": RETRY_AFTER_SECONDS})

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, service: Service, start: float,
                     relay: RelayedStream | None, meter: UsageMeter | None) -> web.StreamResponse:
        headers = {name: upstream.headers[name] for name in _RELAYED_HEADERS if name in upstream.headers}
        if self.config.backend_header:
            headers[contract.BACKEND_HEADER] = service.label
        self.metrics.attempt_done(service.label, str(upstream.status))
        loop = asyncio.get_running_loop()
        if not upstream.headers.get("Content-Type", "").startswith(SSE_CONTENT_TYPE):
            payload = await upstream.read()
            if meter is not None:
                meter.answer(upstream.status, payload)
            return web.Response(status=upstream.status, body=payload, headers=headers)
        response = web.StreamResponse(status=upstream.status, headers={**headers, "Cache-Control": "no-cache"})
        await response.prepare(request)
        first = True
        tail = b""
        writing = False
        try:
            # One bound for both sides: the router quiet, or the client taking nothing, that long ends the stream.
            async with asyncio.timeout(None) as idle:
                while True:
                    idle.reschedule(loop.time() + self.config.stream_idle_timeout)
                    chunk = await upstream.content.readany()
                    if not chunk:
                        break
                    out = relay.feed(chunk) if relay is not None else chunk
                    if out:
                        tail = out
                        if first:
                            self.metrics.first_byte(loop.time() - start)
                            first = False
                        writing = True
                        try:
                            await response.write(out)
                        except (ConnectionError, aiohttp.ClientConnectionResetError):
                            raise ClientGone(response) from None
                        writing = False
            if relay is not None and (left := relay.leftover()):
                await response.write(left)
            await response.write_eof()
        except TimeoutError:
            if writing:  # the client reads nothing: drop it, which ends the router's request too
                if request.transport is not None:
                    request.transport.abort()
                raise ClientGone(response) from None
            await stream_error(response, tail, 504, f"the router of InferenceService {service.label} sent nothing "
                                                    f"for {self.config.stream_idle_timeout:g}s")
        except (aiohttp.ClientError, ConnectionError) as exc:
            log.warning("stream from the router of %s broke: %s", service.label, exc)
            await stream_error(response, tail, 502, f"the router of InferenceService {service.label} broke the "
                                                    "stream")
        finally:
            if meter is not None and relay is not None:
                meter.stream(relay.prompt_tokens, relay.tokens)
        return response
