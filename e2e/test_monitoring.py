"""Prometheus and prometheus-adapter of `e2e/cluster up`, against the real control plane.

A pod of the test's own (KWOK marks it Running and gives it an IP) gets a process
on that IP, in the pod network namespace (`e2e/cluster exec-pod`), serving
Prometheus text. A PodMonitor of the test's own selects it; the e2e cluster's
Prometheus, whose scrape config is the PodMonitors' translation, finds the pod
through Kubernetes service discovery and scrapes it; prometheus-adapter, with the
rules of the chart's ConfigMap, answers the custom-metrics API through the real
kube-apiserver's aggregator (`kubectl get --raw`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube import (
    CLUSTER_SCRIPT,
    RELEASE,
    SYSTEM_NAMESPACE,
    apply,
    cluster_status,
    delete_namespace,
    eventually,
    get,
    items,
    kubectl,
    kubectl_result,
    new_namespace,
)

from tensorfleet import contract

ISVC = "queue-demo"             # the InferenceService the served series belong to (by label; none need exist)
PORT = 9108
MONITOR = "e2e-metrics"
PENDING = 3                     # the value the pod serves for the router's pending-requests gauge
SERVER = """
import http.server, sys
body = sys.argv[3].encode()
class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Metrics).serve_forever()
"""
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # pod IPs are local: never a proxy


def _pod(name: str, namespace: str, app: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": app, contract.LABEL_INFERENCE_SERVICE: ISVC}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "exporter", "image": "registry.invalid/e2e-exporter:1",
                                     "ports": [{"name": "metrics", "containerPort": PORT}]}]}}


def _podmonitor(name: str, namespace: str, app: str, **endpoint: Any) -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": app}},
                     "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "5s", **endpoint}]}}


def _prometheus(path: str, **params: str) -> Any:
    status = cluster_status() or {}
    url = f"{status['monitoring']['prometheus']['url']}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with DIRECT.open(url, timeout=10) as answer:
        found = json.loads(answer.read())
    assert found["status"] == "success", found
    return found["data"]


def _targets(pool: str) -> list[dict[str, Any]]:
    return [t for t in _prometheus("/api/v1/targets", state="active")["activeTargets"] if t["scrapePool"] == pool]


def _running_ip(name: str, namespace: str) -> str | None:
    pod = get("pod", name, namespace) or {}
    status = pod.get("status") or {}
    return status.get("podIP") if status.get("phase") == "Running" else None


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A namespace with a selected pod serving metrics on its IP, an unselected pod, and a PodMonitor."""
    status = cluster_status()
    if not status or not status.get("podNetwork") or not status.get("monitoring"):
        pytest.fail("needs the Prometheus and prometheus-adapter of `e2e/cluster up` (run as root: they serve on "
                    f"pod-range addresses in the pod network). status: {status!r}")
    namespace = new_namespace("monitoring")
    log = tmp_path_factory.mktemp("exporter") / "exporter.log"
    server: subprocess.Popen[bytes] | None = None
    try:
        apply(_pod("exporter", namespace, MONITOR))
        apply(_pod("bystander", namespace, "e2e-other"))  # the same port and labels but for the selected one
        ip = str(eventually("pod exporter Running with an IP", lambda: _running_ip("exporter", namespace)))
        body = (f"# TYPE {contract.ROUTER_METRIC_PENDING} gauge\n{contract.ROUTER_METRIC_PENDING} {PENDING}\n"
                "# TYPE e2e_dropped_total counter\ne2e_dropped_total 1\n")
        with open(log, "wb") as out:
            server = subprocess.Popen([str(CLUSTER_SCRIPT), "exec-pod", "--", sys.executable, "-c", SERVER, ip,
                                       str(PORT), body], stdout=out, stderr=subprocess.STDOUT)

        def serving() -> bool:
            assert server is not None and server.poll() is None, f"the exporter exited: {log.read_text()}"
            try:
                with DIRECT.open(f"http://{ip}:{PORT}/metrics", timeout=5) as answer:
                    return contract.ROUTER_METRIC_PENDING in answer.read().decode()
            except OSError:  # not listening yet
                return False
        eventually(f"the exporter serving on {ip}:{PORT}", serving, timeout=60)
        apply(_podmonitor(MONITOR, namespace, MONITOR, relabelings=[
            {"sourceLabels": ["__meta_kubernetes_pod_label_tensorfleet_dev_inference_service"],
             "targetLabel": "inferenceservice", "action": "replace"}],
            metricRelabelings=[{"sourceLabels": ["__name__"], "regex": "e2e_dropped_total", "action": "drop"}]))
        yield {"namespace": namespace, "ip": ip}
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        delete_namespace(namespace)


