"""The chart's monitoring option against the real API server: every object it renders is accepted with
strict field validation (unknown or duplicate fields refused, not pruned), PodMonitors and ServiceMonitors
included, whose schema is prometheus-operator's CRD (pinned in e2e/build/prometheus-operator) as installed
in this cluster. tests/test_chart.py validates the Kubernetes kinds offline; third-party kinds need the CRD.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube import kubectl, kubectl_result

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "tensorfleet"
# Everything monitoring can turn on: the operator's ServiceMonitor, the PodMonitors of engines and routers
# (selecting two namespaces), and the adapter rules' ConfigMap.
VALUES = ["--set", "operator.replicas=0",
          "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.serviceMonitor.labels.release=prom",
          "--set", "monitoring.podMonitors.enabled=true", "--set", "monitoring.podMonitors.labels.release=prom",
          "--set", "monitoring.podMonitors.namespaces={team-a,team-b}",
          "--set", "autoscaling.prometheusAdapter.configMap=true"]


def _render(namespace: str) -> list[dict[str, Any]]:
    helm = shutil.which("helm")
    assert helm, "helm is on the PATH e2e/cluster up prints"
    server = json.loads(kubectl("version", "-o", "json"))["serverVersion"]["gitVersion"]
    done = subprocess.run([helm, "template", "tf-strict", str(CHART), "-n", namespace, f"--kube-version={server}",
                           *VALUES],
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _dry_run(docs: list[dict[str, Any]], namespace: str) -> subprocess.CompletedProcess[str]:
    listed = {"apiVersion": "v1", "kind": "List", "items": docs}
    return kubectl_result("apply", "-n", namespace, "--dry-run=server", "--validate=strict", "-f", "-",
                          stdin=json.dumps(listed))


def test_every_object_of_the_monitoring_option_is_accepted_strictly(namespace: str) -> None:
    docs = _render(namespace)
    kinds = {doc["kind"] for doc in docs}
    assert {"PodMonitor", "ServiceMonitor", "ConfigMap", "Deployment"} <= kinds, kinds
    done = _dry_run(docs, namespace)
    assert done.returncode == 0, done.stderr
    # Every object went through the API server (a dry run answers each one).
    assert done.stdout.count("(server dry run)") == len(docs), done.stdout


@pytest.mark.parametrize("kind", ["PodMonitor", "ServiceMonitor"])
def test_a_field_the_crd_does_not_know_is_refused(namespace: str, kind: str) -> None:
    # The check above can fail: the same object with one misspelt field is refused, not pruned.
    monitor = copy.deepcopy(next(doc for doc in _render(namespace) if doc["kind"] == kind))
    endpoints = monitor["spec"].get("podMetricsEndpoints") or monitor["spec"].get("endpoints")
    endpoints[0]["scrapeIntervall"] = "5s"
    done = _dry_run([monitor], namespace)
    assert done.returncode != 0
    assert "scrapeIntervall" in done.stderr and "unknown field" in done.stderr, done.stderr
    assert "monitoring.coreos.com" in kubectl("get", "crd", "-o", "name")
