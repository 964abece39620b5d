#!/usr/bin/env python3
"""Prometheus and prometheus-adapter in the e2e cluster: what `e2e/cluster up` starts for autoscaling.

`e2e/cluster up` calls this module (`down` stops what it started, `status` shows it,
`e2e/cluster monitoring reload|status` drive it by hand). Both run as local processes,
built from their Go modules like the control plane (recipes e2e/build/prometheus and
e2e/build/prometheus-adapter), inside the pod network namespace (`tensorfleet-e2e`),
each on an address of the pod range that no node hands out (nodes get 10.244.N.0/24
from N = 1; these are in 10.244.0.0/24), so the host and the API server reach them
there and they reach the API server on the host end of the pod network's veth:

- Prometheus on http://10.244.0.2:9090 (the HTTP API; no web UI: built without the
  `builtinassets` tag), global scrape interval 5 s. Its targets come from Kubernetes
  service discovery (role pod) against the real API server, as the ServiceAccount
  `monitoring/prometheus` (a TokenRequest token), whose ClusterRole may only
  get/list/watch pods and namespaces. Its scrape configuration is derived from the
  PodMonitor objects (monitoring.coreos.com/v1) in the cluster, translated as
  prometheus-operator translates them (e2e/podmonitors.py). The CRDs come from the
  prometheus-operator Go module that e2e/build/prometheus-operator/go.mod pins
  (its example/prometheus-operator-crd/, read from the module download). A watcher
  process (`python3 e2e/monitoring.py watch`, the config-reloader's part) re-reads
  the PodMonitors on every change and has Prometheus reload (POST /-/reload).
- prometheus-adapter on https://10.244.0.3:6443, serving custom.metrics.k8s.io
  (APIServices v1beta1 and v1beta2) to the real kube-apiserver's aggregator, as
  the ServiceAccount `monitoring/prometheus-adapter` (pods and namespaces
  get/list/watch, system:auth-delegator, and the extension-apiserver-authentication
  reader Role). Its rules are the chart's ConfigMap `<fullname>-adapter-rules` (key
  config.yaml) as `helm install` stored it, read after the install (and again on
  `e2e/cluster monitoring reload`, which restarts the adapter when they changed).
  There is no kube-proxy, so the APIService's Service (`monitoring/prometheus-adapter`,
  no selector) has an EndpointSlice naming the adapter's address, and the API server
  runs with --enable-aggregator-routing=true: it dials that endpoint, not the
  ClusterIP. Its serving certificate is signed by a CA made here (the APIService's
  caBundle); the aggregator authenticates to the adapter with a front-proxy client
  certificate from a second CA made here (--requestheader-client-ca-file,
  --requestheader-allowed-names=front-proxy-client, --proxy-client-cert-file), as
  kubeadm sets it up; kwokctl's own setting (its admin certificate as the proxy
  client, no requestheader CA) would make the adapter see every request as that admin.
- kube-controller-manager with --horizontal-pod-autoscaler-sync-period=5s.

Settings that differ from a production cluster (e2e/README.md lists them too): the
scrape interval (5 s here; production uses 15-60 s), the HPA sync period (5 s; default
15 s), the adapter's --metrics-relist-interval (5 s; its default is 10 min, the chart of
prometheus-adapter uses 1 min) and --metrics-max-age (1 min), certificates valid for a
week, made at `up`, and Prometheus' data in the cluster's state folder (deleted by `down`).

The PodMonitors are translated into scrape jobs by e2e/podmonitors.py, which says what it
translates and what not.

Only the Python standard library, like e2e/cluster (it runs before any virtualenv).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The watcher runs this file with `python -I`, which leaves this folder off sys.path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

from podmonitors import prometheus_config

REPO = Path(__file__).resolve().parent.parent
OPERATOR_RECIPE = REPO / "e2e" / "build" / "prometheus-operator"
OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
CRD_FOLDER = "example/prometheus-operator-crd"

NAMESPACE = "monitoring"
PROMETHEUS_ACCOUNT = "prometheus"
ADAPTER_ACCOUNT = "prometheus-adapter"
ADAPTER_SERVICE = "prometheus-adapter"
PROMETHEUS_IP, PROMETHEUS_PORT = "10.244.0.2", 9090
ADAPTER_IP, ADAPTER_PORT = "10.244.0.3", 6443
CUSTOM_METRICS_GROUP = "custom.metrics.k8s.io"
CUSTOM_METRICS_VERSIONS = {"v1beta2": 200, "v1beta1": 100}  # version -> versionPriority (v1beta2 preferred)
FRONT_PROXY_CLIENT = "front-proxy-client"

# The settings that make the loop quick (each differs from production: see the docstring).
SCRAPE_INTERVAL = "5s"
HPA_SYNC_PERIOD = "5s"
ADAPTER_RELIST_INTERVAL = "5s"
ADAPTER_MAX_AGE = "1m"
CERT_DAYS = 7

STATE_FILE = "monitoring.json"
# Prometheus' address is local (the pod network): never through an HTTP proxy from the environment.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
MANAGED_BY = "e2e.tensorfleet.dev"


def say(message: str) -> None:
    sys.stderr.write(f"cluster: {message}\n")
    sys.stderr.flush()


def folder(state: Path) -> Path:
    return state / "monitoring"


def read_json(path: Path) -> dict[str, Any]:
    """A state file's object; {} when it is missing or unreadable."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def write_json(path: Path, conf: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(conf, indent=2, sort_keys=True) + "\n")


