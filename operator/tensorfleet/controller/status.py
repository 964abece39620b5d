"""InferenceService status from an observation. Pure: the clock comes in as `now`.

Conditions follow the Kubernetes API conventions: each has a CamelCase
reason, a message a person can act on, lastTransitionTime that moves only
when the status does, and the generation it was computed for.
"""

from __future__ import annotations

from typing import Any

from tensorfleet.controller.observe import Observation, pod_gpus, set_condition
from tensorfleet.planner import Plan

PLAN_VALID, PROGRESSING, READY, DEGRADED = "PlanValid", "Progressing", "Ready", "Degraded"
MAX_PROBLEMS_SHOWN = 3


def endpoint(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc/v1"


def plan_message(plan: Plan) -> str:
    layout = f"tensor {plan.tensor} x pipeline {plan.pipeline}"
    return (f"{layout} on {plan.accelerator}: {plan.kv_cache_tokens:,} KV-cache tokens per replica, "
            f"{plan.max_concurrent_sequences} sequences of {plan.max_model_len:,} tokens")


def _progress(obs: Observation) -> tuple[str, str, str]:
    desired = obs.desired
    if obs.updated_replicas < desired and obs.existing >= desired:
        return "True", "RollingOut", f"{obs.updated_replicas} of {desired} groups updated"
    if obs.existing < desired:
        return "True", "ScalingUp", f"{obs.existing} of {desired} groups exist"
    if obs.existing > desired:
        return "True", "ScalingDown", f"{obs.existing} groups exist, {desired} wanted"
    if obs.ready_replicas < desired:
        return "True", "WaitingForReady", f"{obs.ready_replicas} of {desired} groups ready"
    return "False", "Complete", f"all {desired} groups ready and updated"


def _readiness(obs: Observation) -> tuple[str, str, str]:
    if obs.desired == 0:
        return "False", "ScaledToZero", "spec.replicas is 0"
    if obs.ready_replicas == 0:
        return "False", "NoReadyReplicas", f"0 of {obs.desired} groups ready"
    if obs.router_available == 0:
        return "False", "RouterUnavailable", "no router pod is available"
    return "True", "Serving", f"{obs.ready_replicas} of {obs.desired} groups ready"


def _shortfall(obs: Observation, plan: Plan) -> str | None:
    """What the cluster lacks for the pods the scheduler cannot place, in GPUs of the planned type."""
    stuck = obs.unschedulable()
    if not stuck:
        return None
    gpus = sum(pod_gpus(pod) for pod in stuck)
    pods = f"{len(stuck)} engine pod{'s' if len(stuck) != 1 else ''} cannot be scheduled"
    if not gpus:
        return pods
    return (f"{pods}: {gpus} {plan.accelerator} GPUs short (each pod needs {pod_gpus(stuck[0])} free "
            f"nvidia.com/gpu on one node whose nvidia.com/gpu.product is a {plan.accelerator}); "
            f"add {plan.accelerator} nodes, lower spec.replicas, or choose another spec.accelerator.type")


def _degradation(obs: Observation, plan: Plan) -> tuple[str, str, str]:
    problems = obs.problems()
    if not problems:
        return "False", "AsExpected", "no pod needs attention"
    shown = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
    more = f" (and {len(problems) - MAX_PROBLEMS_SHOWN} more)" if len(problems) > MAX_PROBLEMS_SHOWN else ""
    shortfall = _shortfall(obs, plan)
    if shortfall:
        return "True", "Unschedulable", f"{shortfall}. {shown}{more}"
    return "True", "PodsFailing", shown + more


def serving_status(previous: dict[str, Any], *, name: str, namespace: str, generation: int | None, plan: Plan,
                   obs: Observation, selector: str, now: str) -> dict[str, Any]:
    conditions = list(previous.get("conditions") or [])
    conditions = set_condition(conditions, PLAN_VALID, "True", "PlanAccepted", plan_message(plan), generation, now)
    for type_, (status, reason, message) in (
        (PROGRESSING, _progress(obs)), (READY, _readiness(obs)), (DEGRADED, _degradation(obs, plan)),
    ):
        conditions = set_condition(conditions, type_, status, reason, message, generation, now)
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "replicas": obs.existing,
        "readyReplicas": obs.ready_replicas,
        "updatedReplicas": obs.updated_replicas,
        "selector": selector,
        "endpoint": endpoint(name, namespace),
        "plan": plan.to_status().model_dump(by_alias=True),
    }


def rejected_status(previous: dict[str, Any], *, generation: int | None, field: str, message: str, now: str) -> dict[str, Any]:
    """The spec cannot be served: say why. Whatever already runs keeps running."""
    conditions = list(previous.get("conditions") or [])
    conditions = set_condition(conditions, PLAN_VALID, "False", "InvalidSpec", f"{field}: {message}", generation, now)
    conditions = set_condition(conditions, PROGRESSING, "False", "PlanInvalid",
                               "fix the spec; the last valid version (if any) keeps serving", generation, now)
    if not any(c.get("type") == READY for c in conditions):
        conditions = set_condition(conditions, READY, "False", "PlanInvalid", "nothing deployed", generation, now)
    return {**previous, "observedGeneration": generation, "conditions": conditions}
