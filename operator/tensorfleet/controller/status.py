"""InferenceService status from an observation. Pure: the clock comes in as `now`.

The status is built as the typed models of api/models.py (InferenceServiceStatus,
Condition, PlanStatus), the models the CRD's status schema is generated from,
so the operator cannot write a field the API server would prune. What goes to
the API is that model dumped with its camelCase aliases and only the fields
set here (`exclude_unset`); reconcile.py writes it as a merge patch. The
previous status is read through the same models: a field they do not know
cannot be in it, because the API server prunes what the CRD does not declare.

Conditions follow the Kubernetes API conventions: each has a CamelCase
reason, a message a person can act on, lastTransitionTime that moves only
when the status does, and the generation it was computed for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensorfleet.api.models import Condition, ConditionStatus, InferenceServiceStatus
from tensorfleet.controller.observe import Observation, pod_gpus
from tensorfleet.planner import Plan

PLAN_VALID, PROGRESSING, READY, DEGRADED = "PlanValid", "Progressing", "Ready", "Degraded"
MAX_PROBLEMS_SHOWN = 3


def endpoint(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc/v1"


def plan_message(plan: Plan) -> str:
    layout = f"tensor {plan.tensor} x pipeline {plan.pipeline}"
    return (f"{layout} on {plan.accelerator}: {plan.kv_cache_tokens:,} KV-cache tokens per replica, "
            f"{plan.max_concurrent_sequences} sequences of {plan.max_model_len:,} tokens")


def _progress(obs: Observation) -> tuple[ConditionStatus, str, str]:
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


def _readiness(obs: Observation) -> tuple[ConditionStatus, str, str]:
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


def _degradation(obs: Observation, plan: Plan, conflicts: Sequence[str]) -> tuple[ConditionStatus, str, str]:
    if conflicts:
        shown = "; ".join(conflicts[:MAX_PROBLEMS_SHOWN])
        more = f" (and {len(conflicts) - MAX_PROBLEMS_SHOWN} more)" if len(conflicts) > MAX_PROBLEMS_SHOWN else ""
        return "True", "ChildConflict", shown + more
    problems = obs.problems()
    if not problems:
        return "False", "AsExpected", "no pod needs attention"
    shown = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
    more = f" (and {len(problems) - MAX_PROBLEMS_SHOWN} more)" if len(problems) > MAX_PROBLEMS_SHOWN else ""
    shortfall = _shortfall(obs, plan)
    if shortfall:
        return "True", "Unschedulable", f"{shortfall}. {shown}{more}"
    return "True", "PodsFailing", shown + more


def set_condition(conditions: list[Condition], type_: str, status: ConditionStatus, reason: str, message: str,
                  generation: int | None, now: str) -> list[Condition]:
    """Conditions with `type_` set; lastTransitionTime moves only when the status does."""
    previous = next((c for c in conditions if c.type == type_), None)
    since = now
    if previous is not None and previous.status == status and previous.last_transition_time is not None:
        since = previous.last_transition_time
    entry = Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=since)
    if generation is not None:
        entry.observed_generation = generation
    if previous is None:
        return [*conditions, entry]
    # Replaced in place: a stable order keeps status writes to real changes.
    return [entry if c is previous else c for c in conditions]


def condition_status(conditions: list[dict[str, Any]], type_: str) -> str | None:
    """The status of condition `type_` in conditions as read from the API, or None when it is absent."""
    return next((c.get("status") for c in conditions if c.get("type") == type_), None)


def _conditions(previous: dict[str, Any]) -> list[Condition]:
    return [Condition.model_validate(c) for c in previous.get("conditions") or []]


def _wire(status: InferenceServiceStatus) -> dict[str, Any]:
    """The status as the API takes it: camelCase, and only the fields this module set."""
    return status.model_dump(by_alias=True, exclude_unset=True)


def serving_status(previous: dict[str, Any], *, name: str, namespace: str, generation: int | None, plan: Plan,
                   obs: Observation, selector: str, now: str, conflicts: Sequence[str] = ()) -> dict[str, Any]:
    """The status of a valid spec: the plan, group counts, and Progressing/Ready/Degraded from `obs`.

    `conflicts` are children the operator would not write because another
    owner holds their names; they make Degraded True (reason ChildConflict).
    """
    conditions = set_condition(_conditions(previous), PLAN_VALID, "True", "PlanAccepted", plan_message(plan),
                               generation, now)
    for type_, (status, reason, message) in (
        (PROGRESSING, _progress(obs)), (READY, _readiness(obs)), (DEGRADED, _degradation(obs, plan, conflicts)),
    ):
        conditions = set_condition(conditions, type_, status, reason, message, generation, now)
    return _wire(InferenceServiceStatus(
        observed_generation=generation,
        conditions=conditions,
        replicas=obs.existing,
        ready_replicas=obs.ready_replicas,
        updated_replicas=obs.updated_replicas,
        selector=selector,
        endpoint=endpoint(name, namespace),
        plan=plan.to_status(),
    ))


def rejected_status(previous: dict[str, Any], *, generation: int | None, field: str, message: str, now: str) -> dict[str, Any]:
    """The spec cannot be served: say why. Whatever already runs keeps running (the rest of `previous` stays)."""
    status = InferenceServiceStatus.model_validate(previous)
    conditions = set_condition(status.conditions, PLAN_VALID, "False", "InvalidSpec", f"{field}: {message}",
                               generation, now)
    conditions = set_condition(conditions, PROGRESSING, "False", "PlanInvalid",
                               "fix the spec; the last valid version (if any) keeps serving", generation, now)
    if not any(c.type == READY for c in conditions):
        conditions = set_condition(conditions, READY, "False", "PlanInvalid", "nothing deployed", generation, now)
    status.observed_generation = generation
    status.conditions = conditions
    return _wire(status)