def load(state: Path) -> dict[str, Any]:
    return read_json(folder(state) / STATE_FILE)


def save(state: Path, conf: dict[str, Any]) -> None:
    write_json(folder(state) / STATE_FILE, conf)


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.chmod(mode)
    partial.replace(path)


# --- certificates (openssl) ------------------------------------------------------------------

OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
authorityKeyIdentifier = keyid
subjectAltName = DNS:{service}.{namespace}.svc,DNS:{service}.{namespace}.svc.cluster.local,IP:{address}
"""


def openssl(pki: Path, name: str, subject: str, extensions: str, ca: str | None = None) -> None:
    """NAME.crt and NAME.key in PKI (an EC P-256 key), self-signed or signed by CA.crt/CA.key."""
    config = pki / "openssl.cnf"
    if not config.is_file():
        config.write_text(OPENSSL_CONFIG.format(service=ADAPTER_SERVICE, namespace=NAMESPACE, address=ADAPTER_IP))
    argv = ["openssl", "req", "-x509", "-config", str(config), "-extensions", extensions, "-newkey", "ec",
            "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(pki / f"{name}.key"),
            "-out", str(pki / f"{name}.crt"), "-days", str(CERT_DAYS), "-subj", f"/CN={subject}"]
    if ca:
        argv += ["-CA", str(pki / f"{ca}.crt"), "-CAkey", str(pki / f"{ca}.key")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"openssl req for {name}: {done.stderr.strip().splitlines()[-1:]}")
    (pki / f"{name}.key").chmod(0o600)


def available() -> str | None:
    """Why monitoring cannot run here (None when it can)."""
    if not shutil.which("openssl"):
        return "openssl is not installed (apt-get install openssl): it makes the aggregator's certificates"
    return None


def control_plane_args(state: Path) -> list[str]:
    """kwokctl --extra-args for the HPA loop and the aggregator (certificates made here first).

    kwokctl v0.8.0 files the extra args of a component under the index of its first flag among
    all of them, which is only right while every component before the last has exactly one:
    so the controller manager's single flag comes first and the API server's follow.
    """
    args = [f"--extra-args=kube-controller-manager=horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD}"]
    if available():
        return args
    pki = folder(state) / "pki"
    shutil.rmtree(pki, ignore_errors=True)
    pki.mkdir(parents=True)
    openssl(pki, "front-proxy-ca", "tensorfleet-e2e-front-proxy-ca", "ca")
    openssl(pki, FRONT_PROXY_CLIENT, FRONT_PROXY_CLIENT, "client", ca="front-proxy-ca")
    openssl(pki, "serving-ca", "tensorfleet-e2e-monitoring-ca", "ca")
    openssl(pki, "adapter", f"{ADAPTER_SERVICE}.{NAMESPACE}.svc", "server", ca="serving-ca")
    apiserver = {
        "enable-aggregator-routing": "true",
        "requestheader-client-ca-file": str(pki / "front-proxy-ca.crt"),
        "requestheader-allowed-names": FRONT_PROXY_CLIENT,
        "requestheader-username-headers": "X-Remote-User",
        "requestheader-group-headers": "X-Remote-Group",
        "requestheader-extra-headers-prefix": "X-Remote-Extra-",
        "proxy-client-cert-file": str(pki / f"{FRONT_PROXY_CLIENT}.crt"),
        "proxy-client-key-file": str(pki / f"{FRONT_PROXY_CLIENT}.key"),
    }
    return args + [f"--extra-args=kube-apiserver={key}={value}" for key, value in apiserver.items()]


# --- the cluster, through kubectl ---------------------------------------------------------------


@dataclass(frozen=True)
class Kube:
    kubectl: str
    kubeconfig: str

    def run(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120) -> str:
        done = subprocess.run([self.kubectl, f"--kubeconfig={self.kubeconfig}", *args], input=stdin,
                              capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            detail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
            raise RuntimeError(f"kubectl {' '.join(args[:3])} ... failed: {' / '.join(detail)}")
        return done.stdout

    def apply(self, docs: list[dict[str, Any]]) -> None:
        self.run("apply", "--server-side", "--force-conflicts", f"--field-manager={MANAGED_BY}", "-f", "-",
                 stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json"))


class Fatal(RuntimeError):
    """A failure that no retry mends (a process exited): `wait_for` gives up at once."""


def wait_for(what: str, probe: Callable[[], Any], timeout: float, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            found = probe()
            if found:
                return found
        except Fatal:
            raise
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last: {last})" if last else ""))
        time.sleep(every)


def module_dir(recipe: Path, module: str) -> Path:
    """The source of MODULE as the recipe folder RECIPE pins it (from the module cache, downloaded if missing)."""
    env = {**os.environ, "GOFLAGS": "-mod=readonly", "GOTOOLCHAIN": "local"}
    go = shutil.which("go")
    if not go:
        raise RuntimeError(f"Go is not installed (the CRDs come from the Go module {module})")
    done = subprocess.run([go, "mod", "download", "-json", module], cwd=recipe, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    try:
        return Path(json.loads(done.stdout)["Dir"])
    except (ValueError, KeyError) as exc:
        detail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]
        raise RuntimeError(f"go mod download {module} in {recipe} failed: {detail}") from exc


def apply_crds(kube: Kube, files: list[Path], source: str) -> list[str]:
    """CRD FILES (from SOURCE, for the error), server-side applied and waited for until Established; their names."""
    if not files:
        raise RuntimeError(f"no CRDs in {source}")
    args = ["apply", "--server-side", "--force-conflicts", f"--field-manager={MANAGED_BY}"]
    for file in files:
        args += ["-f", str(file)]
    names = [line.split("/", 1)[1].split()[0] for line in kube.run(*args, "-o", "name", timeout=300).split()
             if line.startswith("customresourcedefinition")]
    kube.run("wait", "--for=condition=Established", "--timeout=120s",
             *[f"customresourcedefinition/{name}" for name in names], timeout=150)
    return names


def install_crds(kube: Kube) -> list[str]:
    """prometheus-operator's CRDs (PodMonitor among them), server-side applied; their names."""
    files = sorted((module_dir(OPERATOR_RECIPE, OPERATOR_MODULE) / CRD_FOLDER).glob("*.yaml"))
    return apply_crds(kube, files, f"{OPERATOR_MODULE}'s {CRD_FOLDER}")


