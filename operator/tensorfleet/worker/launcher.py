"""The launcher's flows, one per role (docs/architecture.md#the-engine-pod)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorfleet import contract
from tensorfleet.worker import command, health, raywait, simgpu, warmup
from tensorfleet.worker import gpu as gpus
from tensorfleet.worker import state as statefile
from tensorfleet.worker.errors import EXIT_LEADER_LOST, EXIT_NOT_FOUND, EXIT_OK, EXIT_START_FAILED, WorkerError
from tensorfleet.worker.role import Role
from tensorfleet.worker.supervise import EngineDrain, Signals, run_child

if TYPE_CHECKING:
    from tensorfleet.worker import metrics as metrics_module

RAY_START_TIMEOUT_SECONDS = 300.0
RAY_STOP_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True)
class Options:
    state_path: str | None = contract.WORKER_STATE_PATH
    cluster_timeout: float = 1800.0     # leader: every stage joined Ray
    leader_timeout: float = 1800.0      # worker: the leader answers
    leader_lost_after: float = 30.0     # worker: leader unreachable this long -> restart
    poll: float = 2.0                   # between checks while waiting
    log_every: float = 10.0             # between progress lines while waiting
    watch_interval: float = 5.0         # between leader checks once joined
    supervise_poll: float = 0.5         # child-process loop
    kill_after: float = 60.0            # SIGTERM sent to the engine -> SIGKILL when it still runs


class Launcher:
    def __init__(self, role: Role, environ: Mapping[str, str], options: Options,
                 log: Callable[[str], None] | None = None) -> None:
        self.role, self.environ, self.options = role, dict(environ), options
        self.log = log or self._stderr
        self.signals = Signals()
        self.state = statefile.StateFile(options.state_path)
        self._stop_background = threading.Event()
        self._metrics_server: Any = None
        self._health_lock = threading.Lock()
        self._last_health: bool | None = None
        # A simulator pod's GPUs (worker/simgpu.py); None: NVML's, or none to check.
        self._simulated: simgpu.SimulatedGpus | None = None
        # vLLM's CPU backend compiles on its first generations: the serving stage warms it up before Ready.
        self.warmup = (warmup.Warmup(role.engine_port, role.served_model_name, log=self.log)
                       if role.cpu and role.leader else None)

    def _stderr(self, message: str) -> None:
        role = self.role
        sys.stderr.write(f"tensorfleet-worker [{role.name} g{role.group_index} s{role.stage_index}]: {message}\n")
        sys.stderr.flush()

    # --- entry ---------------------------------------------------------------
    def run(self) -> int:
        self.signals.install()
        self.state.phase(statefile.PHASE_STARTING, self.role.describe())
        try:
            self._announce()
            self.prepare()
            if self.role.multi_node and not self.role.leader:
                return self._worker()
            if self.role.multi_node and not self.role.simulator:
                return self._leader()
            return self._engine()
        except raywait.Stopped:
            self.log("stop requested before the engine started; exiting")
            return 0
        finally:
            self.close()
            self.state.phase(statefile.PHASE_EXITED)
            self.signals.restore()

    def prepare(self) -> None:
        """The checks of the pod's mode (vLLM's CPU backend, a simulator, GPUs), its /health served and its
        watchers started; `close` stops them."""
        if self.role.cpu:
            self._cpu_side()
        elif self.role.simulator:
            self._simulated_side()
        else:
            self._gpu_side()

    def close(self) -> None:
        """Stop what `prepare` started: the watchers and the /health server."""
        self._stop_background.set()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None

    # --- flows ---------------------------------------------------------------
    def _engine(self) -> int:
        argv = command.engine_argv(self.role)
        self.state.phase(statefile.PHASE_RUNNING, f"engine `{' '.join(argv[:2])}`")
        return self._serve(argv)

    def _leader(self) -> int:
        role = self.role
        self._run_checked(command.ray_head_argv(role))
        try:
            self.state.phase(statefile.PHASE_WAITING_CLUSTER,
                             f"{role.pipeline_parallel_size} nodes, {role.expected_gpus} GPUs")
            raywait.wait_for_cluster(
                role, self.environ, stop=self.signals, timeout=self.options.cluster_timeout,
                poll=self.options.poll, log_every=self.options.log_every, log=self.log,
            )
            argv = command.engine_argv(role)
            self.state.phase(statefile.PHASE_RUNNING, f"engine `{' '.join(argv[:2])}` over Ray")
            return self._serve(argv)
        finally:
            self._ray_stop()

    def _worker(self) -> int:
        role = self.role
        host, port = role.leader_address or "", role.leader_port
        self.state.phase(statefile.PHASE_WAITING_LEADER, f"{host}:{port}")
        addresses = raywait.wait_for_leader(
            role, stop=self.signals, timeout=self.options.leader_timeout,
            poll=self.options.poll, log_every=self.options.log_every, log=self.log,
        )
        argv = command.idle_argv() if role.simulator else command.ray_worker_argv(role)
        what = "idle stand-in for a Ray worker" if role.simulator else "Ray worker"
        self.state.phase(statefile.PHASE_RUNNING, f"{what} joined to {host}:{port}")
        watch = raywait.LeaderWatch(host, port, addresses, lost_after=self.options.leader_lost_after,
                                    interval=self.options.watch_interval, log=self.log)
        drain = raywait.LeaderGone(host, port, log=self.log, log_every=self.options.log_every)
        try:
            code, reason = run_child(argv, self.environ, signals=self.signals, log=self.log,
                                     poll=self.options.supervise_poll, drain=drain, watch=watch,
                                     kill_after=self.options.kill_after)
        finally:
            if not role.simulator:
                self._ray_stop()
        if reason:
            raise WorkerError(reason, EXIT_LEADER_LOST)
        if self.signals.stopping:
            return self._stopped_code(code)
        raise WorkerError(
            f"the {what} exited with code {code} while the group was up: the leader restarted or went away; "
            "exiting so the pod restarts and rejoins",
            EXIT_LEADER_LOST,
        )

    def _serve(self, argv: list[str]) -> int:
        drain = EngineDrain(self.role.engine_port, log=self.log, log_every=self.options.log_every)
        code, _ = run_child(argv, self.environ, signals=self.signals, log=self.log,
                            poll=self.options.supervise_poll, drain=drain, kill_after=self.options.kill_after)
        if self.signals.stopping:
            self.state.phase(statefile.PHASE_STOPPING)
            code = self._stopped_code(code)
            self.log(f"engine stopped (exit {code})")
        else:
            self.log(f"engine exited on its own with code {code}")
        return code

    # --- helpers -------------------------------------------------------------
    @staticmethod
    def _stopped_code(code: int) -> int:
        # Killed by the SIGTERM we forwarded: a clean stop.
        return 0 if code == 128 + signal.SIGTERM else code

    def _announce(self) -> None:
        role = self.role
        self.log(f"starting: {role.describe()}; model {role.model} served as {role.served_model_name}")
        if role.kv_cache_tokens is not None:
            on = f" on {role.accelerator}" if role.accelerator else ""
            then = ("the simulator sizes its KV cache from it" if role.simulator
                    else "compare with vLLM's `GPU KV cache size: N tokens` line below")
            self.log(f"the planner expects {role.kv_cache_tokens:,} KV-cache tokens per replica{on}; {then}")

    def _cpu_side(self) -> None:
        """vLLM's CPU backend: the cache check and the pod's /health, without NVML, XID watcher or GPU gauges."""
        self._check_cache_dir()
        self.log(f"CPU mode ({contract.ENV_ACCELERATOR}={self.role.accelerator}): vLLM's CPU backend, no GPUs to check")
        self.environ = command.engine_environ(self.role, self.environ, os.sched_getaffinity(0))
        binding = self.environ.get(contract.ENV_CPU_OMP_THREADS_BIND)
        if binding and self.role.tensor_parallel_size > 1:
            self.log(f"{self.role.tensor_parallel_size} tensor-parallel workers bound to cores "
                     f"{contract.ENV_CPU_OMP_THREADS_BIND}={binding}")
        self._serve_health(None)

    def _gpu_side(self) -> None:
        self._check_cache_dir()
        try:
            snapshot = gpus.sample()
        except gpus.NvmlUnavailable as exc:
            self.log(f"warning: GPUs cannot be checked: {exc}")
            snapshot = None
        if snapshot is not None:
            self.log(f"{len(snapshot.gpus)} GPU(s) visible: {', '.join(sorted({g.name for g in snapshot.gpus})) or 'none'}")
            mismatch = gpus.accelerator_mismatch(snapshot, self.role.accelerator)
            if mismatch:
                self.log(f"warning: {mismatch}")
            gpus.XidWatcher(lambda index, xid: self.state.add_xid(index, xid), self._stop_background, log=self.log).start()
        if self.role.gpu_metrics_port:
            from tensorfleet.worker import metrics

            self._serve_health(metrics.GpuCollector(
                gpus.Thresholds(min_gpus=self.role.tensor_parallel_size),
                xids=lambda: self.state.snapshot().get("xids", []),
            ))

    def _simulated_side(self) -> None:
        """A simulator pod that stands in for a GPU one: the same health and gauges, from simulated GPUs."""
        if not self.role.gpu_metrics_port:
            return
        from tensorfleet.worker import metrics

        role = self.role
        self._simulated = simgpu.SimulatedGpus(role.simulated_gpu_state, role.accelerator, role.tensor_parallel_size)
        self.log(f"{role.tensor_parallel_size} simulated {self._simulated.name} GPU(s); their state comes from the "
                 f"pod's {contract.ANNOTATION_SIMULATED_GPU_STATE} annotation")
        simgpu.XidFeed(self._simulated, self.state.add_xid, self._stop_background, log=self.log).start()
        self._serve_health(metrics.GpuCollector(
            gpus.Thresholds(min_gpus=role.tensor_parallel_size),
            xids=lambda: self.state.snapshot().get("xids", []), sampler=self._simulated.sample,
        ))

    def _check_cache_dir(self) -> None:
        hf_home = self.environ.get(contract.ENV_HF_HOME)
        if hf_home:
            path = Path(hf_home)
            try:
                path.mkdir(parents=True, exist_ok=True)
                writable = os.access(path, os.W_OK)
            except OSError:
                writable = False
            if not writable:
                self.log(f"warning: {contract.ENV_HF_HOME}={hf_home} is not writable by uid {os.getuid()}: "
                         "downloads will fail; give the pod securityContext.fsGroup so the cache volume is group-writable")

    def _serve_health(self, collector: metrics_module.GpuCollector | None) -> None:
        """The pod's /health (the readiness probe) on the launcher's port, beside the GPU gauges when given."""
        port = self.role.gpu_metrics_port
        if not port:
            return
        from tensorfleet.worker import metrics

        what = "GPU metrics and the readiness check" if collector is not None else "the readiness check"
        try:
            self._metrics_server = metrics.serve(port, collector, health=self.pod_health)
        except OSError as exc:
            # The pod's readiness probe asks this port: without it the pod would never be Ready.
            raise WorkerError(f"cannot serve {what} on :{port} ({exc.strerror or exc}); "
                              f"is another process in the pod using port {port}?", EXIT_START_FAILED) from None
        if collector is not None:
            self.log(f"GPU metrics on :{port}{contract.METRICS_PATH}, this pod's health on :{port}{contract.HEALTH_PATH}")
        else:
            self.log(f"this pod's health on :{port}{contract.HEALTH_PATH}")

    def pod_health(self) -> tuple[bool, list[str]]:
        """The verdict `/health` serves: GPUs (not on CPU), the launcher's phase, on stage 0 the engine's /health and
        on the CPU backend its warm-up.

        Logs each change of verdict, so `kubectl logs` says why a pod left (or joined) the Service.
        """
        role = self.role
        result = health.judge(
            role.engine_kind, role.tensor_parallel_size, self.state.snapshot(), state_path=None,
            thresholds=gpus.Thresholds(), engine_port=role.engine_port if role.leader else None, cpu=role.cpu,
            warmup=self.warmup.check if self.warmup is not None else None,
            sampler=self._simulated.sample if self._simulated is not None else gpus.sample,
            simulated_gpus=self._simulated is not None,
        )
        healthy = result.code == EXIT_OK
        with self._health_lock:
            changed, self._last_health = healthy != self._last_health, healthy
        if changed:
            self.log(f"pod health: {result.lines[-1]}")
        return healthy, result.lines

    def _run_checked(self, argv: list[str]) -> None:
        self.log(f"running `{' '.join(argv)}`")
        try:
            done = subprocess.run(argv, env=self.environ, timeout=RAY_START_TIMEOUT_SECONDS, check=False)
        except FileNotFoundError:
            raise WorkerError(f"{argv[0]}: command not found on PATH; the worker image must contain Ray", EXIT_NOT_FOUND) from None
        except subprocess.TimeoutExpired:
            raise WorkerError(f"`{' '.join(argv)}` did not finish within {RAY_START_TIMEOUT_SECONDS:.0f}s", EXIT_START_FAILED) from None
        if done.returncode != 0:
            raise WorkerError(f"`{' '.join(argv)}` failed with exit code {done.returncode} (its output is above)", EXIT_START_FAILED)

    def _ray_stop(self) -> None:
        argv = command.ray_stop_argv()
        try:
            subprocess.run(argv, env=self.environ, timeout=RAY_STOP_TIMEOUT_SECONDS, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            pass
