"""kube-proxy for the e2e cluster: Service ClusterIPs that route, as on a real node (issue 36's router fault).

kube-proxy (built from k8s.io/kubernetes like the rest of the control plane) runs in iptables mode inside the
pod network's namespace (e2e/cluster's POD_NETNS), which every pod's veth hangs off as a node's root namespace
does: it watches Services and EndpointSlices and programs that namespace's nat table, so a connection to a
ClusterIP, from a pod or from this host (the Service range is routed into the namespace as the pod range is), is
DNATed to a Ready endpoint and dropped from the rotation when the endpoint turns not Ready. Nothing of this host's
own netfilter state is touched: the conntrack sysctls are left alone (`--conntrack-max-per-core=0` and the
timeouts at 0), and the rules live in the namespace. Needs `iptables` (Debian's package; .ci/run installs it);
without it the cluster comes up without ClusterIPs and says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import monitoring  # e2e/monitoring.py: spawn, terminate, alive, api_server, log_tail

NAMESPACE = "kube-system"
ACCOUNT = "kube-proxy"
HEALTHZ = "127.0.0.1:10256"   # inside the pod network's namespace
METRICS = "127.0.0.1:10249"


def available() -> str | None:
    """Why kube-proxy cannot run here, or None."""
    if not shutil.which("iptables") or not shutil.which("iptables-restore"):
        return "iptables is not installed (apt-get install iptables): Services get no routable ClusterIP"
    return None


def folder(state: Path) -> Path:
    path = state / "kube-proxy"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _manifests() -> list[dict[str, Any]]:
    """Its ServiceAccount, bound to the bootstrap ClusterRole every cluster has for it (system:node-proxier)."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": ACCOUNT, "namespace": NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "e2e-kube-proxy"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node-proxier"},
         "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}]},
    ]


def _nat_rules(netns: str) -> str:
    done = subprocess.run(["ip", "netns", "exec", netns, "iptables-save", "-t", "nat"], capture_output=True,
                          text=True, check=False, timeout=30)
    return done.stdout if done.returncode == 0 else ""


def start(state: Path, kube: monitoring.Kube, binary: Path, *, netns: str, host_ip: str, host_link: str,
          netns_ip: str, service_range: str, node: str) -> dict[str, Any]:
    """kube-proxy in NETNS as node NODE, and this host's route to SERVICE_RANGE through it; its pid and log."""
    why_not = available()
    if why_not:
        raise RuntimeError(why_not)
    where = folder(state)
    port, ca, server_name = monitoring.api_server(kube)
    kube.apply(_manifests())
    (where / "ca.crt").write_bytes(ca)
    token = kube.run("create", "token", ACCOUNT, "-n", NAMESPACE, "--duration=48h").strip()
    monitoring.write_atomically(where / "kubeconfig", json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": ACCOUNT,
        "clusters": [{"name": "e2e", "cluster": {"server": f"https://{host_ip}:{port}", "tls-server-name": server_name,
                                                 "certificate-authority": str(where / "ca.crt")}}],
        "users": [{"name": ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": ACCOUNT, "context": {"cluster": "e2e", "user": ACCOUNT}}],
    }, indent=2), 0o600)
    pid = monitoring.spawn(state, "kube-proxy", [
        "ip", "netns", "exec", netns, str(binary), f"--kubeconfig={where / 'kubeconfig'}", "--proxy-mode=iptables",
        f"--hostname-override={node}", f"--healthz-bind-address={HEALTHZ}", f"--metrics-bind-address={METRICS}",
        # The host's conntrack table is not ours to size; nor is localhost NodePort routing wanted.
        "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0s",
        "--conntrack-tcp-timeout-close-wait=0s", "--iptables-localhost-nodeports=false",
        # A Service change reaches the rules within a second, as kube-proxy's default.
        "--iptables-min-sync-period=1s"], where=where)
    subprocess.run(["ip", "route", "replace", service_range, "via", netns_ip, "dev", host_link], check=True,
                   capture_output=True, timeout=30)
    started = time.monotonic()

    def programmed() -> bool:
        if not monitoring.alive(pid):
            raise RuntimeError(f"kube-proxy exited: {monitoring.log_tail(state, 'kube-proxy', where=where)}")
        # The API server's own Service, kubernetes.default, is the first one every cluster has.
        return "default/kubernetes:https" in _nat_rules(netns)
    monitoring.wait_for("kube-proxy's rules for default/kubernetes", programmed, timeout=60)
    return {"pid": pid, "log": str(where / "kube-proxy.log"), "serviceRange": service_range,
            "seconds": round(time.monotonic() - started, 1)}


def stop(found: dict[str, Any] | None) -> None:
    if found:
        monitoring.terminate(found.get("pid"))
