"""The router's Prometheus metrics (names in contract.ROUTER_METRIC_*): requests, attempts, retries and resumptions, per
engine, per tenant and per adapter, and the gauges read from the pool and the queue at scrape time, the autoscaling
signal's among them. Design: docs/autoscaling.md#the-signal-every-queue-per-replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tensorfleet import contract
from tensorfleet.router.backends import Backend, BackendPool

# Router-side latency: sub-millisecond errors up to minutes-long generations.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0, 160.0, 320.0, 640.0)
NO_BACKEND = "none"  # the `backend` label of answers the router gives itself
CLIENT_CLOSED = "499"  # nginx's code for "client closed the request"


class _PoolCollector(Collector):
    def __init__(self, pool: BackendPool, pending: Callable[[], int], burst: Callable[[], float] | None,
                 tenants: Callable[[], Mapping[str | None, int]] | None, keys: Callable[[], int] | None) -> None:
        self.pool = pool
        self.pending = pending
        self.burst = burst
        self.tenants = tenants
        self.keys = keys

    def collect(self) -> Iterator[Metric]:
        backend = contract.ROUTER_LABEL_BACKEND
        pending = GaugeMetricFamily(contract.ROUTER_METRIC_PENDING,
                                    "Requests queued at the router waiting for a free engine slot.")
        pending.add_metric([], self.pending())
        yield pending
        yield GaugeMetricFamily(contract.ROUTER_METRIC_BURST,
                                "Requests running on engines beyond the router's per-engine ceiling (demand beyond "
                                "what a replica is sized for), this router's share.",
                                value=self.burst() if self.burst is not None else 0.0)
        if self.tenants is not None:
            by_tenant = GaugeMetricFamily(contract.ROUTER_METRIC_TENANT_PENDING,
                                          "Requests queued at the router per tenant (API key).",
                                          labels=[contract.ROUTER_LABEL_TENANT])
            for tenant, count in sorted(self.tenants().items(), key=lambda item: item[0] or ""):
                if tenant is not None:
                    by_tenant.add_metric([tenant], count)
            yield by_tenant
        if self.keys is not None:
            yield GaugeMetricFamily(contract.ROUTER_METRIC_API_KEYS, "API keys in force (tenants).",
                                    value=self.keys())
        in_flight = GaugeMetricFamily(contract.ROUTER_METRIC_IN_FLIGHT, "Requests in flight per engine.",
                                      labels=[backend])
        healthy = GaugeMetricFamily(contract.ROUTER_METRIC_BACKEND_HEALTHY,
                                    "1 when the engine's circuit breaker is closed, else 0.", labels=[backend])
        for b in self.pool:
            in_flight.add_metric([b.url], b.own.requests)
            healthy.add_metric([b.url], 1.0 if b.healthy else 0.0)
        yield in_flight
        yield healthy


class RouterMetrics:
    def __init__(self, pool: BackendPool, pending: Callable[[], int], *,
                 burst: Callable[[], float] | None = None,
                 tenants: Callable[[], Mapping[str | None, int]] | None = None,
                 keys: Callable[[], int] | None = None) -> None:
        """BURST: requests running beyond the per-engine ceiling (dispatch.Dispatcher.burst_requests); TENANTS
        (requests queued per tenant) and KEYS (keys in force) when the router has API keys."""
        self.registry = reg = CollectorRegistry(auto_describe=True)
        reg.register(_PoolCollector(pool, pending, burst, tenants, keys))
        labels = [contract.ROUTER_LABEL_BACKEND, contract.ROUTER_LABEL_CODE]
        self._requests = Counter(contract.ROUTER_METRIC_REQUESTS, "Requests answered, by engine and HTTP status.",
                                 labels, registry=reg)
        self._duration = Histogram(contract.ROUTER_METRIC_DURATION,
                                   "Time from request received to response complete, by HTTP status.",
                                   [contract.ROUTER_LABEL_CODE], buckets=DURATION_BUCKETS, registry=reg)
        self._ttfb = Histogram(contract.ROUTER_METRIC_TTFT,
                               "Time from request received to the first streamed byte sent to the client "
                               "(the first token, for streaming requests).", buckets=DURATION_BUCKETS, registry=reg)
        self._retries = Counter(contract.ROUTER_METRIC_RETRIES,
                                "Requests sent again before any byte reached the client: to another engine, or (closed_idle) to the same "
                                "one over a new connection after a pooled one closed under them.",
                                ["reason"], registry=reg)
        self._ejections = Counter(contract.ROUTER_METRIC_EJECTIONS, "Times an engine's circuit breaker opened.",
                                  [contract.ROUTER_LABEL_BACKEND], registry=reg)
        self._stream_errors = Counter(contract.ROUTER_METRIC_STREAM_ERRORS,
                                      "Streams ended with an error event because the engine failed mid-stream.",
                                      [contract.ROUTER_LABEL_BACKEND], registry=reg)
        self._stream_resumptions = Counter(contract.ROUTER_METRIC_STREAM_RESUMPTIONS,
                                           "Continuations sent for streams whose engine broke mid-stream, by why: "
                                           "stalled, unresponsive, failed, or the retry reason (timeout, connect, "
                                           "...) of a previous continuation that failed before its first byte.",
                                           [contract.ROUTER_LABEL_REASON], registry=reg)
        tenant = contract.ROUTER_LABEL_TENANT
        self._tenant_requests = Counter(contract.ROUTER_METRIC_TENANT_REQUESTS,
                                        "Requests with a valid API key answered, by tenant and HTTP status.",
                                        [tenant, contract.ROUTER_LABEL_CODE], registry=reg)
        self._tenant_rejections = Counter(contract.ROUTER_METRIC_TENANT_REJECTIONS,
                                          "Requests with a valid API key refused with 429, by tenant and reason: "
                                          "requests or tokens (the key's per-minute limits), queue (the router's "
                                          "queue full).", [tenant, contract.ROUTER_LABEL_REASON], registry=reg)
        self._tenant_tokens = Counter(contract.ROUTER_METRIC_TENANT_TOKENS,
                                      "Tokens charged to each tenant's limit, as settled after the answer (only with "
                                      "a tokens-per-minute limit).", [tenant], registry=reg)
        self._auth_failures = Counter(contract.ROUTER_METRIC_AUTH_FAILURES,
                                      "Requests refused with 401, by reason: missing (no Bearer key) or invalid.",
                                      [contract.ROUTER_LABEL_REASON], registry=reg)
        # labels() takes a lock and builds a tuple; requests reuse children.
        self._request_children: dict[tuple[str, str], Counter] = {}
        self._duration_children: dict[str, Histogram] = {}
        # Per LoRA adapter: only names the engines serve get here (others are refused first), so the label's values
        # are bounded by the adapters configured.
        adapter = contract.ROUTER_LABEL_ADAPTER
        self._adapter_requests = Counter(contract.ROUTER_METRIC_ADAPTER_REQUESTS,
                                         "Requests for a LoRA adapter, by adapter and HTTP status.",
                                         [adapter, contract.ROUTER_LABEL_CODE], registry=reg)
        self._adapter_ttfb = Histogram(contract.ROUTER_METRIC_ADAPTER_TTFT,
                                       "Time to the first streamed byte of requests for a LoRA adapter.", [adapter],
                                       buckets=DURATION_BUCKETS, registry=reg)
        self._tenant_children: dict[tuple[Counter, tuple[str, ...]], Counter] = {}
        self._peer_placements: Counter | None = None
        pool.on_removed.append(self.forget)
        pool.on_ejected.append(lambda b: self._ejections.labels(b.url).inc())

    def attempt_done(self, backend: str, code: str) -> None:
        """One answer from an engine (or from the router itself, `none`)."""
        key = (backend, code)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self._requests.labels(backend, code)
        child.inc()

    def request_done(self, code: str, seconds: float, adapter: str | None = None) -> None:
        """One client request, however many engines it took (ADAPTER: the LoRA adapter it asked for)."""
        duration = self._duration_children.get(code)
        if duration is None:
            duration = self._duration_children[code] = self._duration.labels(code)
        duration.observe(seconds)
        if adapter is not None:
            self._adapter_requests.labels(adapter, code).inc()

    def first_byte(self, seconds: float, adapter: str | None = None) -> None:
        self._ttfb.observe(seconds)
        if adapter is not None:
            self._adapter_ttfb.labels(adapter).observe(seconds)

    def retry(self, reason: str) -> None:
        self._retries.labels(reason).inc()

    def stream_error(self, backend: Backend) -> None:
        self._stream_errors.labels(backend.url).inc()

    def stream_resumed(self, reason: str) -> None:
        self._stream_resumptions.labels(reason).inc()

    def prefill_outcomes(self, outcomes: Sequence[str]) -> None:
        """With prefill engines: count each outcome of the prefill half from zero, so a rate of it is defined."""
        self._prefill = Counter(contract.ROUTER_METRIC_PREFILL,
                                "Requests by how their prefill half went: remote (the KV went to the decode engine), "
                                "or why the decode engine computed the prompt itself.",
                                [contract.ROUTER_LABEL_OUTCOME], registry=self.registry)
        for outcome in outcomes:
            self._prefill.labels(outcome)

    def peer_outcomes(self, outcomes: Sequence[str]) -> None:
        """With router peers: count placements by outcome from zero."""
        self._peer_placements = Counter(
            contract.ROUTER_METRIC_PEER_PLACEMENTS,
            "Placements (which engine a prompt went to) exchanged with the other router replicas, by outcome: "
            "sent (per peer), failed (per peer: not delivered), dropped (the outbox overflowed between flushes), "
            "received.", [contract.ROUTER_LABEL_OUTCOME], registry=self.registry)
        for outcome in outcomes:
            self._peer_placements.labels(outcome)

    def peer_placements(self, outcome: str, count: int) -> None:
        if self._peer_placements is not None:
            self._peer_placements.labels(outcome).inc(count)

    def prefill(self, outcome: str) -> None:
        self._prefill.labels(outcome).inc()

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

    def forget(self, backend: Backend) -> None:
        """Drop the per-engine series of an engine that left the pool: pod IPs change on every restart, and series
        kept for every address ever seen would grow without bound. (Its gauges are read from the pool at scrape
        time, so they go by themselves.)"""
        for key in [k for k in self._request_children if k[0] == backend.url]:
            del self._request_children[key]
            self._requests.remove(*key)
        for metric in (self._ejections, self._stream_errors):
            try:
                metric.remove(backend.url)
            except KeyError:
                pass
