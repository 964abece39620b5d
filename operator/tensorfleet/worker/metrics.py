"""GPU health gauges in Prometheus format, next to vLLM's own /metrics.

The collector reads NVML at scrape time (no background polling), so the
values are as fresh as the scrape. When NVML is unavailable only
`tensorfleet_gpu_nvml_up 0` and the expected count are exported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tensorfleet import contract
from tensorfleet.worker import gpu as gpus

LABELS = ("gpu", "uuid", "device")


class GpuCollector(Collector):
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


def serve(port: int, collector: GpuCollector, addr: str = "0.0.0.0") -> Any:
    """Serve /metrics on port in a daemon thread; returns the server (call .shutdown() to stop)."""
    server, _thread = start_http_server(port, addr=addr, registry=registry_for(collector))
    return server

