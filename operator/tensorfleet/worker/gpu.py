"""GPU health through NVML (pynvml, from the `nvidia-ml-py` package): `sample()` reads every visible GPU, `evaluate()`
applies the thresholds and returns findings a person can read; the metrics exporter and `tensorfleet-worker health`
share both. Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tensorfleet import contract
from tensorfleet.gpus import find_gpu

# XIDs that mean the GPU (not the application) is broken and the pod must
# move: 48 double-bit ECC, 64 row-remap/page-retirement failure, 74 NVLink,
# 79 fallen off the bus, 94/95 contained/uncontained ECC, 119/120 GSP errors.
DEFAULT_FATAL_XIDS: frozenset[int] = frozenset({48, 64, 74, 79, 94, 95, 119, 120})
# When NVML does not report the slowdown temperature.
FALLBACK_MAX_TEMPERATURE_C = 85.0

OK, WARNING, UNHEALTHY = "ok", "warning", "unhealthy"


class NvmlUnavailable(Exception):
    """NVML cannot be used here (no driver, no library, no GPU)."""


@dataclass
class GpuSample:
    index: int
    name: str = "unknown"
    uuid: str = ""
    temperature_c: float | None = None
    slowdown_c: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_percent: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    ecc_uncorrectable: int | None = None      # volatile: since the last driver load
    retired_pages_pending: bool | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    error: str | None = None                  # the GPU could not be read at all (e.g. lost)


@dataclass
class Snapshot:
    gpus: list[GpuSample] = field(default_factory=list)
    driver: str | None = None


@dataclass(frozen=True)
class Thresholds:
    max_temperature_c: float | None = None     # None: each GPU's own slowdown temperature
    max_ecc_uncorrectable: int = 0
    max_memory_percent: float | None = None    # None: memory use is not judged (vLLM fills it by design)
    min_gpus: int | None = None                # None: no count check
    fatal_xids: frozenset[int] = DEFAULT_FATAL_XIDS

    def temperature_limit(self, gpu: GpuSample) -> float:
        if self.max_temperature_c is not None:
            return self.max_temperature_c
        return gpu.slowdown_c if gpu.slowdown_c else FALLBACK_MAX_TEMPERATURE_C


@dataclass
class Finding:
    level: str
    message: str
    gpu: int | None = None


@dataclass
class Report:
    snapshot: Snapshot
    findings: list[Finding]
    thresholds: Thresholds

    @property
    def healthy(self) -> bool:
        return not any(f.level == UNHEALTHY for f in self.findings)

    def gpu_healthy(self, index: int) -> bool:
        return not any(f.level == UNHEALTHY and f.gpu == index for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "driver": self.snapshot.driver,
            "gpus": [{**asdict(g), "healthy": self.gpu_healthy(g.index),
                      "temperatureLimitC": self.thresholds.temperature_limit(g)} for g in self.snapshot.gpus],
            "findings": [asdict(f) for f in self.findings],
        }


# Every pynvml call goes through the module attribute (`pynvml.nvmlX`), so tests replace them one by one.
def _pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("the pynvml module is not installed (pip install 'tensorfleet[worker]')") from None
    return pynvml


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _optional(fn: Callable[[], Any], nvml: Any) -> Any:
    """fn(), or None when this GPU does not expose the value (ECC on consumer parts, row remapping before Ampere):
    reported as unknown, never as a failure."""
    try:
        return fn()
    except nvml.NVMLError:
        return None


def init() -> Any:
    """nvmlInit, or NvmlUnavailable with the reason in plain words."""
    nvml = _pynvml()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML did not start ({exc})") from None
    return nvml


def _read(nvml: Any, index: int) -> GpuSample:
    gpu = GpuSample(index=index)
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        gpu.name = _text(nvml.nvmlDeviceGetName(handle))
        gpu.uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        gpu.temperature_c = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
    except nvml.NVMLError as exc:
        gpu.error = str(exc)
        return gpu
    slowdown = _optional(lambda: nvml.nvmlDeviceGetTemperatureThreshold(handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN), nvml)
    gpu.slowdown_c = float(slowdown) if slowdown else None
    memory = _optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle), nvml)
    if memory is not None:
        gpu.memory_used_bytes, gpu.memory_total_bytes = int(memory.used), int(memory.total)
    rates = _optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle), nvml)
    gpu.utilization_percent = float(rates.gpu) if rates is not None else None
    power = _optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle), nvml)
    gpu.power_watts = power / 1000.0 if power is not None else None
    limit = _optional(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle), nvml)
    gpu.power_limit_watts = limit / 1000.0 if limit is not None else None
    ecc = _optional(lambda: nvml.nvmlDeviceGetTotalEccErrors(
        handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC), nvml)
    gpu.ecc_uncorrectable = int(ecc) if ecc is not None else None
    pending = _optional(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle), nvml)
    gpu.retired_pages_pending = bool(pending) if pending is not None else None
    remap = _optional(lambda: nvml.nvmlDeviceGetRemappedRows(handle), nvml)
    if remap is not None:
        _corrected, _uncorrected, is_pending, failed = remap
        gpu.row_remap_pending, gpu.row_remap_failure = bool(is_pending), bool(failed)
    return gpu


def sample() -> Snapshot:
    """Read every visible GPU. Raises NvmlUnavailable when NVML cannot start."""
    nvml = init()
    try:
        driver = _optional(lambda: _text(nvml.nvmlSystemGetDriverVersion()), nvml)
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML could not count the GPUs ({exc})") from None
        return Snapshot(gpus=[_read(nvml, i) for i in range(count)], driver=driver)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def evaluate(snapshot: Snapshot, thresholds: Thresholds, xids: Iterable[dict[str, Any]] = ()) -> Report:
    """Apply the thresholds; every GPU gets a finding, plus one per problem."""
    findings: list[Finding] = []
    for gpu in snapshot.gpus:
        problems: list[Finding] = []
        if gpu.error:
            problems.append(Finding(UNHEALTHY, f"GPU {gpu.index} cannot be read: {gpu.error}", gpu.index))
        limit = thresholds.temperature_limit(gpu)
        if gpu.temperature_c is not None and gpu.temperature_c >= limit:
            problems.append(Finding(UNHEALTHY, f"GPU {gpu.index} is hot: {gpu.temperature_c:.0f} C >= {limit:.0f} C", gpu.index))
        if gpu.ecc_uncorrectable is not None and gpu.ecc_uncorrectable > thresholds.max_ecc_uncorrectable:
            problems.append(Finding(
                UNHEALTHY,
                f"GPU {gpu.index} has {gpu.ecc_uncorrectable} uncorrectable ECC error(s) since the driver loaded "
                f"(more than {thresholds.max_ecc_uncorrectable})", gpu.index))
        if gpu.row_remap_failure:
            problems.append(Finding(UNHEALTHY, f"GPU {gpu.index}: row remapping failed; the GPU needs service", gpu.index))
        if gpu.row_remap_pending:
            problems.append(Finding(WARNING, f"GPU {gpu.index}: a row remap is pending until the GPU is reset", gpu.index))
        if gpu.retired_pages_pending:
            problems.append(Finding(WARNING, f"GPU {gpu.index}: retired pages pending until the GPU is reset", gpu.index))
        if (thresholds.max_memory_percent is not None and gpu.memory_used_bytes is not None and gpu.memory_total_bytes):
            percent = 100.0 * gpu.memory_used_bytes / gpu.memory_total_bytes
            if percent > thresholds.max_memory_percent:
                problems.append(Finding(UNHEALTHY, f"GPU {gpu.index} memory {percent:.0f}% used > {thresholds.max_memory_percent:g}%", gpu.index))
        findings += problems or [Finding(OK, f"GPU {gpu.index} ok", gpu.index)]
    seen: set[tuple[int, int]] = set()
    for event in xids:
        key = (int(event.get("gpu", -1)), int(event.get("xid", 0)))
        if key in seen:
            continue
        seen.add(key)
        level = UNHEALTHY if key[1] in thresholds.fatal_xids else WARNING
        findings.append(Finding(level, f"GPU {key[0]} reported XID {key[1]}" + (
            " (fatal: the GPU needs a reset or service)" if level == UNHEALTHY else ""), key[0]))
    visible = len(snapshot.gpus)
    if thresholds.min_gpus is not None and visible < thresholds.min_gpus:
        findings.append(Finding(
            UNHEALTHY,
            f"{visible} GPU(s) visible but tensor parallel needs {thresholds.min_gpus} "
            "(check the pod's nvidia.com/gpu request or GPU claim, and CUDA_VISIBLE_DEVICES)"))
    return Report(snapshot, findings, thresholds)


def accelerator_mismatch(snapshot: Snapshot, accelerator: str | None) -> str | None:
    """A warning when the GPUs are not the type the plan was made for (labels gone wrong)."""
    if not accelerator or not snapshot.gpus:
        return None
    gpu_type = find_gpu(accelerator)
    if gpu_type is None:
        return None
    names = sorted({g.name for g in snapshot.gpus if not g.error})
    wrong = [n for n in names if n not in gpu_type.nvml_names]
    if not wrong:
        return None
    return (f"the plan was made for {gpu_type.name} ({', '.join(gpu_type.nvml_names)}) but this pod has "
            f"{', '.join(wrong)}: check the nodes' {contract.GPU_PRODUCT_LABEL} labels and spec.accelerator.type")


class XidWatcher(threading.Thread):
    """Collects XID critical-error events from NVML while the launcher runs."""

    def __init__(self, on_xid: Callable[[int, int], None], stop: threading.Event, *,
                 log: Callable[[str], None], timeout_ms: int = 1000) -> None:
        super().__init__(name="xid-watcher", daemon=True)
        self.on_xid, self.stop, self.log, self.timeout_ms = on_xid, stop, log, timeout_ms

    def run(self) -> None:
        try:
            nvml = init()
        except NvmlUnavailable:
            return
        try:
            events = nvml.nvmlEventSetCreate()
            registered: Sequence[int] = []
            for index in range(int(nvml.nvmlDeviceGetCount())):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
                    registered = [*registered, index]
                except nvml.NVMLError:
                    continue   # not supported on this GPU
            if not registered:
                return
            while not self.stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait(events, self.timeout_ms)
                except nvml.NVMLError_Timeout:
                    continue
                gpu: int | None
                try:
                    gpu = int(nvml.nvmlDeviceGetIndex(data.device))
                except nvml.NVMLError:  # this GPU does not expose its index
                    gpu = None
                self.log(f"GPU {gpu if gpu is not None else '?'} reported XID {int(data.eventData)}")
                self.on_xid(gpu if gpu is not None else -1, int(data.eventData))
        except nvml.NVMLError as exc:
            self.log(f"stopped watching GPU XID events: {exc}")
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass
