"""What the e2e tests use to talk to the cluster: kubectl, as a person would, and waits.

Every wait is bounded (TF_E2E_TIMEOUT seconds, default 300) and says what it
waited for and what it saw last when it gives up.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import yaml

from tensorfleet import contract
from tensorfleet.testing.wait import wait_for

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CLUSTER_SCRIPT = ROOT / "e2e" / "cluster"
SYSTEM_NAMESPACE = os.environ.get("TF_E2E_SYSTEM_NAMESPACE", "tensorfleet-system")
RELEASE = os.environ.get("TF_E2E_RELEASE", "tensorfleet")
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
TIMEOUT = float(os.environ.get("TF_E2E_TIMEOUT", "300"))
# A second tag of the control-plane image, for image rollouts: the pod runner runs any tag of it.
NEXT_IMAGE = "ghcr.io/tensorfleet/tensorfleet:e2e-next"
CHILD_KINDS = ("statefulsets,deployments,replicasets,services,endpointslices,horizontalpodautoscalers,"
               "poddisruptionbudgets,serviceaccounts,roles,rolebindings,networkpolicies,pods,controllerrevisions")
# The operator's direct children: what it writes itself (pods, their revisions and endpoint slices are written by
# the StatefulSet and EndpointSlice controllers, and scaling changes them by design).
OWN_KINDS = ",".join(k for k in CHILD_KINDS.split(",")
                     if k not in ("pods", "controllerrevisions", "endpointslices", "replicasets"))


class KubectlError(AssertionError):
    def __init__(self, args: tuple[str, ...], stderr: str) -> None:
        super().__init__(f"kubectl {' '.join(args)} failed: {stderr.strip()}")
        self.stderr = stderr


def kubectl(*args: str, check: bool = True, stdin: str | None = None, timeout: float = 120) -> str:
    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise KubectlError(args, done.stderr)
    return done.stdout


def kubectl_result(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=120, check=False)


def get(kind: str, name: str, namespace: str | None) -> dict[str, Any] | None:
    scope = ["-n", namespace] if namespace else []
    out = kubectl("get", kind, name, *scope, "-o", "json", "--ignore-not-found")
    return json.loads(out) if out.strip() else None


def items(kind: str, namespace: str | None, selector: str | None = None) -> list[dict[str, Any]]:
    scope = ["-n", namespace] if namespace else ["-A"]
    chosen = ["-l", selector] if selector else []
    return list(json.loads(kubectl("get", kind, *scope, *chosen, "-o", "json"))["items"])


def apply(doc: dict[str, Any]) -> str:
    return kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))


def eventually(what: str, probe: Callable[[], Any], timeout: float = TIMEOUT, every: float = 0.5) -> Any:
    """Call `probe` until it returns something truthy; AssertionErrors count as 'not yet'."""
    return wait_for(probe, timeout, what, every, tolerate=(AssertionError,))


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in (obj or {}).get("status", {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def condition_status(obj: dict[str, Any] | None, type_: str) -> str | None:
    found = condition(obj, type_)
    return found.get("status") if found else None


def example(file: str, namespace: str, *, drop: tuple[str, ...] = ("cache", "hfTokenSecretRef"),
            **spec: Any) -> dict[str, Any]:
    """An InferenceService from examples/, moved into `namespace`.

    KWOK runs no volume provisioner and no kubelet, so model-cache PVCs would
    never bind and secrets are never mounted: `drop` removes those spec keys.
    Keyword arguments replace top-level spec keys; None removes one.
    """
    (doc,) = [d for d in yaml.safe_load_all((EXAMPLES / file).read_text()) if d]
    doc["metadata"]["namespace"] = namespace
    for key in drop:
        doc["spec"].pop(key, None)
    for key, value in spec.items():
        if value is None:
            doc["spec"].pop(key, None)
        else:
            doc["spec"][key] = value
    return dict(doc)


def deploy(file: str, namespace: str, **spec: Any) -> tuple[str, dict[str, Any]]:
    """Apply an example (see `example`) and wait until it is Ready; its name and the document."""
    doc = example(file, namespace, **spec)
    name = str(doc["metadata"]["name"])
    apply(doc)
    wait_ready(name, namespace)
    return name, doc


def isvc(name: str, namespace: str) -> dict[str, Any] | None:
    return get(contract.PLURAL, name, namespace)


def ready(name: str, namespace: str) -> dict[str, Any] | None:
    obj = isvc(name, namespace)
    return obj if condition_status(obj, "Ready") == "True" else None


def wait_ready(name: str, namespace: str, timeout: float = TIMEOUT) -> dict[str, Any]:
    return dict(eventually(f"InferenceService {namespace}/{name} Ready=True", lambda: ready(name, namespace), timeout))


def engine_pods(name: str, namespace: str) -> list[dict[str, Any]]:
    selector = f"{contract.LABEL_INFERENCE_SERVICE}={name},{contract.LABEL_COMPONENT}={contract.COMPONENT_ENGINE}"
    return items("pods", namespace, selector)


def router_url(name: str, namespace: str) -> str:
    """The base URL of one Ready router pod of NAME, on its pod IP (the pod runner's pods are reachable here)."""
    selector = f"{contract.LABEL_INFERENCE_SERVICE}={name},{contract.LABEL_COMPONENT}={contract.COMPONENT_ROUTER}"

    def ready_ip() -> str | None:
        for pod in items("pods", namespace, selector):
            if (condition(pod, "Ready") or {}).get("status") == "True" and pod["status"].get("podIP"):
                return str(pod["status"]["podIP"])
        return None
    return f"http://{eventually('a Ready router pod', ready_ip, timeout=120)}:{contract.ROUTER_PORT}"


def nodes() -> dict[str, dict[str, Any]]:
    return {n["metadata"]["name"]: n for n in items("nodes", None)}


def new_namespace(prefix: str) -> str:
    name = f"e2e-{prefix}-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    return name


def delete_namespace(name: str) -> None:
    """Delete a namespace and wait until it is gone."""
    if os.environ.get("TF_E2E_KEEP"):
        return
    # Workloads and pods first: pods that stop gracefully (the pod runner's, like a kubelet's) make the
    # namespace controller look again only after half their longest grace period; with none left it is quick.
    kubectl("delete", f"{contract.PLURAL},deployments,statefulsets,pods", "--all", "-n", name, "--wait=true",
            f"--timeout={int(TIMEOUT)}s", check=False, timeout=TIMEOUT + 30)
    kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=true", f"--timeout={int(TIMEOUT)}s", check=False,
            timeout=TIMEOUT + 30)


