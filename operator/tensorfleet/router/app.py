"""The router's HTTP server: OpenAI API in, the chosen engine's answer out.

Request path: refuse what the router can refuse itself, read the body
(bounded), parse it once (model check, routing keys, prompt size), take an
engine slot from the dispatcher (maybe queueing), forward the bytes unchanged
(but for one addition, below), relay the answer. Streams are relayed chunk by
chunk as the engine writes them; the client's headers are sent only once the
engine's first byte is in hand, so until then a failed engine can be replaced
by another one without the client noticing. After that, a generation's stream
whose engine stalls, stops answering or breaks is resumed: re-issued to another
engine as a continuation of the answer already sent (prompt + text, or the
chat's assistant message with continue_final_message; max_tokens less the
tokens sent), whose events are relayed rewritten to the first stream's id,
created and model, without a second role delta, usage counting the original
prompt and every token sent; the client sees one uninterrupted stream. At most
--stream-resumptions times per stream, never on an engine it broke on, and only
where a continuation is the same answer (router/resume.py lists what is not:
n > 1, logprobs, echo, guided decoding, tool calls or reasoning already sent,
...; counted in ROUTER_METRIC_STREAM_RESUMPTIONS). Any other engine failure
after the first byte ends the client's stream with an explicit SSE error event:
never a silent truncation. A client that disconnects cancels its handler (see
httpapi.start_site), which closes the engine connection, which aborts the
request in the engine.

Token counts: an engine event may carry several tokens, so the router counts
none itself. A stream it tracks (resumable, or with per-key token limits) asks
its engine for `stream_options: {include_usage, continuous_usage_stats}` (added
to the body; router/resume.py), reads the engine's running counts from every
event, and relays only the usage its client asked for. Those counts give the
continuation's max_tokens, the usage after a resumption and the key's charge.

Endpoints (an allow-list): POST /v1/chat/completions, /v1/completions,
/v1/embeddings, /tokenize and /detokenize are forwarded; GET /v1/models is the
union of the engines' lists; GET /health and /metrics are the router's own.
Anything else is an OpenAI-style 404, or 405 for a listed path with another
method. Left out on purpose: /v1/responses (stateful: a stored response lives
on one engine, and a later GET or `previous_response_id` may land on another),
the audio endpoints (multipart uploads, not JSON), and vLLM's operational
endpoints (LoRA adapter loading, sleep/wake, cache resets), which no client of
a shared fleet may reach. The engine always gets the route's own path: an
absolute-form target (`POST http://host/v1/completions`, which HTTP/1.1 servers
must accept) is served like the origin form, and the client's target string
never reaches an engine. Of the client's headers only Authorization (vLLM's
--api-key), X-Request-Id, traceparent and tracestate are forwarded, with
Content-Type: application/json; with --api-keys, Authorization carries the
client's key for the router and stays here too.

API keys (--api-keys; router/tenants.py has the file format, the reload and
the buckets): the forwarded endpoints and GET /v1/models need
`Authorization: Bearer KEY` with a key in force, else 401 (`code`
invalid_api_key, WWW-Authenticate: Bearer), answered before the body is read.
GET /health and /metrics need none (the probes and Prometheus carry no key;
/metrics names tenants, never keys), and the 404/405 of other paths say
nothing a key would change.
The key's tenant then pays, in this order: one request from its
--requests-per-minute bucket (before the body is read), then the request's
token estimate from its --tokens-per-minute bucket (once parsed); either
refusal is 429 with `code` rate_limit_exceeded and Retry-After (the seconds
until that bucket holds enough). The token charge is settled once the answer
is done (tenants.UsageMeter): to the engine's usage, for a stream the counts
above. While waiting for an engine, a tenant's requests queue apart from other
tenants' and slots go round them (see dispatch.py), so a tenant at its limits,
or flooding within them, does not delay the others' requests behind its own.

Refused by the router, never forwarded, never counted against an engine:
  415  a compressed body (Content-Encoding other than identity), unread. vLLM
       does not decode compressed request bodies and OpenAI clients do not
       send them, so nothing legitimate is lost, and refusing unread costs
       nothing: no decompression bomb can cost CPU or memory.
  413  a body over --max-body-bytes (by Content-Length, unread, or as it arrives)
  408  a body not complete within --body-timeout of its head
  503  a body the in-flight budget (--max-body-bytes-in-flight) cannot hold
       now, with Retry-After: the client should retry, not wait connected
  400  not JSON, not an object, nested deeper than --max-json-depth, or with
       more than --max-json-values values (a cheap upper bound taken on the
       bytes before parsing, so no body can inflate into millions of objects)
  404  a model other than the served one and the LoRA adapters a healthy
       engine lists (their /v1/models, as asked after the request came:
       an adapter loaded a moment ago is found). While the router holds no healthy
       engine's list (a cold start, every engine ejected, the router just
       started), such a name may be an adapter it has not heard of yet: it
       waits for an engine as the served model's requests do (and gets their
       503 when none comes within the bound, or is unavailable), and the 404
       comes once that engine's list lacks it (should its list not be had,
       the request goes to it, and the engine answers).
A request refused before its body was read also has its connection closed
(after at most LINGER_SECONDS of reading and dropping the rest of it).

No engine to wait for: a request that finds no engine healthy (every one
ejected, joining or gone) is answered 503 at once, with Retry-After, instead
of waiting --queue-timeout for an engine the router already knows is not
coming, unless a cold start is underway: then it queues, as it does when
the engines are busy, and gets 503 once --queue-timeout passes. A cold start
is underway while any of these holds:
  - discovery (--service) has not listed the engine Service's EndpointSlices
    yet, and has not failed to: the router does not know its engines yet;
  - the EndpointSlices list an endpoint that is neither ready nor terminating:
    an engine pod that runs but has not passed its readiness probe yet
    (loading the model, its group forming, restarting after a crash);
  - an engine is joining (in the pool, no health check answered 200 yet; see
    backends.py) and was named with --backend, or its first health check is
    still out. A static engine has no readiness probe to say it is starting,
    so one never yet seen up is taken as starting while it answers (its
    /health says 503 while it loads) or does not answer in time; one whose
    health check cannot connect (refused: nothing listens there; the name
    does not resolve) is down or misnamed, not starting, and a request
    finding only such engines gets 503 at once. A discovered engine
    joins when its pod is Ready and is checked at once: if the router then
    cannot reach it (a NetworkPolicy, a wrong port) that is a fault to report,
    not a start to wait for.
Requests already queued are refused the same way the moment this becomes
true while they wait (the last engine ejected, the last starting pod gone).
Retry-After says when the soonest engine may serve again: the end of its
ejection (plus one --health-interval when only a health check may probe it:
ejected as unresponsive), or the next health check for a joining engine or a
probe in flight; rounded up, at least 1 s. With no engine at all (the Service
lists none ready or starting, or discovery fails) it is NO_ENGINE_RETRY_SECONDS.
A request that already failed on an engine and finds no other one gets its
502/504 as before, with that Retry-After (or the engine's own 5xx, as it came).

Health accounting (backends.py) counts only the engine's faults: refused or
reset connections, failed health checks, 5xx answers. A 4xx answer is the
client's doing and is neutral. A 5xx counts against its engine only once
another engine has answered the same request without one: a request that
fails on every engine it is tried on is likelier the cause than every engine
at once, and must not be able to eject them all. Client-facing messages never
name an engine; the log does.

Timeouts the router owns:
  first byte   an attempt that has received nothing from its engine within
               --first-byte-timeout + prompt tokens / --prefill-tokens-per-second
               (for a non-streamed generation also + max_tokens /
               --decode-tokens-per-second; none when it sets no max_tokens)
               is abandoned, the engine connection closed, and the request
               retried elsewhere. Not counted against the engine: its health
               checks answer for its health.
  health       a health check unanswered within --health-timeout ejects the
               engine at once as unresponsive; requests waiting for its first
               byte move to other engines then, and its streams are resumed
               elsewhere (or end with an error event) once they have been quiet
               as long.
  stall        a stream that gets nothing from its engine for
               --stream-idle-timeout is resumed on another engine, or ends with
               an SSE error event when it cannot be; a client that reads
               nothing for as long is disconnected.
  clients      request heads (--header-timeout), bodies (--body-timeout) and
               idle keep-alive connections (--idle-timeout); see ServerLimits.

Memory: request bodies are read into one buffer each, charged to a global
budget as their bytes arrive (dispatch.BodyBudget) and given back once the
answer's first byte reached the client or the request ended.

Shutdown (`drain`): on SIGTERM the router keeps accepting and serving for
--drain-delay seconds, every answer with `Connection: close`, while the
endpoints controller takes the pod out of the Service; then it stops
accepting, closes idle connections, and lets in-flight requests finish for up
to --shutdown-grace seconds. What is still running then ends: streams with an
SSE error event, requests without an answer yet and queued ones with 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tensorfleet import contract, vllm_defaults
from tensorfleet.httpapi import (
    SSE_CONTENT_TYPE,
    ServerLimits,
    error_body,
    error_response,
    post_resending_once,
    rate_limited_logger,
)
from tensorfleet.kube.connection import Connection, in_cluster_namespace
from tensorfleet.prompts import content_text, goes_on, opening_chars, prompt_text
from tensorfleet.router import NO_ENGINE_RETRY_SECONDS
from tensorfleet.router.backends import (
    CLOSED,
    HALF_OPEN,
    JOINING,
    OPEN,
    Backend,
    BackendPool,
    BreakerPolicy,
    parse_engine_metrics,
)
from tensorfleet.router.demand import REFRESH_SECONDS as DEMAND_REFRESH_SECONDS
from tensorfleet.router.demand import DemandLease
from tensorfleet.router.discovery import EndpointSliceWatcher
from tensorfleet.router.dispatch import (
    BodyBudget,
    Dispatcher,
    NoBackend,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    Unavailable,
)
from tensorfleet.router.metrics import CLIENT_CLOSED, NO_BACKEND, RouterMetrics
from tensorfleet.router.peers import OUTCOMES as PEER_OUTCOMES
from tensorfleet.router.peers import PEER_MAX_BYTES, PeerMessageError, Peers
from tensorfleet.router.prefill import KV_TRANSFER_PARAMS, PrefillStage
from tensorfleet.router.prefill import OUTCOMES as PREFILL_OUTCOMES
from tensorfleet.router.resume import CHARS_PER_TOKEN, StreamState, ask_usage, resumable, usage_asked
from tensorfleet.router.strategies import RequestInfo, hash_prompt, make_strategy
from tensorfleet.router.tenants import KeyRing, Limits, Refusal, UsageMeter

log = logging.getLogger("tensorfleet.router")
CLIENT_LOG = "tensorfleet.router.clients"  # what clients can trigger at will: rate-limited, no tracebacks

# Forwarded to an engine (POST); the generation endpoints also get a first-byte bound for their answer.
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
INFERENCE_PATHS = (*GENERATION_PATHS, "/v1/embeddings", "/tokenize", "/detokenize")
# The client headers an engine gets; everything else stays at the router.
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id", "traceparent", "tracestate")
_RELAYED_RESPONSE_HEADERS = ("Content-Type", "Content-Encoding", "X-Request-Id")
RETRY_AFTER_SECONDS = "1"
ADAPTERS_ASK_AGAIN_SECONDS = 1.0   # an unknown model name asks the engines for their adapters at most this often
ADAPTERS_REFRESH_SECONDS = 10.0    # once some are known, they are asked this often, so one unloaded is forgotten
_ADAPTER = web.RequestKey("adapter", str)  # the request's LoRA adapter, for its metrics
SHUTDOWN_STOP_SECONDS = 2.0  # after the grace: for the ended requests to write their last bytes
LINGER_SECONDS = 2.0  # a refused request's unread body is drained (and dropped) this long at most
SHUTTING_DOWN = "the router is shutting down; retry the request"


@dataclass
class RouterConfig:
    strategy: str = contract.DEFAULT_ROUTER_STRATEGY
    model: str | None = None
    max_concurrency_per_backend: int = 256
    # Up to this many per engine while the engine reports room (dispatch.py); 0: the ceiling above, no burst.
    burst_concurrency_per_backend: int = 0
    max_queue: int = 0
    queue_timeout: float = 30.0
    # The engines' chunked-prefill budget per step (vLLM's --max-num-batched-tokens): cache-aware sends an engine
    # at most this much prompt at a time (dispatch.py), counted at CHARS_PER_TOKEN; 0: no bound.
    prompt_queue_tokens: int = vllm_defaults.MAX_NUM_BATCHED_TOKENS
    retries: int = 2
    health_interval: float = 2.0
    health_timeout: float = 2.0
    connect_timeout: float = 3.0
    # An attempt's first byte: base + prompt tokens / prefill rate (+ max_tokens / decode rate unstreamed).
    first_byte_timeout: float = 30.0
    prefill_tokens_per_second: float = 1000.0
    decode_tokens_per_second: float = 5.0
    stream_idle_timeout: float = 30.0
    stream_resumptions: int = 2  # times one broken stream may be continued on another engine (router/resume.py)
    # Clients.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 75.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_body_bytes_in_flight: int = 64 * 1024 * 1024
    max_json_depth: int = 64
    max_json_values: int = 250_000
    # Shutdown.
    drain_delay: float = 5.0
    shutdown_grace: float = 60.0
    backend_header: bool = False  # name the engine that answered (its URL) in contract.BACKEND_HEADER
    # API keys (router/tenants.py): a directory of one file per tenant, or a file of tenant:key lines.
    api_keys: str | None = None
    api_keys_reload_interval: float = 5.0
    requests_per_minute: int | None = None  # per tenant; None: no limit
    tokens_per_minute: int | None = None
    default_max_tokens: int = 1024  # charged at admission for a generation without max_tokens
    static_backends: tuple[str, ...] = ()
    service: str | None = None
    namespace: str | None = None
    kube: Connection | None = None  # the API server that lists `service`'s EndpointSlices
    # Scale from zero (router/demand.py): the Lease this router renews on demand, and how long a request that
    # found no engine at all may wait for the fleet to wake before 503.
    demand_lease: str | None = None
    cold_start_timeout: float = 600.0
    breaker: BreakerPolicy | None = None
    # Prefill/decode disaggregation (router/prefill.py): the prefill engines, static or a Service's; their
    # per-engine ceiling (0: max_concurrency_per_backend).
    prefill_backends: tuple[str, ...] = ()
    prefill_service: str | None = None
    prefill_max_concurrency_per_backend: int = 0
    # The other router replicas (router/peers.py): static base URLs, and/or the router's own Service, whose ready
    # endpoints less this pod's address (own_address) are the peers.
    peers: tuple[str, ...] = ()
    peer_service: str | None = None
    own_address: str | None = None


# _Failed.fault: how an attempt's failure counts against its engine.
FATAL = "fatal"      # ejects at once (a refused or reset connection)
COUNTED = "counted"  # towards the breaker's threshold
SUSPECT = "suspect"  # a 5xx: counted once another engine answers the same request without one


class _Failed(Exception):
    """An attempt failed before any byte reached the client: try another engine.

    The message may reach the client: it never names an engine (the log does)."""

    def __init__(self, reason: str, message: str, *, fault: str | None, final: web.Response | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.fault = fault
        self.final = final


class _NoSuchModel(Exception):
    """The model a request names is in no healthy engine's list: 404."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model


