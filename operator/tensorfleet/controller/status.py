"""InferenceService status from an observation, built as the typed status models the CRD's schema comes from, with
conditions that follow the Kubernetes API conventions and take the worst pod's cause from `diagnose`. Pure: the
clock comes in as `now`. Design: docs/architecture.md#status-and-diagnosis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensorfleet.api.status import (
    AdapterStatus,
    Condition,
    ConditionStatus,
    InferenceServiceStatus,
    ModelFactsStatus,
    TrafficStatus,
)
from tensorfleet.controller.devices import Offer
from tensorfleet.controller.diagnose import (
    OOM_KILLED,
    STUCK_REASONS,
    UNSCHEDULABLE,
    Diagnosis,
    causes,
    diagnose_all,
)
from tensorfleet.controller.idle import SCALED_TO_ZERO
from tensorfleet.controller.observe import Observation, pod_gpus, pod_unschedulable
from tensorfleet.controller.rollout import IN_PLACE, STEADY, SURGE_UNSCHEDULABLE, SURGING, Mode
from tensorfleet.planner import Plan

PLAN_VALID, PROGRESSING, READY, DEGRADED = "PlanValid", "Progressing", "Ready", "Degraded"
# kstatus's abnormal-true pair (sigs.k8s.io/cli-utils, what Flux's health checks compute): derived, never set apart.
RECONCILING, STALLED = "Reconciling", "Stalled"
# Degraded reasons that do not go away without a person (a spec, Secret, image or name change): Stalled.
# Unschedulable is not one (a cluster autoscaler may add the nodes), nor a Failed pod (its StatefulSet replaces it).
STALLED_REASONS = STUCK_REASONS | {OOM_KILLED, "ChildConflict"}
MAX_PROBLEMS_SHOWN = 3
WRITE_REFUSED = "WriteRefused"   # Degraded: the API server refused a child's write (write_refused_status)
# rejected_status: leave status.modelFacts as it was.
KEEP: Any = object()


def endpoint(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc/v1"


def plan_message(plan: Plan) -> str:
    layout = f"tensor {plan.tensor} x pipeline {plan.pipeline}"
    return (f"{layout} on {plan.accelerator}: {plan.kv_cache_tokens:,} KV-cache tokens per replica, "
            f"{plan.max_concurrent_sequences} sequences of {plan.max_model_len:,} tokens")


def progress(obs: Observation, rollout: Mode, idle_since: str | None = None) -> tuple[ConditionStatus, str, str]:
    """The Progressing condition's (status, reason, message)."""
    desired = obs.desired
    if rollout.blocked:
        return "True", SURGE_UNSCHEDULABLE, f"{obs.updated_replicas} of {desired} groups updated; {rollout.blocked}"
    if obs.updated_replicas < desired and obs.existing >= desired:
        done = f"{obs.updated_replicas} of {desired} groups updated"
        if rollout.in_place:
            return "True", IN_PLACE, f"{done}, replacing in place one group at a time"
        if rollout.surge:
            return "True", SURGING, f"{done}; {rollout.surge} replacement group(s) started ahead of the old ones"
        return "True", "RollingOut", done
    if rollout.surge and obs.ready_replicas < desired:
        return "True", SURGING, (f"all {desired} groups updated, {obs.ready_replicas} ready; the surge group(s) "
                                 "serve until the rest are")
    if obs.existing < desired:
        return "True", "ScalingUp", f"{obs.existing} of {desired} groups exist"
    if obs.existing > desired:
        return "True", "ScalingDown", f"{obs.existing} groups exist, {desired} wanted"
    if obs.ready_replicas < desired:
        return "True", "WaitingForReady", f"{obs.ready_replicas} of {desired} groups ready"
    if obs.revisions_pending:
        # Every pod runs the revision the StatefulSet's status names, but that status predates its latest spec.
        return "True", "WaitingForStatefulSet", ("the StatefulSet controller has not yet observed the latest "
                                                 "spec; whether every group is updated is known once it has")
    if obs.router_available == 0 and (desired > 0 or idle_since is not None):
        # Ready is False until a router is: without this, kstatus (and Flux's wait) would call the service
        # Current in the window between its engines turning ready and its router.
        return "True", "WaitingForRouter", f"all {desired} groups ready; no router pod is available yet"
    return "False", "Complete", f"all {desired} groups ready and updated"


