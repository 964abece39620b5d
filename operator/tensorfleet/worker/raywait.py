"""Forming a multi-node group: the leader waits for Ray to hold every stage, a worker waits for its leader, then
watches it. Ray is driven through its CLI (`ray start`, `ray status`, `ray stop`), the commands a person would
type, so tests replace it with scripts on PATH. Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tensorfleet.worker import command
from tensorfleet.worker.errors import EXIT_NOT_FOUND, EXIT_TIMEOUT, WorkerError
from tensorfleet.worker.role import Role, worker_hosts

Log = Callable[[str], None]
Resolver = Callable[[str], "list[str] | None"]
Connector = Callable[[str, int], bool]

STATUS_TIMEOUT_SECONDS = 30.0
_COUNT_LINE = re.compile(r"^(\d+)\s+\S")
_GPU_LINE = re.compile(r"^([0-9.]+)\s*/\s*([0-9.]+)\s+GPU$")


class Stopped(Exception):
    """A stop signal arrived while waiting."""


class StopWait(Protocol):
    """What the waits here sleep on: the launcher's Signals (or a threading.Event)."""

    def wait(self, timeout: float) -> bool:
        """Sleep up to timeout seconds; True once a stop is asked for."""
        ...


@dataclass(frozen=True)
class ClusterStatus:
    nodes: int
    gpus: float
    error: str | None = None


def parse_ray_status(text: str) -> tuple[int, float]:
    """(alive nodes, total GPUs) from `ray status` output.

    Nodes are counted under `Active:` and `Idle:` (the v2 autoscaler lists idle
    nodes apart); each line there is `<count> <node id or type>`. GPUs come from
    the first `<used>/<total> GPU` line of the resources section.
    """
    nodes = 0
    gpus: float | None = None
    counting = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped in ("Active:", "Idle:"):
            counting = True
            continue
        if stripped.endswith(":") or not stripped or set(stripped) <= {"-", "="}:
            counting = False
            continue
        if counting and (match := _COUNT_LINE.match(stripped)):
            nodes += int(match.group(1))
        if gpus is None and (match := _GPU_LINE.match(stripped)):
            gpus = float(match.group(2))
    return nodes, gpus or 0.0


