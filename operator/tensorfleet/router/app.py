"""The router's HTTP server: OpenAI API in, the chosen engine's answer out.

Request path: read the body (bounded), parse it once (model check, routing
keys), take an engine slot from the dispatcher (maybe queueing), forward the
bytes unchanged, relay the answer. Streams are relayed chunk by chunk as the
engine writes them; the client's headers are sent only once the engine's first
byte is in hand, so until then a failed engine can be replaced by another one
without the client noticing. After that, an engine failure ends the client's
stream with an explicit SSE error event: never a silent truncation. A client
that disconnects cancels its handler (see httpapi.start_site), which closes
the engine connection, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tensorfleet import contract
from tensorfleet.httpapi import SSE_CONTENT_TYPE, error_body, error_response
from tensorfleet.kube.connection import Connection, in_cluster_namespace
from tensorfleet.prompts import prompt_text
from tensorfleet.router.backends import CLOSED, Backend, BackendPool, BreakerPolicy, parse_engine_metrics
from tensorfleet.router.discovery import EndpointSliceWatcher
from tensorfleet.router.dispatch import Dispatcher, NoBackend, QueueFull, QueueTimeout
from tensorfleet.router.metrics import CLIENT_CLOSED, NO_BACKEND, RouterMetrics
from tensorfleet.router.strategies import RequestInfo, make_strategy, prefix_hashes

log = logging.getLogger("tensorfleet.router")

# Not forwarded: hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})
_RELAYED_RESPONSE_HEADERS = ("Content-Type", "Content-Encoding", "X-Request-Id")
RETRY_AFTER_SECONDS = "1"
HEALTH_TIMEOUT_SECONDS = 2.0


@dataclass
class RouterConfig:
    strategy: str = contract.DEFAULT_ROUTER_STRATEGY
    model: str | None = None
    max_concurrency_per_backend: int = 256
    max_queue: int = 0
    queue_timeout: float = 30.0
    retries: int = 2
    health_interval: float = 2.0
    connect_timeout: float = 3.0
    max_body_bytes: int = 16 * 1024 * 1024
    static_backends: tuple[str, ...] = ()
    service: str | None = None
    namespace: str | None = None
    kube: Connection | None = None  # the API server that lists `service`'s EndpointSlices
    breaker: BreakerPolicy | None = None


class _Failed(Exception):
    """An engine failed before any byte reached the client: try another."""

    def __init__(self, reason: str, message: str, final: web.Response | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.final = final


class _ClientGone(Exception):
    """The client disconnected while its answer was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = BackendPool(config.breaker)
        self.strategy = make_strategy(config.strategy)
        self.dispatcher = Dispatcher(self.pool, self.strategy, ceiling=config.max_concurrency_per_backend,
                                     max_queue=config.max_queue, queue_timeout=config.queue_timeout)
        self.metrics = RouterMetrics(self.pool, lambda: self.dispatcher.pending)
        self.pool.on_removed.append(self.strategy.forget)
        self.pool.on_ejected.append(lambda b: log.warning("ejected engine %s for %.1fs", b.url,
                                                          b.open_until - self.pool.clock()))
        self.session: aiohttp.ClientSession | None = None
        self._static: list[str] = list(config.static_backends)
        self._discovered: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- app ------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/{tail:.+}", self.inference)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get(contract.HEALTH_PATH, self.health)
        app.router.add_get(contract.METRICS_PATH, self.metrics_handler)
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, _: web.Application) -> AsyncIterator[None]:
        self._loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout,
                                        sock_connect=self.config.connect_timeout)
        # Bytes pass through untouched: no decompression, no added User-Agent.
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",))
        self._update_pool()
        tasks = [asyncio.create_task(self._health_loop(), name="router-health")]
        if self.config.service:
            namespace = self.config.namespace or in_cluster_namespace() or "default"
            connection = self.config.kube or Connection.from_environment()
            watcher = EndpointSliceWatcher(self.config.service, namespace, self._on_discovered, connection=connection)
            tasks.append(asyncio.create_task(watcher.run(), name="router-discovery"))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.session.close()

    def _on_discovered(self, urls: list[str]) -> None:
        self._discovered = urls
        self._update_pool()

    def _update_pool(self) -> None:
        self.pool.set_urls([*self._static, *self._discovered])

    # --- health and load ----------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            backends = list(self.pool)
            if backends:
                await asyncio.gather(*(self._check(b) for b in backends), return_exceptions=True)
            self.pool.tick()
            await asyncio.sleep(self.config.health_interval)

    async def _check(self, backend: Backend) -> None:
        assert self.session is not None
        if backend.state != CLOSED:
            if not backend.routable(self.pool.clock()):
                return  # ejected, or a probe is already out: nothing to learn yet
            # Past its ejection time: this check is the half-open probe.
            self.pool.begin_probe(backend)
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_SECONDS)
        try:
            async with self.session.get(backend.url + contract.HEALTH_PATH, timeout=timeout) as resp:
                ok = resp.status == 200
                await resp.read()
            if ok:
                async with self.session.get(backend.url + contract.METRICS_PATH, timeout=timeout) as resp:
                    if resp.status == 200:
                        load = parse_engine_metrics(await resp.text())
                        backend.waiting, backend.running = load.waiting, load.running
                        backend.kv_usage, backend.kv_cache_tokens = load.kv_usage, load.kv_cache_tokens
        except (aiohttp.ClientConnectorError, ConnectionError):
            self.pool.record_failure(backend, fatal=True)
            return
        except Exception:  # noqa: BLE001 - a check that fails in any way has failed
            ok = False
        if not ok:
            self.pool.record_failure(backend)
        elif backend.state != CLOSED:
            self.pool.record_success(backend)

    # --- plain endpoints ---------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        # Always 200 while serving: with no engine ready the router still
        # queues requests, and failing the probe would only restart it.
        healthy = sum(1 for b in self.pool if b.healthy)
        return web.json_response({"status": "ok", "backends": len(self.pool), "healthy": healthy,
                                  "pending": self.dispatcher.pending})

    async def metrics_handler(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def not_found(self, request: web.Request) -> web.Response:
        return error_response(404, f"{request.method} {request.path} is not an endpoint of this router")

    async def models(self, _: web.Request) -> web.Response:
        """The union of the engines' model lists, each model once."""
        assert self.session is not None
        session = self.session
        backends = [b for b in self.pool if b.healthy] or list(self.pool)

        async def one(backend: Backend) -> list[dict[str, Any]]:
            timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_SECONDS)
            async with session.get(backend.url + "/v1/models", timeout=timeout) as resp:
                if resp.status != 200:
                    return []
                body = await resp.json(content_type=None)
                return [m for m in body.get("data", []) if isinstance(m, dict) and "id" in m]

        results = await asyncio.gather(*(one(b) for b in backends), return_exceptions=True)
        models: dict[str, dict[str, Any]] = {}
        for result in results:
            if isinstance(result, list):
                for model in result:
                    models.setdefault(model["id"], model)
        if not models:
            return error_response(503, "no engine answered /v1/models; none is ready yet",
                                  headers={"Retry-After": RETRY_AFTER_SECONDS})
        return web.json_response({"object": "list", "data": list(models.values())})

    # --- inference -----------------------------------------------------------------
    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _request_info(self, request: web.Request, body: Mapping[str, Any]) -> RequestInfo:
        info = RequestInfo()
        if self.strategy.name == "session":
            key = request.headers.get(contract.SESSION_HEADER) or body.get("user")
            info.session_key = key if isinstance(key, str) and key else None
        elif self.strategy.needs_prefix:
            info.prefix_hashes = prefix_hashes(prompt_text(body))
        return info

    async def inference(self, request: web.Request) -> web.StreamResponse:
        start = self._now()
        code = CLIENT_CLOSED
        try:
            response = await self._inference(request)
            code = str(response.status)
            return response
        except _ClientGone as gone:
            return gone.response
        except Exception:
            # A bug, not an engine failure: still an OpenAI-shaped answer.
            log.exception("router error serving %s", request.path)
            code = "500"
            return error_response(500, "internal router error; the router's log has the details")
        finally:
            self.metrics.request_done(code, self._now() - start)

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        start = self._now()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._reject(413, f"request body exceeds the router's limit of {self.config.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return self._reject(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return self._reject(400, "request body must be a JSON object")
        model = body.get("model")
        if self.config.model and model is not None and model != self.config.model:
            return self._reject(404, f"The model `{model}` does not exist; this endpoint serves "
                                     f"`{self.config.model}`.", param="model")
        info = self._request_info(request, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        target = request.raw_path
        tried: set[str] = set()
        failure: _Failed | None = None
        for attempt in range(self.config.retries + 1):
            try:
                backend = await self.dispatcher.acquire(info, frozenset(tried))
            except QueueFull:
                return self._reject(429, f"the router's queue is full ({self.dispatcher.max_queue} requests waiting "
                                         "for an engine); retry later", headers={"Retry-After": RETRY_AFTER_SECONDS})
            except QueueTimeout:
                healthy = sum(1 for b in self.pool if b.healthy)
                return self._reject(503, f"no engine could take the request within {self.config.queue_timeout:g}s "
                                         f"({len(self.pool)} engines, {healthy} healthy); the service is overloaded "
                                         "or starting, retry later", headers={"Retry-After": RETRY_AFTER_SECONDS})
            except NoBackend:
                break
            tried.add(backend.url)
            code = CLIENT_CLOSED
            try:
                response = await self._forward(request, backend, raw, headers, target, start)
                code = str(response.status)
                return response
            except _Failed as exc:
                failure = exc
                code = str(exc.final.status) if exc.final is not None else "502"
                if attempt < self.config.retries:
                    self.metrics.retry(exc.reason)
                    log.info("engine %s failed before the first byte (%s); retrying elsewhere", backend.url, exc)
            finally:
                self.dispatcher.release(backend)
                self.metrics.attempt_done(backend.url, code)
        if failure is not None and failure.final is not None:
            return failure.final
        reason = f": {failure}" if failure else ""
        return self._reject(502, f"no engine could serve the request{reason}")

    def _reject(self, status: int, message: str, *, param: str | None = None,
                headers: Mapping[str, str] | None = None) -> web.Response:
        """An answer the router gives itself (counted against no engine)."""
        self.metrics.attempt_done(NO_BACKEND, str(status))
        return error_response(status, message, param=param, headers=headers)

    async def _forward(self, request: web.Request, backend: Backend, raw: bytes, headers: Mapping[str, str],
                       target: str, start: float) -> web.StreamResponse:
        assert self.session is not None
        try:
            upstream = await self.session.post(backend.url + target, data=raw, headers=headers)
        except (aiohttp.ClientConnectorError, ConnectionError) as exc:
            self.pool.record_failure(backend, fatal=True)
            raise _Failed("connect", f"cannot connect to {backend.url}: {exc}") from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.pool.record_failure(backend)
            raise _Failed("upstream", f"{backend.url} failed before answering: {exc!r}") from None
        try:
            if upstream.status >= 500:
                try:
                    payload = await upstream.read()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self.pool.record_failure(backend, fatal=True)
                    raise _Failed("upstream", f"{backend.url} failed mid-answer: {exc!r}") from None
                self.pool.record_failure(backend)
                final = web.Response(body=payload, status=upstream.status, headers=self._relay_headers(upstream, backend))
                raise _Failed("status", f"{backend.url} answered HTTP {upstream.status}", final)
            if upstream.headers.get("Content-Type", "").startswith(SSE_CONTENT_TYPE):
                return await self._relay_stream(request, backend, upstream, start)
            try:
                payload = await upstream.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.pool.record_failure(backend, fatal=True)
                raise _Failed("upstream", f"{backend.url} failed mid-answer: {exc!r}") from None
            self.pool.record_success(backend)
            return web.Response(body=payload, status=upstream.status, headers=self._relay_headers(upstream, backend))
        finally:
            # close(), not release(): an unfinished answer must drop the
            # connection, which is what tells the engine to abort.
            if not upstream.closed and not upstream.content.is_eof():
                upstream.close()
            else:
                upstream.release()

    def _relay_headers(self, upstream: aiohttp.ClientResponse, backend: Backend) -> dict[str, str]:
        out = {name: upstream.headers[name] for name in _RELAYED_RESPONSE_HEADERS if name in upstream.headers}
        out[contract.BACKEND_HEADER] = backend.url
        return out

    async def _relay_stream(self, request: web.Request, backend: Backend, upstream: aiohttp.ClientResponse,
                            start: float) -> web.StreamResponse:
        content = upstream.content
        try:
            first = await content.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.pool.record_failure(backend, fatal=True)
            raise _Failed("upstream", f"{backend.url} failed before its first token: {exc!r}") from None
        if not first:
            self.pool.record_failure(backend)
            raise _Failed("upstream", f"{backend.url} ended the stream before sending anything")
        response = web.StreamResponse(status=upstream.status, headers={
            **self._relay_headers(upstream, backend), "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            await response.write(first)
            self.metrics.first_byte(self._now() - start)
            tail = first[-2:]
            while True:
                try:
                    chunk = await content.readany()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self.pool.record_failure(backend, fatal=True)
                    self.metrics.stream_error(backend)
                    log.warning("engine %s failed mid-stream: %r", backend.url, exc)
                    await self._stream_error(response, tail, f"the engine serving this request ({backend.url}) failed "
                                                             f"mid-stream ({exc.__class__.__name__}); the answer is "
                                                             "incomplete")
                    return response
                if not chunk:
                    break
                await response.write(chunk)
                tail = chunk[-2:] if len(chunk) >= 2 else tail[-1:] + chunk
            self.pool.record_success(backend)
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            # The client went away between two chunks (a write failed rather
            # than the handler being cancelled); the engine is fine.
            raise _ClientGone(response) from None
        return response

    async def _stream_error(self, response: web.StreamResponse, tail: bytes, message: str) -> None:
        # Close the event the engine was in the middle of, then send an error
        # event the openai SDK raises on, and end the stream.
        prefix = b"" if tail.endswith(b"\n\n") else b"\n\n"
        event = json.dumps(error_body(502, message, type_="upstream_error")).encode()
        try:
            await response.write(prefix + b"data: " + event + b"\n\n")
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass
