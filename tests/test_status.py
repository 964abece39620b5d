"""InferenceService status from what the cluster shows: the Degraded condition's words, how conditions
move, and a status the CRD's status schema accepts (what the API server would otherwise prune or refuse)."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
from conftest import strict_schema

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.api.crd import crd
from tensorfleet.catalog.models import catalog_facts
from tensorfleet.controller.modelfacts import REFRESH_ANNOTATION, pin
from tensorfleet.controller.observe import observe
from tensorfleet.controller.reconcile import merge_patch
from tensorfleet.controller.status import condition_status, pod_causes, rejected_status, serving_status
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


PULL = ('Back-off pulling image "registry.example.com/vllm:typo": ErrImagePull: rpc error: code = NotFound desc = '
        'failed to pull and unpack image "registry.example.com/vllm:typo": failed to resolve reference '
        '"registry.example.com/vllm:typo": registry.example.com/vllm:typo: not found')


def _failing(pod: dict[str, Any], reason: str, message: str, *, restarts: int = 0,
             last: dict[str, Any] | None = None) -> dict[str, Any]:
    pod["status"]["containerStatuses"] = [{
        "name": "engine", "ready": False, "restartCount": restarts,
        "state": {"waiting": {"reason": reason, "message": message}},
        "lastState": {"terminated": last} if last else {},
    }]
    return pod


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


def _serving(pods: list[dict[str, Any]], *, desired: int = 2, previous: dict[str, Any] | None = None,
             generation: int | None = 1, now: str = "2026-01-01T00:00:00Z", routers: int = 1) -> dict[str, Any]:
    plan = _plan(8, 2, "H100-80GB")
    obs = observe(plan.pipeline, desired, pods, {}, {"status": {"availableReplicas": routers}})
    return serving_status(copy.deepcopy(previous or {}), name="m", namespace="ns", generation=generation, plan=plan,
                          obs=obs, selector="a=b", now=now)


def _ready_pods(groups: int = 2) -> list[dict[str, Any]]:
    return [_pod(stage, index, 8, scheduled=True, ready=True) for index in range(groups) for stage in range(2)]


def _rejected(previous: dict[str, Any], now: str = "2026-01-01T00:05:00Z") -> dict[str, Any]:
    return rejected_status(copy.deepcopy(previous), generation=2, field="spec.accelerator.type",
                           message="unknown GPU type 'B100'", now=now)


def _status_schema() -> dict[str, Any]:
    root = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return strict_schema(root["properties"]["status"])


def _written() -> dict[str, dict[str, Any]]:
    serving = _serving(_ready_pods())
    degraded = _serving([*_ready_pods(1), _pod(0, 1, 8, scheduled=False), _pod(1, 1, 8, scheduled=False)])
    failing = _serving([_failing(_pod(0, 0, 8, scheduled=True), "ImagePullBackOff", PULL)], desired=1)
    pinned = serving_status(serving, name="m", namespace="ns", generation=1, plan=_plan(8, 2, "H100-80GB"),
                            obs=observe(2, 2, _ready_pods(), {}, {"status": {"availableReplicas": 1}}), selector="a=b",
                            now="2026-01-01T00:00:00Z", model_facts=_pin().pin, facts_note=_pin().note,
                            warnings=[_pin().warning or ""])
    return {
        "serving": serving,
        "degraded": degraded,
        "failing": failing,
        "rejected-at-creation": _rejected({}),
        "rejected-while-serving": _rejected(serving),
        "serving-with-pinned-facts": pinned,
        "facts-unavailable": rejected_status({}, generation=1, field="spec.model.name", message="no facts",
                                             now="t0", reason="ModelFactsUnavailable"),
    }


def _pin() -> Any:
    """The catalog's facts pinned after the Hub failed, as the reconciler pins them."""
    isvc = load_inference_service({
        "apiVersion": contract.API_VERSION, "kind": contract.KIND,
        "metadata": {"name": "m", "namespace": "ns", "annotations": {REFRESH_ANNOTATION: "2"}},
        "spec": {"model": {"name": "meta-llama/Llama-3.1-70B-Instruct", "revision": "main"},
                 "accelerator": {"type": "H100-80GB"}},
    })
    facts = catalog_facts(isvc.spec.model.name)
    assert facts is not None
    return pin(isvc, facts, hub_error="config.json not read: the Hub answered 503")


@pytest.mark.parametrize("case", list(_written()))
def test_written_status_validates_against_the_crd_status_schema(case: str) -> None:
    """Every field is one the CRD knows (an unknown one would be pruned on a real API server) and typed as it says."""
    jsonschema.validate(_written()[case], _status_schema())


def test_the_schema_check_refuses_what_the_api_server_would_not_keep() -> None:
    status = _written()["serving"]
    ready = {**status["conditions"][2], "status": "Yes"}
    for broken in (
        {**status, "phase": "Running"},                                # unknown field: pruned
        {**status, "plan": {**status["plan"], "gpus": 16}},            # unknown nested field
        {**status, "plan": {**status["plan"], "tensor_parallel": 8}},  # snake_case instead of the alias
        {**status, "readyReplicas": "2"},                              # wrong type
        {**status, "conditions": [*status["conditions"][:2], ready]},  # not True, False or Unknown
        {**status, "conditions": [{"type": "Ready"}]},                 # a condition without its status
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, _status_schema())


def test_serving_status_fields_and_condition_order() -> None:
    status = _written()["serving"]
    assert list(status) == ["observedGeneration", "conditions", "replicas", "readyReplicas", "updatedReplicas",
                            "selector", "endpoint", "plan"]
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 2, 2)
    assert status["endpoint"] == "http://m.ns.svc/v1" and status["selector"] == "a=b"
    assert status["plan"]["tensor"] == 8 and status["plan"]["pipeline"] == 2 and status["plan"]["gpusPerReplica"] == 16
    assert [c["type"] for c in status["conditions"]] == ["PlanValid", "Progressing", "Ready", "Degraded",
                                                         "Reconciling", "Stalled"]
    for condition in status["conditions"]:
        assert list(condition) == ["type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"]
    assert {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]} == {
        "PlanValid": ("True", "PlanAccepted"), "Progressing": ("False", "Complete"),
        "Ready": ("True", "Serving"), "Degraded": ("False", "AsExpected"),
        "Reconciling": ("False", "Reconciled"), "Stalled": ("False", "AsExpected"),
    }


def test_last_transition_time_moves_only_with_the_status() -> None:
    starting = _serving([_pod(0, 0, 8, scheduled=True), _pod(1, 0, 8, scheduled=True)], desired=1, now="t0")
    assert condition_status(starting["conditions"], "Ready") == "False"
    serving = _serving(_ready_pods(1), desired=1, previous=starting, generation=2, now="t1")
    since = {c["type"]: c["lastTransitionTime"] for c in serving["conditions"]}
    assert since == {"PlanValid": "t0", "Progressing": "t1", "Ready": "t1", "Degraded": "t0", "Reconciling": "t1",
                     "Stalled": "t0"}
    assert all(c["observedGeneration"] == 2 for c in serving["conditions"])


def test_rejected_spec_keeps_what_runs_and_says_why() -> None:
    serving = _written()["serving"]
    rejected = _written()["rejected-while-serving"]
    assert {k: v for k, v in rejected.items() if k not in ("observedGeneration", "conditions")} == \
        {k: v for k, v in serving.items() if k not in ("observedGeneration", "conditions")}
    assert rejected["observedGeneration"] == 2
    conditions = {c["type"]: c for c in rejected["conditions"]}
    assert [c["type"] for c in rejected["conditions"]] == ["PlanValid", "Progressing", "Ready", "Degraded",
                                                           "Reconciling", "Stalled"]
    assert (conditions["PlanValid"]["status"], conditions["PlanValid"]["reason"]) == ("False", "InvalidSpec")
    assert conditions["PlanValid"]["message"] == "spec.accelerator.type: unknown GPU type 'B100'"
    assert conditions["Ready"] == next(c for c in serving["conditions"] if c["type"] == "Ready"), "still serving"
    # kstatus computes Failed: Stalled carries PlanValid's reason and message.
    assert (conditions["Stalled"]["status"], conditions["Stalled"]["reason"], conditions["Stalled"]["message"]) == (
        "True", "InvalidSpec", conditions["PlanValid"]["message"])
    fresh = _written()["rejected-at-creation"]
    assert list(fresh) == ["observedGeneration", "conditions"]
    assert {c["type"]: (c["status"], c["reason"]) for c in fresh["conditions"]} == {
        "PlanValid": ("False", "InvalidSpec"), "Progressing": ("False", "PlanInvalid"), "Ready": ("False", "PlanInvalid"),
        "Reconciling": ("False", "Stalled"), "Stalled": ("True", "InvalidSpec"),
    }