def identity_manifests() -> list[dict[str, Any]]:
    """The namespace, both ServiceAccounts and their least-privilege RBAC."""
    labels = {"app.kubernetes.io/managed-by": MANAGED_BY}

    def meta(name: str, namespace: str | None = NAMESPACE) -> dict[str, Any]:
        found: dict[str, Any] = {"name": name, "labels": labels}
        if namespace:
            found["namespace"] = namespace
        return found

    def account(name: str) -> dict[str, Any]:
        return {"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}

    read_pods = [{"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["get", "list", "watch"]}]
    docs: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": meta(NAMESPACE, None)}]
    for name in (PROMETHEUS_ACCOUNT, ADAPTER_ACCOUNT):
        role = f"tensorfleet-e2e:{name}"
        docs += [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(name)},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": meta(role, None),
             "rules": read_pods},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": meta(role, None),
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
             "subjects": [account(name)]},
        ]
    # An aggregated API server checks its callers with the API server (TokenReview,
    # SubjectAccessReview) and reads the front-proxy CA from kube-system's ConfigMap.
    docs += [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": meta(f"tensorfleet-e2e:{ADAPTER_ACCOUNT}:auth-delegator", None),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:auth-delegator"},
         "subjects": [account(ADAPTER_ACCOUNT)]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": meta(f"tensorfleet-e2e:{ADAPTER_ACCOUNT}:auth-reader", "kube-system"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                     "name": "extension-apiserver-authentication-reader"},
         "subjects": [account(ADAPTER_ACCOUNT)]},
    ]
    return docs


