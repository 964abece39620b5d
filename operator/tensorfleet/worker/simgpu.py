"""Simulated GPUs for simulator engine pods, so that they run the launcher's GPU health path as GPU pods do: `tensor`
healthy GPUs of the planned type, overlaid with the faults the pod's `tensorfleet.dev/simulated-gpu-state`
annotation sets (read from its downward-API file at every sample). Design: docs/architecture.md#simulated-gpus.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from tensorfleet.gpus import find_gpu
from tensorfleet.worker import gpu as gpus

# An idle GPU: what NVML shows of one with nothing running.
IDLE_TEMPERATURE_C = 35.0
_FIELDS = {f.name for f in fields(gpus.GpuSample)} - {"index"}
_KINDS = {"name": "string", "uuid": "string", "error": "string", "retired_pages_pending": "boolean",
          "row_remap_pending": "boolean", "row_remap_failure": "boolean"}


def _fits(key: str, value: Any) -> bool:
    kind = _KINDS.get(key, "number")
    if value is None:
        return True
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    return isinstance(value, int | float) and not isinstance(value, bool)


class SimulatedGpus:
    """`count` GPUs of `accelerator`, healthy unless the state file at `path` says otherwise."""

    def __init__(self, path: str | None, accelerator: str | None, count: int) -> None:
        self.path, self.count = path, max(count, 1)
        known = find_gpu(accelerator or "")
        self.name = known.nvml_names[0] if known is not None and known.nvml_names else accelerator or "simulated GPU"
        self.memory = known.memory_bytes if known is not None else None

    def state(self) -> dict[str, Any]:
        """The annotation's state ({} when unset); NvmlUnavailable naming what is wrong with it."""
        try:
            text = Path(self.path).read_text() if self.path else ""
        except FileNotFoundError:
            text = ""
        except OSError as exc:
            raise gpus.NvmlUnavailable(f"simulated GPU state {self.path}: {exc.strerror or exc}") from None
        if not text.strip():
            return {}
        try:
            state = json.loads(text)
        except ValueError as exc:
            raise gpus.NvmlUnavailable(f"simulated GPU state is not JSON ({exc})") from None
        if not isinstance(state, dict) or set(state) - {"gpus", "xids"}:
            raise gpus.NvmlUnavailable('simulated GPU state: give one JSON object with "gpus" and/or "xids"')
        return state

    def sample(self) -> gpus.Snapshot:
        found = [gpus.GpuSample(index=i, name=self.name, uuid=f"GPU-simulated-{i}", temperature_c=IDLE_TEMPERATURE_C,
                                memory_used_bytes=0, memory_total_bytes=self.memory, utilization_percent=0.0,
                                ecc_uncorrectable=0, retired_pages_pending=False, row_remap_pending=False,
                                row_remap_failure=False)
                 for i in range(self.count)]
        for entry in self.state().get("gpus") or []:
            index = entry.get("index") if isinstance(entry, dict) else None
            if not isinstance(index, int) or not 0 <= index < self.count:
                raise gpus.NvmlUnavailable(f"simulated GPU state: gpus entry {entry!r} needs an index from 0 to "
                                           f"{self.count - 1}")
            unknown = set(entry) - _FIELDS - {"index"}
            if unknown:
                raise gpus.NvmlUnavailable(f"simulated GPU state: unknown GPU field(s) {sorted(unknown)}; "
                                           f"known: {sorted(_FIELDS)}")
            for key, value in entry.items():
                if key != "index" and not _fits(key, value):
                    raise gpus.NvmlUnavailable(f"simulated GPU state: GPU {index} {key}={value!r} is not a "
                                               f"{_KINDS.get(key, 'number')}")
            found[index] = replace(found[index], **{k: v for k, v in entry.items() if k != "index"})
        return gpus.Snapshot(gpus=found, driver="simulated")

    def xids(self) -> list[tuple[int, int]]:
        """(gpu, xid) of each XID event the state lists, in order; none when it cannot be read."""
        try:
            listed = self.state().get("xids") or []
        except gpus.NvmlUnavailable:
            return []
        return [(int(e.get("gpu", -1)), int(e["xid"])) for e in listed if isinstance(e, dict) and "xid" in e]


class XidFeed(threading.Thread):
    """Reports the state's XID events to `on_xid` as they appear, once each: the simulated XidWatcher."""

    def __init__(self, source: SimulatedGpus, on_xid: Callable[[int, int], None], stop: threading.Event, *,
                 log: Callable[[str], None], every_s: float = 1.0) -> None:
        super().__init__(name="simulated-xids", daemon=True)
        self.source, self.on_xid, self.stop, self.log, self.every_s = source, on_xid, stop, log, every_s

    def run(self) -> None:
        reported = 0
        while not self.stop.is_set():
            listed = self.source.xids()
            for gpu, xid in listed[reported:]:
                self.log(f"simulated GPU {gpu} reported XID {xid}")
                self.on_xid(gpu, xid)
            reported = max(reported, len(listed))
            self.stop.wait(self.every_s)
