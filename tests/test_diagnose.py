"""diagnose.py over pod statuses shaped as kubelet and kube-scheduler 1.36 write them (containerd 2 runtime
messages), each reduced to one line with the reason `kubectl get pods` shows."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tensorfleet.controller.diagnose import (
    DETAIL_LIMIT,
    SEVERITY,
    STUCK_REASONS,
    Diagnosis,
    causes,
    diagnose,
    diagnose_all,
    last_line,
    one_line,
    rank,
    worst,
)
from tensorfleet.controller.observe import Group, pod_problem

IMAGE = "ghcr.io/tensorfleet/tensorfleet-worker:0.9.9"
NOT_FOUND = (f'rpc error: code = NotFound desc = failed to pull and unpack image "{IMAGE}": failed to resolve '
             f'reference "{IMAGE}": {IMAGE}: not found')
UNAUTHORIZED = ('rpc error: code = Unknown desc = failed to pull and unpack image "nvcr.io/acme/private-vllm:1.0": '
                'failed to resolve reference "nvcr.io/acme/private-vllm:1.0": pull access denied, repository does not '
                'exist or may require authorization: server message: insufficient_scope: authorization failed')
SCHEDULER = ("0/5 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 4 Insufficient "
             "nvidia.com/gpu. preemption: 0/5 nodes are available: 1 Preemption is not helpful for scheduling, "
             "4 No preemption victims found for incoming pod.")
TRACEBACK = """Traceback (most recent call last):
  File "/usr/local/bin/vllm", line 8, in <module>
    sys.exit(main())
  File "/usr/local/lib/python3.12/site-packages/vllm/engine/arg_utils.py", line 1021, in create_engine_config
    raise ValueError(
ValueError: The model's max seq len (131072) is larger than the maximum number of tokens that can be stored in KV cache (53328). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.
"""


def _pod(name: str = "llama-70b-stage-0-0", *, phase: str = "Pending", conditions: list[dict[str, Any]] | None = None,
         containers: list[dict[str, Any]] | None = None, init: list[dict[str, Any]] | None = None,
         memory: str | None = "64Gi") -> dict[str, Any]:
    limits = {"nvidia.com/gpu": "4", **({"memory": memory} if memory else {})}
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions if conditions is not None else [
            {"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": "2026-11-24T12:00:03Z"},
            {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-11-24T12:00:01Z"},
            {"type": "Ready", "status": "False", "reason": "ContainersNotReady",
             "message": "containers with unready status: [engine]", "lastTransitionTime": "2026-11-24T12:00:01Z"},
            {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady",
             "message": "containers with unready status: [engine]", "lastTransitionTime": "2026-11-24T12:00:01Z"},
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-24T12:00:00Z"},
        ],
        "hostIP": "10.0.3.17", "podIP": "10.244.1.9", "qosClass": "Burstable", "startTime": "2026-11-24T12:00:01Z",
    }
    if containers is not None:
        status["containerStatuses"] = containers
    if init is not None:
        status["initContainerStatuses"] = init
    return {
        "metadata": {"name": name, "namespace": "llm"},
        "spec": {"containers": [{"name": "engine", "image": IMAGE, "resources": {"limits": limits}}]},
        "status": status,
    }


def _waiting(reason: str, message: str | None = None, *, restarts: int = 0,
             last: dict[str, Any] | None = None, name: str = "engine") -> dict[str, Any]:
    waiting = {"reason": reason, **({"message": message} if message is not None else {})}
    return {"name": name, "image": IMAGE, "imageID": "", "ready": False, "started": False, "restartCount": restarts,
            "state": {"waiting": waiting}, "lastState": {"terminated": last} if last else {},
            "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}


def _terminated(exit_code: int, reason: str, message: str | None = None) -> dict[str, Any]:
    return {"exitCode": exit_code, "reason": reason, "startedAt": "2026-11-24T12:03:10Z",
            "finishedAt": "2026-11-24T12:05:42Z", "containerID": "containerd://4f1c9e",
            **({"message": message} if message is not None else {})}


def _running() -> dict[str, Any]:
    return {"name": "engine", "image": IMAGE, "ready": False, "started": True, "restartCount": 0,
            "state": {"running": {"startedAt": "2026-11-24T12:00:04Z"}}, "lastState": {}}


def test_image_pull_back_off_keeps_the_registry_answer_and_the_image() -> None:
    back_off = f'Back-off pulling image "{IMAGE}": ErrImagePull: {NOT_FOUND}'
    found = diagnose(_pod(containers=[_waiting("ImagePullBackOff", back_off)]))
    assert found is not None
    assert (found.reason, found.container, found.restarts) == ("ImagePullBackOff", "engine", 0)
    assert "rpc error" not in found.detail, "gRPC's wrapper says nothing to a person"
    assert found.detail.startswith(f'Back-off pulling image "{IMAGE}"')
    assert found.detail.endswith(f"{IMAGE}: not found")
    assert found.line == f"pod llama-70b-stage-0-0: ImagePullBackOff: {found.detail}"


def test_err_image_pull_for_a_private_registry_says_access_was_denied() -> None:
    found = diagnose(_pod(containers=[_waiting("ErrImagePull", UNAUTHORIZED)]))
    assert found is not None and found.reason == "ErrImagePull"
    assert "nvcr.io/acme/private-vllm:1.0" in found.detail and "authorization failed" in found.detail
    assert len(found.detail) <= DETAIL_LIMIT


def test_an_image_the_message_does_not_name_is_named() -> None:
    found = diagnose(_pod(containers=[_waiting("ImagePullBackOff", f"Back-off pulling image {IMAGE!r}")]))
    assert found is not None and IMAGE in found.detail
    bare = diagnose(_pod(containers=[_waiting("ErrImagePull", "429 Too Many Requests")]))
    assert bare is not None and bare.detail == f'image "{IMAGE}": 429 Too Many Requests'


def test_a_missing_secret_is_named() -> None:
    found = diagnose(_pod(containers=[_waiting("CreateContainerConfigError", 'secret "hf-token" not found')]))
    assert found is not None
    assert found.line == 'pod llama-70b-stage-0-0: CreateContainerConfigError: secret "hf-token" not found'
    key = diagnose(_pod(containers=[_waiting("CreateContainerConfigError",
                                             "couldn't find key token in Secret llm/hf-token")]))
    assert key is not None and key.detail == "couldn't find key token in Secret llm/hf-token"


def test_an_oom_crash_loop_is_oomkilled_with_the_memory_limit() -> None:
    back_off = "back-off 2m40s restarting failed container=engine pod=llama-70b-stage-0-0_llm(5c1f7e2a-0d7b)"
    pod = _pod(phase="Running", containers=[_waiting("CrashLoopBackOff", back_off, restarts=4,
                                                     last=_terminated(137, "OOMKilled"))])
    found = diagnose(pod)
    assert found is not None
    assert found.reason == "OOMKilled"
    assert found.detail == "container engine ran out of memory (exit code 137, memory limit 64Gi)"
    assert found.line.endswith("(restarted 4 times)")
    assert "back-off" not in found.line, "the back-off delay changes every restart and says nothing of the cause"
    unlimited = diagnose(_pod(phase="Running", memory=None, containers=[
        _waiting("CrashLoopBackOff", back_off, restarts=1, last=_terminated(137, "OOMKilled"))]))
    assert unlimited is not None and "no memory limit: the node ran out" in unlimited.detail
    assert unlimited.line.endswith("(restarted 1 time)")


def test_a_crash_loop_says_how_the_container_ended_and_its_last_words() -> None:
    back_off = "back-off 5m0s restarting failed container=engine pod=llama-70b-stage-0-0_llm(5c1f7e2a-0d7b)"
    pod = _pod(phase="Running", containers=[_waiting("CrashLoopBackOff", back_off, restarts=7,
                                                     last=_terminated(1, "Error", TRACEBACK))])
    found = diagnose(pod)
    assert found is not None and found.reason == "CrashLoopBackOff"
    assert found.detail.startswith("container engine exited with code 1: ValueError: The model's max seq len (131072)")
    assert "Traceback" not in found.detail, "the exception, not the stack"
    assert len(found.detail) <= DETAIL_LIMIT and found.detail.endswith("initializing the engine.")
    segfault = diagnose(_pod(phase="Running", containers=[
        _waiting("CrashLoopBackOff", back_off, restarts=2, last=_terminated(139, "Error"))]))
    assert segfault is not None and segfault.detail == "container engine exited with code 139 (SIGSEGV)"
    completed = diagnose(_pod(phase="Running", containers=[
        _waiting("CrashLoopBackOff", back_off, restarts=2, last=_terminated(0, "Completed"))]))
    assert completed is not None and completed.detail == "container engine exited with code 0 (Completed)"
    unknown = diagnose(_pod(phase="Running", containers=[_waiting("CrashLoopBackOff", back_off, restarts=2)]))
    assert unknown is not None and unknown.detail == "container engine keeps exiting"


def test_unschedulable_gives_the_scheduler_words_without_the_preemption_sentence() -> None:
    pod = _pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": SCHEDULER,
                            "lastProbeTime": None, "lastTransitionTime": "2026-11-24T12:00:00Z"}])
    found = diagnose(pod)
    assert found is not None and found.reason == "Unschedulable"
    assert found.detail == ("0/5 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
                            "4 Insufficient nvidia.com/gpu.")


def test_an_evicted_pod_says_why() -> None:
    pod = _pod(phase="Failed", conditions=[])
    pod["status"].update({"reason": "Evicted", "message": "The node was low on resource: ephemeral-storage. "
                          "Threshold quantity: 10Gi, available: 9Gi. Container engine was using 120Gi, request is 0, "
                          "has larger consumption of ephemeral-storage. "})
    found = diagnose(pod)
    assert found is not None and found.reason == "Evicted"
    assert found.detail.startswith("The node was low on resource: ephemeral-storage.")
    plain = _pod(phase="Failed", conditions=[])
    assert diagnose(plain) == Diagnosis("llama-70b-stage-0-0", "PodFailed", "the pod failed")


def test_a_stuck_init_container_counts() -> None:
    pod = _pod(init=[_waiting("CreateContainerConfigError", 'secret "hf-token" not found', name="fetch")],
               containers=[_waiting("PodInitializing")])
    found = diagnose(pod)
    assert found is not None and (found.reason, found.container) == ("CreateContainerConfigError", "fetch")


@pytest.mark.parametrize("containers", [
    [],                                                    # just scheduled
    [_waiting("ContainerCreating")],                       # pulling, mounting
    [_waiting("PodInitializing")],
    [_running()],                                          # loading the model
])
def test_a_pod_on_its_way_is_not_diagnosed(containers: list[dict[str, Any]]) -> None:
    assert diagnose(_pod(containers=containers)) is None
    assert pod_problem(_pod(containers=containers)) is None


def test_worst_is_the_earliest_obstacle_in_a_pods_life() -> None:
    assert rank("Unschedulable") < rank("ImagePullBackOff") == rank("ErrImagePull") \
        < rank("CreateContainerConfigError") < rank("OOMKilled") < rank("CrashLoopBackOff") < rank("Evicted")
    assert {reason for tied in SEVERITY for reason in tied} >= STUCK_REASONS, "every stuck container reason is ranked"
    crash = Diagnosis("p-0", "CrashLoopBackOff", "container engine exited with code 1")
    oom = Diagnosis("p-1", "OOMKilled", "container engine ran out of memory")
    evicted = Diagnosis("p-2", "Evicted", "The node was low on resource: memory.")
    secret = Diagnosis("p-3", "CreateContainerConfigError", 'secret "hf-token" not found')
    pull = Diagnosis("p-4", "ErrImagePull", "not found")
    back_off = Diagnosis("p-5", "ImagePullBackOff", "Back-off")
    nowhere = Diagnosis("p-6", "Unschedulable", "0/5 nodes are available")
    assert worst([crash, evicted, oom]) == oom
    assert worst([evicted, crash]) == crash, "a failed pod is replaced by its controller"
    assert worst([crash, secret, oom]) == secret
    assert worst([back_off, pull]) == back_off, "the kubelet alternates between the two: same rank, first pod wins"
    assert worst([crash, pull, nowhere]) == nowhere
    assert worst([]) is None
    # Within a container list, the worst container of the pod.
    pod = _pod(phase="Running", containers=[
        _waiting("CrashLoopBackOff", "back-off", restarts=2, last=_terminated(1, "Error")),
        _waiting("ImagePullBackOff", f'Back-off pulling image "{IMAGE}"', name="sidecar")])
    found = diagnose(pod)
    assert found is not None and (found.reason, found.container) == ("ImagePullBackOff", "sidecar")


def test_causes_are_one_per_distinct_reason_and_detail_naming_the_pods() -> None:
    pull = f'Back-off pulling image "{IMAGE}": ErrImagePull: {NOT_FOUND}'
    pods = [_pod(f"m-stage-{stage}-{index}", containers=[_waiting("ImagePullBackOff", pull)])
            for index in range(3) for stage in range(2)]
    pods.append(_pod("m-stage-0-3", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                 "message": SCHEDULER}]))
    found = diagnose_all(pods)
    assert [d.reason for d in found] == ["Unschedulable", *["ImagePullBackOff"] * 6]
    events = causes(found)
    assert [reason for reason, _ in events] == ["Unschedulable", "ImagePullBackOff"]
    assert events[0][1].endswith("(pod m-stage-0-3)")
    assert events[1][1].endswith("(pods m-stage-0-0, m-stage-1-0, m-stage-0-1 and 3 more)")
    restarted = copy.deepcopy(pods[0])
    restarted["status"]["containerStatuses"][0]["restartCount"] = 9
    assert causes(diagnose_all([restarted])) == causes(diagnose_all([pods[0]])), "restarts do not make a new event"


def test_one_line_collapses_and_keeps_head_and_tail() -> None:
    assert one_line("  a\n\tb   c \n") == "a b c"
    assert one_line(None) == ""
    long = "head " + "x" * 500 + " tail: not found"
    short = one_line(long, 100)
    assert len(short) <= 100 and short.startswith("head ") and short.endswith("tail: not found") and " ... " in short
    assert last_line("first\nsecond\n\n") == "second" and last_line("") == ""


def test_pod_problem_is_the_diagnosis_line_and_a_crash_looping_member_does_not_restart_its_group() -> None:
    pod = _pod(containers=[_waiting("CreateContainerConfigError", 'secret "hf-token" not found')])
    assert pod_problem(pod) == 'pod llama-70b-stage-0-0: CreateContainerConfigError: secret "hf-token" not found'
    leader = _pod("m-stage-0-0", phase="Running", conditions=[{"type": "Ready", "status": "True"}],
                  containers=[{**_running(), "ready": True}])
    leader["metadata"]["labels"] = {"tensorfleet.dev/stage": "0"}
    member = _pod("m-stage-1-0", phase="Running", containers=[
        _waiting("CrashLoopBackOff", "back-off", restarts=3, last=_terminated(137, "OOMKilled"))])
    assert Group(0, {0: leader, 1: member}).broken(2) is None, "restarting the group again cannot help"


def test_a_member_deleted_after_its_leader_formed_the_group_breaks_it_one_left_from_the_last_restart_does_not() -> None:
    leader = _pod("m-stage-0-0", phase="Running", containers=[{**_running(), "ready": True}],
                  conditions=[{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-24T12:05:00Z"}])
    member = _pod("m-stage-1-0", phase="Running", containers=[{**_running(), "ready": True}],
                  conditions=[{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-24T12:00:30Z"}])
    member["metadata"]["creationTimestamp"] = "2026-11-24T12:00:00Z"
    assert Group(0, {0: leader, 1: member}).broken(2) is None
    member["metadata"]["deletionTimestamp"] = "2026-11-24T12:06:00Z"   # evicted, drained, deleted
    assert "pod m-stage-1-0 is being deleted" in (Group(0, {0: leader, 1: member}).broken(2) or "")
    # The old member of a group restarted at 12:04, still stopping once the new leader is Ready: no second restart.
    member["metadata"]["deletionTimestamp"] = "2026-11-24T12:04:00Z"
    assert Group(0, {0: leader, 1: member}).broken(2) is None
    # A leader going away takes its group with it: nothing to restart.
    leader["metadata"]["deletionTimestamp"] = "2026-11-24T12:07:00Z"
    member["metadata"]["deletionTimestamp"] = "2026-11-24T12:07:00Z"
    assert Group(0, {0: leader, 1: member}).broken(2) is None