_DELETING: dict[str, threading.Thread] = {}


def delete_namespace_later(name: str) -> None:
    """Delete a namespace in the background and go on: its routers drain and its engines stop while the
    next test runs. Done as `delete_namespace` does it (workloads and pods first): a namespace deleted with
    its pods still stopping is looked at again only after half their grace period (48 s against 11 s
    here). `wait_deleted` (before a test that reads operator-wide figures, and at the session's end) waits
    for every such namespace to be gone."""
    if os.environ.get("TF_E2E_KEEP"):
        return
    def delete() -> None:
        try:
            delete_namespace(name)
        except subprocess.TimeoutExpired:
            pass   # wait_deleted names what is left
    worker = threading.Thread(target=delete, name=f"delete namespace {name}", daemon=True)
    worker.start()
    _DELETING[name] = worker


def wait_deleted(timeout: float = TIMEOUT) -> None:
    """Until every namespace `delete_namespace_later` deleted is gone (the cluster quiet again)."""
    if not _DELETING:
        return
    deadline = time.monotonic() + timeout
    for worker in _DELETING.values():
        worker.join(max(0.0, deadline - time.monotonic()))
    names = [f"namespace/{name}" for name in sorted(_DELETING)]
    done = kubectl_result("wait", "--for=delete", f"--timeout={int(max(1.0, deadline - time.monotonic()))}s", *names)
    left = [n for n in _DELETING if get("namespace", n, None) is not None]
    _DELETING.clear()
    assert not left, f"namespaces still there after {timeout:.0f}s: {left}; {done.stderr.strip()}"


def cluster_status() -> dict[str, Any] | None:
    """`e2e/cluster status --json`: the local cluster's processes and ports (None when it is not up)."""
    done = subprocess.run([str(CLUSTER_SCRIPT), "status", "--json"], capture_output=True, text=True, timeout=30,
                          check=False)
    found = json.loads(done.stdout) if done.stdout.strip() else None
    return found if isinstance(found, dict) else None


def local_cluster() -> bool:
    """True when the cluster is the one e2e/cluster runs (its operator is a local process)."""
    found = cluster_status()
    return bool(found and found["operator"]["running"])


def token_kubeconfig(account: str, namespace: str, path: Path) -> Path:
    """A kubeconfig for a ServiceAccount of the local cluster (a TokenRequest token)."""
    subprocess.run([str(CLUSTER_SCRIPT), "kubeconfig-for", account, "-n", namespace, "-o", str(path)],
                   check=True, capture_output=True, timeout=60)
    return path