class _Stopped(Exception):
    """The shutdown grace ended before the engine's first byte: answer 503."""


class _ClientGone(Exception):
    """The client disconnected while its answer was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


class _Interrupted(Exception):
    """Set on an engine stream's reader to end its relay: `stalled`, `unresponsive` or `shutdown`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Resume(Exception):
    """A resumable stream broke after bytes reached its client: continue it on another engine (Router._resume).
    STATUS and MESSAGE make the error event that ends it if it cannot be."""

    def __init__(self, backend: Backend, reason: str, status: int, message: str) -> None:
        super().__init__(message)
        self.backend = backend
        self.reason = reason
        self.status = status
        self.message = message


class _Body:
    """One request's body as it arrives, its bytes charged to the router's BodyBudget until released."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.data = bytearray()
        self.held = 0

    def add(self, chunk: bytes) -> bool:
        if not self.budget.take(len(chunk), held=self.held):
            return False
        self.held += len(chunk)
        self.data += chunk
        return True

    def replace(self, data: bytes) -> bool:
        """Send DATA instead (the same request, rewritten), charging the difference; False (nothing changed) if
        the budget cannot take it."""
        extra = len(data) - self.held
        if extra > 0 and not self.budget.take(extra, held=self.held):
            return False
        if extra < 0:
            self.budget.give(-extra)
        self.held += extra
        self.data = bytearray(data)
        return True

    def release(self) -> None:
        """Give the bytes back: no retry can need them any more."""
        self.data = bytearray()
        self.budget.give(self.held)
        self.held = 0


@dataclass(eq=False)
class _Call:
    """A parsed request, ready to send to any engine."""

    path: str
    body: _Body
    headers: dict[str, str]
    info: RequestInfo
    first_byte_bound: float | None
    start: float
    suspects: list[Backend] = field(default_factory=list)  # engines that answered it 5xx, not yet charged
    tenant: str | None = None  # whose API key it came with
    meter: UsageMeter | None = None  # what it used, when tokens are limited
    resumable: bool = False  # a stream that may be continued elsewhere should it break (router/resume.py)
    adapter: str | None = None  # the LoRA adapter it asks for
    unresolved: str | None = None  # a model name no healthy engine's list has said anything of yet: maybe an adapter
    usage: tuple[bool, bool] = (False, False)  # a stream's usage its client asked for (resume.usage_asked)
    usage_added: bool = False  # the router asked the engine for usage on every event (resume.ask_usage)
    stream: StreamState | None = None  # once it streams (resumable or metered): what was sent; on continuations too
    response: web.StreamResponse | None = None  # the client's stream, for a continuation to write on


@dataclass(eq=False)
class _Attempt:
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
        (_Interrupted) or, when the client is the one not reading, by dropping the client."""
        if self.reason is not None:
            return
        self.reason = reason
        if self.timer is not None:
            self.timer.reschedule(self.loop.time())
        elif self.streaming and self.writing:
            if self.client is not None:
                self.client.abort()
        elif self.streaming and self.upstream is not None:
            self.upstream.content.set_exception(_Interrupted(reason))


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """An over-estimate of a request's prompt in tokens: token ids count one each, text one per CHARS_PER_TOKEN
    characters (English runs about four; code and CJK text fewer)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = sum(len(content_text(m.get("content"))) for m in messages if isinstance(m, Mapping))
        return chars // CHARS_PER_TOKEN + 1
    prompt = body.get("prompt", body.get("input"))
    if isinstance(prompt, str):
        return len(prompt) // CHARS_PER_TOKEN + 1
    total = 0
    if isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, str):
                total += len(item) // CHARS_PER_TOKEN + 1
            elif isinstance(item, list):
                total += len(item)
            else:
                total += 1
    return total


def _adapter_key(name: str) -> int:
    """An adapter's name as the cache-aware strategy hashes it: the same in every router replica."""
    return zlib.crc32(name.encode()) | (1 << 32)  # never equal to a conversation's opening hash (32 bits)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests containers more than `limit` deep (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        # Engines join the pool without traffic until a health check passes (backends.py).
        self.pool = BackendPool(config.breaker, check_first=True)
        self.strategy = make_strategy(config.strategy)
        self.dispatcher = Dispatcher(self.pool, self.strategy, ceiling=config.max_concurrency_per_backend,
                                     burst=config.burst_concurrency_per_backend,
                                     max_queue=config.max_queue, queue_timeout=config.queue_timeout,
                                     prompt_queue_chars=config.prompt_queue_tokens * CHARS_PER_TOKEN,
                                     unavailable=self._unavailable)
        self.body_budget = BodyBudget(config.max_body_bytes_in_flight)
        # API keys: read now, so a path that cannot be read stops the router at start (KeysError).
        self.keys = KeyRing(config.api_keys) if config.api_keys else None
        if self.keys is not None:
            self.keys.load()
        self.key_limits = Limits(config.requests_per_minute, config.tokens_per_minute)
        self._forwarded = tuple(h for h in _FORWARDED_HEADERS if self.keys is None or h != hdrs.AUTHORIZATION)
        keys = self.keys
        self.metrics = RouterMetrics(self.pool, lambda: self.dispatcher.pending, burst=self.dispatcher.burst_requests,
                                     tenants=self.dispatcher.pending_by_tenant if keys is not None else None,
                                     keys=(lambda: len(keys.tenants)) if keys is not None else None)
        self.pool.on_removed.append(self.strategy.forget)
        self.pool.on_ejected.append(self._on_ejected)
        self.session: aiohttp.ClientSession | None = None
        self.draining = False
        self.clients_log = rate_limited_logger(CLIENT_LOG)
        self._static: list[str] = list(config.static_backends)
        self.prefill: PrefillStage | None = None
        if config.prefill_backends or config.prefill_service:
            self.prefill = PrefillStage(ceiling=config.prefill_max_concurrency_per_backend
                                        or config.max_concurrency_per_backend,
                                        policy=config.breaker, static=config.prefill_backends)
            self.metrics.prefill_outcomes(PREFILL_OUTCOMES)
        self._static_urls = {url.rstrip("/") for url in self._static}
        self._discovered: list[str] = []
        self._watcher: EndpointSliceWatcher | None = None
        self.demand: DemandLease | None = None
        self._health_wake = asyncio.Event()  # set when engines join: check them now, not an interval later
        self._loop: asyncio.AbstractEventLoop | None = None
        self._attempts: set[_Attempt] = set()
        self._active = 0  # inference requests being handled
        # LoRA adapters the engines serve (their /v1/models entries with a parent), and when that was last asked.
        self.adapters: frozenset[str] = frozenset()
        self._adapter_hosts: dict[str, frozenset[str]] = {}  # engine URL -> the adapters it listed
        self._adapters_asked = -math.inf
        self._adapters_from: frozenset[str] = frozenset()  # the engines that answered then
        self._refreshing: asyncio.Task[None] | None = None  # a round of asking them, in flight
        self._round_started = -math.inf   # when the round in flight (or the last one) began
        self._round_answered = -math.inf  # when the last round to end began
        self._idle = asyncio.Event()
        self._idle.set()
        # Router replicas share their placements when the strategy indexes prompts (router/peers.py).
        self.peers: Peers | None = None
        if self.strategy.needs_prefix and (config.peers or config.peer_service):
            self.metrics.peer_outcomes(PEER_OUTCOMES)
            self.peers = Peers(static=config.peers, own_address=config.own_address,
                               on_outcome=self.metrics.peer_placements)
            peers = self.peers
            self.dispatcher.on_placed = lambda backend, info: peers.share(backend.url, info.prefix_hashes,
                                                                           info.opening)
            self.dispatcher.on_load = peers.nudge

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
        self._loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=contract.ENGINE_CLIENT_KEEP_ALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout,
                                        sock_connect=self.config.connect_timeout)
        # Bytes pass through untouched: no decompression, no added User-Agent. No cookie jar: the session is
        # shared by every client, so a cookie an engine (or a proxy before it) set must not ride on others' requests.
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",), cookie_jar=aiohttp.DummyCookieJar())
        self._update_pool()
        tasks = [asyncio.create_task(self._health_loop(), name="router-health"),
                 asyncio.create_task(self._watchdog(), name="router-watchdog")]
        if self.keys is not None:
            tasks.append(asyncio.create_task(self._keys_loop(self.keys), name="router-api-keys"))
        if self.peers is not None:
            strategy, pool = self.strategy, self.pool
            tasks.append(asyncio.create_task(
                self.peers.run(self.session, lambda: strategy.block_chars,
                               lambda: {b.url: (b.in_flight, b.prefill_chars, b.context_chars, b.queued_prompt_chars)
                                               for b in pool},
                               self._now),
                name="router-peers"))
        if self.config.service or self.config.prefill_service or (self.peers and self.config.peer_service):
            namespace = self.config.namespace or in_cluster_namespace() or "default"
            connection = self.config.kube or Connection.from_environment()
        if self.config.service:
            watcher = EndpointSliceWatcher(self.config.service, namespace, self._on_discovered, connection=connection,
                                           on_update=self.dispatcher.reevaluate)
            self._watcher = watcher
            tasks.append(asyncio.create_task(watcher.run(), name="router-discovery"))
            if self.config.demand_lease:
                self.demand = DemandLease(self.config.demand_lease, namespace, connection)
                tasks.append(asyncio.create_task(self._demand_loop(self.demand), name="router-demand"))
        if self.peers is not None and self.config.peer_service:
            # The router's own Service: its ready endpoints are this replica and its peers.
            replicas = EndpointSliceWatcher(self.config.peer_service, namespace, self.peers.set_discovered,
                                            connection=connection)
            tasks.append(asyncio.create_task(replicas.run(), name="router-peer-discovery"))
        if self.config.prefill_service:
            prefill = EndpointSliceWatcher(self.config.prefill_service, namespace, self._on_prefill_discovered,
                                           connection=connection)
            tasks.append(asyncio.create_task(prefill.run(), name="router-prefill-discovery"))
        yield
        if self._refreshing is not None:
            tasks.append(self._refreshing)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.demand is not None:
            await self.demand.close()
        await self.session.close()

    async def _keys_loop(self, keys: KeyRing) -> None:
        """Read the API keys again whenever their files changed (checked each reload interval), until cancelled."""
        while True:
            await asyncio.sleep(self.config.api_keys_reload_interval)
            if keys.refresh():
                self.key_limits.retain(keys.tenants)
                self.dispatcher.forget(keys.tenants)
                self.metrics.forget_tenants(keys.tenants)

    async def _demand_loop(self, demand: DemandLease) -> None:
        """Keep renewing the demand Lease while requests are being handled (a long stream is demand too)."""
        while True:
            await asyncio.sleep(DEMAND_REFRESH_SECONDS)
            if self._active:
                demand.touch()

    def _on_discovered(self, urls: list[str]) -> None:
        self._discovered = urls
        self._update_pool()

    async def peer_placements(self, request: web.Request) -> web.Response:
        """Another router replica's placements (router/peers.py): taken into the strategy's index."""
        assert self.peers is not None
        if not self.peers.allowed(request.remote):
            return self._reject(403, f"{request.path} takes posts from this router's peers only", close=True)
        if request.content_length is None or request.content_length > PEER_MAX_BYTES:
            return self._reject(413, f"a placements message is at most {PEER_MAX_BYTES} bytes, with a Content-Length",
                                close=True)
        try:
            placements = self.peers.decode(await request.read(), self.strategy.block_chars, self._now())
        except PeerMessageError as exc:
            return self._reject(400, f"not a placements message: {exc}")
        backends = self.pool.backends
        for url, opening, hashes in placements:
            backend = backends.get(url)
            if backend is not None:
                self.strategy.learn(backend, hashes, opening)
        self._peer_load()
        return web.Response(status=204)

    def _peer_load(self) -> None:
        """The other replicas' load, as they last told it, replaces what the last scrape said of it; a peer
        not heard from within PEER_STALE counts no more."""
        if self.peers is None or not self.peers.heard:
            return
        load = self.peers.load(self._now())
        freed = False
        for backend in self.pool:
            n, chars, context, queued = load.get(backend.url, (0, 0.0, 0.0, 0.0))
            freed = freed or n < backend.peer_in_flight or queued < backend.peer_queued_prompt_chars
            backend.others, backend.peer_prefill_chars, backend.peer_in_flight = n, chars, n
            backend.peer_context_chars, backend.peer_queued_prompt_chars = context, queued
        if freed:
            self.dispatcher.drain()  # the peers freed slots or prompt room on an engine: waiters here may take them

    def _on_prefill_discovered(self, urls: list[str]) -> None:
        if self.prefill is not None and self.prefill.set_discovered(urls):
            self._health_wake.set()

    def _update_pool(self) -> None:
        if self.pool.set_urls([*self._static, *self._discovered]):
            self._health_wake.set()
        self.dispatcher.reevaluate()

    async def not_found(self, request: web.Request) -> web.Response:
        """Anything not on the allow-list: an OpenAI-style 404."""
        return self._reject(404, f"{request.method} {request.path} is not an endpoint of this router")

    async def method_not_allowed(self, request: web.Request) -> web.Response:
        """A listed path with another method: an OpenAI-style 405."""
        resource = request.match_info.route.resource
        allowed = sorted({r.method for r in resource} - {hdrs.METH_ANY}) if resource is not None else []
        return self._reject(405, f"{request.method} is not allowed on {request.path}; allowed: {', '.join(allowed)}",
                            headers={"Allow": ",".join(allowed)})

    # --- health and load ----------------------------------------------------------
    async def _health_loop(self) -> None:
        """Check every engine each health interval (and scrape its load), and at once when engines join, until
        cancelled."""
        while True:
            self._health_wake.clear()
            checks = [self.check(b) for b in self.pool]
            if self.prefill is not None:
                checks += [self.check(b, self.prefill.pool, self.prefill.dispatcher) for b in self.prefill.pool]
            if checks:
                await asyncio.gather(*checks, return_exceptions=True)
            self.pool.tick()
            self._peer_load()
            self.strategy.align(b.kv_block_size for b in self.pool)
            if self.prefill is not None:
                self.prefill.strategy.align(b.kv_block_size for b in self.prefill.pool)
            if self.adapters and (self._now() - self._adapters_asked >= ADAPTERS_REFRESH_SECONDS
                                  or self._adapters_from != frozenset(b.url for b in self.pool if b.healthy)):
                await self._refresh_adapters()  # on schedule, or an engine joined or left: an adapter may be gone
            self.dispatcher.reevaluate()  # a joining engine's first check may have ended a cold start
            try:
                await asyncio.wait_for(self._health_wake.wait(), self.config.health_interval)
            except TimeoutError:
                pass

    async def check(self, backend: Backend, pool: BackendPool | None = None,
                    dispatcher: Dispatcher | None = None) -> None:
        """One health check of BACKEND in POOL (the decode engines', unless the prefill engines'): unanswered
        within the timeout ejects as unresponsive, refused ejects, else counts. A joining engine is checked every
        time, and joins on its first 200."""
        pool = pool or self.pool
        if backend.state in (OPEN, HALF_OPEN):
            if not backend.probe_due(pool.clock()):
                return  # ejected, or a probe is already out: nothing to learn yet
            # Past its ejection time: this check is the half-open probe.
            pool.begin_probe(backend)
        try:
            await self._check(backend, pool, dispatcher or self.dispatcher)
        finally:
            backend.checked = True

    async def _check(self, backend: Backend, pool: BackendPool, dispatcher: Dispatcher) -> None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        ok: bool | None = None  # None: no answer in time
        refused = False
        try:
            async with self.session.get(backend.url + contract.HEALTH_PATH, timeout=timeout) as resp:
                ok = resp.status == 200
                await resp.read()
        except TimeoutError:
            ok = None
        except (aiohttp.ClientConnectorError, ConnectionError):
            refused = True
        except Exception:  # noqa: BLE001 - a check that fails in any way has failed
            ok = False
        if refused and not backend.unreachable and backend.state == JOINING and backend.url in self._static_urls:
            log.warning("engine %s refuses connections: not taken as starting, requests get 503 until it answers",
                        backend.url)
        backend.unreachable = refused
        if refused:
            pool.record_failure(backend, fatal=True)
            return
        if ok is None:
            if backend.state == CLOSED:
                log.warning("engine %s did not answer its health check within %gs", backend.url,
                            self.config.health_timeout)
            pool.record_failure(backend, unresponsive=True)
            return
        if ok:
            try:
                async with self.session.get(backend.url + contract.METRICS_PATH, timeout=timeout) as resp:
                    if resp.status == 200:
                        backend.scraped(parse_engine_metrics(await resp.text()))
                        dispatcher.adapt(backend)
            except Exception:  # noqa: BLE001 - a scrape that fails in any way has failed
                ok = False
        if not ok:
            pool.record_failure(backend)
        elif backend.state != CLOSED:
            if backend.state == JOINING:
                log.info("engine %s is up: taking requests", backend.url)
            pool.record_success(backend)

    def _on_ejected(self, backend: Backend) -> None:
        log.warning("ejected engine %s%s for %.1fs", backend.url, " (unresponsive)" if backend.unresponsive else "",
                    backend.open_until - self.pool.clock())
        self.dispatcher.reevaluate()  # the last healthy engine gone: the queued requests have nothing to wait for
        if not backend.unresponsive or self._loop is None:
            return
        # Nothing will come from it: requests waiting for its first byte go elsewhere now, and its streams that
        # have been quiet as long as its health check end.
        now = self._now()
        for attempt in [a for a in self._attempts if a.backend is backend]:
            if attempt.timer is not None or (attempt.streaming and not attempt.writing
                                              and now - attempt.last >= self.config.health_timeout):
                attempt.interrupt("unresponsive")

    async def _watchdog(self) -> None:
        """End streams that stalled: the engine sent nothing, or the client took nothing, for the idle timeout;
        and streams of an engine ejected as unresponsive that have been quiet as long as its health check (it
        was ejected after they last heard from it)."""
        limit = self.config.stream_idle_timeout
        hung = self.config.health_timeout
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = self._now()
            for attempt in [a for a in self._attempts if a.streaming]:
                quiet = now - attempt.last
                if quiet > limit:
                    attempt.interrupt("stalled")
                elif (quiet >= hung and not attempt.writing and attempt.backend.unresponsive
                      and not attempt.backend.healthy):
                    attempt.interrupt("unresponsive")

    # --- availability ---------------------------------------------------------------------
    def cold_start(self) -> str | None:
        """What makes a cold start underway (see the module docstring), in words; None when none is."""
        watcher = self._watcher
        if watcher is not None:
            if not watcher.listed and not watcher.failing:
                return "the router is listing its engines"
            starting = watcher.starting()
            if starting:
                return f"{len(starting)} engine pod(s) starting"
            if self.demand is not None and not watcher.failing and not len(self.pool):
                return "the fleet is scaled to zero; waking it"
        joining = sum(1 for b in self.pool if b.state == JOINING
                      and (b.url in self._static_urls and not b.unreachable or not b.checked))
        if joining:
            return f"{joining} engine(s) not up yet"
        return None

    def _unavailable(self, exclude: frozenset[str]) -> Unavailable | None:
        """Why a request (that already failed on `exclude`) cannot wait for an engine: none healthy or about to
        be probed, no cold start underway. None when it may queue."""
        now = self.pool.clock()
        candidates = [b for b in self.pool if b.url not in exclude]
        if any(b.state == CLOSED or b.routable(now) for b in candidates):
            return None
        if self.cold_start() is not None:
            return None
        if candidates:
            seconds = min(b.back_in(now, self.config.health_interval) for b in candidates)
            ejected = sum(1 for b in candidates if b.state in (OPEN, HALF_OPEN))
            parts = [f"{ejected} ejected after failures"] if ejected else []
            unreachable = sum(1 for b in candidates
                              if b.state == JOINING and b.unreachable and b.url in self._static_urls)
            if unreachable:
                parts.append(f"{unreachable} not accepting connections (down, or a wrong --backend address)")
            if len(candidates) > ejected + unreachable:
                parts.append(f"{len(candidates) - ejected - unreachable} ready but not answering the router's "
                             "health checks")
            detail = ", ".join(parts)
        else:
            seconds = NO_ENGINE_RETRY_SECONDS
            if self._watcher is not None and self._watcher.failing:
                detail = "the router cannot list its engines; its log says why"
            else:
                detail = "none is ready and none is starting"
        retry = max(1, math.ceil(seconds))
        return Unavailable(f"no engine is available ({detail}); retry in {retry}s", retry)

    # --- plain endpoints ---------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        """Always 200 while serving, draining included (see the comment)."""
        # With no engine ready the router answers requests 503 itself (or
        # queues them, during a cold start), and failing the probe would only
        # restart it; while draining it still serves.
        healthy = sum(1 for b in self.pool if b.healthy)
        return web.json_response({"status": "ok", "backends": len(self.pool), "healthy": healthy,
                                  "pending": self.dispatcher.pending, "cold_start": self.cold_start(),
                                  "draining": self.draining})

    async def metrics_handler(self, _: web.Request) -> web.Response:
        """The router's Prometheus metrics."""
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        """The union of the engines' model lists, each model once."""
        refused = self._authenticate(request)
        if isinstance(refused, web.Response):
            return refused
        assert self.session is not None
        session = self.session
        backends = [b for b in self.pool if b.healthy] or list(self.pool)

        async def one(backend: Backend) -> list[dict[str, Any]]:
            """One engine's models ([] unless it answers 200)."""
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
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
        info = RequestInfo(queues_prompt=body.get("stream") is True)
        if self.strategy.name == "session":
            key = request.headers.get(contract.SESSION_HEADER) or body.get("user")
            info.session_key = key if isinstance(key, str) and key else None
        elif self.strategy.needs_prefix:
            text, opening = prompt_text(body), opening_chars(body)
            info.prefix_hashes, info.opening, info.opening_blocks = hash_prompt(text, opening, self.strategy.block_chars)
            info.prompt_chars = len(text)
            info.continues = goes_on(text, opening)
        return info

    def first_byte_bound(self, path: str, body: Mapping[str, Any]) -> float | None:
        """Seconds an engine may take to send the first byte of its answer to this request (None: no bound).

        A long prompt is a long prefill; an answer that is not streamed arrives whole, after its generation.
        """
        cfg = self.config
        bound = cfg.first_byte_timeout + estimate_prompt_tokens(body) / cfg.prefill_tokens_per_second
        if path in GENERATION_PATHS and body.get("stream") is not True:
            limit = body.get("max_completion_tokens", body.get("max_tokens"))
            if not isinstance(limit, int) or isinstance(limit, bool):
                return None  # the engine's default is the whole context: no useful bound
            bound += max(limit, 0) / cfg.decode_tokens_per_second
        return bound

    async def inference(self, request: web.Request) -> web.StreamResponse:
        """One OpenAI API request: refused by the router, or answered by an engine. Counted in flight for the
        drain; while draining, the answer closes its connection so the client reconnects to a router that stays."""
        start = self._now()
        code = CLIENT_CLOSED
        tenant: str | None = None
        response: web.StreamResponse
        self._active += 1
        self._idle.clear()
        try:
            who = self._authenticate(request)
            if isinstance(who, web.Response):
                response = who
            else:
                tenant = who
                response = await self._inference(request, start, tenant)
            code = str(response.status)
        except _ClientGone as gone:
            return gone.response
        except Exception:
            # A bug, not an engine failure: still an OpenAI-shaped answer.
            log.exception("router error serving %s", request.path)
            code = "500"
            response = error_response(500, "internal router error; the router's log has the details")
        finally:
            self.metrics.request_done(code, self._now() - start, request.get(_ADAPTER))
            if tenant is not None and self.keys is not None and tenant in self.keys.tenants:  # still one
                self.metrics.tenant_done(tenant, code)
            self._active -= 1
            if not self._active:
                self._idle.set()
        if self.draining and not response.prepared:
            response.force_close()
        return response

    def _authenticate(self, request: web.Request) -> str | web.Response | None:
        """The tenant whose API key the request carries; None without --api-keys; a 401 without a key in force
        (the body left unread)."""
        if self.keys is None:
            return None
        header = request.headers.get(hdrs.AUTHORIZATION)
        tenant = self.keys.tenant(header)
        if tenant is not None:
            return tenant
        reason = "invalid" if header else "missing"
        self.metrics.auth_failed(reason)
        self.clients_log.info("refused a request from %s: %s API key", request.remote, reason)
        message = ("no API key: send one as `Authorization: Bearer KEY`" if reason == "missing"
                   else "invalid API key: the Authorization header does not carry a key in force (`Bearer KEY`)")
        return self._reject(401, message, type_="invalid_request_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"}, close=request.can_read_body)

    def _over_limit(self, tenant: str, refusal: Refusal | None, *, close: bool = False) -> web.Response | None:
        """The 429 for a tenant over one of its limits; None when it is not."""
        if refusal is None:
            return None
        self.metrics.tenant_rejected(tenant, refusal.limit)
        return self._reject(429, refusal.message, type_=refusal.limit, code="rate_limit_exceeded",
                            headers={"Retry-After": str(refusal.retry_after)}, close=close)

    def completion_estimate(self, path: str, body: Mapping[str, Any]) -> int:
        """The most tokens a request may generate, as charged at admission: max_tokens (else
        --default-max-tokens) for each of its `n` choices; 0 for what generates nothing."""
        if path not in GENERATION_PATHS:
            return 0
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            limit = self.config.default_max_tokens
        n = body.get("n")
        return limit * (n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1)

    def _settle(self, tenant: str, charged: int, meter: UsageMeter) -> None:
        """Charge what the request used instead of its estimate."""
        used = meter.used()
        final = charged if used is None else used
        self.key_limits.settle(tenant, charged, final)
        if self.keys is not None and tenant in self.keys.tenants:
            self.metrics.tenant_tokens(tenant, final)

    async def _inference(self, request: web.Request, start: float, tenant: str | None) -> web.StreamResponse:
        cfg = self.config
        resource = request.match_info.route.resource
        assert resource is not None
        path = resource.canonical
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
        if encoding not in ("", "identity"):
            return self._reject(415, "compressed request bodies are not accepted (Content-Encoding must be identity); "
                                     "send the JSON as is", close=True)
        length = request.content_length
        if length is not None and length > cfg.max_body_bytes:
            return self._reject(413, f"request body exceeds the router's limit of {cfg.max_body_bytes} bytes",
                                close=True)
        if tenant is not None:
            refused = self._over_limit(tenant, self.key_limits.admit_request(tenant), close=True)
            if refused is not None:
                return refused
        body = _Body(self.body_budget)
        meter: UsageMeter | None = None
        call: _Call | None = None
        charged = 0
        try:
            refused = await self._read(request, body)
            if refused is not None:
                return refused
            parsed = self._parse(body.data)
            if isinstance(parsed, web.Response):
                return parsed
            model = parsed.get("model")
            adapter = await self._adapter(model, start)
            unresolved: str | None = None
            if cfg.model and model is not None and model != cfg.model and adapter is None:
                if not isinstance(model, str) or self._models_known():
                    return self._unknown_model(model)
                unresolved = model  # no healthy engine has listed its models yet: it may be an adapter; wait
            if adapter is not None:
                request[_ADAPTER] = adapter
            if tenant is not None and self.key_limits.counts_tokens:
                prompt = estimate_prompt_tokens(parsed)
                estimate = prompt + self.completion_estimate(path, parsed)
                refused = self._over_limit(tenant, self.key_limits.admit_tokens(tenant, estimate))
                if refused is not None:
                    return refused
                meter, charged = UsageMeter(prompt), estimate
            headers = {name: request.headers[name] for name in self._forwarded if name in request.headers}
            headers[hdrs.CONTENT_TYPE] = "application/json"
            info = self._request_info(request, parsed)
            if adapter is not None:
                info.adapter = _adapter_key(adapter)
                info.hosts = frozenset(url for url, names in self._adapter_hosts.items() if adapter in names)
            call = _Call(path, body, headers, info, self.first_byte_bound(path, parsed),
                         start, tenant=tenant, meter=meter, adapter=adapter, unresolved=unresolved,
                         resumable=cfg.stream_resumptions > 0 and resumable(path, parsed, len(body.data)))
            if path in GENERATION_PATHS and parsed.get("stream") is True and (call.resumable or meter is not None):
                self._ask_usage(call, parsed)
            if self.prefill is not None and path in GENERATION_PATHS:
                await self._prefill(self.prefill, call, parsed)
            del parsed  # the bytes are what is forwarded; the parsed copy can go now
            return await self._dispatch(request, call)
        finally:
            body.release()
            if meter is not None and tenant is not None:
                if call is not None and call.stream is not None:
                    meter.stream(call.stream.prompt_tokens, call.stream.tokens)
                self._settle(tenant, charged, meter)

    def _ask_usage(self, call: _Call, parsed: dict[str, Any]) -> None:
        """Have a stream the router tracks (resumable or metered) carry the engine's token counts on every event
        (router/resume.py), noting what usage its client asked for; the request goes as it came when its
        stream_options are not an object (the engine refuses it) or the body budget cannot take the bytes."""
        asked = usage_asked(parsed)
        if asked is None:
            return
        call.usage = asked
        rewritten = ask_usage(call.body.data, parsed)
        if rewritten is not None and call.body.replace(rewritten[0]):
            parsed["stream_options"] = rewritten[1]  # what a rewrite of the body from it (prefill) must keep
            call.usage_added = True

    def _unknown_model(self, model: Any) -> web.Response:
        """The 404 for a model that is neither the served one nor an adapter a healthy engine lists."""
        served = f"`{self.config.model}`" + (f" and its adapters ({', '.join(sorted(self.adapters)[:20])})"
                                             if self.adapters else "")
        return self._reject(404, f"The model `{str(model)[:200]}` does not exist; this endpoint serves {served}.",
                            param="model")

    async def _prefill(self, stage: PrefillStage, call: _Call, parsed: dict[str, Any]) -> None:
        """The first of a disaggregated request's two phases (router/prefill.py): on success the call carries the
        prefill engine's kv_transfer_params to the decode engine; otherwise it goes as it came (the decode engine
        computes the prompt)."""
        assert self.session is not None
        # The prefill half answers after its prompt and one token: bounded as a stream's first byte is.
        bound = self.first_byte_bound(call.path, {**parsed, "stream": True})
        # The prompt hashed once where the decode side hashed it alike (an adapter's info routes by the adapter).
        same = (self.strategy.needs_prefix and self.strategy.block_chars == stage.strategy.block_chars
                and call.info.adapter is None)
        info = call.info if same else stage.info(parsed)
        outcome, params = await stage.run(self.session, call.path, parsed, info, call.headers, bound)
        if params is not None:
            data = json.dumps({**parsed, KV_TRANSFER_PARAMS: params}, separators=(",", ":")).encode()
            if call.body.replace(data):
                call.info.queues_prompt = False  # the decode engine computes none of it: nothing for it to queue
            else:
                outcome = "failed"  # no room in the body budget for the rewritten request: it goes as it came
        self.metrics.prefill(outcome)

    async def _adapter(self, model: Any, arrived: float) -> str | None:
        """MODEL when it names a LoRA adapter the engines serve. A name not known yet waits for the engines' lists
        as asked after the request ARRIVED (rounds start at most once a second, shared by every request waiting),
        so an adapter loaded a moment ago is found, never refused."""
        if not isinstance(model, str) or model == self.config.model:
            return None
        if model not in self.adapters:
            if self._models_known():
                await self._refresh_adapters(since=arrived)
            elif self._now() - self._round_started >= ADAPTERS_ASK_AGAIN_SECONDS:
                # No healthy engine's list to refuse it by: the request waits for an engine (unresolved), and
                # asks once more now in case one has just come up.
                await self._refresh_adapters()
        return model if model in self.adapters else None

    def _models_known(self) -> bool:
        """Whether the router holds the model list of an engine that is healthy now: a name no such list has is
        no adapter of the fleet's (404). Without one (a cold start, every engine ejected, the router just
        started) a name may be an adapter the router has not heard of yet."""
        return any(b.healthy and b.url in self._adapter_hosts for b in self.pool)

    async def _resolve_model(self, request: web.Request, call: _Call, backend: Backend, exclude: frozenset[str],
                             waiting: float) -> Backend:
        """A request naming a model no healthy engine had listed when it came (call.unresolved), now that it has
        an engine: learn the lists (BACKEND is up). An adapter goes on as one, to an engine that lists it; a name
        no list has is refused (_NoSuchModel: 404, the slot given back); with still no list to be had (BACKEND
        did not answer /v1/models) it goes to BACKEND, which decides."""
        name = call.unresolved
        assert name is not None
        call.unresolved = None
        if name not in self.adapters:
            # BACKEND's list is one the router lacks: a round from now on; else one begun since the request came
            await self._refresh_adapters(since=self._now() if backend.url not in self._adapter_hosts else call.start)
        if name in self.adapters:
            call.adapter = request[_ADAPTER] = name
            call.info.adapter = _adapter_key(name)
            call.info.hosts = frozenset(url for url, names in self._adapter_hosts.items() if name in names)
            if backend.url in call.info.hosts:
                return backend
            self.dispatcher.release(backend, call.info)  # picked without the adapter's placement: pick again
            return await self.dispatcher.acquire(call.info, exclude, tenant=call.tenant, timeout=waiting)
        if self._models_known():
            self.dispatcher.release(backend, call.info)
            raise _NoSuchModel(name)
        return backend

    async def _refresh_adapters(self, since: float | None = None) -> None:
        """Learn the adapters the healthy engines list in /v1/models (entries with a parent); callers at the same
        time share one round of asking. SINCE: return once a round begun at or after it has ended (a new one
        begins at most every ADAPTERS_ASK_AGAIN_SECONDS); None: once the round in flight, or a new one, ends."""
        while since is None or self._round_answered < since:
            task = self._refreshing
            if task is None or task.done():
                wait = self._round_started + ADAPTERS_ASK_AGAIN_SECONDS - self._now()
                if since is not None and wait > 0:
                    await asyncio.sleep(wait)
                    continue  # another waiter may have begun the round meanwhile
                self._round_started = self._now()
                task = self._refreshing = asyncio.create_task(self._ask_adapters(self._round_started),
                                                              name="router-adapters")
            await asyncio.shield(task)
            if since is None:
                return

    async def _ask_adapters(self, started: float) -> None:
        try:
            await self._ask_engines_adapters()
        finally:
            self._round_answered = max(self._round_answered, started)

    async def _ask_engines_adapters(self) -> None:
        assert self.session is not None
        session = self.session
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        healthy = [b for b in self.pool if b.healthy]

        async def listed(backend: Backend) -> set[str]:
            async with session.get(backend.url + "/v1/models", timeout=timeout) as resp:
                data = (await resp.json(content_type=None)).get("data", []) if resp.status == 200 else []
            return {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent")}

        results = await asyncio.gather(*(listed(b) for b in healthy), return_exceptions=True)
        answers = [r for r in results if isinstance(r, set)]
        if answers:  # else ask again at the next chance: no engine could say
            self.adapters = frozenset().union(*answers)
            self._adapter_hosts = {b.url: frozenset(r) for b, r in zip(healthy, results, strict=True)
                                   if isinstance(r, set)}
            self._adapters_asked = self._now()
            self._adapters_from = frozenset(b.url for b in healthy)

    async def _read(self, request: web.Request, body: _Body) -> web.Response | None:
        """Read the body within the size limit, the in-flight budget and the body timeout; an answer if it can't."""
        cfg = self.config
        content = request.content
        try:
            if content.is_eof():  # the usual case: the whole body came with the head, no need for a timer
                return self._take(body, content.read_nowait())
            async with asyncio.timeout(cfg.body_timeout):
                while chunk := await content.readany():
                    refused = self._take(body, chunk)
                    if refused is not None:
                        return refused
        except TimeoutError:
            self.clients_log.info("closed a connection from %s: request body not complete within %gs", request.remote,
                                  cfg.body_timeout)
            return self._reject(408, f"the request body did not arrive within {cfg.body_timeout:g}s", close=True)
        except web.RequestPayloadError:
            return self._reject(400, "the request body is malformed (bad chunked encoding)", close=True)
        return None

    def _take(self, body: _Body, chunk: bytes) -> web.Response | None:
        """Add a chunk to the body, or the answer refusing it: too large (413), or over the budget (503)."""
        limit = self.config.max_body_bytes
        if len(body.data) + len(chunk) > limit:
            return self._reject(413, f"request body exceeds the router's limit of {limit} bytes", close=True)
        if body.add(chunk):
            return None
        self.clients_log.warning("refused a request: the router already holds %d bytes of request bodies (limit %d)",
                                 self.body_budget.used, self.body_budget.limit)
        return self._reject(503, "the router is holding too many request bytes right now; retry later",
                            headers={"Retry-After": RETRY_AFTER_SECONDS}, close=True)

    def _parse(self, raw: bytearray) -> dict[str, Any] | web.Response:
        """The body as a JSON object, or a 400 that says which limit it broke."""
        cfg = self.config
        containers = raw.count(b"[") + raw.count(b"{")
        if containers + raw.count(b",") >= cfg.max_json_values:
            return self._reject(400, f"request body has more than {cfg.max_json_values} JSON values")
        try:
            body = json.loads(raw)
        except RecursionError:
            return self._reject(400, f"request body nests JSON deeper than {cfg.max_json_depth} levels")
        except (ValueError, UnicodeDecodeError) as exc:
            return self._reject(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return self._reject(400, "request body must be a JSON object")
        if containers > cfg.max_json_depth and _deeper_than(body, cfg.max_json_depth):
            return self._reject(400, f"request body nests JSON deeper than {cfg.max_json_depth} levels")
        return body

    async def _dispatch(self, request: web.Request, call: _Call) -> web.StreamResponse:
        """Send the call to engines until one answers (or the retries are spent); the answer, or the router's."""
        tried: set[str] = set()
        failures: list[_Failed] = []
        retry_after: dict[str, str] = {}
        # A request that finds no engine to serve it during a cold start (the fleet waking from zero, its
        # engines loading) waits up to --cold-start-timeout, not --queue-timeout.
        waiting = self.config.queue_timeout
        if not self.pool.routable():
            if self.demand is not None:
                self.demand.touch(urgent=True)
            if self.cold_start() is not None:
                waiting = max(waiting, self.config.cold_start_timeout)
        elif self.demand is not None:
            self.demand.touch()
        for attempt in range(self.config.retries + 1):
            try:
                backend = await self.dispatcher.acquire(call.info, frozenset(tried), tenant=call.tenant,
                                                        timeout=waiting)
                if call.unresolved is not None:
                    backend = await self._resolve_model(request, call, backend, frozenset(tried), waiting)
            except _NoSuchModel as exc:
                return self._unknown_model(exc.model)
            except QueueFull as exc:
                if call.tenant is not None:
                    self.metrics.tenant_rejected(call.tenant, "queue")
                if exc.displaced:
                    message = ("the router's queue is full, and a request of an API key with fewer requests waiting "
                               "took this one's place; retry later")
                else:
                    message = (f"the router's queue is full ({self.dispatcher.max_queue} requests waiting for an "
                               "engine); retry later")
                return self._reject(429, message, headers={"Retry-After": RETRY_AFTER_SECONDS})
            except QueueTimeout:
                healthy = sum(1 for b in self.pool if b.healthy)
                return self._reject(503, f"no engine could take the request within {waiting:g}s "
                                         f"({len(self.pool)} engines, {healthy} healthy); the service is overloaded "
                                         "or starting, retry later", headers={"Retry-After": RETRY_AFTER_SECONDS})
            except ShuttingDown:
                return self._shutting_down()
            except Unavailable as exc:
                retry_after = {"Retry-After": str(exc.retry_after)}
                if failures:
                    break  # it failed where it was tried: say how, below
                return self._reject(503, str(exc), headers=retry_after)
            except NoBackend:
                break
            tried.add(backend.url)
            code = CLIENT_CLOSED
            broken: _Resume | None = None
            try:
                response = await self._attempt(request, backend, call)
                code = str(response.status)
                return response
            except _Resume as exc:
                code = "200"  # its answer began as one; the rest comes from elsewhere
                broken = exc
            except _Failed as exc:
                failures.append(exc)
                code = str(exc.final.status) if exc.final is not None else "502"
                if exc.fault == FATAL:
                    self.pool.record_failure(backend, fatal=True)
                elif exc.fault == COUNTED:
                    self.pool.record_failure(backend)
                else:
                    if exc.fault == SUSPECT:
                        call.suspects.append(backend)
                    self.pool.record_neutral(backend)
                if attempt < self.config.retries:
                    self.metrics.retry(exc.reason)
                    log.info("engine %s: %s before the first byte; retrying elsewhere", backend.url, exc)
                else:
                    log.info("engine %s: %s before the first byte", backend.url, exc)
            except _Stopped:
                code = "503"  # counted against this attempt's engine label below, like any answer on its behalf
                response = error_response(503, SHUTTING_DOWN, headers={"Retry-After": RETRY_AFTER_SECONDS})
                response.force_close()
                return response
            finally:
                self.dispatcher.release(backend, call.info)
                self.metrics.attempt_done(backend.url, code)
            if broken is not None:
                return await self._resume(request, call, broken)
        final = next((f.final for f in reversed(failures) if f.final is not None), None)
        if final is not None:
            return final
        reasons = "; ".join(dict.fromkeys(str(f) for f in failures)) or "no engine"
        status = 504 if failures and all(f.reason in ("timeout", "unresponsive") for f in failures) else 502
        return self._reject(status, f"no engine could serve the request ({len(failures)} tried: {reasons})",
                            headers=retry_after)

    def _reject(self, status: int, message: str, *, param: str | None = None, type_: str | None = None,
                code: str | None = None, headers: Mapping[str, str] | None = None, close: bool = False) -> web.Response:
        """An answer the router gives itself (counted against no engine); `close` for a request whose body
        was left unread, so the connection is not kept for more."""
        self.metrics.attempt_done(NO_BACKEND, str(status))
        response = error_response(status, message, type_=type_, param=param, code=code, headers=headers)
        if close:
            response.force_close()
        return response

    def _shutting_down(self) -> web.Response:
        return self._reject(503, SHUTTING_DOWN, headers={"Retry-After": RETRY_AFTER_SECONDS}, close=True)

    async def _attempt(self, request: web.Request, backend: Backend, call: _Call) -> web.StreamResponse:
        """The call on one engine: its whole answer, or its stream relayed."""
        assert self._loop is not None
        attempt = _Attempt(backend, self._loop)
        self._attempts.add(attempt)
        try:
            try:
                async with asyncio.timeout(call.first_byte_bound) as timer:
                    attempt.timer = timer
                    first, payload = await self._exchange(backend, call, attempt)
            except TimeoutError:
                if attempt.reason == "shutdown":
                    raise _Stopped() from None
                if attempt.reason == "unresponsive":
                    raise _Failed("unresponsive", "its engine stopped answering health checks", fault=None) from None
                raise _Failed("timeout", f"no answer within {call.first_byte_bound or 0:g}s", fault=None) from None
            finally:
                attempt.timer = None
                self.dispatcher.discharge(backend, call.info)
            # This engine answered without a 5xx: those that answered this same request with one were at fault.
            for suspect in call.suspects:
                self.pool.record_failure(suspect)
            call.suspects.clear()
            upstream = attempt.upstream
            assert upstream is not None
            if payload is not None:
                if call.response is not None:  # a continuation answered whole: an error (a stream was asked for)
                    raise _Failed("status", f"an engine answered HTTP {upstream.status}: {payload[:300]!r}", fault=None,
                                  final=web.Response(body=payload, status=upstream.status))
                if upstream.status >= 400:
                    self.pool.record_neutral(backend)  # the client's doing, not the engine's
                else:
                    self.pool.record_success(backend)
                if call.meter is not None:
                    call.meter.answer(upstream.status, payload)
                return web.Response(body=payload, status=upstream.status, headers=self._relay_headers(upstream, backend))
            assert first is not None
            return await self._relay_stream(request, attempt, upstream, first, call)
        finally:
            self._attempts.discard(attempt)
            upstream = attempt.upstream
            if upstream is not None:
                # close(), not release(): an unfinished answer must drop the
                # connection, which is what tells the engine to abort.
                if not upstream.closed and not upstream.content.is_eof():
                    upstream.close()
                else:
                    upstream.release()

    async def _exchange(self, backend: Backend, call: _Call, attempt: _Attempt) -> tuple[bytes | None, bytes | None]:
        """Send the call and wait for the answer's first byte: (first chunk, None) for a stream, (None, whole
        answer) otherwise. An engine failure raises _Failed."""
        assert self.session is not None
        try:
            upstream = await self._post(backend, call)
        except (aiohttp.ClientConnectorError, ConnectionError) as exc:
            raise _Failed("connect", f"could not connect to an engine ({exc.__class__.__name__})", fault=FATAL) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _Failed("upstream", f"an engine failed before answering ({exc.__class__.__name__})",
                          fault=COUNTED) from None
        attempt.upstream = upstream
        try:
            if upstream.status >= 500:
                payload = await upstream.read()
                final = web.Response(body=payload, status=upstream.status, headers=self._relay_headers(upstream, backend))
                raise _Failed("status", f"an engine answered HTTP {upstream.status}", fault=SUSPECT, final=final)
            if upstream.status == 200 and upstream.headers.get(hdrs.CONTENT_TYPE, "").startswith(SSE_CONTENT_TYPE):
                first = await upstream.content.readany()
                if not first:
                    raise _Failed("upstream", "an engine ended the stream before sending anything", fault=COUNTED)
                return first, None
            return None, await upstream.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _Failed("upstream", f"an engine failed mid-answer ({exc.__class__.__name__})", fault=FATAL) from None

    async def _post(self, backend: Backend, call: _Call) -> aiohttp.ClientResponse:
        """POST the call; once more on a new connection if the engine hung up before answering anything (a
        pooled connection it closed: no engine fault; httpapi.post_resending_once)."""
        assert self.session is not None

        def resend(exc: BaseException) -> None:
            log.debug("engine %s: %s on a pooled connection; sending again", backend.url, exc.__class__.__name__)
            self.metrics.retry("closed_idle")

        return await post_resending_once(self.session, backend.url + call.path, on_resend=resend,
                                         data=call.body.data, headers=call.headers)

    def _relay_headers(self, upstream: aiohttp.ClientResponse, backend: Backend) -> dict[str, str]:
        out = {name: upstream.headers[name] for name in _RELAYED_RESPONSE_HEADERS if name in upstream.headers}
        if self.config.backend_header:
            out[contract.BACKEND_HEADER] = backend.url
        return out

    async def _relay_stream(self, request: web.Request, attempt: _Attempt, upstream: aiohttp.ClientResponse,
                            first: bytes, call: _Call) -> web.StreamResponse:
        """Relay the engine's stream to the client as it comes (a continuation's onto the client's stream, its
        events rewritten). An interruption ends it with an error event, or raises _Resume for a resumable one."""
        backend = attempt.backend
        stream = call.stream
        continuing = call.response is not None
        if call.response is None:
            if call.resumable or call.meter is not None:
                # Tracked for a continuation, or for its token charge; a resumable one's body stays for a
                # continuation (resume.MAX_BODY_BYTES at most).
                stream = call.stream = StreamState.start(call.path, call.body.data if call.resumable else b"",
                                                         resumable=call.resumable, usage=call.usage,
                                                         added=call.usage_added)
            call.body.release()  # no retry can need it from here on
            response = call.response = web.StreamResponse(status=upstream.status, headers={
                **self._relay_headers(upstream, backend), "Cache-Control": "no-cache"})
            if self.draining:
                response.force_close()
        else:
            response = call.response
        content = upstream.content
        loop_time = self._now
        resumes = stream is not None and stream.resumable
        attempt.client = request.transport
        attempt.streaming = attempt.writing = True
        attempt.last = loop_time()
        try:
            if not continuing:
                await response.prepare(request)
            out = first if stream is None else stream.feed(first)
            if out:
                await response.write(out)
            attempt.writing = False
            if not continuing:
                self.metrics.first_byte(loop_time() - call.start, call.adapter)
            tail = out[-2:]
            while True:
                attempt.last = loop_time()
                try:
                    chunk = await content.readany()
                except _Interrupted as exc:
                    if resumes and exc.reason != "shutdown":
                        status, message = self._breakage(backend, exc.reason)
                        raise _Resume(backend, exc.reason, status, message) from None
                    await self._end_interrupted(response, tail, backend, exc.reason)
                    return response
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self.pool.record_failure(backend, fatal=True)
                    status, message = self._breakage(backend, "failed", exc)
                    if resumes:
                        raise _Resume(backend, "failed", status, message) from None
                    self.metrics.stream_error(backend)
                    await self._stream_error(response, tail, status, message)
                    return response
                if not chunk:
                    break
                out = chunk if stream is None else stream.feed(chunk)
                if not out:
                    continue
                attempt.writing = True
                attempt.last = loop_time()
                await response.write(out)
                attempt.writing = False
                tail = out[-2:] if len(out) >= 2 else tail[-1:] + out
            self.pool.record_success(backend)
            if stream is not None and (rest := stream.leftover()):
                await response.write(rest)
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            # The client went away between two chunks (a write failed rather
            # than the handler being cancelled); the engine is fine.
            raise _ClientGone(response) from None
        finally:
            attempt.streaming = False
        return response

    def _breakage(self, backend: Backend, reason: str, exc: BaseException | None = None) -> tuple[int, str]:
        """Log how an engine's stream broke (`unresponsive`, `stalled` or `failed` with EXC); the status and
        message of the error event that ends the client's stream if it cannot go on."""
        if reason == "unresponsive":
            log.warning("engine %s stopped answering health checks mid-stream", backend.url)
            return 504, "the engine serving this request stopped responding mid-stream; the answer is incomplete"
        if reason == "stalled":
            log.warning("engine %s sent nothing for %gs mid-stream", backend.url, self.config.stream_idle_timeout)
            return 504, (f"the engine serving this request sent nothing for {self.config.stream_idle_timeout:g}s "
                         "mid-stream; the answer is incomplete")
        log.warning("engine %s failed mid-stream: %r", backend.url, exc)
        name = exc.__class__.__name__ if exc is not None else "error"
        return 502, f"the engine serving this request failed mid-stream ({name}); the answer is incomplete"

    async def _end_interrupted(self, response: web.StreamResponse, tail: bytes, backend: Backend, reason: str) -> None:
        if reason == "shutdown":
            await self._stream_error(response, tail, 503, "the router is shutting down; the answer is incomplete, "
                                                          "retry the request", type_="ServiceUnavailableError")
            return
        self.metrics.stream_error(backend)
        status, message = self._breakage(backend, reason)
        await self._stream_error(response, tail, status, message)

    async def _resume(self, request: web.Request, call: _Call, broken: _Resume) -> web.StreamResponse:
        """Continue a stream that broke mid-way as a continuation on another engine (never one it broke on), at
        most --stream-resumptions times; a stream that cannot be continued ends with its error event."""
        stream, response = call.stream, call.response
        assert stream is not None and response is not None
        while True:
            stream.failed.add(broken.backend.url)
            body = stream.continuation_body() if not stream.complete and stream.blocked is None else None
            if stream.complete or (stream.blocked is None and body is None):
                # All of the answer was sent (the engine broke before its last events): end the stream.
                await self._finish(response, stream.ending())
                return response
            why = stream.blocked
            if why is None and stream.resumptions >= self.config.stream_resumptions:
                why = f"it was resumed {stream.resumptions} times already"
            backend = None
            if why is None:
                try:
                    backend = await self.dispatcher.acquire(call.info, frozenset(stream.failed), tenant=call.tenant)
                except (QueueFull, QueueTimeout, ShuttingDown, Unavailable, NoBackend) as exc:
                    why = f"no other engine could take it ({exc.__class__.__name__})"
            if why is not None or backend is None or body is None:
                log.warning("a stream broken on engine %s ends with an error event: %s", broken.backend.url, why)
                self.metrics.stream_error(broken.backend)
                await self._stream_error(response, b"\n\n", broken.status, broken.message)
                return response
            stream.resumptions += 1
            self.metrics.stream_resumed(broken.reason)
            log.info("resuming a stream broken on engine %s on engine %s (%d token(s) sent; resumption %d of %d)",
                     broken.backend.url, backend.url, stream.tokens, stream.resumptions, self.config.stream_resumptions)
            data = _Body(self.body_budget)
            data.data = bytearray(json.dumps(body, ensure_ascii=False).encode())  # not charged: the stream's own
            continuation = _Call(call.path, data, call.headers, call.info, self.first_byte_bound(call.path, body),
                                 self._now(), tenant=call.tenant, meter=call.meter, stream=stream, response=response)
            stream.begin_continuation()
            code = CLIENT_CLOSED
            try:
                await self._attempt(request, backend, continuation)
                code = "200"
                return response
            except _Resume as exc:
                code = "200"
                broken = exc
            except _Failed as exc:
                code = str(exc.final.status) if exc.final is not None else "502"
                if exc.fault == FATAL:
                    self.pool.record_failure(backend, fatal=True)
                elif exc.fault == COUNTED:
                    self.pool.record_failure(backend)
                else:
                    self.pool.record_neutral(backend)
                log.info("engine %s: %s before the continuation's first byte", backend.url, exc)
                if exc.final is not None and exc.final.status < 500:
                    # Refused (4xx): any engine would refuse it. The stream ends as it would have without it.
                    self.metrics.stream_error(broken.backend)
                    await self._stream_error(response, b"\n\n", broken.status, broken.message)
                    return response
                broken = _Resume(backend, exc.reason, broken.status, broken.message)
            except _Stopped:
                code = "503"
                await self._stream_error(response, b"\n\n", 503, "the router is shutting down; the answer is "
                                         "incomplete, retry the request", type_="ServiceUnavailableError")
                return response
            finally:
                self.dispatcher.release(backend, call.info)
                self.metrics.attempt_done(backend.url, code)

    async def _finish(self, response: web.StreamResponse, data: bytes) -> None:
        """Write the last bytes of a stream and end it (a client gone by then is no matter)."""
        try:
            if data:
                await response.write(data)
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass

    async def _stream_error(self, response: web.StreamResponse, tail: bytes, status: int, message: str, *,
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

    # --- shutdown ----------------------------------------------------------------------
    async def drain(self, runner: web.AppRunner) -> None:
        """SIGTERM: keep serving for the drain delay, stop accepting, give in-flight requests the grace period,
        then end what is left (streams with an SSE error event, the rest with 503)."""
        cfg = self.config
        self.draining = True
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
            await asyncio.wait_for(self._idle.wait(), cfg.shutdown_grace)
            log.info("drained: no request in flight")
            return
        except TimeoutError:
            pass
        log.warning("shutdown grace of %gs over: ending %d requests", cfg.shutdown_grace, self._active)
        self.dispatcher.close()
        for attempt in list(self._attempts):
            attempt.interrupt("shutdown")
        try:
            await asyncio.wait_for(self._idle.wait(), SHUTDOWN_STOP_SECONDS)
        except TimeoutError:
            pass