def adapter_service_manifests(ca_bundle: bytes) -> list[dict[str, Any]]:
    """The adapter's Service (no selector), its EndpointSlice (the adapter's address) and the APIServices."""
    labels = {"app.kubernetes.io/managed-by": MANAGED_BY}
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE, "labels": labels},
         "spec": {"ports": [{"name": "https", "port": 443, "targetPort": ADAPTER_PORT, "protocol": "TCP"}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": f"{ADAPTER_SERVICE}-local", "namespace": NAMESPACE,
                      "labels": {**labels, "kubernetes.io/service-name": ADAPTER_SERVICE,
                                 "endpointslice.kubernetes.io/managed-by": MANAGED_BY}},
         "addressType": "IPv4",
         "endpoints": [{"addresses": [ADAPTER_IP], "conditions": {"ready": True}}],
         "ports": [{"name": "https", "port": ADAPTER_PORT, "protocol": "TCP"}]},
    ]
    for version, priority in CUSTOM_METRICS_VERSIONS.items():
        docs.append({
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
            "metadata": {"name": f"{version}.{CUSTOM_METRICS_GROUP}", "labels": labels},
            "spec": {"group": CUSTOM_METRICS_GROUP, "version": version,
                     "service": {"namespace": NAMESPACE, "name": ADAPTER_SERVICE, "port": 443},
                     "caBundle": base64.b64encode(ca_bundle).decode(),
                     "groupPriorityMinimum": 100, "versionPriority": priority},
        })
    return docs


def api_server(kube: Kube) -> tuple[int, bytes, str]:
    """The API server's port, CA certificate and the host name its certificate is checked against."""
    admin = json.loads(kube.run("config", "view", "--raw", "--minify", "-o", "json"))
    cluster = admin["clusters"][0]["cluster"]
    found = re.fullmatch(r"https://([^/:]+|\[[^\]]+\]):(\d+)/?", cluster["server"])
    if not found:
        raise RuntimeError(f"unexpected API server URL {cluster['server']!r} in the kubeconfig")
    if "certificate-authority-data" in cluster:
        ca = base64.b64decode(cluster["certificate-authority-data"])
    else:
        ca = Path(cluster["certificate-authority"]).read_bytes()
    return int(found.group(2)), ca, found.group(1)


def token(kube: Kube, account: str) -> str:
    return kube.run("create", "token", account, "-n", NAMESPACE, "--duration=48h").strip()


# --- processes -----------------------------------------------------------------------------------


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
        except (OSError, IndexError):
            return False


def spawn(state: Path, name: str, argv: list[str], *, where: Path | None = None,
          env: dict[str, str] | None = None) -> int:
    """Start ARGV in its own session, in WHERE (default: the monitoring folder) logging to WHERE/NAME.log, with
    ENV added to this environment; its pid (= its process group)."""
    where = where or folder(state)
    log = open(where / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
    child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, cwd=where, env={**os.environ, **(env or {})})
    log.close()
    return child.pid


def terminate(pid: int | None, timeout: float = 15) -> None:
    if not alive(pid):
        return
    assert pid is not None
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        os.killpg(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.1)