def test_prometheus_targets_the_pod_its_podmonitor_selects(scraped: dict[str, str]) -> None:
    namespace = scraped["namespace"]
    pool = f"podMonitor/{namespace}/{MONITOR}/0"

    def up() -> list[dict[str, Any]] | None:
        found = _targets(pool)
        return found if found and all(t["health"] == "up" for t in found) else None
    targets = eventually(f"an up target in Prometheus' pool {pool}", up, timeout=120)
    assert len(targets) == 1, f"only the exporter pod is selected (not the bystander): {targets}"
    (target,) = targets
    assert target["scrapeUrl"] == f"http://{scraped['ip']}:{PORT}/metrics"
    assert target["labels"] == {
        "namespace": namespace, "pod": "exporter", "container": "exporter", "endpoint": "metrics",
        "job": f"{namespace}/{MONITOR}", "instance": f"{scraped['ip']}:{PORT}", "inferenceservice": ISVC,
    }, target["labels"]
    assert target["scrapeInterval"] == "5s"


def test_a_metric_served_on_the_pod_ip_is_queryable(scraped: dict[str, str]) -> None:
    namespace = scraped["namespace"]

    def series() -> list[dict[str, Any]] | None:
        found = _prometheus("/api/v1/query", query=f'{contract.ROUTER_METRIC_PENDING}{{namespace="{namespace}"}}')
        return found["result"] or None
    (sample,) = eventually(f"{contract.ROUTER_METRIC_PENDING} in Prometheus", series, timeout=120)
    assert float(sample["value"][1]) == PENDING
    assert sample["metric"]["pod"] == "exporter" and sample["metric"]["inferenceservice"] == ISVC
    # The PodMonitor's metricRelabelings dropped the other series of the same scrape.
    names = _prometheus("/api/v1/label/__name__/values", **{"match[]": f'{{namespace="{namespace}"}}'})
    assert contract.ROUTER_METRIC_PENDING in names and "up" in names
    assert "e2e_dropped_total" not in names, names


def _chart_rule() -> dict[str, Any]:
    """The chart's adapter rule for the metric the operator's HPAs read (from the installed ConfigMap)."""
    found = [c for c in items("configmaps", SYSTEM_NAMESPACE, f"app.kubernetes.io/instance={RELEASE}")
             if c["metadata"]["name"].endswith("-adapter-rules")]
    assert found, f"the chart installed no *-adapter-rules ConfigMap in {SYSTEM_NAMESPACE}"
    rules = yaml.safe_load(found[0]["data"]["config.yaml"])["rules"]
    chosen = [r for r in rules if (r.get("name") or {}).get("as") == contract.HPA_METRIC_PENDING]
    assert chosen, f"no rule names {contract.HPA_METRIC_PENDING} in {found[0]['metadata']['name']}: {rules}"
    return dict(chosen[0])


def test_the_custom_metrics_api_answers_through_the_aggregator(scraped: dict[str, str]) -> None:
    namespace = scraped["namespace"]
    rule = _chart_rule()
    target = rule["resources"]["overrides"]["inferenceservice"]
    assert (target.get("group"), target["resource"]) == (contract.GROUP, contract.PLURAL), rule
    for version in ("v1beta1", "v1beta2"):
        service = get("apiservice", f"{version}.custom.metrics.k8s.io", None) or {}
        assert service["spec"]["service"] == {"namespace": "monitoring", "name": "prometheus-adapter", "port": 443}
        available = [c for c in service["status"]["conditions"] if c["type"] == "Available"]
        assert available and available[0]["status"] == "True", available
    path = (f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace}/{contract.PLURAL}.{contract.GROUP}/{ISVC}/"
            f"{contract.HPA_METRIC_PENDING}")

    def value() -> dict[str, Any] | None:
        done = kubectl_result("get", "--raw", path)
        assert done.returncode == 0, done.stderr.strip()
        answer = json.loads(done.stdout)
        return answer if answer.get("items") else None
    answer = eventually(f"{path} through the aggregator", value, timeout=120)
    assert answer["kind"] == "MetricValueList"
    (item,) = answer["items"]
    assert item["metricName"] == contract.HPA_METRIC_PENDING
    assert item["describedObject"]["name"] == ISVC and item["describedObject"]["namespace"] == namespace
    assert float(item["value"]) == PENDING, item