def query_cluster(env: Mapping[str, str], timeout: float = STATUS_TIMEOUT_SECONDS) -> ClusterStatus:
    argv = command.ray_status_argv()
    try:
        done = subprocess.run(argv, env=dict(env), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise WorkerError(f"{argv[0]}: command not found on PATH; the worker image must contain Ray", EXIT_NOT_FOUND) from None
    except subprocess.TimeoutExpired:
        return ClusterStatus(0, 0.0, f"`{' '.join(argv)}` did not answer within {timeout:.0f}s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
        return ClusterStatus(0, 0.0, f"`{' '.join(argv)}` exited {done.returncode}: {last}")
    nodes, gpus = parse_ray_status(done.stdout)
    return ClusterStatus(nodes, gpus)


def resolve(host: str) -> list[str] | None:
    """The host's addresses, or None while it has no DNS record."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return sorted({str(info[4][0]) for info in infos}) or None


def tcp_open(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _gpus(value: float) -> str:
    return f"{value:g}"


def describe_missing(role: Role, status: ClusterStatus, resolver: Resolver = resolve) -> str:
    """Who the leader is still waiting for, in words a person can act on."""
    want_nodes, want_gpus = role.pipeline_parallel_size, role.expected_gpus
    head = f"{status.nodes}/{want_nodes} nodes, {_gpus(status.gpus)}/{want_gpus} GPUs"
    if status.error:
        return f"{head}; {status.error}"
    if status.nodes >= want_nodes:
        return (f"{head}; every node joined but GPUs are short: each stage needs {role.tensor_parallel_size} "
                "GPU(s) visible to Ray (check the pods' nvidia.com/gpu requests and the device plugin, or their GPU "
                "claims and the DRA driver)")
    down, up = [], []
    for stage, host in worker_hosts(role):
        addresses = resolver(host)
        if addresses:
            up.append(f"stage {stage} ({host} at {', '.join(addresses)})")
        else:
            down.append(f"stage {stage} ({host})")
    parts = [head]
    if down:
        parts.append("no pod IP yet, pod not scheduled or not started: " + ", ".join(down))
    if up:
        parts.append("pod up, Ray worker not joined yet (or joined, if others are missing): " + ", ".join(up))
    if not down and not up:
        parts.append(f"waiting for {want_nodes - status.nodes} more stage pod(s) to join")
    return "; ".join(parts)


def wait_for_cluster(
    role: Role,
    env: Mapping[str, str],
    *,
    stop: StopWait,
    timeout: float,
    poll: float,
    log_every: float,
    log: Log,
    query: Callable[[Mapping[str, str]], ClusterStatus] = query_cluster,
    resolver: Resolver = resolve,
) -> ClusterStatus:
    """Poll `ray status` until the cluster has every stage and GPU; raise WorkerError at the deadline."""
    start = time.monotonic()
    last_log: float | None = None
    while True:
        status = query(env)
        elapsed = time.monotonic() - start
        if status.error is None and status.nodes >= role.pipeline_parallel_size and status.gpus >= role.expected_gpus:
            log(f"Ray cluster ready after {elapsed:.0f}s: {status.nodes} nodes, {_gpus(status.gpus)} GPUs")
            return status
        if elapsed >= timeout:
            raise WorkerError(
                f"Ray cluster incomplete after {timeout:g}s: {describe_missing(role, status, resolver)}",
                EXIT_TIMEOUT,
            )
        if last_log is None or time.monotonic() - last_log >= log_every:
            log(f"waiting for the Ray cluster ({elapsed:.0f}s of {timeout:g}s): {describe_missing(role, status, resolver)}")
            last_log = time.monotonic()
        if stop.wait(poll):
            raise Stopped


def wait_for_leader(
    role: Role,
    *,
    stop: StopWait,
    timeout: float,
    poll: float,
    log_every: float,
    log: Log,
    resolver: Resolver = resolve,
    connect: Connector = tcp_open,
) -> list[str]:
    """Wait until the leader's name resolves and its port accepts connections; return its addresses."""
    host, port = role.leader_address or "", role.leader_port
    what = "simulator" if role.simulator else "Ray head"
    start = time.monotonic()
    last_log: float | None = None
    while True:
        addresses = resolver(host)
        if addresses and connect(host, port):
            log(f"leader {host}:{port} is up at {', '.join(addresses)} after {time.monotonic() - start:.0f}s")
            return addresses
        why = (f"resolves to {', '.join(addresses)} but port {port} refuses connections ({what} not started yet)"
               if addresses else "has no DNS record yet (leader pod not scheduled or not started)")
        elapsed = time.monotonic() - start
        if elapsed >= timeout:
            raise WorkerError(f"leader {host} not reachable after {timeout:g}s: it {why}", EXIT_TIMEOUT)
        if last_log is None or time.monotonic() - last_log >= log_every:
            log(f"waiting for the leader ({elapsed:.0f}s of {timeout:g}s): {host} {why}")
            last_log = time.monotonic()
        if stop.wait(poll):
            raise Stopped


class LeaderWatch:
    """Tells a joined worker when its leader is gone: moved to a new address, or unreachable too long."""

    def __init__(
        self,
        host: str,
        port: int,
        addresses: Sequence[str],
        *,
        lost_after: float,
        interval: float,
        log: Log,
        resolver: Resolver = resolve,
        connect: Connector = tcp_open,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host, self.port = host, port
        self.addresses = set(addresses)
        self.lost_after, self.interval = lost_after, interval
        self.log, self.resolver, self.connect, self.clock = log, resolver, connect, clock
        self.failing_since: float | None = None
        self.last_check: float | None = None

    def __call__(self) -> str | None:
        """None while the leader is fine; otherwise why this worker must restart."""
        now = self.clock()
        if self.last_check is not None and now - self.last_check < self.interval:
            return None
        self.last_check = now
        addresses = self.resolver(self.host)
        if addresses and self.addresses and not set(addresses) & self.addresses:
            return (f"leader {self.host} moved from {', '.join(sorted(self.addresses))} to {', '.join(addresses)}: "
                    "it was recreated, so this worker must restart to join its new cluster")
        if addresses and self.connect(self.host, self.port):
            if self.failing_since is not None:
                self.log(f"leader {self.host}:{self.port} reachable again")
            self.failing_since = None
            return None
        if self.failing_since is None:
            self.failing_since = now
            self.log(f"leader {self.host}:{self.port} unreachable; restarting if it stays so for {self.lost_after:g}s")
        if now - self.failing_since >= self.lost_after:
            return (f"leader {self.host}:{self.port} unreachable for {self.lost_after:g}s: "
                    "it restarted or went away, so this worker must restart and rejoin")
        return None


class LeaderGone:
    """Drain rule for a worker told to stop: keep serving the group until the leader has stopped."""

    def __init__(self, host: str, port: int, *, log: Log, log_every: float, connect: Connector = tcp_open) -> None:
        self.host, self.port, self.log, self.log_every, self.connect = host, port, log, log_every, connect
        self.last_log: float | None = None

    def __call__(self) -> bool:
        if not self.connect(self.host, self.port):
            self.log(f"leader {self.host}:{self.port} has stopped; stopping this stage")
            return True
        now = time.monotonic()
        if self.last_log is None or now - self.last_log >= self.log_every:
            self.log("stop requested; this stage keeps running until the leader finishes its in-flight requests "
                     "(the pod's termination grace period bounds the wait; signal again to stop now)")
            self.last_log = now
        return False