def log_tail(state: Path, name: str, *, where: Path | None = None) -> str:
    """The last lines of NAME.log in WHERE (default: the monitoring folder), as one line."""
    try:
        lines = ((where or folder(state)) / f"{name}.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " / ".join(lines[-3:])


def prometheus_url(conf: dict[str, Any]) -> str:
    return f"http://{conf['prometheus']['address']}:{conf['prometheus']['port']}"


def http_ok(url: str, method: str = "GET") -> bool:
    request = urllib.request.Request(url, method=method)
    with DIRECT.open(request, timeout=5) as answer:
        return bool(answer.status == 200)


# --- start, stop, reload ----------------------------------------------------------------------


def start(state: Path, kube: Kube, binaries: dict[str, Path], *, netns: str, host_ip: str,
          release: str, release_namespace: str) -> dict[str, Any]:
    """Prometheus, its PodMonitor watcher and prometheus-adapter, after the chart was installed."""
    why_not = available()
    if why_not:
        raise RuntimeError(why_not)
    pki = folder(state) / "pki"
    if not (pki / "adapter.crt").is_file():
        raise RuntimeError("the monitoring certificates are missing (control_plane_args makes them before kwokctl)")
    port, ca, server_name = api_server(kube)
    conf: dict[str, Any] = {
        "kubectl": kube.kubectl, "kubeconfig": kube.kubeconfig, "netns": netns,
        "release": release, "releaseNamespace": release_namespace,
        "apiServer": f"https://{host_ip}:{port}", "apiServerName": server_name,
        "binaries": {k: str(v) for k, v in binaries.items()},
        "prometheus": {"address": PROMETHEUS_IP, "port": PROMETHEUS_PORT},
        "adapter": {"address": ADAPTER_IP, "port": ADAPTER_PORT},
    }
    save(state, conf)
    started = time.monotonic()
    kube.apply(identity_manifests())
    mon = folder(state)
    (mon / "kube-ca.crt").write_bytes(ca)
    write_atomically(mon / "prometheus.token", token(kube, PROMETHEUS_ACCOUNT), 0o600)
    write_atomically(mon / "adapter.kubeconfig", json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": ADAPTER_ACCOUNT,
        "clusters": [{"name": "e2e", "cluster": {"server": conf["apiServer"], "tls-server-name": server_name,
                                                 "certificate-authority": str(mon / "kube-ca.crt")}}],
        "users": [{"name": ADAPTER_ACCOUNT, "user": {"token": token(kube, ADAPTER_ACCOUNT)}}],
        "contexts": [{"name": ADAPTER_ACCOUNT, "context": {"cluster": "e2e", "user": ADAPTER_ACCOUNT}}],
    }, indent=2), 0o600)

    warnings = sync_prometheus_config(state, conf, reload=False)
    for warning in warnings:
        say(f"monitoring: {warning}")
    data = mon / "prometheus-data"
    data.mkdir(exist_ok=True)
    conf["prometheus"]["pid"] = spawn(state, "prometheus", [
        "ip", "netns", "exec", netns, str(binaries["prometheus"]), f"--config.file={mon / 'prometheus.yml'}",
        f"--storage.tsdb.path={data}", f"--web.listen-address={PROMETHEUS_IP}:{PROMETHEUS_PORT}",
        "--web.enable-lifecycle", "--storage.tsdb.retention.time=1d", "--log.level=info"])
    save(state, conf)
    url = prometheus_url(conf)

    def prometheus_ready() -> bool:
        if not alive(conf["prometheus"]["pid"]):
            raise Fatal(f"Prometheus exited: {log_tail(state, 'prometheus')}")
        return http_ok(f"{url}/-/ready")
    wait_for(f"Prometheus at {url}/-/ready", prometheus_ready, timeout=60)
    say(f"Prometheus running (pid {conf['prometheus']['pid']}, {url}, log {mon / 'prometheus.log'})")

    conf["watcher"] = {"pid": spawn(state, "watcher", [sys.executable, "-I", str(Path(__file__).resolve()),
                                                       "watch", "--state", str(state)])}
    save(state, conf)
    if adapter_rules(state, conf) is None:
        say(f"no ConfigMap *-adapter-rules of release {release} in {release_namespace}: "
            "prometheus-adapter not started (autoscaling.prometheusAdapter.configMap is false?)")
    else:
        kube.apply(adapter_service_manifests((pki / "serving-ca.crt").read_bytes()))
        start_adapter(state, conf)
    save(state, conf)
    say(f"monitoring up in {time.monotonic() - started:.0f}s")
    return conf


