"""The router's identity and discovery, against the EndpointSlices the real controller publishes.

KWOK runs no container, so the test runs the pods' processes itself, on this
machine: the router under its Deployment's arguments and its ServiceAccount's
token (through `kubectl proxy`), and each engine leader's simulator on the pod
IP KWOK gave it, inside the pod network namespace that `e2e/cluster up` made
(the pod range is routed there and nowhere else). Then a chat completion goes
client -> router -> the engine that the router discovered.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import pytest
from kube import (
    CLUSTER_SCRIPT,
    cluster_status,
    deploy,
    engine_pods,
    eventually,
    get,
    items,
    kubectl_result,
    token_kubeconfig,
)

from tensorfleet import contract, promtext
from tensorfleet.testing.loopback import free_port

BIN = Path(sys.executable).parent


def _can(identity: str, *args: str) -> bool:
    return kubectl_result("auth", "can-i", *args, f"--as={identity}").stdout.strip() == "yes"


def _field(pod: dict[str, Any], path: str) -> str:
    labels = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
    if labels:
        return str(pod["metadata"]["labels"][labels.group(1)])
    value: Any = pod
    for part in path.split("."):
        value = value[part]
    return str(value)


def _pod_env(pod: dict[str, Any]) -> dict[str, str]:
    """The engine container's environment as the kubelet would build it (plain values and field refs)."""
    env: dict[str, str] = {}
    for var in pod["spec"]["containers"][0].get("env") or []:
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
        elif "fieldRef" in (var.get("valueFrom") or {}):
            env[var["name"]] = _field(pod, var["valueFrom"]["fieldRef"]["fieldPath"])
    return env


class Processes:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - the child writes it
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.running.append(proc)
        return proc

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.running:
            proc.terminate()
        for proc in self.running:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as running:
        yield running


def _run_engine_leader(processes: Processes, pod: dict[str, Any]) -> str:
    """Run the simulator a leader pod would run, on the pod's IP; return its base URL."""
    env = {"PATH": f"{BIN}:/usr/bin:/bin", **_pod_env(pod)}
    plan = json.loads(subprocess.run([str(BIN / "tensorfleet-worker"), "--print-command"], env=env,
                                     capture_output=True, text=True, check=True, timeout=60).stdout)
    (argv,) = plan["commands"]
    ip = pod["status"]["podIP"]
    argv = [str(BIN / argv[0]), *argv[1:]]
    argv[argv.index("--host") + 1] = ip
    # e2e/cluster finds its state through TF_E2E_*; the engine itself sees only the pod's env.
    cluster_env = {k: v for k, v in os.environ.items() if k.startswith("TF_E2E_")}
    processes.start(pod["metadata"]["name"], [str(CLUSTER_SCRIPT), "exec-pod", "--", *argv], {**cluster_env, **env})
    return f"http://{ip}:{env[contract.ENV_ENGINE_PORT]}"


def _backends(router_port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{router_port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:  # not listening yet
        return {}
    found = {}
    for sample in promtext.select(text, contract.ROUTER_METRIC_BACKEND_HEALTHY):
        backend = sample.labels.get(contract.ROUTER_LABEL_BACKEND)
        if backend:
            found[backend] = sample.value
    return found


def test_the_router_identity_may_list_only_its_own_endpointslices(namespace: str) -> None:
    name, _ = deploy("simulator-cpu.yaml", namespace)
    identity = f"system:serviceaccount:{namespace}:{contract.router_name(name)}"
    for verb in ("get", "list", "watch"):
        assert _can(identity, verb, "endpointslices.discovery.k8s.io", "-n", namespace)
    assert not _can(identity, "list", "endpointslices.discovery.k8s.io", "-n", "default")
    assert not _can(identity, "list", "endpointslices.discovery.k8s.io", "-A")
    assert not _can(identity, "get", "secrets", "-n", namespace)
    assert not _can(identity, "list", "pods", "-n", namespace)
    assert not _can(identity, "create", "endpointslices.discovery.k8s.io", "-n", namespace)


def test_the_router_discovers_the_published_engines_and_serves_through_them(
        namespace: str, processes: Processes, tmp_path: Path) -> None:
    status = cluster_status()
    if not status or not status["podNetwork"]:
        pytest.fail("needs the pod network of `e2e/cluster up` (run as root), so that pod IPs are local: "
                    f"without it the router would dial addresses off this machine. status: {status!r}")
    name, doc = deploy("simulator-cpu.yaml", namespace, replicas=2, autoscaling=None)
    eventually("2 ready groups", lambda: (get(contract.PLURAL, name, namespace) or {}).get("status", {})
               .get("readyReplicas") == 2)

    # What the EndpointSlice controller published for the engine Service.
    def published() -> set[str]:
        slices = items("endpointslices", namespace, f"{contract.ENDPOINTSLICE_SERVICE_LABEL}="
                                                     f"{contract.engine_service_name(name)}")
        found = {a for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready")
                 for a in e["addresses"][:1]}
        return found if len(found) == 2 else set()
    addresses = eventually("2 ready engine endpoints published", published)
    leaders = [p for p in engine_pods(name, namespace) if p["metadata"]["labels"][contract.LABEL_STAGE] == "0"]
    assert {p["status"]["podIP"] for p in leaders} == addresses

    # The router, as its Deployment runs it, under its own ServiceAccount.
    config = token_kubeconfig(contract.router_name(name), namespace, tmp_path / "router.kubeconfig")
    proxy_port = free_port()
    processes.start("kubectl-proxy", ["kubectl", "proxy", f"--kubeconfig={config}", f"--port={proxy_port}",
                                      "--address=127.0.0.1"])
    deployment = get("deployment", contract.router_name(name), namespace)
    assert deployment is not None
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    router_port = free_port()
    argv = [str(BIN / container["command"][0]), *container["command"][1:], *container.get("args", []),
            "--kube-api", f"http://127.0.0.1:{proxy_port}", "--host", "127.0.0.1", "--port", str(router_port),
            "--health-interval", "0.5"]
    processes.start("router", argv)

    urls = {f"http://{address}:{contract.ENGINE_PORT}" for address in addresses}
    eventually("the router to discover both engines", lambda: set(_backends(router_port)) == urls or None,
               timeout=60)
    for pod in leaders:
        _run_engine_leader(processes, pod)
    # The router ejected the engines while nothing listened (backing off up to 30 s), so allow for that.
    eventually("both engines healthy at the router", lambda: all(v == 1.0 for v in _backends(router_port).values()),
               timeout=120)

    model = doc["spec"]["model"]["servedName"]
    body = json.dumps({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{router_port}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        reply = json.loads(answer.read())
    assert reply["object"] == "chat.completion" and reply["model"] == model, reply
    assert reply["choices"][0]["message"]["content"]
    # A refused list or watch logs status 403 (Forbidden); "403" in a port number (:40349) or in a log line's
    # milliseconds (22:40:10,403) is not one.
    log = processes.log("router")
    assert not re.search(r"(?<![\d,.:])403(?!\d)", log) and "Forbidden" not in log, log
