"""The router's Prometheus metrics (names in contract.ROUTER_METRIC_*): requests, attempts, retries and resumptions, per
engine, per tenant and per adapter, and the gauges read from the pool and the queue at scrape time, the autoscaling
signal's among them. Design: docs/autoscaling.md#the-signal-every-queue-per-replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tensorfleet import contract
from tensorfleet.router.backends import Backend, BackendPool
from tensorfleet.router.clients import CLIENT_CLOSED, DURATION_BUCKETS, NO_BACKEND, ClientMetrics

__all__ = ["CLIENT_CLOSED", "NO_BACKEND", "RouterMetrics"]


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


class RouterMetrics(ClientMetrics):
    def __init__(self, pool: BackendPool, pending: Callable[[], int], *,
                 burst: Callable[[], float] | None = None,
                 tenants: Callable[[], Mapping[str | None, int]] | None = None,
                 keys: Callable[[], int] | None = None) -> None:
        """BURST: requests running beyond the per-engine ceiling (dispatch.Dispatcher.burst_requests); TENANTS
        (requests queued per tenant) and KEYS (keys in force) when the router has API keys."""
        super().__init__(contract.ROUTER_CLIENT_METRICS)
        reg = self.registry
        reg.register(_PoolCollector(pool, pending, burst, tenants, keys))
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
        # Per LoRA adapter: only names the engines serve get here (others are refused first), so the label's values
        # are bounded by the adapters configured.
        adapter = contract.ROUTER_LABEL_ADAPTER
        self._adapter_requests = Counter(contract.ROUTER_METRIC_ADAPTER_REQUESTS,
                                         "Requests for a LoRA adapter, by adapter and HTTP status.",
                                         [adapter, contract.ROUTER_LABEL_CODE], registry=reg)
        self._adapter_ttfb = Histogram(contract.ROUTER_METRIC_ADAPTER_TTFT,
                                       "Time to the first streamed byte of requests for a LoRA adapter.", [adapter],
                                       buckets=DURATION_BUCKETS, registry=reg)
        self._peer_placements: Counter | None = None
        pool.on_removed.append(self.forget)
        pool.on_ejected.append(lambda b: self._ejections.labels(b.url).inc())

    def adapter_done(self, adapter: str | None, code: str, seconds: float) -> None:
        """One client request (ADAPTER: the LoRA adapter it asked for)."""
        self.request_done(code, seconds)
        if adapter is not None:
            self._adapter_requests.labels(adapter, code).inc()

    def adapter_first_byte(self, seconds: float, adapter: str | None) -> None:
        self.first_byte(seconds)
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

    def peer_yield_outcomes(self, outcomes: Sequence[str]) -> None:
        """With router peers whose strategy orders the queue: count slots left to peers by outcome from zero."""
        self._peer_yields = Counter(
            contract.ROUTER_METRIC_PEER_YIELDS,
            "Free engine slots this router left to another replica whose queued request would compute less prompt "
            "there, by how it ended: taken (a peer placed a request there), reclaimed (one of this router's "
            "requests took it: the peer did not come in time, or no longer wanted it).",
            [contract.ROUTER_LABEL_OUTCOME], registry=self.registry)
        for outcome in outcomes:
            self._peer_yields.labels(outcome)

    def peer_yield(self, outcome: str) -> None:
        self._peer_yields.labels(outcome).inc()

    def peer_placements(self, outcome: str, count: int) -> None:
        if self._peer_placements is not None:
            self._peer_placements.labels(outcome).inc(count)

    def prefill(self, outcome: str) -> None:
        self._prefill.labels(outcome).inc()

    def forget(self, backend: Backend) -> None:
        """Drop the per-engine series of an engine that left the pool: pod IPs change on every restart, and series
        kept for every address ever seen would grow without bound. (Its gauges are read from the pool at scrape
        time, so they go by themselves.)"""
        self.forget_backend(backend.url)
        for metric in (self._ejections, self._stream_errors):
            try:
                metric.remove(backend.url)
            except KeyError:
                pass