def adapter_rules(state: Path, conf: dict[str, Any]) -> str | None:
    """The chart's prometheus-adapter rules (config.yaml of `<fullname>-adapter-rules`), written for the adapter."""
    kube = Kube(conf["kubectl"], conf["kubeconfig"])
    found = kube.json("get", "configmaps", "-n", conf["releaseNamespace"],
                      "-l", f"app.kubernetes.io/instance={conf['release']}")["items"]
    chosen = [c for c in found if c["metadata"]["name"].endswith("-adapter-rules")]
    if not chosen or "config.yaml" not in (chosen[0].get("data") or {}):
        return None
    rules = str(chosen[0]["data"]["config.yaml"])
    conf["adapter"]["rulesFrom"] = f"configmap/{chosen[0]['metadata']['name']} -n {conf['releaseNamespace']}"
    write_atomically(folder(state) / "adapter-rules.yaml", rules)
    return rules


def start_adapter(state: Path, conf: dict[str, Any]) -> None:
    mon = folder(state)
    kubeconfig = mon / "adapter.kubeconfig"
    conf["adapter"]["pid"] = spawn(state, "adapter", [
        "ip", "netns", "exec", conf["netns"], conf["binaries"]["prometheus-adapter"],
        f"--bind-address={ADAPTER_IP}", f"--secure-port={ADAPTER_PORT}",
        f"--tls-cert-file={mon / 'pki' / 'adapter.crt'}", f"--tls-private-key-file={mon / 'pki' / 'adapter.key'}",
        f"--lister-kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}", f"--prometheus-url={prometheus_url(conf)}/",
        f"--config={mon / 'adapter-rules.yaml'}", f"--metrics-relist-interval={ADAPTER_RELIST_INTERVAL}",
        f"--metrics-max-age={ADAPTER_MAX_AGE}", "--v=1"])
    save(state, conf)
    kube = Kube(conf["kubectl"], conf["kubeconfig"])

    def served() -> bool:
        if not alive(conf["adapter"]["pid"]):
            raise Fatal(f"prometheus-adapter exited: {log_tail(state, 'adapter')}")
        for version in CUSTOM_METRICS_VERSIONS:
            service = kube.json("get", "apiservice", f"{version}.{CUSTOM_METRICS_GROUP}")
            conditions = {c["type"]: c for c in service.get("status", {}).get("conditions") or []}
            if conditions.get("Available", {}).get("status") != "True":
                return False
        return True
    wait_for(f"APIServices {', '.join(CUSTOM_METRICS_VERSIONS)} of {CUSTOM_METRICS_GROUP} Available", served,
             timeout=120, every=1)
    say(f"prometheus-adapter running (pid {conf['adapter']['pid']}, https://{ADAPTER_IP}:{ADAPTER_PORT}, "
        f"{CUSTOM_METRICS_GROUP} Available, log {mon / 'adapter.log'})")


def sync_prometheus_config(state: Path, conf: dict[str, Any], *, reload: bool = True) -> list[str]:
    """Write prometheus.yml from the PodMonitors now in the cluster; reload Prometheus if it changed."""
    kube = Kube(conf["kubectl"], conf["kubeconfig"])
    monitors = kube.json("get", "podmonitors.monitoring.coreos.com", "-A")["items"]
    mon = folder(state)
    sd = {"api_server": conf["apiServer"],
          "tls_config": {"ca_file": str(mon / "kube-ca.crt"), "server_name": conf["apiServerName"]},
          "authorization": {"credentials_file": str(mon / "prometheus.token")}}
    config, warnings = prometheus_config(monitors, sd, SCRAPE_INTERVAL)
    text = json.dumps(config, indent=2) + "\n"
    target = mon / "prometheus.yml"
    try:
        unchanged = target.read_text() == text
    except OSError:
        unchanged = False
    if not unchanged:
        write_atomically(target, text)
        if reload:
            request = urllib.request.Request(f"{prometheus_url(conf)}/-/reload", method="POST")
            try:
                with DIRECT.open(request, timeout=30):
                    pass
            except urllib.error.HTTPError as exc:
                raise RuntimeError(f"Prometheus refused the new config: {exc.read().decode(errors='replace').strip()}"
                                   ) from None
    return warnings


