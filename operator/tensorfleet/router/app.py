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

from tensorfleet import contract
from tensorfleet.httpapi import error_response
from tensorfleet.prompts import goes_on, opening_chars, prompt_text
from tensorfleet.router.adapters import REQUEST_ADAPTER, adapter_key
from tensorfleet.router.admission import Admission
from tensorfleet.router.budget import Body, BodyBudget
from tensorfleet.router.clients import (
    CLIENT_LOG,
    GENERATION_PATHS,
    RETRY_AFTER_SECONDS,
    drain,
    openai_app,
    reject,
)
from tensorfleet.router.config import RouterConfig
from tensorfleet.router.fleet import Fleet
from tensorfleet.router.forward import Forwarder, NoSuchModel
from tensorfleet.router.inflight import InFlight
from tensorfleet.router.metrics import RouterMetrics
from tensorfleet.router.peers import OUTCOMES as PEER_OUTCOMES
from tensorfleet.router.peers import PEER_MAX_BYTES, PeerMessageError, Peers
from tensorfleet.router.prefill import OUTCOMES as PREFILL_OUTCOMES
from tensorfleet.router.proxy import Call, Proxy
from tensorfleet.router.proxy import first_byte_bound as _first_byte_bound
from tensorfleet.router.resume import resumable
from tensorfleet.router.scheduling import RequestInfo, exposure, hash_prompt
from tensorfleet.router.tenants import UsageMeter, open_keys
from tensorfleet.router.tokencount import stated_max_tokens
from tensorfleet.router.yielding import YIELD_OUTCOMES

# The names the CLI, the test helpers and the tests import from here.
__all__ = ["CLIENT_LOG", "Router", "RouterConfig"]

log = logging.getLogger("tensorfleet.router")

# The client headers an engine gets; everything else stays at the router (Authorization too, with API keys: it
# carries the router's key then).
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id", "traceparent", "tracestate")
SHUTDOWN_STOP_SECONDS = 2.0  # after the grace: for the ended requests to write their last bytes


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
        self.keys = open_keys(config.api_keys)
        self._forwarded = tuple(h for h in _FORWARDED_HEADERS if self.keys is None or h != hdrs.AUTHORIZATION)
        keys, dispatcher = self.keys, self.dispatcher
        # RouterMetrics reads these as it is scraped (metrics.py takes callables).
        self.metrics = RouterMetrics(self.pool, lambda: dispatcher.pending, burst=dispatcher.limits.burst_requests,
                                     tenants=dispatcher.pending_by_tenant if keys is not None else None,
                                     keys=(lambda: len(keys.tenants)) if keys is not None else None)
        if self.fleet.kv is not None:
            self.metrics.registry.register(self.fleet.kv)
        if self.prefill is not None:
            self.metrics.prefill_outcomes(PREFILL_OUTCOMES)
        self.admission = Admission(config, self.metrics, self.body_budget, self.keys)
        self.key_limits = self.admission.key_limits
        # Router replicas share their placements when the strategy indexes prompts (router/peers.py).
        self.peers: Peers | None = None
        if self.strategy.needs_prefix and (config.peers or config.peer_service):
            self.metrics.peer_outcomes(PEER_OUTCOMES)
            self.peers = self.fleet.share_placements(self.metrics.peer_placements)
            if self.strategy.orders_queue:
                self.metrics.peer_yield_outcomes(YIELD_OUTCOMES)
                self.dispatcher.yielding.on_end = self.metrics.peer_yield
        self.proxy = Proxy(config, self.pool, self.dispatcher, self.in_flight, self.metrics)
        self.forwarder = Forwarder(config, self.fleet, self.proxy, self.in_flight, self.metrics, self.body_budget)

    # --- app ------------------------------------------------------------------
    def app(self) -> web.Application:
        posts = {contract.ROUTER_PEER_PATH: self.peer_placements} if self.peers is not None else {}
        app = openai_app(self.config, self.metrics, "router", inference=self.inference, models=self.models,
                         health=self.health, posts=posts)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, _: web.Application) -> AsyncIterator[None]:
        self.in_flight.open()
        self.fleet.start()
        tasks = [asyncio.create_task(self.in_flight.watchdog(), name="router-watchdog")]
        if self.keys is not None:
            tasks.append(asyncio.create_task(self.admission.follow_keys(self.dispatcher.forget),
                                             name="router-api-keys"))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.fleet.stop()
        await self.in_flight.close()

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

    async def health(self, _: web.Request) -> web.Response:
        """Always 200 while serving, draining included (see the comment)."""
        # With no engine ready the router answers requests 503 itself (or
        # queues them, during a cold start), and failing the probe would only
        # restart it; while draining it still serves.
        healthy = sum(1 for b in self.pool if b.healthy)
        return web.json_response({"status": "ok", "backends": len(self.pool), "healthy": healthy,
                                  "pending": self.dispatcher.pending, "cold_start": self.fleet.cold_start(),
                                  "draining": self.in_flight.draining})

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
    def _request_info(self, request: web.Request, path: str, body: Mapping[str, Any]) -> RequestInfo:
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
        if self.strategy.places_by_prefill:
            info.exposure = exposure(stated_max_tokens(body), path in GENERATION_PATHS)
        return info

    def first_byte_bound(self, path: str, body: Mapping[str, Any]) -> float | None:
        """Seconds an engine may take to send the first byte of its answer to this request (None: no bound;
        router/proxy.py)."""
        return _first_byte_bound(self.config, path, body)

    async def inference(self, request: web.Request) -> web.StreamResponse:
        """One OpenAI API request: refused by the router, or answered by an engine (Admission.serve)."""
        in_flight, metrics = self.in_flight, self.metrics

        def done(code: str, seconds: float) -> None:
            metrics.adapter_done(request.get(REQUEST_ADAPTER), code, seconds)

        return await self.admission.serve(request, in_flight, self._inference, in_flight.now, who="router", done=done)

    async def _inference(self, request: web.Request, start: float, tenant: str | None) -> web.StreamResponse:
        """Refuse what the router can itself (the head, then the body), parse the body once (the model, the routing
        keys, the prompt's size), and forward it: the bytes as they came but for the token counts a tracked stream
        asks its engine for (router/proxy.py), to an engine the dispatcher gives (maybe after queueing)."""
        cfg = self.config
        resource = request.match_info.route.resource
        assert resource is not None
        # The route's own path: the client's target string (an absolute-form one, say) never reaches an engine.
        path = resource.canonical
        body = Body(self.body_budget)
        meter: UsageMeter | None = None
        call: Call | None = None
        charged = 0
        try:
            parsed = await self.admission.receive(request, tenant, body)
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
            info = self._request_info(request, path, parsed)
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
        if await drain(runner, in_flight, cfg.drain_delay, cfg.shutdown_grace, log):
            return
        self.dispatcher.close()
        in_flight.interrupt("shutdown")
        try:
            await asyncio.wait_for(in_flight.idle.wait(), SHUTDOWN_STOP_SECONDS)
        except TimeoutError:
            pass