def test_pinned_model_facts_are_written_and_kept_by_a_rejection() -> None:
    status = _written()["serving-with-pinned-facts"]
    pinned = status["modelFacts"]
    assert {k: pinned[k] for k in ("model", "revision", "refresh", "source")} == \
        {"model": "meta-llama/Llama-3.1-70B-Instruct", "revision": "main", "refresh": "2", "source": "catalog"}
    assert "commit" not in pinned and pinned["hubError"].endswith("the Hub answered 503")
    assert pinned["digest"].startswith("sha256:") and pinned["facts"]["encoding"] == 1
    plan_valid = next(c for c in status["conditions"] if c["type"] == "PlanValid")
    assert plan_valid["reason"] == "PlanAcceptedWithWarnings"
    assert "; model facts: catalog; warning: model facts from the built-in catalog: config.json not read: the Hub " \
        "answered 503; they stay pinned until spec.model changes or the tensorfleet.dev/model-facts-refresh " \
        "annotation gets a new value" in plan_valid["message"]
    # A rejection keeps the pin unless told; None removes it.
    assert _rejected(status)["modelFacts"] == pinned
    assert rejected_status(status, generation=2, field="f", message="m", now="t", model_facts=None)["modelFacts"] is None
    unavailable = {c["type"]: c for c in _written()["facts-unavailable"]["conditions"]}["PlanValid"]
    assert (unavailable["status"], unavailable["reason"]) == ("False", "ModelFactsUnavailable")


def test_a_status_patch_removes_what_the_new_status_lacks_at_any_depth() -> None:
    old = {"plan": {"tensor": 2}, "modelFacts": {"model": "a", "hubError": "503", "facts": {"x": 1}}, "idleSince": "t"}
    new = {"plan": {"tensor": 2}, "modelFacts": {"model": "a", "facts": {"x": 1}}}
    patch = merge_patch(old, new)
    assert patch == {"idleSince": None, "plan": {"tensor": 2}, "modelFacts": {"hubError": None, "model": "a",
                                                                                "facts": {"x": 1}}}


def test_unknown_generation_is_left_out_of_the_conditions() -> None:
    status = _serving(_ready_pods(), generation=None)
    assert all("observedGeneration" not in c for c in status["conditions"])


# --- why not Ready: the worst pod's cause in Ready and Degraded (diagnose.py) -----------------------------

def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_no_ready_group_makes_the_worst_pods_cause_the_ready_reason() -> None:
    pods = [_failing(_pod(stage, 0, 8, scheduled=True), "ImagePullBackOff", PULL) for stage in range(2)]
    conditions = _conditions(_serving(pods, desired=1))
    ready, degraded = conditions["Ready"], conditions["Degraded"]
    assert (ready["status"], ready["reason"]) == ("False", "ImagePullBackOff")
    assert (degraded["status"], degraded["reason"]) == ("True", "ImagePullBackOff")
    assert degraded["message"].startswith('pod m-stage-0-0: ImagePullBackOff: Back-off pulling image '
                                          '"registry.example.com/vllm:typo"')
    assert degraded["message"].endswith("; 1 more pod need attention (1 ImagePullBackOff)")
    assert "rpc error" not in degraded["message"] and "\n" not in degraded["message"]
    assert ready["message"] == f"0 of 1 groups ready: {degraded['message']}"