def _readiness(obs: Observation, cause: tuple[str, str] | None,
               idle_since: str | None = None) -> tuple[ConditionStatus, str, str]:
    """Ready, with the worst pod's cause as its reason when no group is ready (and in its message when some are not).

    A fleet the operator took to zero (IDLE_SINCE) is Ready while its routers are: they take requests and wake it.
    """
    if obs.desired == 0 and idle_since is not None:
        if obs.router_available == 0:
            return "False", "RouterUnavailable", f"scaled to zero since {idle_since}, and no router pod is available"
        return "True", SCALED_TO_ZERO, (f"idle since {idle_since}: no engine runs; the routers hold the next request "
                                        "and start the fleet")
    if obs.desired == 0:
        # Reconciled as asked, as a Deployment at 0 replicas is: Ready False would hold kstatus (and a GitOps
        # tool waiting on it) at InProgress for good.
        return "True", SCALED_TO_ZERO, "spec.replicas is 0: nothing runs and requests are refused until it is raised"
    groups = f"{obs.ready_replicas} of {obs.desired} groups ready"
    if obs.ready_replicas == 0:
        if cause is not None:
            return "False", cause[0], f"{groups}: {cause[1]}"
        return "False", "NoReadyReplicas", groups
    if obs.router_available == 0:
        return "False", "RouterUnavailable", "no router pod is available"
    if cause is not None and obs.ready_replicas < obs.desired:
        return "True", "Serving", f"{groups}; {cause[1]}"
    return "True", "Serving", groups


def _shortfall(obs: Observation, plan: Plan, offer: Offer | None) -> str | None:
    """What the cluster lacks for the pods the scheduler cannot place, in GPUs of the planned type (OFFER: what
    the nodes offer through DRA, when the pods claim their GPUs so)."""
    stuck = obs.unschedulable()
    if not stuck:
        return None
    gpus = sum(pod_gpus(pod) for pod in stuck)
    pods = f"{len(stuck)} engine pod{'s' if len(stuck) != 1 else ''} cannot be scheduled"
    if offer is not None:
        short = offer.short_of(plan.tensor)
        return (f"{pods}: each claims {plan.tensor} {plan.accelerator} GPUs on one node through DeviceClass "
                f"{offer.device_class}; " + (short or "a node offers that many, but other claims hold them")
                + f"; add {plan.accelerator} nodes, lower spec.replicas, or choose another spec.accelerator.type")
    if not gpus:
        return pods
    return (f"{pods}: {gpus} {plan.accelerator} GPUs short (each pod needs {pod_gpus(stuck[0])} free "
            f"nvidia.com/gpu on one node whose nvidia.com/gpu.product is a {plan.accelerator}); "
            f"add {plan.accelerator} nodes, lower spec.replicas, or choose another spec.accelerator.type")


def _diagnoses(obs: Observation) -> list[Diagnosis]:
    """Why pods are not becoming ready, worst first: the wanted groups' pods and a rollout's surge groups'.

    A surge group waiting for a node is left out: the Progressing condition
    says so (rollout.py), and the groups that serve are not degraded by it.
    """
    pods = [group.pods[stage] for group in obs.current() for stage in sorted(group.pods)]
    surge = [group.pods[stage] for group in obs.surge_groups() for stage in sorted(group.pods)]
    return diagnose_all([*pods, *(pod for pod in surge if not pod_unschedulable(pod))], obs.nodes)


