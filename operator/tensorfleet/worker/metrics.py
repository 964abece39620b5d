"""GPU health gauges in Prometheus format, read from NVML at scrape time, next to vLLM's own /metrics, and the pod's
`/health` served beside them (alone, without NVML, on a CPU engine pod). Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tensorfleet import contract
from tensorfleet.worker import gpu as gpus

LABELS = ("gpu", "uuid", "device")


class GpuCollector(Collector):
    """Reads NVML at scrape time (no background polling), so the values are as fresh as the scrape. When NVML is
    unavailable only `tensorfleet_gpu_nvml_up 0` and the expected count are exported."""

    def __init__(
        self,
        thresholds: gpus.Thresholds,
        *,
        xids: Callable[[], Iterable[dict[str, Any]]] = lambda: (),
        sampler: Callable[[], gpus.Snapshot] = gpus.sample,
    ) -> None:
        self.thresholds, self.xids, self.sampler = thresholds, xids, sampler

    def collect(self) -> Iterator[Any]:
        expected = GaugeMetricFamily(contract.GPU_METRIC_EXPECTED, "GPUs this pod needs (tensor-parallel size).")
        families = [expected] if self.thresholds.min_gpus is not None else []
        if self.thresholds.min_gpus is not None:
            expected.add_metric([], self.thresholds.min_gpus)
        up = GaugeMetricFamily(contract.GPU_METRIC_NVML_UP, "1 when NVML answers, 0 when GPUs cannot be read.")
        try:
            snapshot = self.sampler()
        except gpus.NvmlUnavailable:
            up.add_metric([], 0)
            yield from (up, *families)
            return
        up.add_metric([], 1)
        events = list(self.xids())
        report = gpus.evaluate(snapshot, self.thresholds, events)
        visible = GaugeMetricFamily(contract.GPU_METRIC_VISIBLE, "GPUs NVML sees in this container.")
        visible.add_metric([], len(snapshot.gpus))
        overall = GaugeMetricFamily(contract.GPU_METRIC_ALL_HEALTHY, "1 when `tensorfleet-worker health` would pass.")
        overall.add_metric([], 1 if report.healthy else 0)
        yield from (up, *families, visible, overall)

        def family(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=LABELS)

        healthy = family(contract.GPU_METRIC_HEALTHY, "1 when the GPU passes every health check.")
        temperature = family(contract.GPU_METRIC_TEMPERATURE, "GPU core temperature.")
        limit = family(contract.GPU_METRIC_TEMPERATURE_LIMIT, "Temperature at which the GPU counts as unhealthy.")
        used = family(contract.GPU_METRIC_MEMORY_USED, "Device memory in use.")
        total = family(contract.GPU_METRIC_MEMORY_TOTAL, "Device memory in all.")
        utilization = family(contract.GPU_METRIC_UTILIZATION, "Share of time a kernel ran over the last sample period (0-1).")
        power = family(contract.GPU_METRIC_POWER, "Power draw.")
        power_limit = family(contract.GPU_METRIC_POWER_LIMIT, "Enforced power limit.")
        ecc = family(contract.GPU_METRIC_ECC_UNCORRECTABLE, "Uncorrectable ECC errors since the driver loaded.")
        retired = family(contract.GPU_METRIC_RETIRED_PAGES_PENDING, "1 when retired pages wait for a GPU reset.")
        remap_pending = family(contract.GPU_METRIC_ROW_REMAP_PENDING, "1 when a row remap waits for a GPU reset.")
        remap_failure = family(contract.GPU_METRIC_ROW_REMAP_FAILURE, "1 when row remapping failed.")
        for g in snapshot.gpus:
            labels = [str(g.index), g.uuid, g.name]
            healthy.add_metric(labels, 1 if report.gpu_healthy(g.index) else 0)
            limit.add_metric(labels, self.thresholds.temperature_limit(g))
            for fam, value in (
                (temperature, g.temperature_c), (used, g.memory_used_bytes), (total, g.memory_total_bytes),
                (utilization, None if g.utilization_percent is None else g.utilization_percent / 100.0),
                (power, g.power_watts), (power_limit, g.power_limit_watts), (ecc, g.ecc_uncorrectable),
                (retired, g.retired_pages_pending), (remap_pending, g.row_remap_pending),
                (remap_failure, g.row_remap_failure),
            ):
                if value is not None:
                    fam.add_metric(labels, float(value))
        yield from (healthy, temperature, limit, used, total, utilization, power, power_limit,
                    ecc, retired, remap_pending, remap_failure)
        xid = CounterMetricFamily(contract.GPU_METRIC_XID_ERRORS, "XID critical errors NVML reported since the launcher started.",
                                  labels=["gpu", "xid"])
        counts: dict[tuple[str, str], int] = {}
        for event in events:
            key = (str(event.get("gpu", -1)), str(event.get("xid", 0)))
            counts[key] = counts.get(key, 0) + 1
        for key, count in sorted(counts.items()):
            xid.add_metric(list(key), count)
        yield xid


def registry_for(collector: GpuCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(collector: GpuCollector) -> str:
    """The Prometheus text format, once."""
    return generate_latest(registry_for(collector)).decode("utf-8")


# The check behind /health: (healthy, lines for a person).
HealthCheck = Callable[[], tuple[bool, list[str]]]


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], registry: CollectorRegistry | None, health: HealthCheck | None) -> None:
        super().__init__(addr, _Handler)
        self.registry, self.health = registry, health

    def shutdown(self) -> None:
        super().shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == contract.HEALTH_PATH and self.server.health is not None:
            try:
                healthy, lines = self.server.health()
            except Exception as exc:  # noqa: BLE001 - a probe must get an answer, not a reset connection
                healthy, lines = False, [f"unhealthy: the check failed: {exc!r}"]
            self._send(200 if healthy else 503, ("\n".join(lines) + "\n").encode(), "text/plain; charset=utf-8")
        elif path in (contract.METRICS_PATH, "/") and self.server.registry is not None:
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a probe every few seconds would flood the pod's log."""


def serve(port: int, collector: GpuCollector | None, addr: str = "0.0.0.0",
          health: HealthCheck | None = None) -> MetricsServer:
    """Serve /metrics and / (with a collector) and /health (when given) on port in a daemon thread; .shutdown()
    stops it. /health answers 200 or 503 with the check's lines as a plain-text body; without a collector (a CPU
    engine pod: no NVML) /metrics is 404."""
    server = MetricsServer((addr, port), registry_for(collector) if collector is not None else None, health)
    threading.Thread(target=server.serve_forever, name="gpu-metrics", daemon=True).start()
    return server