def test_a_missing_secret_and_an_oom_name_their_cause() -> None:
    secret = [_failing(_pod(0, 0, 8, scheduled=True), "CreateContainerConfigError", 'secret "hf-token" not found'),
              _failing(_pod(1, 0, 8, scheduled=True), "CreateContainerConfigError", 'secret "hf-token" not found')]
    conditions = _conditions(_serving(secret, desired=1))
    assert conditions["Ready"]["reason"] == conditions["Degraded"]["reason"] == "CreateContainerConfigError"
    assert 'secret "hf-token" not found' in conditions["Degraded"]["message"]
    oom = [*_ready_pods(1), _failing(_pod(0, 1, 8, scheduled=True), "CrashLoopBackOff", "back-off 40s restarting",
                                     restarts=3, last={"exitCode": 137, "reason": "OOMKilled"}),
           _pod(1, 1, 8, scheduled=True, ready=True)]
    conditions = _conditions(_serving(oom, desired=2))
    ready, degraded = conditions["Ready"], conditions["Degraded"]
    assert (ready["status"], ready["reason"]) == ("True", "Serving"), "one group serves"
    assert (degraded["status"], degraded["reason"]) == ("True", "OOMKilled")
    assert degraded["message"] == "pod m-stage-0-1: OOMKilled: container engine ran out of memory (exit code 137, " \
                                  "no memory limit: the node ran out) (restarted 3 times)"
    assert ready["message"] == f"1 of 2 groups ready; {degraded['message']}"


def test_unschedulable_is_worse_than_a_crash_and_keeps_the_shortfall() -> None:
    crash = _failing(_pod(0, 0, 8, scheduled=True), "CrashLoopBackOff", "back-off 10s restarting", restarts=1,
                     last={"exitCode": 1, "reason": "Error", "message": "Traceback ...\nRuntimeError: NCCL error"})
    pods = [crash, _pod(1, 0, 8, scheduled=False)]
    conditions = _conditions(_serving(pods, desired=1))
    degraded = conditions["Degraded"]
    assert conditions["Ready"]["reason"] == degraded["reason"] == "Unschedulable"
    assert degraded["message"].startswith("1 engine pod cannot be scheduled: 8 H100-80GB GPUs short")
    assert "pod m-stage-1-0: Unschedulable: 0/5 nodes are available: 2 Insufficient nvidia.com/gpu" in degraded["message"]
    assert "preemption" not in degraded["message"]
    assert degraded["message"].endswith("; 1 more pod need attention (1 CrashLoopBackOff)")
    events = pod_causes(observe(2, 1, pods, {}, None))
    assert [reason for reason, _ in events] == ["Unschedulable", "CrashLoopBackOff"]
    assert events[1] == ("CrashLoopBackOff",
                         "container engine exited with code 1: RuntimeError: NCCL error (pod m-stage-0-0)")


def test_a_starting_fleet_is_not_degraded_and_says_no_ready_replicas() -> None:
    conditions = _conditions(_serving([_pod(0, 0, 8, scheduled=True), _pod(1, 0, 8, scheduled=True)], desired=1))
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False", "NoReadyReplicas")
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == ("False", "AsExpected")
    assert pod_causes(observe(2, 1, [_pod(0, 0, 8, scheduled=True)], {}, None)) == []


def test_a_surge_group_that_cannot_pull_its_new_image_degrades_a_serving_fleet() -> None:
    """A rollout to a bad image: the old group serves, the surge group (ordinal 1) says why it never will."""
    plan = _plan(8, 2, "H100-80GB")
    surge = [_failing(_pod(stage, 1, 8, scheduled=True), "ImagePullBackOff", PULL) for stage in range(2)]
    obs = observe(plan.pipeline, 1, [*_ready_pods(1), *surge], {}, {"status": {"availableReplicas": 1}}, surge=1)
    status = serving_status({}, name="m", namespace="ns", generation=1, plan=plan, obs=obs, selector="s", now="t")
    conditions = _conditions(status)
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("True", "Serving")
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == ("True", "ImagePullBackOff")
    # A surge group merely waiting for GPUs is the Progressing condition's news, not Degraded's.
    waiting = [_pod(stage, 1, 8, scheduled=False) for stage in range(2)]
    obs = observe(plan.pipeline, 1, [*_ready_pods(1), *waiting], {}, {"status": {"availableReplicas": 1}}, surge=1)
    status = serving_status({}, name="m", namespace="ns", generation=1, plan=plan, obs=obs, selector="s", now="t")
    assert _conditions(status)["Degraded"]["status"] == "False"


def test_the_spec_is_loaded_without_a_status_it_cannot_read() -> None:
    """The reconciler and the webhook load objects by their spec: a status they cannot parse does not stop them."""
    from tensorfleet.api import SpecError

    document = {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "m"},
                "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "accelerator": {"type": "L4"}},
                "status": {"conditions": "written by someone else"}}
    with pytest.raises(SpecError):
        load_inference_service(document)
    loaded = load_inference_service(document, ignore_status=True)
    assert loaded.status is None and loaded.spec.model.name == "meta-llama/Llama-3.1-8B-Instruct"
    assert "status" in document, "the caller's document is left as it was"