def _cause(obs: Observation, plan: Plan, found: list[Diagnosis], offer: Offer | None) -> tuple[str, str] | None:
    """(reason, one-line message) of the worst pod, and how many others need attention; None when none does."""
    if not found:
        return None
    worst, others = found[0], found[1:]
    message = worst.line
    if worst.reason == UNSCHEDULABLE:
        shortfall = _shortfall(obs, plan, offer)
        if shortfall:
            message = f"{shortfall}. {message}"
    if others:
        counts: dict[str, int] = {}
        for diagnosis in others:
            counts[diagnosis.reason] = counts.get(diagnosis.reason, 0) + 1
        listed = ", ".join(f"{count} {reason}" for reason, count in counts.items())
        message += f"; {len(others)} more pod{'s' if len(others) != 1 else ''} need attention ({listed})"
    return worst.reason, message


def _degradation(cause: tuple[str, str] | None, conflicts: Sequence[str]) -> tuple[ConditionStatus, str, str]:
    if conflicts:
        shown = "; ".join(conflicts[:MAX_PROBLEMS_SHOWN])
        more = f" (and {len(conflicts) - MAX_PROBLEMS_SHOWN} more)" if len(conflicts) > MAX_PROBLEMS_SHOWN else ""
        return "True", "ChildConflict", shown + more
    if cause is None:
        return "False", "AsExpected", "no pod needs attention"
    return "True", cause[0], cause[1]


def with_kstatus(conditions: list[Condition], generation: int | None, now: str) -> list[Condition]:
    """CONDITIONS with Reconciling and Stalled set from PlanValid, Progressing and Degraded, so that kstatus
    computes Failed for a spec that cannot be served or a cause that needs a person, InProgress while the fleet
    converges or rolls out, and Current (with Ready True) otherwise. The two are never True together: kstatus
    takes whichever comes first in the list."""
    def find(type_: str) -> Condition | None:
        return next((c for c in conditions if c.type == type_), None)

    plan, progressing, degraded = find(PLAN_VALID), find(PROGRESSING), find(DEGRADED)
    cause: Condition | None = None
    if plan is not None and plan.status == "False":
        cause = plan
    elif degraded is not None and degraded.status == "True" and degraded.reason in STALLED_REASONS:
        cause = degraded
    reconciling: tuple[ConditionStatus, str, str]
    if cause is not None:
        reconciling = "False", "Stalled", "stopped until the cause Stalled names is fixed"
        stalled: tuple[ConditionStatus, str, str] = "True", cause.reason or STALLED, cause.message or ""
    else:
        stalled = "False", "AsExpected", "nothing needs a person"
        reconciling = ("True", progressing.reason or PROGRESSING, progressing.message or "") \
            if progressing is not None and progressing.status == "True" \
            else ("False", "Reconciled", "the fleet is as the spec asks")
    for type_, (status, reason, message) in ((RECONCILING, reconciling), (STALLED, stalled)):
        conditions = set_condition(conditions, type_, status, reason, message, generation, now)
    return conditions


def pod_causes(obs: Observation) -> list[tuple[str, str]]:
    """One (reason, message) per distinct cause that stops pods, worst first: the Warning events to post."""
    return causes(_diagnoses(obs))


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


def condition_status(conditions: list[dict[str, Any]], type_: str, field: str = "status") -> str | None:
    """A field (`status` unless told) of condition `type_` in conditions as read from the API; None when absent."""
    return next((c.get(field) for c in conditions if c.get("type") == type_), None)


def _conditions(previous: dict[str, Any]) -> list[Condition]:
    return [Condition.model_validate(c) for c in previous.get("conditions") or []]


def _wire(status: InferenceServiceStatus) -> dict[str, Any]:
    """The status as the API takes it: camelCase, and only the fields this module set."""
    return status.model_dump(by_alias=True, exclude_unset=True)