def test_prometheus_follows_podmonitor_changes(scraped: dict[str, str]) -> None:
    """A PodMonitor created, then deleted: the watcher rewrites the config and Prometheus reloads each time."""
    namespace = scraped["namespace"]
    pool = f"podMonitor/{namespace}/bystanders/0"
    apply(_podmonitor("bystanders", namespace, "e2e-other"))
    (target,) = eventually(f"a target in the new pool {pool}", lambda: _targets(pool), timeout=120)
    assert target["labels"]["pod"] == "bystander"
    kubectl("delete", "podmonitor", "bystanders", "-n", namespace)
    eventually(f"pool {pool} gone", lambda: not _targets(pool) and pool not in json.dumps(
        _prometheus("/api/v1/status/config")), timeout=120)
    assert _targets(f"podMonitor/{namespace}/{MONITOR}/0"), "the other PodMonitor's target stayed"


def test_prometheus_and_the_adapter_hold_least_privilege() -> None:
    for account in ("prometheus", "prometheus-adapter"):
        identity = f"system:serviceaccount:monitoring:{account}"
        for verb in ("get", "list", "watch"):
            for resource in ("pods", "namespaces"):
                assert kubectl_result("auth", "can-i", verb, resource, "-A", f"--as={identity}").stdout.strip() == \
                    "yes", (identity, verb, resource)
        for forbidden in (("get", "secrets"), ("list", "configmaps"), ("create", "pods"), ("delete", "pods"),
                          ("list", "podmonitors.monitoring.coreos.com"), ("list", f"{contract.PLURAL}.{contract.GROUP}")):
            assert kubectl_result("auth", "can-i", *forbidden, "-A", f"--as={identity}").stdout.strip() == "no", \
                (identity, forbidden)


def test_the_prometheus_operator_crds_come_from_the_pinned_module() -> None:
    recipe = Path(__file__).resolve().parent / "build" / "prometheus-operator" / "go.mod"
    pinned = next(line.split()[2] for line in recipe.read_text().splitlines() if line.startswith("require "))
    crd = get("customresourcedefinition", "podmonitors.monitoring.coreos.com", None) or {}
    assert crd["metadata"]["annotations"]["operator.prometheus.io/version"] == pinned.lstrip("v")
    assert any(v["name"] == "v1" and v["served"] for v in crd["spec"]["versions"])


def test_the_hpa_controller_scales_on_the_adapter_metric(scraped: dict[str, str]) -> None:
    """The real HPA controller reads the chart rule's Object metric through the aggregator, and scales."""
    namespace = scraped["namespace"]
    labels = {"app.kubernetes.io/name": "e2e-scaled"}
    apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "scaled", "namespace": namespace},
           "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                    "template": {"metadata": {"labels": labels},
                                 "spec": {"containers": [{"name": "app", "image": "registry.invalid/e2e-app:1"}]}}}})
    apply({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "scaled", "namespace": namespace},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "scaled"},
                    "minReplicas": 1, "maxReplicas": 5,
                    "metrics": [{"type": "Object", "object": {
                        "describedObject": {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "name": ISVC},
                        "metric": {"name": contract.HPA_METRIC_PENDING},
                        "target": {"type": "Value", "value": "1"}}}]}})

    def scaled() -> dict[str, Any] | None:
        hpa = get("horizontalpodautoscaler", "scaled", namespace) or {}
        return hpa if (hpa.get("status") or {}).get("desiredReplicas") == PENDING else None
    hpa = eventually(f"the HPA wanting {PENDING} replicas ({PENDING} pending / target 1)", scaled, timeout=120)
    (current,) = hpa["status"]["currentMetrics"]
    assert float(current["object"]["current"]["value"]) == PENDING, current
    active = [c for c in hpa["status"]["conditions"] if c["type"] == "ScalingActive"]
    assert active and active[0]["status"] == "True" and active[0]["reason"] == "ValidMetricFound", active
    eventually(f"the Deployment at {PENDING} replicas", lambda: (get("deployment", "scaled", namespace) or {})
               .get("spec", {}).get("replicas") == PENDING, timeout=60)
