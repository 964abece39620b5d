"""Drift is repaired from watch events, and deletion leaves nothing: the real garbage collector."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kube import (
    CHILD_KINDS,
    condition_status,
    deploy,
    engine_pods,
    eventually,
    get,
    isvc,
    kubectl,
    local_cluster,
    operator_metrics,
    wait_deleted,
    wait_ready,
)

from tensorfleet import contract


def test_a_deleted_or_edited_child_is_restored(namespace: str) -> None:
    name, doc = deploy("simulator-cpu.yaml", namespace)
    router = contract.router_name(name)
    service = get("service", name, namespace)
    assert service is not None
    kubectl("delete", "service", name, "-n", namespace)
    kubectl("scale", "deployment", router, "-n", namespace, "--replicas=0")
    eventually("the Service recreated", lambda: (get("service", name, namespace) or {}).get("metadata", {})
               .get("uid") not in (None, service["metadata"]["uid"]))
    want = doc["spec"]["router"]["replicas"]
    eventually("the router's replicas restored", lambda: (get("deployment", router, namespace) or {})
               .get("spec", {}).get("replicas") == want)
    wait_ready(name, namespace)
    reasons = kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                      "-o", "jsonpath={.items[*].reason}").split()
    assert "ChildRestored" in reasons and "ChildReverted" in reasons, reasons


def test_deleting_the_inference_service_leaves_nothing(namespace: str) -> None:
    name, _ = deploy("simulator-cpu.yaml", namespace)
    selector = f"{contract.LABEL_INFERENCE_SERVICE}={name}"
    assert kubectl("get", CHILD_KINDS, "-n", namespace, "-l", selector, "-o", "name").strip()
    kubectl("delete", contract.PLURAL, name, "-n", namespace, "--wait=true", "--timeout=120s")
    assert isvc(name, namespace) is None

    def everything() -> list[str]:
        # By label, and by name for what carries no label of ours (EndpointSlices,
        # ReplicaSets and ControllerRevisions are labelled by their controllers).
        left = kubectl("get", CHILD_KINDS, "-n", namespace, "-o", "name").split()
        return [ref for ref in left if name in ref.split("/", 1)[1]]

    eventually("the garbage collector to remove every child", lambda: not everything(), timeout=120)


def _calls(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """API requests per (method, kind) beyond the one GET of the InferenceService a reconcile makes.

    Writes of any kind, and reads of children or pods (which come from the
    watch-fed cache, so any GET or LIST of them is a defect). The Lease
    renewals, which run on a timer, are left out.
    """
    found = {}
    for (name, labels), value in samples.items():
        tags = dict(labels)
        if name != "tensorfleet_api_requests_total" or tags.get("kind") == "Lease":
            continue
        if tags.get("method") == "GET" and tags.get("kind") == contract.KIND:
            continue
        found[f"{tags['method']} {tags['kind']}"] = value
    return found


def _reconciles(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return sum(v for (name, _), v in samples.items() if name == "tensorfleet_reconciles_total")


def test_a_converged_inference_service_costs_no_writes_and_no_lists(namespace: str) -> None:
    """Real defaults (omitted false bools, added fields) must not look like drift to the operator,
    and its children are read from the cache, not listed."""
    if not local_cluster():
        pytest.skip("reads the local operator's metrics (e2e/cluster); in-cluster operators expose them on a Service")
    wait_deleted()  # other tests' teardown would count as this operator's calls
    name, _ = deploy("simulator-cpu.yaml", namespace)
    eventually("Progressing=False", lambda: condition_status(isvc(name, namespace), "Progressing") == "False")
    time.sleep(2)
    before = operator_metrics()
    for i in range(3):  # each annotation change is a watch event, so a full reconcile
        kubectl("annotate", contract.PLURAL, name, "-n", namespace, f"e2e/touch=t{i}", "--overwrite")
        time.sleep(1)
    def three_more_reconciles() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        samples = operator_metrics()
        return samples if _reconciles(samples) >= _reconciles(before) + 3 else None

    after = eventually("the reconciles of those events", three_more_reconciles, timeout=60)
    changed = {k: v - _calls(before).get(k, 0) for k, v in _calls(after).items() if v != _calls(before).get(k)}
    assert not changed, f"API calls beyond one GET per reconcile while nothing changed: {changed}"


def test_an_immutable_statefulset_change_recreates_it_keeping_the_pods(namespace: str) -> None:
    """spec.cache adds a volumeClaimTemplate, which a StatefulSet cannot change: the operator
    deletes it with propagationPolicy=Orphan, waits for the real garbage collector to release
    the pods, and creates the new one, which adopts them."""
    name, _ = deploy("simulator-cpu.yaml", namespace, replicas=2, autoscaling=None)
    eventually("2 ready groups", lambda: (isvc(name, namespace) or {}).get("status", {}).get("readyReplicas") == 2)
    stage0 = contract.stage_name(name, 0)
    old = get("statefulset", stage0, namespace)
    assert old is not None
    pods_before = {p["metadata"]["uid"] for p in engine_pods(name, namespace)}
    wait_deleted()  # a reconcile in another test's terminating namespace may fail; only this one's count
    failures_before = _failed_reconciles() if local_cluster() else None
    kubectl("patch", contract.PLURAL, name, "-n", namespace, "--type=merge", "-p",
            '{"spec": {"cache": {"size": "10Gi"}}}')

    def recreated() -> dict[str, Any] | None:
        sts = get("statefulset", stage0, namespace)
        return sts if sts and sts["metadata"]["uid"] != old["metadata"]["uid"] else None
    new = eventually("the StatefulSet recreated", recreated)
    assert new["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    # Pods of the old StatefulSet were adopted, not deleted with it (the group rollout that
    # follows replaces outdated groups one at a time; at least one group is untouched yet).
    adopted = eventually("orphaned pods adopted by the new StatefulSet", lambda: [
        p for p in engine_pods(name, namespace) if p["metadata"]["uid"] in pods_before
        and [r["uid"] for r in p["metadata"].get("ownerReferences") or []] == [new["metadata"]["uid"]]])
    assert adopted
    reasons = kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                      "-o", "jsonpath={.items[*].reason}").split()
    assert "StatefulSetRecreated" in reasons, reasons
    if failures_before is not None:
        assert _failed_reconciles() == failures_before, "a reconcile failed on the way (RBAC? a terminating object?)"


def _failed_reconciles() -> float:
    return sum(v for (name, labels), v in operator_metrics().items()
               if name == "tensorfleet_reconciles_total" and dict(labels).get("result") == "error")
