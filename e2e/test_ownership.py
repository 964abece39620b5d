"""The operator never takes over, borrows or deletes what it did not create: on the real API server.

Each case was reproduced against the operator before ownership was checked:
a foreign Service was rewritten and then garbage-collected with the
InferenceService; a pre-existing ServiceAccount NAME-router (bound to
`admin`) ran the manifest's router image with its token; two InferenceServices
`foo` and `foo-engine` fought over the Service `foo-engine`.
"""

from __future__ import annotations

import time

import yaml
from kube import apply, condition, eventually, example, get, isvc, kubectl, kubectl_result, wait_ready


def _foreign_service(name: str, namespace: str) -> None:
    apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace,
                                                               "labels": {"team": "other"}},
           "spec": {"selector": {"app": "theirs"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})


def _conflict(name: str, namespace: str) -> dict[str, object] | None:
    found = condition(isvc(name, namespace), "Degraded")
    return found if found and found.get("reason") == "ChildConflict" else None


def test_a_foreign_service_is_neither_rewritten_nor_garbage_collected(namespace: str) -> None:
    doc = example("simulator-cpu.yaml", namespace)
    name = doc["metadata"]["name"]
    _foreign_service(f"{name}-engine", namespace)
    before = get("service", f"{name}-engine", namespace)
    apply(doc)
    found = eventually("Degraded=ChildConflict", lambda: _conflict(name, namespace))
    assert f"Service {name}-engine already exists" in str(found["message"])
    reasons = kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                      "-o", "jsonpath={.items[*].reason}").split()
    assert "ChildConflict" in reasons, reasons
    eventually("the StatefulSet, whose name is free", lambda: get("statefulset", f"{name}-stage-0", namespace))
    after = get("service", f"{name}-engine", namespace)
    assert after is not None and before is not None
    assert after["spec"]["selector"] == {"app": "theirs"} and not after["metadata"].get("ownerReferences")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], "the Service was written"
    kubectl("delete", "inferenceservice", name, "-n", namespace, "--wait=true", "--timeout=60s")
    eventually("the garbage collector to take the StatefulSet",
               lambda: get("statefulset", f"{name}-stage-0", namespace) is None, timeout=120)
    assert get("service", f"{name}-engine", namespace) is not None, "the foreign Service was garbage-collected"


def test_a_manifest_cannot_run_as_an_existing_service_account(namespace: str) -> None:
    doc = example("simulator-cpu.yaml", namespace)
    name = doc["metadata"]["name"]
    account = f"{name}-router"
    kubectl("create", "serviceaccount", account, "-n", namespace)
    kubectl("create", "rolebinding", "powerful", "--clusterrole=admin", f"--serviceaccount={namespace}:{account}",
            "-n", namespace)
    doc["spec"]["router"] = {**doc["spec"].get("router", {}), "image": "registry.example/attacker:1"}
    apply(doc)
    found = eventually("Degraded=ChildConflict", lambda: _conflict(name, namespace))
    assert f"ServiceAccount {account} already exists" in str(found["message"])
    eventually("the engines, which need no identity", lambda: get("statefulset", f"{name}-stage-0", namespace))
    time.sleep(2)  # room for a wrong write to land
    assert get("deployment", f"{name}-router", namespace) is None, "the router would run with the borrowed token"
    assert get("rolebinding", f"{name}-router", namespace) is None
    assert not (get("serviceaccount", account, namespace) or {}).get("metadata", {}).get("ownerReferences")


def test_a_name_whose_children_collide_is_refused_at_admission_and_nothing_flaps(namespace: str) -> None:
    first = example("simulator-cpu.yaml", namespace)
    name = first["metadata"]["name"]
    apply(first)
    wait_ready(name, namespace)
    second = example("simulator-cpu.yaml", namespace)
    second["metadata"]["name"] = f"{name}-engine"
    done = kubectl_result("apply", "-f", "-", stdin=yaml.safe_dump(second))
    assert done.returncode != 0, done.stdout
    assert "denied the request" in done.stderr and f"would share the Service {name}-engine" in done.stderr, \
        done.stderr
    assert isvc(f"{name}-engine", namespace) is None
    service = get("service", f"{name}-engine", namespace)
    assert service is not None and service["metadata"]["ownerReferences"][0]["name"] == name


def test_a_multi_node_group_that_lost_a_worker_restarts_as_a_whole(namespace: str) -> None:
    """vLLM cannot take a lost pipeline stage back: the leader goes too (out of every router at once), and both return."""
    doc = example("simulator-cpu.yaml", namespace)
    name = doc["metadata"]["name"]
    assert doc["spec"]["parallelism"]["pipeline"] >= 2, "the example must be multi-node"
    apply(doc)
    wait_ready(name, namespace)
    leader = get("pod", f"{name}-stage-0-0", namespace)
    assert leader is not None
    time.sleep(1.5)  # timestamps have whole seconds: the replacement must be visibly later than the group
    kubectl("delete", "pod", f"{name}-stage-1-0", "-n", namespace, "--wait=false")

    def leader_replaced() -> bool:
        now = get("pod", f"{name}-stage-0-0", namespace)
        return now is not None and now["metadata"]["uid"] != leader["metadata"]["uid"]

    eventually("the leader of group 0 replaced", leader_replaced)
    reasons = kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                      "-o", "jsonpath={.items[*].reason}").split()
    assert "GroupRestarted" in reasons, reasons
    wait_ready(name, namespace)
