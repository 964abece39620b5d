"""GPUs through Dynamic Resource Allocation on the real scheduler: engine pods of spec.accelerator.allocation
deviceClass claim their GPUs from the fake NVIDIA DRA driver's ResourceSlices (e2e/dra.py: 8 devices on each H100
and A100 node) and the real kube-scheduler allocates them; the resourceclaim controller makes and removes each
pod's claim. docs/dra.md says what is proven here."""

from __future__ import annotations

from typing import Any

import dra  # e2e/dra.py: the fake driver's objects
from kube import (
    TIMEOUT,
    apply,
    condition,
    engine_pods,
    eventually,
    example,
    get,
    isvc,
    items,
    kubectl,
    nodes,
    wait_ready,
)

from tensorfleet import contract
from tensorfleet.gpus import find_gpu

DEVICE_CLASS = {"allocation": contract.ALLOCATION_DEVICE_CLASS}


def _h100(**accelerator: Any) -> dict[str, Any]:
    return {"type": "H100-80GB", **DEVICE_CLASS, **accelerator}


def _claim(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The pod's GPU claim once the scheduler allocated it."""
    statuses = {s["name"]: s.get("resourceClaimName") for s in pod.get("status", {}).get("resourceClaimStatuses") or []}
    name = statuses.get(contract.GPU_CLAIM)
    claim = get("resourceclaims", name, pod["metadata"]["namespace"]) if name else None
    return claim if claim and (claim.get("status") or {}).get("allocation") else None


def _allocated(name: str, namespace: str, count: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod, claim) of COUNT engine pods, each running with its claim allocated."""
    def done() -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
        pods = [p for p in engine_pods(name, namespace) if p["status"].get("phase") == "Running"]
        pairs = [(p, c) for p in pods if (c := _claim(p)) is not None]
        return pairs if len(pairs) == count == len(engine_pods(name, namespace)) else None
    return list(eventually(f"{count} engine pods of {namespace}/{name} running with their GPUs allocated", done))


def _check(pod: dict[str, Any], claim: dict[str, Any], accelerator: str, tensor: int) -> set[tuple[str, str]]:
    """The claim holds TENSOR devices of the pod's own node, on a node of the type; the pod asks the device plugin for
    nothing. The devices, as (pool, device)."""
    node = pod["spec"]["nodeName"]
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == tensor, results
    assert {(r["request"], r["driver"], r["pool"]) for r in results} == {(contract.GPU_CLAIM, "gpu.nvidia.com", node)}
    gpu = find_gpu(accelerator)
    assert gpu is not None
    assert nodes()[node]["metadata"]["labels"].get("nvidia.com/gpu.product") in gpu.product_labels
    assert [ref["name"] for ref in claim["status"].get("reservedFor") or []] == [pod["metadata"]["name"]]
    owners = claim["metadata"].get("ownerReferences") or []
    assert [(o["kind"], o["name"]) for o in owners] == [("Pod", pod["metadata"]["name"])], "the pod's own claim"
    assert contract.GPU_RESOURCE not in (pod["spec"]["containers"][0].get("resources") or {}).get("limits", {})
    return {(r["pool"], r["device"]) for r in results}


def _released(name: str, namespace: str) -> None:
    """Delete the InferenceService; every claim of its pods goes, and its claim templates."""
    kubectl("delete", contract.PLURAL, name, "-n", namespace, "--wait=false")
    eventually(f"every ResourceClaim in {namespace} gone", lambda: not items("resourceclaims", namespace))
    eventually("its ResourceClaimTemplates gone", lambda: not items("resourceclaimtemplates", namespace))


def test_tensor_8_claims_the_eight_h100s_of_one_node(namespace: str) -> None:
    doc = example("llama-3.1-70b-h100.yaml", namespace, replicas=1, accelerator=_h100(),
                  parallelism={"tensor": 8, "pipeline": 1})
    name = doc["metadata"]["name"]
    apply(doc)
    ((pod, claim),) = _allocated(name, namespace, 1)
    assert len(_check(pod, claim, "H100-80GB", 8)) == 8
    (template,) = items("resourceclaimtemplates", namespace)
    assert template["metadata"]["ownerReferences"][0]["name"] == name
    assert claim["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"] == contract.GPU_CLAIM
    assert wait_ready(name, namespace)["status"]["readyReplicas"] == 1
    _released(name, namespace)


def test_tensor_8_pipeline_2_claims_one_node_each(namespace: str) -> None:
    doc = example("llama-3.1-405b-h100-multinode.yaml", namespace, replicas=1,
                  accelerator=_h100(nodeSelector={"node.kubernetes.io/instance-type": "p5.48xlarge"}))
    name = doc["metadata"]["name"]
    apply(doc)
    pairs = _allocated(name, namespace, 2)
    devices = [_check(pod, claim, "H100-80GB", 8) for pod, claim in pairs]
    assert {pod["spec"]["nodeName"] for pod, _ in pairs} == {"gpu-h100-0", "gpu-h100-1"}, "a stage on each node"
    assert not devices[0] & devices[1]
    wait_ready(name, namespace)
    _released(name, namespace)


def test_more_devices_than_any_node_offers_stay_pending_and_say_so(namespace: str) -> None:
    doc = example("llama-3.1-70b-a100.yaml", namespace, replicas=1, autoscaling=None,
                  accelerator={"type": "A100-80GB", **DEVICE_CLASS, "gpusPerNode": 16},
                  parallelism={"tensor": 16, "pipeline": 1})
    name = doc["metadata"]["name"]
    apply(doc)
    wanted = "no node offers 16 A100-80GB through DRA: the most is 8, on gpu-a100-"

    def degraded() -> dict[str, Any] | None:
        found = condition(isvc(name, namespace), "Degraded")
        return found if found and found["status"] == "True" and wanted in found["message"] else None
    said = eventually(f"{namespace}/{name} Degraded saying {wanted!r}", degraded)
    assert said["reason"] == "Unschedulable"
    assert "cannot allocate all claims" in said["message"], "the scheduler's own DRA reason follows"
    plan_valid = condition(isvc(name, namespace), "PlanValid")
    assert plan_valid is not None and wanted in plan_valid["message"], "warned about when accepted"
    assert all(p["status"].get("phase") == "Pending" for p in engine_pods(name, namespace))
    # What the scheduler left: the claim exists, unallocated.
    eventually("the pod's claim made and left unallocated",
               lambda: (found := items("resourceclaims", namespace)) and not found[0].get("status", {}).get("allocation"))
    _released(name, namespace)


def test_scaling_up_gets_new_claims(namespace: str) -> None:
    """spec.replicas left to the HPA: raising autoscaling.minReplicas, the HPA scales the service up through /scale
    and the new group's pod claims GPUs of its own."""
    doc = example("llama-3.1-70b-h100.yaml", namespace, replicas=None, accelerator=_h100(),
                  parallelism={"tensor": 4, "pipeline": 1},
                  autoscaling={"minReplicas": 1, "maxReplicas": 3, "targetPendingRequests": 4})
    name = doc["metadata"]["name"]
    apply(doc)
    ((_, first),) = _allocated(name, namespace, 1)
    doc["spec"]["autoscaling"]["minReplicas"] = 2
    apply(doc)
    eventually("the HPA to scale it to 2", lambda: (isvc(name, namespace) or {}).get("spec", {}).get("replicas") == 2)
    pairs = _allocated(name, namespace, 2)
    claims = {c["metadata"]["name"] for _, c in pairs}
    assert first["metadata"]["name"] in claims and len(claims) == 2
    held = [_check(pod, claim, "H100-80GB", 4) for pod, claim in pairs]
    assert not held[0] & held[1], "no device given twice"
    assert wait_ready(name, namespace, timeout=TIMEOUT)["status"]["readyReplicas"] == 2
    _released(name, namespace)


def test_kep_5004_gives_an_extended_resource_request_dra_devices_on_a_node_without_a_device_plugin(
        namespace: str) -> None:
    """KEP-5004 (DRAExtendedResource, beta in 1.36): with a DeviceClass naming `extendedResourceName:
    nvidia.com/gpu`, the scheduler serves today's `nvidia.com/gpu` requests (allocation extendedResource) from DRA
    devices on a node that advertises no nvidia.com/gpu, making the pod a claim itself; the GPU type is then held by
    the node's labels only."""
    node, klass = f"dra-only-{namespace}"[:63], f"gpu-extended.{namespace}"
    labels = {"kubernetes.io/hostname": node, "kubernetes.io/os": "linux", "type": "kwok",
              "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    capacity = {"cpu": "192", "memory": "2Ti", "pods": "110"}
    apply({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": node, "labels": labels, "annotations": {"kwok.x-k8s.io/node": "fake"}},
           "spec": {"podCIDR": "10.244.200.0/24", "podCIDRs": ["10.244.200.0/24"],
                    "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
           "status": {"capacity": capacity, "allocatable": capacity}})
    try:
        live = eventually(f"node {node} registered", lambda: get("node", node, None))
        apply(dra.resource_slice(live, "NVIDIA H100 80GB HBM3", "hopper", 81559, 8))
        extended = dra.device_class()
        extended["metadata"]["name"] = klass
        extended["spec"]["extendedResourceName"] = contract.GPU_RESOURCE
        apply(extended)
        stored = get("deviceclass", klass, None) or {}
        assert stored.get("spec", {}).get("extendedResourceName") == contract.GPU_RESOURCE, \
            "the API server dropped extendedResourceName: DRAExtendedResource is off"
        doc = example("llama-3.1-70b-h100.yaml", namespace, replicas=1, parallelism={"tensor": 4, "pipeline": 1},
                      accelerator={"type": "H100-80GB", "nodeSelector": {"kubernetes.io/hostname": node}})
        name = doc["metadata"]["name"]
        apply(doc)

        def placed() -> tuple[dict[str, Any], dict[str, Any]] | None:
            pods = engine_pods(name, namespace)
            if len(pods) != 1 or pods[0]["status"].get("phase") != "Running":
                return None
            status = pods[0]["status"].get("extendedResourceClaimStatus") or {}
            claim = get("resourceclaims", status.get("resourceClaimName", ""), namespace) if status else None
            return (pods[0], claim) if claim and claim.get("status", {}).get("allocation") else None
        pod, claim = eventually("the pod running on DRA devices", placed)
        assert pod["spec"]["nodeName"] == node
        assert pod["spec"]["containers"][0]["resources"]["limits"][contract.GPU_RESOURCE] == "4"
        results = claim["status"]["allocation"]["devices"]["results"]
        assert len(results) == 4 and {r["pool"] for r in results} == {node}
        kubectl("delete", contract.PLURAL, name, "-n", namespace, "--wait=false")
        eventually("the pod's claim released", lambda: not items("resourceclaims", namespace))
    finally:
        kubectl("delete", "deviceclass", klass, "--ignore-not-found", "--wait=false")
        kubectl("delete", "node", node, "--ignore-not-found", "--wait=false")


def test_a_pipeline_group_stays_in_one_nvlink_domain(namespace: str) -> None:
    """spec.parallelism.groupTopologyKey nvidia.com/gpu.clique: with the two H100 nodes in different cliques a TP 8 x
    PP 2 group cannot be placed (its worker must join its leader's clique); once they share one, it is."""
    key = "nvidia.com/gpu.clique"
    h100 = ("gpu-h100-0", "gpu-h100-1")
    try:
        for index, node in enumerate(h100):
            kubectl("label", "node", node, "--overwrite", f"{key}=e2e-domain.{index}")
        doc = example("llama-3.1-405b-h100-multinode.yaml", namespace, replicas=1, accelerator=_h100(),
                      parallelism={"tensor": 8, "pipeline": 2, "groupTopologyKey": key})
        name = doc["metadata"]["name"]
        apply(doc)

        def split() -> dict[str, Any] | None:
            found = condition(isvc(name, namespace), "Degraded")
            return found if found and found["status"] == "True" and "affinity" in found["message"] else None
        said = eventually("the worker held back from the other clique", split)
        assert said["reason"] == "Unschedulable", said
        placed = [p for p in engine_pods(name, namespace) if p["spec"].get("nodeName")]
        assert len(placed) == 1 and placed[0]["metadata"]["labels"][contract.LABEL_STAGE] == "0", "only the leader"
        kubectl("label", "node", h100[1], "--overwrite", f"{key}=e2e-domain.0")
        pairs = _allocated(name, namespace, 2)
        assert {pod["spec"]["nodeName"] for pod, _ in pairs} == set(h100)
        wait_ready(name, namespace)
        _released(name, namespace)
    finally:
        for node in h100:
            kubectl("label", "node", node, f"{key}-")
