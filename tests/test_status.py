"""InferenceService status from what the cluster shows: the Degraded condition's words."""

from __future__ import annotations

from typing import Any

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.controller.observe import observe
from tensorfleet.controller.status import serving_status
from tensorfleet.planner import make_plan

# What kube-scheduler 1.36 wrote on a TP8 H100 pod when every H100 node's GPUs were taken.
SCHEDULER_MESSAGE = ("0/5 nodes are available: 2 Insufficient nvidia.com/gpu, 2 node(s) didn't match Pod's node "
                     "affinity/selector, 1 node(s) didn't match Pod's node affinity/selector. preemption: ...")


def _plan(tensor: int, pipeline: int, accelerator: str) -> Any:
    isvc = load_inference_service({
        "apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "m", "namespace": "ns"},
        "spec": {"model": {"name": "meta-llama/Llama-3.1-70B-Instruct", "maxModelLen": 8192},
                 "parallelism": {"tensor": tensor, "pipeline": pipeline}, "accelerator": {"type": accelerator}},
    })
    return make_plan(isvc.spec)


def _pod(stage: int, index: int, gpus: int, *, scheduled: bool, ready: bool = False) -> dict[str, Any]:
    conditions: list[dict[str, Any]] = []
    if scheduled:
        conditions.append({"type": "PodScheduled", "status": "True"})
        conditions.append({"type": "Ready", "status": "True" if ready else "False"})
    else:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": SCHEDULER_MESSAGE})
    return {
        "metadata": {"name": f"m-stage-{stage}-{index}",
                     "labels": {contract.LABEL_STAGE: str(stage), "apps.kubernetes.io/pod-index": str(index)}},
        "spec": {"containers": [{"name": "engine", "resources": {"limits": {contract.GPU_RESOURCE: str(gpus)}}}]},
        "status": {"phase": "Pending" if not ready else "Running", "conditions": conditions},
    }


def _degraded(plan: Any, pods: list[dict[str, Any]], desired: int) -> dict[str, Any]:
    obs = observe(plan.pipeline, desired, pods, {}, {"status": {"availableReplicas": 1}})
    status = serving_status({}, name="m", namespace="ns", generation=1, plan=plan, obs=obs, selector="s", now="t")
    return next(c for c in status["conditions"] if c["type"] == "Degraded")


def test_unschedulable_gpu_pods_name_the_gpu_type_and_the_shortfall() -> None:
    plan = _plan(8, 2, "H100-80GB")
    pods = [_pod(0, 0, 8, scheduled=True, ready=True), _pod(1, 0, 8, scheduled=True, ready=True),
            _pod(0, 1, 8, scheduled=False), _pod(1, 1, 8, scheduled=False)]
    degraded = _degraded(plan, pods, desired=2)
    assert degraded["status"] == "True"
    assert degraded["reason"] == "Unschedulable"
    assert "2 engine pods cannot be scheduled: 16 H100-80GB GPUs short" in degraded["message"]
    assert "each pod needs 8 free nvidia.com/gpu" in degraded["message"]
    assert "Insufficient nvidia.com/gpu" in degraded["message"], "the scheduler's own words follow"


def test_one_pod_short_is_singular() -> None:
    plan = _plan(4, 1, "A100-80GB")
    degraded = _degraded(plan, [_pod(0, 0, 4, scheduled=True, ready=True), _pod(0, 1, 4, scheduled=False)], desired=2)
    assert degraded["message"].startswith("1 engine pod cannot be scheduled: 4 A100-80GB GPUs short")


def test_scheduled_pods_are_not_degraded() -> None:
    plan = _plan(4, 1, "A100-80GB")
    degraded = _degraded(plan, [_pod(0, 0, 4, scheduled=True, ready=True)], desired=1)
    assert (degraded["status"], degraded["reason"]) == ("False", "AsExpected")
