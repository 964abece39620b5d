"""The e2e pod runner's network: the names and the gateway of each pod's network namespace (`tfe2e-pod-<uid>`, joined
to the cluster's by a veth pair), deleting those namespaces (`delete_netns`, and `sweep` for what a stopped or killed
runner left), the iproute2 and util-linux tools it runs (`tool`, `run_ip`), and the relay that makes the API
server's port on a pod's own 127.0.0.1 reach the API server on this host (`listen_in_netns`, `Relay`). Part of the
pod runner, e2e/podrunner.py; the pod network it joins: e2e/README.md#real-processes-for-control-plane-pods.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from podrunner_spec import libc

CLUSTER_NETNS = "tensorfleet-e2e"       # e2e/cluster's POD_NETNS: the whole pod range is routed into it
NETNS_PREFIX = "tfe2e-pod-"
VETH_PREFIX = "tfp"                      # + 12 hex digits: 15 characters, the most an interface name holds
GATEWAY = "169.254.1.1"                  # each pod's next hop, answered by proxy ARP on its veth's far end


def tool(name: str) -> str:
    found = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}", f"/sbin/{name}")
                                        if Path(p).is_file()), None)
    if not found:
        raise RuntimeError(f"{name} is not installed (the pod runner needs iproute2 and util-linux)")
    return found


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([tool("ip"), *args], capture_output=True, text=True, check=False, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def netns_pids(name: str) -> list[int]:
    done = run_ip("netns", "pids", name, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def delete_netns(name: str) -> None:
    """Kill whatever runs in the namespace, then delete it (its veth pair and routes go with it)."""
    deadline = time.monotonic() + 10
    while (pids := netns_pids(name)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    run_ip("netns", "delete", name, check=False)


def sweep() -> list[str]:
    """Delete every pod network namespace a runner made (after it was stopped or killed); their names."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return []
    names = [line.split()[0] for line in run_ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    ours = [name for name in names if name.startswith(NETNS_PREFIX)]
    for name in ours:
        delete_netns(name)
    return ours


# --- the API relay into a pod's network namespace ----------------------------------------------------

CLONE_NEWNET = 0x40000000


def listen_in_netns(netns: str, port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:PORT inside NETNS, made by a thread that enters it and ends."""
    lib = libc()
    made: dict[str, Any] = {}

    def enter_and_listen() -> None:
        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if lib.setns(fd, CLONE_NEWNET) != 0:
                    import ctypes

                    raise OSError(ctypes.get_errno(), f"setns {netns}")
            finally:
                os.close(fd)
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(64)
            made["socket"] = listener
        except OSError as exc:
            made["error"] = exc

    # setns changes only the calling thread: this one ends, the socket stays in the pod's namespace.
    thread = threading.Thread(target=enter_and_listen, name=f"netns-{netns}")
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]
    return made["socket"]


class Relay:
    """127.0.0.1:PORT in a pod's namespace -> 127.0.0.1:PORT here (the API server): raw TCP, TLS end to end."""

    def __init__(self, netns: str, port: int) -> None:
        self.port = port
        self.listener = listen_in_netns(netns, port)
        self.listener.settimeout(0.5)
        self.closed = threading.Event()
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"relay-{netns}", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                inside, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                outside = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            except OSError:
                inside.close()
                continue
            outside.settimeout(None)
            inside.settimeout(None)
            with self.lock:
                if self.closed.is_set():
                    inside.close()
                    outside.close()
                    return
                self.connections |= {inside, outside}
            ended: list[int] = []
            for source, target in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(source, target, (inside, outside), ended),
                                 daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, pair: tuple[socket.socket, socket.socket],
              ended: list[int]) -> None:
        try:
            while chunk := source.recv(65536):
                target.sendall(chunk)
            target.shutdown(socket.SHUT_WR)
        except OSError:
            for sock in pair:   # wakes the other direction too
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        finally:
            with self.lock:
                ended.append(1)
                if len(ended) == 2:
                    for sock in pair:
                        self.connections.discard(sock)
                        sock.close()

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            self.listener.close()
            for sock in self.connections:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
