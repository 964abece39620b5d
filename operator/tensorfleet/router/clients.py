"""What the router and the gateway (tensorfleet/gateway) share facing their clients: the OpenAI paths they forward,
the metrics of the requests they answer, per status, per tenant and per refusal (ClientMetrics, names from
contract.ClientMetricNames), `reject`, the OpenAI-style answer either gives itself, and the drain at SIGTERM
(Requests, drain), and the app both serve (`openai_app`: the allow-list of routes). Design:
docs/gateway.md#one-implementation-of-the-client-side.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping

import aiohttp
from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from tensorfleet import contract
from tensorfleet.httpapi import ServerLimits, error_body, error_response
from tensorfleet.router.config import ClientConfig

CLIENT_LOG = "tensorfleet.router.clients"  # what clients can trigger at will: rate-limited, no tracebacks

# The generation endpoints: forwarded, with a first-byte bound and token accounting for their answers.
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
# The forwarded routes, an allow-list: /v1/responses (stateful), the audio endpoints (multipart) and vLLM's operational
# ones are left out on purpose (docs/security.md#clients-of-the-router).
INFERENCE_PATHS = (*GENERATION_PATHS, "/v1/embeddings", "/tokenize", "/detokenize")
LINGER_SECONDS = 2.0  # a refused request's unread body is drained (and dropped) this long at most
RETRY_AFTER_SECONDS = "1"
# Latency of an answer: sub-millisecond errors up to minutes-long generations.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0, 160.0, 320.0, 640.0)
NO_BACKEND = "none"  # the `backend` label of answers given without a backend
CLIENT_CLOSED = "499"  # nginx's code for "client closed the request"


class ClientMetrics:
    """Requests answered (by backend and status), their duration and first byte, and per tenant (API keys) what
    was answered, refused and charged, in REGISTRY under NAMES."""

    def __init__(self, names: contract.ClientMetricNames, registry: CollectorRegistry | None = None) -> None:
        self.registry = reg = registry if registry is not None else CollectorRegistry(auto_describe=True)
        code, reason, tenant = contract.ROUTER_LABEL_CODE, contract.ROUTER_LABEL_REASON, contract.ROUTER_LABEL_TENANT
        self._requests = Counter(names.requests, "Requests answered, by backend and HTTP status.",
                                 [contract.ROUTER_LABEL_BACKEND, code], registry=reg)
        self._duration = Histogram(names.duration, "Time from request received to response complete, by HTTP status.",
                                   [code], buckets=DURATION_BUCKETS, registry=reg)
        self._ttfb = Histogram(names.first_byte,
                               "Time from request received to the first streamed byte sent to the client "
                               "(the first token, for streaming requests).", buckets=DURATION_BUCKETS, registry=reg)
        self._tenant_requests = Counter(names.tenant_requests,
                                        "Requests with a valid API key answered, by tenant and HTTP status.",
                                        [tenant, code], registry=reg)
        self._tenant_rejections = Counter(names.tenant_rejections,
                                          "Requests with a valid API key refused with 429, by tenant and reason: "
                                          "requests or tokens (the key's per-minute limits), queue (the router's "
                                          "queue full).", [tenant, reason], registry=reg)
        self._tenant_tokens = Counter(names.tenant_tokens,
                                      "Tokens charged to each tenant's limit, as settled after the answer (only with "
                                      "a tokens-per-minute limit).", [tenant], registry=reg)
        self._auth_failures = Counter(names.auth_failures,
                                      "Requests refused with 401, by reason: missing (no Bearer key) or invalid.",
                                      [reason], registry=reg)
        # labels() takes a lock and builds a tuple; requests reuse children.
        self._request_children: dict[tuple[str, str], Counter] = {}
        self._duration_children: dict[str, Histogram] = {}
        self._tenant_children: dict[tuple[Counter, tuple[str, ...]], Counter] = {}

    def attempt_done(self, backend: str, code: str) -> None:
        """One answer from a backend (or given without one, NO_BACKEND)."""
        key = (backend, code)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self._requests.labels(backend, code)
        child.inc()

    def request_done(self, code: str, seconds: float) -> None:
        """One client request, however many attempts it took."""
        duration = self._duration_children.get(code)
        if duration is None:
            duration = self._duration_children[code] = self._duration.labels(code)
        duration.observe(seconds)

    def first_byte(self, seconds: float) -> None:
        self._ttfb.observe(seconds)

    def forget_backend(self, backend: str) -> None:
        """Drop BACKEND's request series (one that left: an engine's address, a deleted InferenceService)."""
        for key in [k for k in self._request_children if k[0] == backend]:
            del self._request_children[key]
            self._requests.remove(*key)

    def _tenant(self, metric: Counter, *labels: str) -> Counter:
        key = (metric, labels)
        child = self._tenant_children.get(key)
        if child is None:
            child = self._tenant_children[key] = metric.labels(*labels)
        return child

    def tenant_done(self, tenant: str, code: str) -> None:
        self._tenant(self._tenant_requests, tenant, code).inc()

    def tenant_rejected(self, tenant: str, reason: str) -> None:
        self._tenant(self._tenant_rejections, tenant, reason).inc()

    def tenant_tokens(self, tenant: str, tokens: int) -> None:
        self._tenant(self._tenant_tokens, tenant).inc(tokens)

    def auth_failed(self, reason: str) -> None:
        self._auth_failures.labels(reason).inc()

    def forget_tenants(self, keep: frozenset[str]) -> None:
        """Drop the series of tenants no longer in the keys (tenant labels come from the keys' Secret only, never
        from anything a client sent)."""
        for metric, labels in [key for key in self._tenant_children if key[1][0] not in keep]:
            del self._tenant_children[metric, labels]
            metric.remove(*labels)


class ClientGone(Exception):
    """The client disconnected while its answer was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


