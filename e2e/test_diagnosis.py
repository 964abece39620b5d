"""Why not Ready, in one look: what a kubelet reports on an engine pod shows in `kubectl get infsvc` (the REASON
column, the Ready condition's reason), in the Ready and Degraded conditions, and as a Warning event.

KWOK runs no kubelet. The stages in e2e/kwok-stages.yaml write what one would, kubelet 1.36's shapes, on pods
whose container carries E2E_KWOK_FAULT (set here through spec.engine.env); everything downstream of the pod
status, the operator's watch, the status subresource, the CRD's printer column and Events, is the real thing.
Unschedulable needs no stage: the real scheduler says it (test_placement.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from kube import apply, cluster_status, condition, engine_pods, eventually, example, isvc, kubectl

from tensorfleet import contract

CAUSES = {
    # fault: what the conditions' message must say (regexes), beyond the pod's name
    "ImagePullBackOff": [r'Back-off pulling image "ghcr\.io/\S+"', r": not found$"],
    "ErrImagePull": [r'failed to pull and unpack image "ghcr\.io/\S+"', r": not found$"],
    "CreateContainerConfigError": [r'secret "hf-token" not found'],
    "OOMKilled": [r"container engine ran out of memory \(exit code 137, memory limit 8Gi\)",
                  r"\(restarted 3 times\)$"],
    "CrashLoopBackOff": [r"container engine exited with code 1: ValueError: To serve at least one request",
                         r"\(restarted 5 times\)$"],
}


@pytest.fixture(autouse=True)
def _fault_stages() -> None:
    """These tests need e2e/cluster's KWOK stages; a cluster with kubelets fails pods its own way."""
    found = cluster_status()
    if not found or not found["operator"]["running"]:
        pytest.skip("needs the KWOK fault stages of `e2e/cluster up` (e2e/kwok-stages.yaml)")
    if not found.get("faultStages"):
        pytest.fail("this e2e/cluster was brought up before e2e/kwok-stages.yaml existed, so its kwok cannot fail "
                    "pods: `e2e/cluster down && e2e/cluster up`")


def _columns(name: str, namespace: str) -> dict[str, str]:
    """`kubectl get infsvc NAME` as {header: value}, cut where the headers start (a value may be empty)."""
    header, row = kubectl("get", "infsvc", name, "-n", namespace).splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    ends = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}


def _events(name: str, namespace: str, reason: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.kind=InferenceService,involvedObject.name={name},reason={reason},type=Warning"
    return list(json.loads(kubectl("get", "events", "-n", namespace, "--field-selector", selector, "-o", "json"))["items"])


def _failing(fault: str, namespace: str) -> dict[str, Any]:
    """The simulator on the CPU node, one pod, whose engine container fails with `fault`."""
    doc = example("simulator-cpu.yaml", namespace, parallelism={"tensor": 1, "pipeline": 1}, autoscaling=None,
                  replicas=1)
    doc["spec"]["engine"]["env"] = [{"name": "E2E_KWOK_FAULT", "value": fault}]
    if fault == "CreateContainerConfigError":
        doc["spec"]["hfTokenSecretRef"] = {"name": "hf-token"}  # and no such Secret
    if fault == "OOMKilled":
        doc["spec"]["engine"]["resources"] = {"limits": {"memory": "8Gi"}}  # the limit it ran into
    return doc


@pytest.mark.parametrize("fault", list(CAUSES))
def test_a_kubelet_cause_shows_in_get_in_ready_and_degraded_and_as_an_event(namespace: str, fault: str) -> None:
    doc = _failing(fault, namespace)
    name = doc["metadata"]["name"]
    apply(doc)

    def said() -> dict[str, Any] | None:
        obj = isvc(name, namespace)
        degraded = condition(obj, "Degraded")
        return obj if degraded and degraded["status"] == "True" and degraded["reason"] == fault else None
    obj = eventually(f"{namespace}/{name} Degraded=True reason {fault}", said)

    (pod,) = engine_pods(name, namespace)
    waiting = pod["status"]["containerStatuses"][0]["state"]["waiting"]["reason"]
    assert waiting == ("CrashLoopBackOff" if fault == "OOMKilled" else fault), "what kubectl get pods shows"
    ready, degraded = condition(obj, "Ready"), condition(obj, "Degraded")
    assert ready is not None and degraded is not None
    assert (ready["status"], ready["reason"]) == ("False", fault)
    assert degraded["message"].startswith(f"pod {pod['metadata']['name']}: {fault}: "), degraded["message"]
    assert ready["message"] == f"0 of 1 groups ready: {degraded['message']}"
    for says in CAUSES[fault]:
        assert re.search(says, degraded["message"]), (says, degraded["message"])
    assert "\n" not in degraded["message"] and "rpc error" not in degraded["message"]

    columns = _columns(name, namespace)
    assert (columns["READY"], columns["REASON"]) == ("False", fault)

    events = eventually(f"a Warning event {fault} on {namespace}/{name}", lambda: _events(name, namespace, fault))
    # One per distinct cause however often the operator reconciles (a restarted operator may post it again),
    # saying what Degraded says but the restart count, which changes with every restart.
    pod_name = pod["metadata"]["name"]
    detail = re.sub(r" \(restarted \d+ times?\)$", "", degraded["message"].removeprefix(f"pod {pod_name}: {fault}: "))
    assert {e["message"] for e in events} == {f"{detail} (pod {pod_name})"}
    assert all(e["reportingComponent"] == contract.OPERATOR_COMPONENT for e in events)


def test_the_fix_clears_the_reason(namespace: str) -> None:
    """Fixing what the reason says (here: the image) brings Ready back with reason Serving."""
    doc = _failing("ImagePullBackOff", namespace)
    name = doc["metadata"]["name"]
    apply(doc)
    eventually("REASON ImagePullBackOff", lambda: _columns(name, namespace)["REASON"] == "ImagePullBackOff")
    doc["spec"]["engine"]["env"] = []
    apply(doc)
    # The StatefulSet's rolling update replaces the pod; the new one has no fault.
    eventually("Ready True, reason Serving", lambda: (_columns(name, namespace)["READY"],
                                                     _columns(name, namespace)["REASON"]) == ("True", "Serving"))
    degraded = condition(isvc(name, namespace), "Degraded")
    assert degraded is not None and (degraded["status"], degraded["reason"]) == ("False", "AsExpected")