def operator_metrics() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The local operator's Prometheus samples, keyed by (name, sorted labels)."""
    from tensorfleet import promtext

    found = cluster_status()
    assert found and found["operator"]["metricsPort"], f"no local operator metrics port: {found!r}"
    with urllib.request.urlopen(f"http://127.0.0.1:{found['operator']['metricsPort']}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in promtext.samples(text)}


def operator_service_account() -> str:
    deployments = items("deployments", SYSTEM_NAMESPACE, OPERATOR_SELECTOR)
    assert deployments, f"no operator Deployment of release {RELEASE} in {SYSTEM_NAMESPACE}"
    account = deployments[0]["spec"]["template"]["spec"]["serviceAccountName"]
    return f"system:serviceaccount:{SYSTEM_NAMESPACE}:{account}"


def kill_operator() -> None:
    """SIGKILL the operator: the local process, or the Lease holder's pod in a real cluster."""
    wait_deleted()  # what the restarted operator finds is the test's own, not other tests' teardown
    if local_cluster():
        subprocess.run([str(CLUSTER_SCRIPT), "operator", "kill"], check=True, capture_output=True, timeout=60)
        return
    lease = get("lease", "tensorfleet-operator", SYSTEM_NAMESPACE) or {}
    holder = lease.get("spec", {}).get("holderIdentity")
    assert holder, "no operator holds the Lease"
    kubectl("delete", "pod", holder, "-n", SYSTEM_NAMESPACE, "--grace-period=0", "--force")


def start_operator() -> None:
    """Start the local operator again (in a real cluster its Deployment already did)."""
    if cluster_status() is not None:
        subprocess.run([str(CLUSTER_SCRIPT), "operator", "start"], check=True, capture_output=True, timeout=120)


class PodWatch:
    """`kubectl get pods --watch` (or another `resource`) in a thread: every state they went through, in order.

    `check` runs on every event once `arm()` was called (after the initial
    listing, which arrives one pod at a time, has been seen whole).
    """

    def __init__(self, namespace: str, selector: str,
                 check: Callable[[dict[str, dict[str, Any]]], None], resource: str = "pods") -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.failures: list[str] = []
        self.events = 0
        self.armed = False
        self._check = check
        self._proc = subprocess.Popen(
            ["kubectl", "get", resource, "-n", namespace, "-l", selector, "--watch", "--output-watch-events",
             "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        decoder = json.JSONDecoder()
        buffer = ""
        for line in self._proc.stdout:
            buffer += line
            while buffer.strip():
                try:
                    event, end = decoder.raw_decode(buffer.lstrip())
                except ValueError:
                    break
                buffer = buffer.lstrip()[end:]
                self._on(event)

    def _on(self, event: dict[str, Any]) -> None:
        pod = event.get("object") or {}
        name = pod.get("metadata", {}).get("name")
        if not name:
            return
        if event.get("type") == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod
        self.events += 1
        if not self.armed:
            return
        try:
            self._check(self.pods)
        except AssertionError as exc:
            self.failures.append(str(exc))

    def arm(self) -> None:
        self.armed = True
        self._check(self.pods)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._thread.join(timeout=10)


@contextmanager
def watching_pods(namespace: str, selector: str,
                  check: Callable[[dict[str, dict[str, Any]]], None], resource: str = "pods") -> Iterator[PodWatch]:
    watch = PodWatch(namespace, selector, check, resource)
    try:
        yield watch
    finally:
        watch.stop()


class Requests:
    """Chat completions through a router, one after another in a thread, until stopped (bounded in count and
    time): every answer's status kept."""

    def __init__(self, url: str, model: str, limit: int = 2000, seconds: float = 600) -> None:
        self.url, self.model, self.limit, self.seconds = url, model, limit, seconds
        self.codes: list[int | str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = json.dumps({"model": self.model, "max_tokens": 4,
                           "messages": [{"role": "user", "content": "Hello"}]}).encode()
        deadline = time.monotonic() + self.seconds
        while not self._stop.is_set() and len(self.codes) < self.limit and time.monotonic() < deadline:
            request = urllib.request.Request(f"{self.url}/v1/chat/completions", data=body,
                                             headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    answer.read()
                    self.codes.append(answer.status)
            except urllib.error.HTTPError as exc:
                self.codes.append(exc.code)
            except OSError as exc:
                self.codes.append(type(exc).__name__)
            time.sleep(0.05)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=90)