def serving_status(previous: dict[str, Any], *, name: str, namespace: str, generation: int | None, plan: Plan,
                   obs: Observation, selector: str, now: str, rollout: Mode = STEADY,
                   conflicts: Sequence[str] = (), warnings: Sequence[str] = (),
                   idle_since: str | None = None, model_facts: ModelFactsStatus | None = None,
                   facts_note: str | None = None, adapters: Sequence[dict[str, Any]] | None = None,
                   prefill: tuple[int, int] | None = None, offer: Offer | None = None,
                   traffic: dict[str, Any] | None = None) -> dict[str, Any]:
    """The status of a valid spec: the plan, group counts, and Progressing/Ready/Degraded from `obs`.

    `conflicts` are children the operator would not write because another
    owner holds their names; they make Degraded True (reason ChildConflict).
    `warnings` are things about an accepted spec a person should know; they
    follow the plan in PlanValid's message (reason PlanAcceptedWithWarnings),
    after `facts_note` (where the model's facts came from). `model_facts` are
    the facts pinned for the model (controller/modelfacts.py); None: none.
    `adapters`: status.adapters (controller/adapters.py); None without LoRA.
    `prefill`: (existing, ready) prefill engines, with spec.prefill; None without.
    `offer`: what the nodes offer of the planned GPU through DRA, when the engine pods claim their GPUs so.
    `traffic`: status.traffic (controller/traffic.py); None when the operator has not placed it in a group.
    """
    accepted = "PlanAcceptedWithWarnings" if warnings else "PlanAccepted"
    message = "; ".join([plan_message(plan), *([facts_note] if facts_note else []),
                         *(f"warning: {w}" for w in warnings)])
    conditions = set_condition(_conditions(previous), PLAN_VALID, "True", accepted, message, generation, now)
    cause = _cause(obs, plan, _diagnoses(obs), offer)
    for type_, (status, reason, message) in (
        (PROGRESSING, progress(obs, rollout, idle_since)), (READY, _readiness(obs, cause, idle_since)), (DEGRADED, _degradation(cause, conflicts)),
    ):
        conditions = set_condition(conditions, type_, status, reason, message, generation, now)
    return _wire(InferenceServiceStatus(
        observed_generation=generation,
        conditions=with_kstatus(conditions, generation, now),
        replicas=obs.existing,
        ready_replicas=obs.ready_replicas,
        updated_replicas=obs.updated_replicas,
        selector=selector,
        endpoint=endpoint(name, namespace),
        plan=plan.to_status(),
        **({"idle_since": idle_since} if idle_since is not None else {}),
        **({"model_facts": model_facts} if model_facts is not None else {}),
        **({"adapters": [AdapterStatus.model_validate(a) for a in adapters]} if adapters is not None else {}),
        **({"prefill_replicas": prefill[0], "ready_prefill_replicas": prefill[1]} if prefill is not None else {}),
        **({"traffic": TrafficStatus.model_validate(traffic)} if traffic is not None else {}),
    ))


def rejected_status(previous: dict[str, Any], *, generation: int | None, field: str, message: str, now: str,
                    reason: str = "InvalidSpec", model_facts: ModelFactsStatus | None = KEEP) -> dict[str, Any]:
    """The spec cannot be served: say why. Whatever already runs keeps running (the rest of `previous` stays).

    `model_facts`: the facts pinned for the model now (None: none); KEEP leaves them as they were.
    """
    status = InferenceServiceStatus.model_validate(previous)
    conditions = set_condition(status.conditions, PLAN_VALID, "False", reason, f"{field}: {message}",
                               generation, now)
    if model_facts is not KEEP:
        status.model_facts = model_facts
    conditions = set_condition(conditions, PROGRESSING, "False", "PlanInvalid",
                               "fix the spec; the last valid version (if any) keeps serving", generation, now)
    if not any(c.type == READY for c in conditions):
        conditions = set_condition(conditions, READY, "False", "PlanInvalid", "nothing deployed", generation, now)
    status.observed_generation = generation
    status.conditions = with_kstatus(conditions, generation, now)
    return _wire(status)


def write_refused_status(previous: dict[str, Any], *, generation: int | None, message: str,
                         now: str) -> dict[str, Any]:
    """The API server refused a child's write (a quota, an admission webhook, a full Service IP range): Degraded
    says which and why until a reconcile gets through. Nothing else moves: the spec is not reconciled yet."""
    status = InferenceServiceStatus.model_validate(previous)
    conditions = set_condition(status.conditions, DEGRADED, "True", WRITE_REFUSED, message, generation, now)
    status.conditions = with_kstatus(conditions, generation, now)
    return _wire(status)
