"""The whole flow on a real cluster, in order: install, serve, scale, roll, heal, delete.

Uses helm-python-sdk (Helm's Go SDK; no helm binary) to install the chart and
kubectl for everything else, as a user would. Settings (environment):

  TF_E2E_IMAGE          control-plane image loaded into the cluster
                        (default: contract.CONTROL_PLANE_IMAGE)
  TF_E2E_NEXT_IMAGE     a second tag of the same image, for the rollout test
                        (default: <repository>:e2e-next)
  TF_E2E_NAMESPACE      namespace for the InferenceService (default tensorfleet-e2e)
  TF_E2E_TIMEOUT        seconds to wait for each step (default 600)
  TF_E2E_KEEP=1         leave the release and namespace in place afterwards
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tensorfleet import contract

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "tensorfleet"
EXAMPLE = ROOT / "examples" / "simulator-cpu.yaml"
RELEASE = "tensorfleet"
SYSTEM_NAMESPACE = "tensorfleet-system"
NAMESPACE = os.environ.get("TF_E2E_NAMESPACE", "tensorfleet-e2e")
IMAGE = os.environ.get("TF_E2E_IMAGE", contract.CONTROL_PLANE_IMAGE)
NEXT_IMAGE = os.environ.get("TF_E2E_NEXT_IMAGE", IMAGE.rsplit(":", 1)[0] + ":e2e-next")
TIMEOUT = float(os.environ.get("TF_E2E_TIMEOUT", "600"))
CHILD_KINDS = "statefulsets,deployments,services,horizontalpodautoscalers,poddisruptionbudgets," \
              "serviceaccounts,roles,rolebindings,pods"



def kubectl(*args: str, check: bool = True, stdin: str | None = None) -> str:
    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def get(kind: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
    out = kubectl("get", kind, name, "-n", namespace, "-o", "json", "--ignore-not-found", check=True)
    return json.loads(out) if out.strip() else None


def eventually(what: str, probe: Callable[[], Any], timeout: float = TIMEOUT, every: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def condition(obj: dict[str, Any] | None, kind: str) -> str | None:
    for cond in (obj or {}).get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return cond["status"]
    return None


@pytest.fixture(scope="module")
def release() -> Iterator[str]:
    import helm_python as helm

    config = helm.Config(kubeconfig_path=os.environ["KUBECONFIG"], namespace=SYSTEM_NAMESPACE)
    config.check_reachable()
    repository, _, tag = IMAGE.rpartition(":")
    values = {"image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
              "operator": {"resyncSeconds": 30}}
    # No Helm wait: with the webhook on only the leader is Ready by design; we wait for it below.
    config.install(str(CHART), RELEASE, values, namespace=SYSTEM_NAMESPACE, create_namespace=True, timeout=300)
    try:
        eventually("a Ready operator leader", lambda: (get("deployment", f"{RELEASE}", SYSTEM_NAMESPACE) or {})
                   .get("status", {}).get("readyReplicas", 0) >= 1)
        kubectl("create", "namespace", NAMESPACE, check=False)
        yield RELEASE
    finally:
        if not os.environ.get("TF_E2E_KEEP"):
            kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", "--timeout=300s", check=False)
            config.uninstall(RELEASE, ignore_not_found=True, timeout=300)
        config.close() if hasattr(config, "close") else None


@pytest.fixture(scope="module")
def isvc(release: str) -> dict[str, Any]:
    """examples/simulator-cpu.yaml as shipped, moved into the e2e namespace."""
    (doc,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    doc["metadata"]["namespace"] = NAMESPACE
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    return doc


def name_of(isvc: dict[str, Any]) -> str:
    return str(isvc["metadata"]["name"])


def ready(isvc: dict[str, Any]) -> dict[str, Any] | None:
    obj = get(contract.PLURAL, name_of(isvc))
    return obj if condition(obj, "Ready") == "True" else None


def test_01_chart_installed_the_operator(release: str) -> None:
    crd = get("customresourcedefinition", contract.CRD_NAME, "default")
    assert crd is not None, "the chart's crds/ installs the InferenceService CRD"
    lease = eventually("the leader Lease", lambda: get("lease", "tensorfleet-operator", SYSTEM_NAMESPACE))
    assert lease["spec"]["holderIdentity"].startswith(RELEASE)


def test_02_webhook_rejects_an_impossible_plan(release: str) -> None:
    bad = {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
           "metadata": {"name": "too-big", "namespace": NAMESPACE},
           "spec": {"model": {"name": "meta-llama/Llama-3.1-405B-Instruct"}, "accelerator": {"type": "L4"},
                    "parallelism": {"tensor": 1, "pipeline": 1}}}
    done = subprocess.run(["kubectl", "apply", "--dry-run=server", "-f", "-"], input=yaml.safe_dump(bad),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "admission webhook" in done.stderr, done.stderr


def test_03_example_becomes_ready(isvc: dict[str, Any]) -> None:
    obj = eventually("InferenceService Ready", lambda: ready(isvc))
    name = name_of(isvc)
    assert condition(obj, "PlanValid") == "True"
    assert obj["status"]["endpoint"].startswith(f"http://{name}.{NAMESPACE}.svc")
    pipeline = isvc["spec"]["parallelism"]["pipeline"]
    for stage in range(pipeline):
        assert get("statefulset", contract.stage_name(name, stage)) is not None
    assert get("horizontalpodautoscaler", contract.hpa_name(name)) is not None
    # GitOps: the operator never writes spec (no replicas appear under autoscaling).
    assert "replicas" not in obj["spec"]


def test_04_hpa_is_not_disabled(isvc: dict[str, Any]) -> None:
    """The HPA must see a non-zero /scale: at 0 it reports ScalingDisabled and never scales.

    /scale of a custom resource answers spec.replicas 0 while the field is absent,
    which is how the example (and GitOps) leave it under autoscaling.
    """
    name = name_of(isvc)

    def conditions() -> list[dict[str, Any]]:
        hpa = get("horizontalpodautoscaler", contract.hpa_name(name)) or {}
        return hpa.get("status", {}).get("conditions", [])

    found = eventually("HPA conditions", conditions, timeout=120)
    disabled = [c for c in found if c.get("reason") == "ScalingDisabled"]
    assert not disabled, f"the HPA is disabled: {disabled[0]['message']} (spec.replicas absent -> /scale says 0)"


def _port_forward(service: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(["kubectl", "port-forward", "-n", NAMESPACE, f"svc/{service}", f":{contract.SERVICE_PORT}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"127\.0\.0\.1:(\d+)", line)
    if not match:
        proc.kill()
        raise AssertionError(f"port-forward did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc, int(match.group(1))


def test_05_chat_completion_through_the_service(isvc: dict[str, Any]) -> None:
    eventually("InferenceService Ready", lambda: ready(isvc))
    proc, port = _port_forward(name_of(isvc))
    try:
        model = isvc["spec"]["model"].get("servedName") or isvc["spec"]["model"]["name"]
        body = json.dumps({"model": model, "max_tokens": 16,
                           "messages": [{"role": "user", "content": "Say hello"}]}).encode()

        def ask() -> dict[str, Any]:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())

        answer = eventually("a chat completion", ask, timeout=120)
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"]
        assert answer["model"] == model
    finally:
        proc.kill()
        proc.wait()


def test_06_kubectl_scale(isvc: dict[str, Any]) -> None:
    name = name_of(isvc)
    # A fixed replica count: drop autoscaling (the HPA would otherwise own /scale), then scale.
    kubectl("patch", contract.PLURAL, name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps({"spec": {"autoscaling": None}}))
    eventually("the HPA pruned", lambda: get("horizontalpodautoscaler", contract.hpa_name(name)) is None)
    kubectl("scale", f"{contract.PLURAL}/{name}", "-n", NAMESPACE, "--replicas=2")
    pipeline = isvc["spec"]["parallelism"]["pipeline"]
    for stage in range(pipeline):
        eventually(f"stage {stage} at 2 replicas",
                   lambda: (get("statefulset", contract.stage_name(name, stage)) or {}).get("spec", {}).get("replicas") == 2)
    obj = eventually("2 ready replicas", lambda: (lambda o: o if o and o.get("status", {}).get("readyReplicas") == 2
                                                  and condition(o, "Ready") == "True" else None)(get(contract.PLURAL, name)))
    assert obj["spec"]["replicas"] == 2
    scale = json.loads(kubectl("get", "--raw",
                               f"/apis/{contract.API_VERSION}/namespaces/{NAMESPACE}/{contract.PLURAL}/{name}/scale"))
    assert scale["kind"] == "Scale" and scale["status"]["replicas"] == 2


def test_07_image_tag_change_rolls_out(isvc: dict[str, Any]) -> None:
    name = name_of(isvc)
    kubectl("patch", contract.PLURAL, name, "-n", NAMESPACE, "--type=merge", "-p",
            json.dumps({"spec": {"engine": {"image": NEXT_IMAGE, "imagePullPolicy": "IfNotPresent"}}}))
    selector = f"{contract.LABEL_INFERENCE_SERVICE}={name},{contract.LABEL_COMPONENT}={contract.COMPONENT_ENGINE}"

    def rolled() -> bool:
        pods = json.loads(kubectl("get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "json"))["items"]
        obj = get(contract.PLURAL, name) or {}
        return bool(pods) and all(
            p["spec"]["containers"][0]["image"] == NEXT_IMAGE and p["metadata"].get("deletionTimestamp") is None
            for p in pods) and condition(obj, "Ready") == "True" and \
            obj.get("status", {}).get("updatedReplicas") == obj.get("spec", {}).get("replicas")

    eventually(f"every engine pod on {NEXT_IMAGE}", rolled)


def test_08_broken_children_are_restored(isvc: dict[str, Any]) -> None:
    name = name_of(isvc)
    router = contract.router_name(name)
    service = get("service", name)
    assert service is not None
    kubectl("delete", "service", name, "-n", NAMESPACE)
    kubectl("scale", "deployment", router, "-n", NAMESPACE, "--replicas=0")
    eventually("Service restored", lambda: (get("service", name) or {}).get("metadata", {}).get("uid")
               not in (None, service["metadata"]["uid"]))
    want = isvc["spec"]["router"]["replicas"]
    eventually("router replicas restored", lambda: (get("deployment", router) or {}).get("spec", {}).get("replicas") == want)
    eventually("Ready again", lambda: ready(isvc))


def test_09_delete_leaves_nothing(isvc: dict[str, Any]) -> None:
    name = name_of(isvc)
    kubectl("delete", contract.PLURAL, name, "-n", NAMESPACE, "--wait=true", "--timeout=300s")
    selector = f"{contract.LABEL_INFERENCE_SERVICE}={name}"

    def gone() -> bool:
        left = kubectl("get", CHILD_KINDS, "-n", NAMESPACE, "-l", selector, "-o", "name")
        return not left.strip()

    eventually("every child garbage-collected", gone, timeout=300)
    assert get(contract.PLURAL, name) is None
