"""The launcher's state file, its phase and the GPU XID errors it saw: the launcher writes it (atomically: write,
then rename); `tensorfleet-worker health`, run by hand in the same container, reads it.
Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

# Phases, in the order a healthy launcher goes through them.
PHASE_STARTING = "starting"
PHASE_WAITING_CLUSTER = "waiting-for-ray-cluster"
PHASE_WAITING_LEADER = "waiting-for-leader"
PHASE_RUNNING = "running"
PHASE_STOPPING = "stopping"
PHASE_EXITED = "exited"
# Keep at most this many XID events: the newest matter.
MAX_XIDS = 64


class StateFile:
    """Thread-safe writer; the exporter's XID thread and the main flow share it."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {"pid": os.getpid(), "phase": PHASE_STARTING, "since": time.time(), "xids": []}

    def update(self, **fields: Any) -> None:
        with self._lock:
            if "phase" in fields and fields["phase"] != self._data.get("phase"):
                self._data["since"] = time.time()
            self._data.update(fields)
            self._write()

    def phase(self, phase: str, detail: str = "", **fields: Any) -> None:
        self.update(phase=phase, detail=detail, **fields)

    def add_xid(self, gpu: int, xid: int) -> None:
        with self._lock:
            xids = list(self._data.get("xids", []))
            xids.append({"gpu": gpu, "xid": xid, "time": time.time()})
            self._data["xids"] = xids[-MAX_XIDS:]
            self._write()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._data))

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._data), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            # The state file helps the probe; failing to write it must not stop the engine.
            pass


def read_state(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The launcher's last state, or None when there is none (not run under the launcher)."""
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