def reload(state: Path) -> list[str]:
    """`e2e/cluster monitoring reload`: the PodMonitors and the adapter rules, read again."""
    conf = load(state)
    if not conf.get("prometheus", {}).get("pid"):
        raise RuntimeError("monitoring does not run in this cluster")
    said = sync_prometheus_config(state, conf)
    said.append(f"Prometheus config: {len(json.loads((folder(state) / 'prometheus.yml').read_text())['scrape_configs'])}"
                " scrape jobs from the PodMonitors")
    before = (folder(state) / "adapter-rules.yaml").read_text() if (folder(state) / "adapter-rules.yaml").is_file() else None
    rules = adapter_rules(state, conf)
    if rules is not None and (rules != before or not alive(conf["adapter"].get("pid"))):
        terminate(conf["adapter"].get("pid"))
        start_adapter(state, conf)
        said.append("prometheus-adapter restarted with the rules now in the ConfigMap")
    else:
        said.append("prometheus-adapter rules unchanged")
    save(state, conf)
    return said


def stop(state: Path) -> None:
    """Stop the watcher, the adapter and Prometheus (what `start` recorded); nothing else."""
    conf = load(state)
    for name in ("watcher", "adapter", "prometheus"):
        pid = (conf.get(name) or {}).get("pid")
        if alive(pid):
            terminate(pid)
            say(f"{name} (pid {pid}) stopped")


def status(state: Path) -> dict[str, Any] | None:
    conf = load(state)
    if not conf.get("prometheus", {}).get("pid"):
        return None
    out: dict[str, Any] = {}
    for name in ("prometheus", "adapter", "watcher"):
        part = dict(conf.get(name) or {})
        part["running"] = alive(part.get("pid"))
        part["log"] = str(folder(state) / f"{name}.log")
        out[name] = part
    out["prometheus"]["url"] = prometheus_url(conf)
    out["adapter"]["url"] = f"https://{ADAPTER_IP}:{ADAPTER_PORT}"
    out["adapter"]["apiServices"] = [f"{v}.{CUSTOM_METRICS_GROUP}" for v in CUSTOM_METRICS_VERSIONS]
    return out


# --- the PodMonitor watcher (its own process) -------------------------------------------------------


def watch(state: Path) -> None:
    """Re-read the PodMonitors whenever one changes (a kubectl watch), rewrite the config, reload Prometheus."""
    conf = load(state)
    argv = [conf["kubectl"], f"--kubeconfig={conf['kubeconfig']}", "get", "podmonitors.monitoring.coreos.com",
            "-A", "--watch", "-o", "name"]

    def sync() -> None:
        try:
            for warning in sync_prometheus_config(state, conf):
                print(f"warning: {warning}", flush=True)
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            print(f"sync failed: {exc}", flush=True)
        else:
            print(f"{time.strftime('%H:%M:%S')} config in sync with the PodMonitors", flush=True)

    while True:
        sync()  # also when a deletion fell between two watches
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=None)
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        open_ = True
        while open_:
            select.select([fd], [], [])
            open_ = bool(os.read(fd, 65536))
            # Wait for a quiet moment (the initial listing arrives one line per object), then sync once.
            while open_ and select.select([fd], [], [], 0.3)[0]:
                open_ = bool(os.read(fd, 65536))
            sync()
        proc.wait()
        print(f"kubectl watch ended ({proc.returncode}); watching again", flush=True)
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/monitoring.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    watcher = commands.add_parser("watch", help="keep Prometheus' config in sync with the PodMonitors")
    watcher.add_argument("--state", required=True, type=Path, help="e2e/cluster's state folder")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    watch(args.state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
