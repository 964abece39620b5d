"""The real scheduler places engine pods on nodes of the planned GPU type, or says why it cannot."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from kube import apply, condition, engine_pods, eventually, example, isvc, kubectl, nodes, wait_ready

from tensorfleet import contract
from tensorfleet.gpus import find_gpu


def _product(node: dict[str, Any]) -> str | None:
    return node["metadata"].get("labels", {}).get("nvidia.com/gpu.product")


def _placed(name: str, namespace: str, count: int) -> list[dict[str, Any]]:
    def running() -> list[dict[str, Any]] | None:
        pods = engine_pods(name, namespace)
        ok = [p for p in pods if p["spec"].get("nodeName") and p["status"].get("phase") == "Running"]
        return pods if len(pods) == count and len(ok) == count else None
    return list(eventually(f"{count} engine pods of {namespace}/{name} running", running))


def _columns(name: str, namespace: str) -> dict[str, str]:
    table = kubectl("get", "infsvc", name, "-n", namespace).splitlines()
    assert len(table) == 2, table
    headers = re.split(r"\s{2,}", table[0].strip())
    values = re.split(r"\s{2,}", table[1].strip())
    return dict(zip(headers, values, strict=True))


def _check_gpu_placement(pods: list[dict[str, Any]], accelerator: str, tensor: int) -> set[str]:
    gpu = find_gpu(accelerator)
    assert gpu is not None
    products = set(gpu.product_labels)
    by_name = nodes()
    used = set()
    for pod in pods:
        node = by_name[pod["spec"]["nodeName"]]
        assert _product(node) in products, f"{pod['metadata']['name']} on {node['metadata']['name']} ({_product(node)})"
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits[contract.GPU_RESOURCE] == str(tensor)
        used.add(node["metadata"]["name"])
    return used


def test_h100_tensor_8_pipeline_2_puts_one_pod_on_each_h100_node(namespace: str) -> None:
    doc = example("llama-3.1-405b-h100-multinode.yaml", namespace, replicas=1)
    name = doc["metadata"]["name"]
    apply(doc)
    pods = _placed(name, namespace, 2)
    used = _check_gpu_placement(pods, "H100-80GB", 8)
    assert len(used) == 2, "TP8 fills a node's 8 GPUs: the two stages land on two nodes"
    wait_ready(name, namespace)
    columns = _columns(name, namespace)
    assert columns["READY"] == "True" and columns["GPU"] == "H100-80GB"
    assert (columns["TP"], columns["PP"], columns["REPLICAS"], columns["AVAILABLE"]) == ("8", "2", "1", "1")
    assert columns["ENDPOINT"] == f"http://{name}.{namespace}.svc/v1"


def test_a100_tensor_4_two_replicas_land_on_a100_nodes(namespace: str) -> None:
    doc = example("llama-3.1-70b-a100.yaml", namespace, replicas=2, autoscaling=None)
    name = doc["metadata"]["name"]
    apply(doc)
    pods = _placed(name, namespace, 2)
    _check_gpu_placement(pods, "A100-80GB", 4)
    obj = wait_ready(name, namespace)
    assert obj["status"]["readyReplicas"] == 2
    columns = _columns(name, namespace)
    assert (columns["READY"], columns["GPU"], columns["TP"], columns["REPLICAS"]) == ("True", "A100-80GB", "4", "2")


def test_the_simulator_engine_runs_without_gpus(namespace: str) -> None:
    doc = example("simulator-cpu.yaml", namespace)
    name = doc["metadata"]["name"]
    apply(doc)
    pods = _placed(name, namespace, doc["spec"]["parallelism"]["pipeline"])
    by_name = nodes()
    for pod in pods:
        assert contract.GPU_RESOURCE not in (pod["spec"]["containers"][0].get("resources") or {}).get("limits", {})
        assert _product(by_name[pod["spec"]["nodeName"]]) is None, "a CPU pod does not take a GPU node"
    wait_ready(name, namespace)
    assert _columns(name, namespace)["READY"] == "True"


def _degraded(name: str, namespace: str, says: str) -> dict[str, Any]:
    """Wait until Degraded=True says `says` (a regex): the scheduler tries pods one by one."""
    def said() -> dict[str, Any] | None:
        obj = isvc(name, namespace)
        found = condition(obj, "Degraded")
        return obj if found and found["status"] == "True" and re.search(says, found["message"]) else None
    obj = eventually(f"{namespace}/{name} Degraded=True saying {says!r}", said)
    ready, degraded = condition(obj, "Ready"), condition(obj, "Degraded")
    assert ready is not None and ready["status"] == "False", ready
    assert degraded is not None
    return degraded


def test_more_gpus_than_the_cluster_has_stay_pending_and_say_so(namespace: str) -> None:
    # 4 nodes of 8 H100s per replica; the cluster has 2 H100 nodes.
    doc = example("llama-3.1-405b-h100-multinode.yaml", namespace, replicas=1,
                  parallelism={"tensor": 8, "pipeline": 4})
    name = doc["metadata"]["name"]
    apply(doc)
    degraded = _degraded(name, namespace, "2 engine pods cannot be scheduled: 16 H100-80GB GPUs short")
    assert degraded["reason"] == "Unschedulable"
    pending = [p for p in engine_pods(name, namespace) if p["status"].get("phase") == "Pending"]
    assert len(pending) == 2


def test_a_gpu_type_no_node_has_stays_pending_and_says_so(namespace: str) -> None:
    doc = example("llama-3.1-8b-l4.yaml", namespace, replicas=1, accelerator={"type": "L40S"}, autoscaling=None)
    name = doc["metadata"]["name"]
    apply(doc)
    degraded = _degraded(name, namespace, r"1 engine pod cannot be scheduled: \d+ L40S GPUs short")
    assert degraded["reason"] == "Unschedulable"
    assert "node affinity" in degraded["message"], "the scheduler's own reason follows"
    assert all(p["status"].get("phase") == "Pending" for p in engine_pods(name, namespace))
    # Why not Ready, in one look: the Ready reason (kubectl get's REASON column), and a Warning event.
    ready = condition(isvc(name, namespace), "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "Unschedulable")
    assert "L40S GPUs short" in ready["message"]
    assert (_columns(name, namespace)["READY"], _columns(name, namespace)["REASON"]) == ("False", "Unschedulable")
    selector = f"involvedObject.name={name},reason=Unschedulable,type=Warning"
    eventually("a Warning event Unschedulable", lambda: json.loads(kubectl(
        "get", "events", "-n", namespace, "--field-selector", selector, "-o", "json"))["items"])


@pytest.mark.parametrize(("accelerator", "node"), [
    ("L4", "gke-l4-0"),                # GKE: cloud.google.com/gke-accelerator
    ("A100-40GB", "eks-a100-40gb-0"),  # EKS/Karpenter: instance-gpu-name + instance-gpu-memory
    ("H200-141GB", "aks-h200-0"),      # AKS: the GPU VM size
])
def test_engine_pods_land_on_managed_gpu_nodes_without_gfd_labels(namespace: str, accelerator: str,
                                                                  node: str) -> None:
    doc = example("llama-3.1-8b-l4.yaml", namespace, replicas=1, autoscaling=None,
                  accelerator={"type": accelerator}, parallelism={"tensor": 1})
    name = doc["metadata"]["name"]
    assert _product(nodes()[node]) is None, f"{node} must carry no GFD label for this test to mean anything"
    apply(doc)
    (pod,) = _placed(name, namespace, 1)
    assert pod["spec"]["nodeName"] == node, f"{accelerator} landed on {pod['spec']['nodeName']}"
    wait_ready(name, namespace)