# --- kstatus (sigs.k8s.io/cli-utils/pkg/kstatus), what Flux's health checks compute ----------------------------------


def _kstatus_conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {t: (c["status"], c["reason"]) for t, c in _conditions(status).items() if t in ("Reconciling", "Stalled")}


def test_reconciling_follows_progressing_and_stalled_needs_a_person() -> None:
    """Reconciling mirrors Progressing; Stalled is True only for a cause that does not heal on its own (and then
    Reconciling is False, since kstatus takes whichever True one comes first); a missing GPU is not one."""
    starting = _serving([_pod(0, 0, 8, scheduled=True), _pod(1, 0, 8, scheduled=True)], desired=1)
    assert _kstatus_conditions(starting) == {"Reconciling": ("True", "WaitingForReady"),
                                             "Stalled": ("False", "AsExpected")}
    assert _conditions(starting)["Reconciling"]["message"] == _conditions(starting)["Progressing"]["message"]
    scaling = _serving(_ready_pods(1), desired=2)
    assert _kstatus_conditions(scaling)["Reconciling"] == ("True", "ScalingUp")
    assert _conditions(scaling)["Ready"]["status"] == "True", "Ready alone would read as Current"
    for reason, message, last in (("CrashLoopBackOff", "back-off 40s", {"exitCode": 1, "reason": "Error"}),
                                  ("ImagePullBackOff", PULL, None),
                                  ("CreateContainerConfigError", 'secret "hf-token" not found', None)):
        pods = [_failing(_pod(stage, 0, 8, scheduled=True), reason, message, restarts=2, last=last)
                for stage in range(2)]
        stuck = _serving(pods, desired=1)
        assert _kstatus_conditions(stuck) == {"Reconciling": ("False", "Stalled"), "Stalled": ("True", reason)}
        assert _conditions(stuck)["Stalled"]["message"] == _conditions(stuck)["Degraded"]["message"]
    waiting = _serving([_pod(0, 0, 8, scheduled=False), _pod(1, 0, 8, scheduled=False)], desired=1)
    assert _conditions(waiting)["Degraded"]["reason"] == "Unschedulable"
    assert _kstatus_conditions(waiting) == {"Reconciling": ("True", "WaitingForReady"),
                                            "Stalled": ("False", "AsExpected")}
    healed = _serving(_ready_pods(1), desired=1, previous=stuck, generation=1, now="2026-01-01T00:09:00Z")
    assert _kstatus_conditions(healed) == {"Reconciling": ("False", "Reconciled"), "Stalled": ("False", "AsExpected")}


def test_engines_ready_before_their_router_is_still_reconciling() -> None:
    """Every group ready but no router pod available: Ready is False, so Reconciling must be True, or kstatus (and
    a Flux Kustomization waiting on it) reads the service as Current in that window (seen in CI)."""
    early = _serving(_ready_pods(2), desired=2, routers=0)
    assert (_conditions(early)["Ready"]["status"], _conditions(early)["Ready"]["reason"]) == (
        "False", "RouterUnavailable")
    assert _kstatus_conditions(early) == {"Reconciling": ("True", "WaitingForRouter"),
                                          "Stalled": ("False", "AsExpected")}
    assert _conditions(early)["Reconciling"]["message"] == "all 2 groups ready; no router pod is available yet"
    served = _serving(_ready_pods(2), desired=2, previous=early, now="2026-01-01T00:01:00Z")
    assert _kstatus_conditions(served) == {"Reconciling": ("False", "Reconciled"), "Stalled": ("False", "AsExpected")}
    assert _conditions(served)["Ready"]["status"] == "True"


def test_spec_replicas_zero_is_ready_so_kstatus_reads_it_as_current() -> None:
    """Parked at zero by the spec, as a Deployment at 0 replicas is reconciled: Ready True, nothing reconciling."""
    status = _serving([], desired=0)
    conditions = _conditions(status)
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("True", "ScaledToZero")
    assert conditions["Ready"]["message"].startswith("spec.replicas is 0")
    assert _kstatus_conditions(status) == {"Reconciling": ("False", "Reconciled"), "Stalled": ("False", "AsExpected")}
