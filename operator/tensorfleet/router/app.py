"""The router's HTTP face: the routes (an allow-list), the inference handler's steps (refuse what the router can
itself, read and parse the body once, take an engine slot, forward the bytes, relay the answer), and the app's start,
stop and drain; the engines, placement and the relay are the other modules'. Design:
docs/architecture.md#layers-one-way-only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tensorfleet import contract
from tensorfleet.httpapi import ServerLimits, error_response
from tensorfleet.prompts import goes_on, opening_chars, prompt_text
from tensorfleet.router.adapters import REQUEST_ADAPTER, adapter_key
from tensorfleet.router.admission import CLIENT_LOG, Admission
from tensorfleet.router.budget import BodyBudget
from tensorfleet.router.config import RouterConfig
from tensorfleet.router.fleet import Fleet
from tensorfleet.router.forward import Forwarder, NoSuchModel
from tensorfleet.router.inflight import InFlight
from tensorfleet.router.metrics import CLIENT_CLOSED, RouterMetrics
from tensorfleet.router.peers import OUTCOMES as PEER_OUTCOMES
from tensorfleet.router.peers import PEER_MAX_BYTES, PeerMessageError, Peers
from tensorfleet.router.prefill import OUTCOMES as PREFILL_OUTCOMES
from tensorfleet.router.proxy import (
    GENERATION_PATHS,
    RETRY_AFTER_SECONDS,
    Body,
    Call,
    ClientGone,
    Proxy,
    reject,
)
from tensorfleet.router.proxy import first_byte_bound as _first_byte_bound
from tensorfleet.router.resume import resumable
from tensorfleet.router.scheduling import RequestInfo, hash_prompt
from tensorfleet.router.tenants import KeyRing, Limits, UsageMeter

# The names the CLI, the test helpers and the tests import from here.
__all__ = ["CLIENT_LOG", "Router", "RouterConfig"]

log = logging.getLogger("tensorfleet.router")

# The forwarded routes, an allow-list: /v1/responses (stateful), the audio endpoints (multipart) and vLLM's operational
# ones are left out on purpose (docs/security.md#clients-of-the-router).
INFERENCE_PATHS = (*GENERATION_PATHS, "/v1/embeddings", "/tokenize", "/detokenize")
# The client headers an engine gets; everything else stays at the router (Authorization too, with API keys: it
# carries the router's key then).
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id", "traceparent", "tracestate")
SHUTDOWN_STOP_SECONDS = 2.0  # after the grace: for the ended requests to write their last bytes
LINGER_SECONDS = 2.0  # a refused request's unread body is drained (and dropped) this long at most


class Router:
    """The HTTP face: what a client sends is read, refused or admitted here, then handed to the Forwarder."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.in_flight = InFlight(config)
        self.fleet = Fleet(config, self.in_flight)
        self.pool, self.strategy, self.dispatcher = self.fleet.pool, self.fleet.strategy, self.fleet.dispatcher
        self.prefill = self.fleet.prefill
        self.body_budget = BodyBudget(config.max_body_bytes_in_flight)
        # API keys: read now, so a path that cannot be read stops the router at start (KeysError).
        self.keys = KeyRing(config.api_keys) if config.api_keys else None
        if self.keys is not None:
            self.keys.load()
        self.key_limits = Limits(config.requests_per_minute, config.tokens_per_minute)
        self._forwarded = tuple(h for h in _FORWARDED_HEADERS if self.keys is None or h != hdrs.AUTHORIZATION)
        keys, dispatcher = self.keys, self.dispatcher
        # RouterMetrics reads these as it is scraped (metrics.py takes callables).
        self.metrics = RouterMetrics(self.pool, lambda: dispatcher.pending, burst=dispatcher.burst_requests,
                                     tenants=dispatcher.pending_by_tenant if keys is not None else None,
                                     keys=(lambda: len(keys.tenants)) if keys is not None else None)
        if self.fleet.kv is not None:
            self.metrics.registry.register(self.fleet.kv)
        if self.prefill is not None:
            self.metrics.prefill_outcomes(PREFILL_OUTCOMES)
        self.admission = Admission(config, self.metrics, self.body_budget, self.keys, self.key_limits)
        # Router replicas share their placements when the strategy indexes prompts (router/peers.py).
        self.peers: Peers | None = None
        if self.strategy.needs_prefix and (config.peers or config.peer_service):
            self.metrics.peer_outcomes(PEER_OUTCOMES)
            self.peers = self.fleet.share_placements(self.metrics.peer_placements)
        self.proxy = Proxy(config, self.pool, self.dispatcher, self.in_flight, self.metrics)
        self.forwarder = Forwarder(config, self.fleet, self.proxy, self.in_flight, self.metrics, self.body_budget)

    # --- app ------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        for path in INFERENCE_PATHS:
            app.router.add_post(path, self.inference)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get(contract.HEALTH_PATH, self.health)
        app.router.add_get(contract.METRICS_PATH, self.metrics_handler)
        if self.peers is not None:
            app.router.add_post(contract.ROUTER_PEER_PATH, self.peer_placements)
        # No middleware (each costs every request): the listed paths answer other methods themselves, and a
        # catch-all answers the rest. A route's own method is matched before its "*".
        for path in (*INFERENCE_PATHS, "/v1/models", contract.HEALTH_PATH, contract.METRICS_PATH):
            app.router.add_route(hdrs.METH_ANY, path, self.method_not_allowed)
        app.router.add_route(hdrs.METH_ANY, "/{tail:.*}", self.not_found)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    def limits(self) -> ServerLimits:
        """The bounds on the router's clients, for httpapi.start_site: bodies arrive undecoded (a compressed
        one is refused unread) and malformed requests log rate-limited single lines."""
        cfg = self.config
        return ServerLimits(header_timeout=cfg.header_timeout, idle_timeout=cfg.idle_timeout, decompress=False,
                            client_error_log=CLIENT_LOG, lingering_time=min(LINGER_SECONDS, cfg.body_timeout))

    async def _lifecycle(self, _: web.Application) -> AsyncIterator[None]:
        self.in_flight.open()
        self.fleet.start()
        tasks = [asyncio.create_task(self.in_flight.watchdog(), name="router-watchdog")]
        if self.keys is not None:
            tasks.append(asyncio.create_task(self._keys_loop(self.keys), name="router-api-keys"))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.fleet.stop()
        await self.in_flight.close()

    async def _keys_loop(self, keys: KeyRing) -> None:
        """Read the API keys again whenever their files changed (checked each reload interval), until cancelled."""
        while True:
            await asyncio.sleep(self.config.api_keys_reload_interval)
            if keys.refresh():
                self.key_limits.retain(keys.tenants)
                self.dispatcher.forget(keys.tenants)
                self.metrics.forget_tenants(keys.tenants)

    # --- plain endpoints ---------------------------------------------------------------
    async def peer_placements(self, request: web.Request) -> web.Response:
        """Another router replica's placements (router/peers.py): taken into the strategy's index."""
        assert self.peers is not None
        if not self.peers.allowed(request.remote):
            return reject(self.metrics, 403, f"{request.path} takes posts from this router's peers only", close=True)
        if request.content_length is None or request.content_length > PEER_MAX_BYTES:
            return reject(self.metrics, 413, f"a placements message is at most {PEER_MAX_BYTES} bytes, with a "
                                             "Content-Length", close=True)
        try:
            placements = self.peers.decode(await request.read(), self.strategy.block_chars, self.in_flight.now())
        except PeerMessageError as exc:
            return reject(self.metrics, 400, f"not a placements message: {exc}")
        self.fleet.learn_placements(placements)
        return web.Response(status=204)

    async def not_found(self, request: web.Request) -> web.Response:
        """Anything not on the allow-list: an OpenAI-style 404."""
        return reject(self.metrics, 404, f"{request.method} {request.path} is not an endpoint of this router")

    async def method_not_allowed(self, request: web.Request) -> web.Response:
        """A listed path with another method: an OpenAI-style 405."""
        resource = request.match_info.route.resource
        allowed = sorted({r.method for r in resource} - {hdrs.METH_ANY}) if resource is not None else []
        return reject(self.metrics, 405, f"{request.method} is not allowed on {request.path}; allowed: "
                                         f"{', '.join(allowed)}", headers={"Allow": ",".join(allowed)})

    async def health(self, _: web.Request) -> web.Response:
        """Always 200 while serving, draining included (see the comment)."""
        # With no engine ready the router answers requests 503 itself (or
        # queues them, during a cold start), and failing the probe would only
        # restart it; while draining it still serves.
        healthy = sum(1 for b in self.pool if b.healthy)
        return web.json_response({"status": "ok", "backends": len(self.pool), "healthy": healthy,
                                  "pending": self.dispatcher.pending, "cold_start": self.fleet.cold_start(),
                                  "draining": self.in_flight.draining})

    async def metrics_handler(self, _: web.Request) -> web.Response:
        """The router's Prometheus metrics."""
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        """The union of the engines' model lists, each model once."""
        refused = self.admission.authenticate(request)
        if isinstance(refused, web.Response):
            return refused
        models = await self.fleet.adapters.models()
        if not models:
            return error_response(503, "no engine answered /v1/models; none is ready yet",
                                  headers={"Retry-After": RETRY_AFTER_SECONDS})
        return web.json_response({"object": "list", "data": list(models.values())})

    # --- inference -----------------------------------------------------------------
    def _request_info(self, request: web.Request, body: Mapping[str, Any]) -> RequestInfo:
        info = RequestInfo(queues_prompt=body.get("stream") is True)
        if self.strategy.needs_session_key:
            key = request.headers.get(contract.SESSION_HEADER) or body.get("user")
            info.session_key = key if isinstance(key, str) and key else None
        elif self.strategy.needs_prefix:
            text, opening = prompt_text(body), opening_chars(body)
            info.prefix_hashes, info.opening, info.opening_blocks = hash_prompt(text, opening, self.strategy.block_chars)
            info.prompt_chars = len(text)
            info.opening_chars = opening or 0
            info.continues = goes_on(text, opening)
        return info

    def first_byte_bound(self, path: str, body: Mapping[str, Any]) -> float | None:
        """Seconds an engine may take to send the first byte of its answer to this request (None: no bound;
        router/proxy.py)."""
        return _first_byte_bound(self.config, path, body)

    async def inference(self, request: web.Request) -> web.StreamResponse:
        """One OpenAI API request: refused by the router, or answered by an engine. Counted in flight for the
        drain; while draining, the answer closes its connection so the client reconnects to a router that stays."""
        start = self.in_flight.now()
        code = CLIENT_CLOSED
        tenant: str | None = None
        response: web.StreamResponse
        self.in_flight.request_started()
        try:
            who = self.admission.authenticate(request)
            if isinstance(who, web.Response):
                response = who
            else:
                tenant = who
                response = await self._inference(request, start, tenant)
            code = str(response.status)
        except ClientGone as gone:
            return gone.response
        except Exception:
            # A bug, not an engine failure: still an OpenAI-shaped answer.
            log.exception("router error serving %s", request.path)
            code = "500"
            response = error_response(500, "internal router error; the router's log has the details")
        finally:
            self.metrics.request_done(code, self.in_flight.now() - start, request.get(REQUEST_ADAPTER))
            if tenant is not None and self.keys is not None and tenant in self.keys.tenants:  # still one
                self.metrics.tenant_done(tenant, code)
            self.in_flight.request_done()
        if self.in_flight.draining and not response.prepared:
            response.force_close()
        return response

    async def _inference(self, request: web.Request, start: float, tenant: str | None) -> web.StreamResponse:
        """Refuse what the router can itself (the head, then the body), parse the body once (the model, the routing
        keys, the prompt's size), and forward it: the bytes as they came but for the token counts a tracked stream
        asks its engine for (router/proxy.py), to an engine the dispatcher gives (maybe after queueing)."""
        cfg = self.config
        resource = request.match_info.route.resource
        assert resource is not None
        # The route's own path: the client's target string (an absolute-form one, say) never reaches an engine.
        path = resource.canonical
        refused = self.admission.head(request, tenant)
        if refused is not None:
            return refused
        body = Body(self.body_budget)
        meter: UsageMeter | None = None
        call: Call | None = None
        charged = 0
        try:
            parsed = await self.admission.read(request, body)
            if isinstance(parsed, web.Response):
                return parsed
            model = parsed.get("model")
            adapters = self.fleet.adapters
            adapter = await adapters.lookup(model, start)
            unresolved: str | None = None
            if cfg.model and model is not None and model != cfg.model and adapter is None:
                if not isinstance(model, str) or adapters.known():
                    return self._unknown_model(model)
                unresolved = model  # no healthy engine has listed its models yet: it may be an adapter; wait
            if adapter is not None:
                request[REQUEST_ADAPTER] = adapter
            if tenant is not None and self.key_limits.counts_tokens:
                admitted = self.admission.admit_tokens(tenant, path, parsed)
                if isinstance(admitted, web.Response):
                    return admitted
                meter, charged = admitted
            headers = {name: request.headers[name] for name in self._forwarded if name in request.headers}
            headers[hdrs.CONTENT_TYPE] = "application/json"
            info = self._request_info(request, parsed)
            if adapter is not None:
                info.adapter = adapter_key(adapter)
                info.adapter_name = adapter
                info.hosts = adapters.hosts(adapter)
            if path in GENERATION_PATHS and self.strategy.wants_tokens(self.pool.routable(), info):
                info.token_ids = await self.fleet.token_ids(path, parsed)
            call = Call(path, body, headers, info, self.first_byte_bound(path, parsed),
                        start, tenant=tenant, meter=meter, adapter=adapter, unresolved=unresolved,
                        resumable=cfg.stream_resumptions > 0 and resumable(path, parsed, len(body.data)))
            if path in GENERATION_PATHS and parsed.get("stream") is True and (call.resumable or meter is not None):
                call.ask_usage(parsed)
            if self.prefill is not None and path in GENERATION_PATHS:
                await self.forwarder.prefill(self.prefill, call, parsed)
            del parsed  # the bytes are what is forwarded; the parsed copy can go now
            try:
                return await self.forwarder.forward(request, call)
            except NoSuchModel as exc:
                return self._unknown_model(exc.model)
        finally:
            body.release()
            if meter is not None and tenant is not None:
                if call is not None and call.stream is not None:
                    meter.stream(call.stream.prompt_tokens, call.stream.tokens)
                self.admission.settle(tenant, charged, meter)

    def _unknown_model(self, model: Any) -> web.Response:
        """The 404 for a model that is neither the served one nor an adapter a healthy engine lists."""
        names = self.fleet.adapters.names
        served = f"`{self.config.model}`" + (f" and its adapters ({', '.join(sorted(names)[:20])})" if names else "")
        return reject(self.metrics, 404, f"The model `{str(model)[:200]}` does not exist; this endpoint serves "
                                         f"{served}.", param="model")

    # --- shutdown ----------------------------------------------------------------------
    async def drain(self, runner: web.AppRunner) -> None:
        """SIGTERM: keep serving for the drain delay, stop accepting, give in-flight requests the grace period,
        then end what is left (streams with an SSE error event, the rest with 503)."""
        cfg, in_flight = self.config, self.in_flight
        in_flight.draining = True
        log.info("draining: serving for %gs more, then finishing in-flight requests for up to %gs", cfg.drain_delay,
                 cfg.shutdown_grace)
        await asyncio.sleep(cfg.drain_delay)
        for site in list(runner.sites):
            await site.stop()
        server = runner.server
        if server is not None:
            for connection in server.connections:
                connection.close()  # idle ones close now, busy ones after their answer
        try:
            await asyncio.wait_for(in_flight.idle.wait(), cfg.shutdown_grace)
            log.info("drained: no request in flight")
            return
        except TimeoutError:
            pass
        log.warning("shutdown grace of %gs over: ending %d requests", cfg.shutdown_grace, in_flight.requests)
        self.dispatcher.close()
        in_flight.interrupt("shutdown")
        try:
            await asyncio.wait_for(in_flight.idle.wait(), SHUTDOWN_STOP_SECONDS)
        except TimeoutError:
            pass
