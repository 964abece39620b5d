"""Drift is repaired from watch events, and deletion leaves nothing: the real garbage collector."""

from __future__ import annotations

from kube import CHILD_KINDS, apply, eventually, example, get, isvc, kubectl, wait_ready

from tensorfleet import contract


def test_a_deleted_or_edited_child_is_restored(namespace: str) -> None:
    doc = example("simulator-cpu.yaml", namespace)
    name = doc["metadata"]["name"]
    apply(doc)
    wait_ready(name, namespace)
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
    doc = example("simulator-cpu.yaml", namespace)
    name = doc["metadata"]["name"]
    apply(doc)
    wait_ready(name, namespace)
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