def reject(metrics: ClientMetrics, status: int, message: str, *, param: str | None = None, type_: str | None = None,
           code: str | None = None, headers: Mapping[str, str] | None = None, close: bool = False) -> web.Response:
    """An answer given without a backend; `close` for a request whose body was left unread, so the connection is
    not kept for more."""
    metrics.attempt_done(NO_BACKEND, str(status))
    response = error_response(status, message, type_=type_, param=param, code=code, headers=headers)
    if close:
        response.force_close()
    return response


class Requests:
    """The client requests being handled, for the drain: `idle` is set while there are none, `draining` once
    SIGTERM came (answers then close their connections, so clients reconnect to a replica that stays)."""

    def __init__(self) -> None:
        self.requests = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False

    def request_started(self) -> None:
        self.requests += 1
        self.idle.clear()

    def request_done(self) -> None:
        self.requests -= 1
        if not self.requests:
            self.idle.set()


async def drain(runner: web.AppRunner, requests: Requests, delay: float, grace: float, log: logging.Logger) -> bool:
    """SIGTERM: keep serving for DELAY seconds (the pod leaves its Service's endpoints meanwhile), stop accepting,
    then give the requests in flight GRACE seconds; whether they all ended within it."""
    requests.draining = True
    log.info("draining: serving for %gs more, then finishing in-flight requests for up to %gs", delay, grace)
    await asyncio.sleep(delay)
    for site in list(runner.sites):
        await site.stop()
    server = runner.server
    if server is not None:
        for connection in server.connections:
            connection.close()  # idle ones close now, busy ones after their answer
    try:
        await asyncio.wait_for(requests.idle.wait(), grace)
    except TimeoutError:
        log.warning("shutdown grace of %gs over: ending %d requests", grace, requests.requests)
        return False
    log.info("drained: no request in flight")
    return True


async def stream_error(response: web.StreamResponse, tail: bytes, status: int, message: str, *,
                       type_: str = "upstream_error") -> None:
    """Close the event the engine was in the middle of, then send an error event the openai SDK raises on,
    and end the stream."""
    prefix = b"" if tail.endswith(b"\n\n") else b"\n\n"
    event = json.dumps(error_body(status, message, type_=type_)).encode()
    try:
        await response.write(prefix + b"data: " + event + b"\n\n")
        await response.write_eof()
    except (ConnectionError, aiohttp.ClientConnectionResetError):
        pass


Route = Callable[[web.Request], Awaitable[web.StreamResponse]]


def openai_app(config: ClientConfig, metrics: ClientMetrics, who: str, *, inference: Route, models: Route,
               health: Route, posts: Mapping[str, Route] | None = None) -> web.Application:
    """The app of a process facing OpenAI clients (WHO: router, gateway): INFERENCE on INFERENCE_PATHS, MODELS on
    GET /v1/models, HEALTH and the metrics, POSTS' own paths; another method on one of those paths gets an
    OpenAI-style 405, any other path 404, both counted in METRICS."""

    async def not_found(request: web.Request) -> web.Response:
        return reject(metrics, 404, f"{request.method} {request.path} is not an endpoint of this {who}")

    async def method_not_allowed(request: web.Request) -> web.Response:
        resource = request.match_info.route.resource
        allowed = sorted({r.method for r in resource} - {hdrs.METH_ANY}) if resource is not None else []
        return reject(metrics, 405, f"{request.method} is not allowed on {request.path}; allowed: "
                                    f"{', '.join(allowed)}", headers={"Allow": ",".join(allowed)})

    async def exposition(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=config.max_body_bytes)
    for path in INFERENCE_PATHS:
        app.router.add_post(path, inference)
    app.router.add_get("/v1/models", models)
    app.router.add_get(contract.HEALTH_PATH, health)
    app.router.add_get(contract.METRICS_PATH, exposition)
    for path, handler in (posts or {}).items():
        app.router.add_post(path, handler)
    # No middleware (each costs every request): the listed paths answer other methods themselves, and a
    # catch-all answers the rest. A route's own method is matched before its "*".
    for path in (*INFERENCE_PATHS, "/v1/models", contract.HEALTH_PATH, contract.METRICS_PATH):
        app.router.add_route(hdrs.METH_ANY, path, method_not_allowed)
    app.router.add_route(hdrs.METH_ANY, "/{tail:.*}", not_found)
    return app


def client_limits(config: ClientConfig) -> ServerLimits:
    """The bounds on the clients, for httpapi.start_site: bodies arrive undecoded (a compressed one is refused
    unread) and malformed requests log rate-limited single lines."""
    return ServerLimits(header_timeout=config.header_timeout, idle_timeout=config.idle_timeout, decompress=False,
                        client_error_log=CLIENT_LOG, lingering_time=min(LINGER_SECONDS, config.body_timeout))
