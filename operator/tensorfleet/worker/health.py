"""The engine pod's health, `judge`: the launcher's state, the engine's own `/health` when asked, then every GPU
(none in CPU mode, simulated ones on a simulator pod). The launcher serves it as the pod's `/health`, its readiness
probe, and `tensorfleet-worker health` runs it by hand. Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tensorfleet import contract
from tensorfleet.worker import gpu as gpus
from tensorfleet.worker import simgpu
from tensorfleet.worker import state as statefile
from tensorfleet.worker.errors import EXIT_NO_NVML, EXIT_OK, EXIT_UNHEALTHY
from tensorfleet.worker.role import cpu_backend, health_settings

GiB = 1024**3
# Within the probes' 5 s timeout, with room for the NVML reads.
ENGINE_TIMEOUT_SECONDS = 2.0


@dataclass
class HealthResult:
    code: int
    lines: list[str]
    document: dict[str, Any]


def _launcher_check(state: dict[str, Any] | None, path: str | None) -> tuple[bool | None, str]:
    """(ok, line). ok None: no launcher state here, nothing to judge."""
    if state is None:
        return None, f"launcher: no state at {path} (not running under the launcher here)" if path else "launcher: not checked"
    phase = str(state.get("phase", "unknown"))
    since = state.get("since")
    age = f" for {time.time() - since:.0f}s" if isinstance(since, (int, float)) else ""
    detail = f": {state['detail']}" if state.get("detail") else ""
    if not statefile.pid_alive(state.get("pid")):
        return False, f"launcher: not running (pid {state.get('pid')} is gone; last phase {phase})"
    if phase == statefile.PHASE_RUNNING:
        return True, f"launcher: {phase}{age}{detail}"
    return False, f"launcher: {phase}{age}{detail}"


def engine_check(port: int, timeout: float = ENGINE_TIMEOUT_SECONDS) -> tuple[bool, str]:
    """(ok, line): does the engine on this pod answer its /health with 200?"""
    url = f"http://127.0.0.1:{port}{contract.HEALTH_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            status = int(answer.status)
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, f"engine: {url} did not answer ({reason})"
    return status == 200, f"engine: {url} answered {status}"


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / GiB:.1f}"


def gpu_line(g: gpus.GpuSample, report: gpus.Report) -> str:
    if g.error:
        return f"GPU {g.index}  {g.name}  UNREADABLE: {g.error}"
    parts = [f"GPU {g.index}", g.name, g.uuid]
    if g.temperature_c is not None:
        parts.append(f"{g.temperature_c:.0f} C (limit {report.thresholds.temperature_limit(g):.0f} C)")
    if g.memory_total_bytes:
        percent = 100.0 * (g.memory_used_bytes or 0) / g.memory_total_bytes
        parts.append(f"memory {_gib(g.memory_used_bytes)}/{_gib(g.memory_total_bytes)} GiB ({percent:.0f}%)")
    if g.utilization_percent is not None:
        parts.append(f"util {g.utilization_percent:.0f}%")
    if g.power_watts is not None:
        limit = f"/{g.power_limit_watts:.0f}" if g.power_limit_watts is not None else ""
        parts.append(f"power {g.power_watts:.0f}{limit} W")
    parts.append(f"ECC uncorrectable {g.ecc_uncorrectable if g.ecc_uncorrectable is not None else 'n/a'}")
    parts.append("ok" if report.gpu_healthy(g.index) else "UNHEALTHY")
    return "  ".join(p for p in parts if p)


def check(
    environ: Mapping[str, str],
    *,
    thresholds: gpus.Thresholds,
    state_path: str | None,
    min_gpus: int | None = None,
) -> HealthResult:
    """`tensorfleet-worker health`: the pod's settings from `environ`, the launcher's state from its file."""
    kind, tensor = health_settings(environ)
    simulated = environ.get(contract.ENV_SIMULATED_GPU_STATE) if kind == "simulator" else None
    sampler = simgpu.SimulatedGpus(simulated, environ.get(contract.ENV_ACCELERATOR), tensor or 1).sample \
        if simulated else gpus.sample
    return judge(kind, tensor, statefile.read_state(state_path), state_path=state_path,
                 thresholds=thresholds, min_gpus=min_gpus, cpu=cpu_backend(environ), sampler=sampler,
                 simulated_gpus=bool(simulated))


def judge(
    kind: str,
    tensor: int | None,
    state: dict[str, Any] | None,
    *,
    state_path: str | None,
    thresholds: gpus.Thresholds,
    min_gpus: int | None = None,
    engine_port: int | None = None,
    sampler: Callable[[], gpus.Snapshot] = gpus.sample,
    cpu: bool = False,
    warmup: Callable[[], tuple[bool, str]] | None = None,
    simulated_gpus: bool = False,
) -> HealthResult:
    """The verdict on one engine pod. Checks, in order: the launcher's state (when it runs in this container, it
    must be running its engine or Ray worker, not still waiting), the engine's own /health (engine_port: ask it),
    then every GPU through NVML. cpu: the pod runs vLLM's CPU backend (no GPUs to check; the mode comes from the
    plan, never from NVML failing, so a GPU pod whose NVML cannot be read stays unhealthy); warmup: asked once
    the engine answers healthy, (done, line) (worker/warmup.py); simulated_gpus: a simulator pod whose SAMPLER
    reports simulated GPUs (worker/simgpu.py), checked as real ones are.

    The code is `tensorfleet-worker health`'s exit code (2, bad flags, is the command line's):
      0  healthy (warnings may be printed)
      1  unhealthy: a threshold crossed, an XID, fewer GPUs than tensor parallel needs, the launcher not (yet)
         running its engine, or the engine not answering
      3  NVML unavailable: no driver or GPU in this container, so GPUs cannot be checked (a GPU pod only: CPU
         mode checks none, a simulator its simulated GPUs)
    """
    launcher_ok, launcher_line = _launcher_check(state, state_path)
    lines = [launcher_line]
    doc: dict[str, Any] = {"engine": kind, "launcher": {"ok": launcher_ok, "state": state}}
    reasons = [launcher_line] if launcher_ok is False else []
    if engine_port is not None:
        engine_ok, engine_line = engine_check(engine_port)
        lines.append(engine_line)
        doc["engineHealth"] = {"ok": engine_ok, "port": engine_port}
        if not engine_ok:
            reasons.append(engine_line)
        elif warmup is not None:
            warm, warm_line = warmup()
            lines.append(warm_line)
            if not warm:
                reasons.append(warm_line)

    if cpu or (kind == "simulator" and not simulated_gpus):
        lines.append(f"simulator mode ({contract.ENV_ENGINE_KIND}=simulator): no GPUs to check" if kind == "simulator"
                     else f"CPU mode ({contract.ENV_ACCELERATOR}={contract.CPU_ACCELERATOR}, vLLM's CPU backend): "
                          "no GPUs to check")
        if cpu:
            doc["cpu"] = True
        healthy = not reasons
        lines.append("healthy" if healthy else "unhealthy: " + "; ".join(reasons))
        doc["healthy"] = healthy
        return HealthResult(EXIT_OK if healthy else EXIT_UNHEALTHY, lines, doc)

    wanted = min_gpus if min_gpus is not None else tensor
    limits = gpus.Thresholds(
        max_temperature_c=thresholds.max_temperature_c,
        max_ecc_uncorrectable=thresholds.max_ecc_uncorrectable,
        max_memory_percent=thresholds.max_memory_percent,
        min_gpus=wanted,
        fatal_xids=thresholds.fatal_xids,
    )
    try:
        snapshot = sampler()
    except gpus.NvmlUnavailable as exc:
        lines.append(f"cannot check GPU health: {exc}. This container has no NVIDIA driver or no GPU assigned "
                     f"(engine pods request nvidia.com/gpu or claim GPUs; run this where GPUs are visible)")
        doc.update(healthy=None, nvml=str(exc))
        return HealthResult(EXIT_NO_NVML, lines, doc)

    report = gpus.evaluate(snapshot, limits, (state or {}).get("xids", []))
    if snapshot.driver:
        lines.append(f"driver {snapshot.driver}, {len(snapshot.gpus)} GPU(s) visible")
    lines += [gpu_line(g, report) for g in snapshot.gpus]
    problems = [f for f in report.findings if f.level != gpus.OK]
    # Warnings get their own lines; what makes the pod unhealthy is the last line.
    lines += [f"{f.level}: {f.message}" for f in problems if f.level == gpus.WARNING]
    healthy = report.healthy and not reasons
    need = f"; tensor parallel needs {wanted}" if wanted is not None else ""
    ok_count = sum(1 for g in snapshot.gpus if report.gpu_healthy(g.index))
    if healthy:
        lines.append(f"healthy: {ok_count} of {len(snapshot.gpus)} GPU(s) ok{need}")
    else:
        reasons += [f.message for f in problems if f.level == gpus.UNHEALTHY]
        lines.append("unhealthy: " + "; ".join(reasons))
    doc.update(report.to_json())
    doc["healthy"] = healthy
    return HealthResult(EXIT_OK if healthy else EXIT_UNHEALTHY, lines, doc)
