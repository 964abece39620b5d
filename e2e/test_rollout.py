"""Rollouts as the real StatefulSet controller and scheduler carry them out.

A group (ordinal i of every stage) is the unit: the operator surges a
replacement group first and retires an old one only while `replicas` other
groups serve, so a group never mixes versions and serving capacity never
drops. A pod watch checks both on every event; for a one-replica service an
EndpointSlice watch checks what the router sees: at least one ready engine at
every moment.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from kube import (
    NEXT_IMAGE,
    apply,
    engine_pods,
    eventually,
    example,
    get,
    isvc,
    items,
    kill_operator,
    kubectl,
    start_operator,
    wait_ready,
    watching_pods,
)

from tensorfleet import contract


def _group(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["labels"]["apps.kubernetes.io/pod-index"])


def _serving(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or [])


def group_invariants(replicas: int, pipeline: int) -> Callable[[dict[str, dict[str, Any]]], None]:
    def check(pods: dict[str, dict[str, Any]]) -> None:
        groups: dict[int, dict[int, dict[str, Any]]] = {}
        for pod in pods.values():
            if _serving(pod):
                stage = int(pod["metadata"]["labels"][contract.LABEL_STAGE])
                groups.setdefault(_group(pod), {})[stage] = pod
        for index, members in groups.items():
            images = {p["spec"]["containers"][0]["image"] for p in members.values()}
            assert len(images) == 1, f"group {index} serves mixed versions: {sorted(images)}"
        whole = [i for i, members in groups.items() if len(members) == pipeline]
        assert len(whole) >= replicas, f"only groups {sorted(whole)} serving, {replicas} wanted"
    return check


def rollout_done(name: str, namespace: str, image: str, replicas: int) -> dict[str, Any] | None:
    pods = engine_pods(name, namespace)
    obj = isvc(name, namespace) or {}
    status = obj.get("status", {})
    done = (len(pods) == replicas * obj["spec"]["parallelism"]["pipeline"]
            and all(p["spec"]["containers"][0]["image"] == image and _serving(p) for p in pods)
            and status.get("updatedReplicas") == replicas and status.get("readyReplicas") == replicas)
    return obj if done else None


def rollout_under_way(name: str, namespace: str, image: str, replicas: int) -> bool:
    """A rollout to IMAGE begun (an engine pod runs it) and not finished."""
    updated = (isvc(name, namespace) or {}).get("status", {}).get("updatedReplicas", 0)
    return bool(any(p["spec"]["containers"][0]["image"] == image for p in engine_pods(name, namespace))
                and updated < replicas)


def deploy_replicas(namespace: str, replicas: int) -> tuple[str, int]:
    doc = example("simulator-cpu.yaml", namespace, replicas=replicas, autoscaling=None)
    name = doc["metadata"]["name"]
    apply(doc)
    obj = wait_ready(name, namespace)
    eventually(f"{replicas} ready groups", lambda: (isvc(name, namespace) or {}).get("status", {})
               .get("readyReplicas") == replicas)
    return name, int(obj["spec"]["parallelism"]["pipeline"])


def set_engine_image(name: str, namespace: str, image: str) -> None:
    kubectl("patch", contract.PLURAL, name, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"engine": {"image": image}}}))


def test_an_image_change_surges_and_never_drops_a_serving_group(namespace: str) -> None:
    replicas = 3
    name, pipeline = deploy_replicas(namespace, replicas)
    selector = f"{contract.LABEL_INFERENCE_SERVICE}={name},{contract.LABEL_COMPONENT}={contract.COMPONENT_ENGINE}"
    with watching_pods(namespace, selector, group_invariants(replicas, pipeline)) as watch:
        eventually("the pod watch to list the pods", lambda: len(watch.pods) == replicas * pipeline)
        watch.arm()
        set_engine_image(name, namespace, NEXT_IMAGE)
        eventually(f"every engine pod on {NEXT_IMAGE}", lambda: rollout_done(name, namespace, NEXT_IMAGE, replicas))
    assert not watch.failures, watch.failures[:5]
    assert watch.events > replicas * pipeline * 3, f"the watch saw only {watch.events} events"
    for stage in range(pipeline):
        sts = get("statefulset", contract.stage_name(name, stage), namespace)
        assert sts and sts["spec"]["updateStrategy"]["type"] == "OnDelete"
        assert sts["status"]["currentRevision"] == sts["status"]["updateRevision"] or \
            sts["status"]["updatedReplicas"] == replicas


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller") for ref in obj["metadata"].get("ownerReferences") or [])


def test_killing_the_operator_mid_rollout_converges_without_duplicates_or_orphans(namespace: str) -> None:
    replicas = 4
    name, pipeline = deploy_replicas(namespace, replicas)
    # The kill must land mid-rollout; a rollout can finish first (KWOK is fast), so try a few images.
    for image in (NEXT_IMAGE, f"{NEXT_IMAGE}-2", f"{NEXT_IMAGE}-3"):
        set_engine_image(name, namespace, image)

        eventually("the rollout under way", functools.partial(rollout_under_way, name, namespace, image, replicas), every=0.1)
        kill_operator()
        mid_rollout = (isvc(name, namespace) or {}).get("status", {}).get("updatedReplicas", 0) < replicas
        time.sleep(2)
        start_operator()
        def rolled(image: str = image) -> dict[str, Any] | None:
            return rollout_done(name, namespace, image, replicas)
        obj = eventually("the rollout finished after the restart", rolled)
        if mid_rollout:
            break
    else:
        pytest.fail("every rollout finished before the operator was killed")
    uid = obj["metadata"]["uid"]

    expected = {
        "StatefulSet": {contract.stage_name(name, k) for k in range(pipeline)},
        "Deployment": {contract.router_name(name)},
        "Service": {name, contract.engine_service_name(name), contract.workers_service_name(name)},
        "PodDisruptionBudget": {contract.pdb_name(name)},
        "NetworkPolicy": {contract.engine_service_name(name), contract.router_name(name)},
        "ServiceAccount": {contract.router_name(name)},
        "Role": {contract.router_name(name)},
        "RoleBinding": {contract.router_name(name)},
    }
    selector = f"{contract.LABEL_INSTANCE}={name}"
    for kind, names in expected.items():
        found = items(kind.lower() + "s" if not kind.endswith("y") else kind.lower()[:-1] + "ies", namespace, selector)
        assert sorted(o["metadata"]["name"] for o in found) == sorted(names), kind
        for child in found:
            assert _owned_by(child, uid), f"{kind} {child['metadata']['name']} is not owned by the InferenceService"
    pods = engine_pods(name, namespace)
    want = {f"{contract.stage_name(name, k)}-{i}" for k in range(pipeline) for i in range(replicas)}
    assert sorted(p["metadata"]["name"] for p in pods) == sorted(want), "one pod per stage and group, no more"
    sts_uids = {s["metadata"]["uid"] for s in items("statefulsets", namespace, selector)}
    for pod in pods:
        owners = {ref["uid"] for ref in pod["metadata"].get("ownerReferences") or [] if ref.get("controller")}
        assert owners & sts_uids, f"pod {pod['metadata']['name']} is orphaned"
    eventually("Progressing=False", lambda: any(c["type"] == "Progressing" and c["status"] == "False"
                                                 for c in (isvc(name, namespace) or {}).get("status", {})
                                                 .get("conditions", [])))


def test_a_one_replica_service_keeps_a_ready_engine_behind_the_router_throughout(namespace: str) -> None:
    doc = example("simulator-cpu.yaml", namespace, replicas=1, autoscaling=None,
                  parallelism={"tensor": 1, "pipeline": 1})
    name = doc["metadata"]["name"]
    apply(doc)
    wait_ready(name, namespace)
    seen: list[int] = []

    def ready_endpoints(slices: dict[str, dict[str, Any]]) -> None:
        ready = sum(1 for s in slices.values() for e in s.get("endpoints") or []
                    if (e.get("conditions") or {}).get("ready") is not False)
        seen.append(ready)
        assert ready >= 1, "no ready engine behind the router"

    selector = f"{contract.ENDPOINTSLICE_SERVICE_LABEL}={contract.engine_service_name(name)}"
    with watching_pods(namespace, selector, ready_endpoints, resource="endpointslices") as watch:
        eventually("the EndpointSlice watch to list the slices", lambda: bool(watch.pods))
        watch.arm()
        set_engine_image(name, namespace, NEXT_IMAGE)
        eventually(f"the engine on {NEXT_IMAGE}", lambda: rollout_done(name, namespace, NEXT_IMAGE, 1))
        eventually("the surge retired", lambda: len(engine_pods(name, namespace)) == 1)
    assert not watch.failures, watch.failures[:5]
    assert max(seen) >= 2, f"no surge seen behind the router: {seen}"
    assert watch.events >= 3, f"the watch saw only {watch.events} events"
