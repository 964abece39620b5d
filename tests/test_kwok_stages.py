"""The KWOK stages e2e/cluster hands kwok (e2e/kwok-stages.yaml) fail pods only on request, never flap, and
produce the causes diagnose.py names; the pod runner's stages (e2e/podrunner.py) keep KWOK from making its pods
Ready or deleting them, and choose exactly the pods the runner runs. Rendering them is kwok's (the e2e suite runs
them); this checks their shape."""

from __future__ import annotations

import re
from typing import Any

import yaml
from conftest import ROOT
from test_podrunner import podrunner

from tensorfleet.controller.diagnose import SEVERITY

STAGES = ROOT / "e2e" / "kwok-stages.yaml"
MARKER = '.spec.containers[].env[]? | select(.name == "E2E_KWOK_FAULT") | .value'


def _stages() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(STAGES.read_text()) if doc]


def _named(prefix: str) -> list[dict[str, Any]]:
    return [stage for stage in _stages() if stage["metadata"]["name"].startswith(prefix)]


def _expressions(stage: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["key"]: e for e in stage["spec"]["selector"]["matchExpressions"]}


def test_every_stage_is_a_pod_stage_with_a_name_of_ours() -> None:
    for stage in _stages():
        assert (stage["apiVersion"], stage["kind"]) == ("kwok.x-k8s.io/v1alpha1", "Stage")
        name = stage["metadata"]["name"]
        assert name.startswith(("e2e-fault-", podrunner.STAGE_PREFIX)), "never a name of kwok's defaults"
        assert stage["spec"]["resourceRef"] == {"apiGroup": "v1", "kind": "Pod"}


def test_every_fault_stage_is_chosen_only_for_marked_pods() -> None:
    faults: list[str] = []
    for stage in _named("e2e-fault-"):
        expressions = _expressions(stage)
        assert expressions[MARKER]["operator"] == "In", "only pods that ask for a fault"
        assert expressions[".metadata.deletionTimestamp"]["operator"] == "DoesNotExist", "kwok's pod-delete deletes"
        assert expressions[".status.phase"]["values"] == ["Pending"]
        assert stage["spec"]["weight"] >= 1, "beats pod-ready (weight 0), which matches the same Pending pods"
        faults += expressions[MARKER]["values"]
    assert sorted(faults) == sorted(["ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError", "OOMKilled",
                                     "CrashLoopBackOff"])
    assert set(faults) <= {reason for tied in SEVERITY for reason in tied}, "each is a cause diagnose.py ranks"


def test_templates_are_idempotent_so_a_matching_stage_renders_no_new_patch() -> None:
    """A Pending pod still matches its stage after the patch; kwok skips an unchanged patch, so no Now."""
    for stage in _stages():
        if not stage["spec"]["next"]:
            continue   # the runner's hold stage: no step at all
        (patch,) = stage["spec"]["next"]["patches"]
        assert (patch["subresource"], patch["root"]) == ("status", "status")
        template = patch["template"]
        assert not re.search(r"\bNow\b|\bStartTime\b|randAlpha|uuidv4", template), stage["metadata"]["name"]
        if stage["metadata"]["name"].startswith("e2e-fault-"):
            assert "E2E_KWOK_FAULT" in template


def _runner_stage(name: str) -> dict[str, Any]:
    (stage,) = [s for s in _stages() if s["metadata"]["name"] == podrunner.STAGE_PREFIX + name]
    return stage


def test_the_runner_stages_choose_the_pods_the_runner_runs_and_no_fault_marked_one() -> None:
    stages = _named(podrunner.STAGE_PREFIX)
    assert {s["metadata"]["name"] for s in stages} == {"e2e-runner-start", "e2e-runner-hold"}
    for stage in stages:
        expressions = stage["spec"]["selector"]["matchExpressions"]
        for wanted in podrunner.STAGE_SELECTOR:
            assert wanted in expressions, (stage["metadata"]["name"], wanted)
        assert _expressions(stage)[MARKER]["operator"] == "DoesNotExist", "a fault-marked pod stays the fault stages'"
        assert stage["spec"]["weight"] >= 1, "beats kwok's pod-ready, pod-delete and pod-complete (weight 0)"


def test_the_runner_start_stage_gives_an_ip_and_never_ready() -> None:
    stage = _runner_stage("start")
    expressions = _expressions(stage)
    assert expressions[".status.podIP"]["operator"] == "DoesNotExist", "once: the runner writes the status after it"
    assert expressions[".metadata.deletionTimestamp"]["operator"] == "DoesNotExist"
    status = stage["spec"]["next"]["patches"][0]["template"]
    assert "PodIPsWith .spec.nodeName" in status and "podIP:" in status, "kwok still hands out the pod IPs"
    conditions = re.findall(r"- type: (\w+)\n\s+status: \"(\w+)\"", status)
    assert dict(conditions) == {"PodReadyToStartContainers": "True", "Initialized": "True", "Ready": "False",
                                "ContainersReady": "False"}
    assert "ready: true" not in status and "phase: Pending" in status and "ContainerCreating" in status


def test_the_runner_hold_stage_does_nothing_to_a_pod_with_an_ip_deleted_or_not() -> None:
    stage = _runner_stage("hold")
    expressions = _expressions(stage)
    assert stage["spec"]["next"] == {}, "no step: kwok leaves the pod's status and its deletion to the runner"
    assert expressions[".status.podIP"]["operator"] == "Exists"
    assert ".metadata.deletionTimestamp" not in expressions and ".status.phase" not in expressions


def test_up_writes_the_image_into_the_runner_stages_or_leaves_them_out() -> None:
    text = STAGES.read_text()
    image = "registry.example:5000/tensorfleet:9.9"
    written = [d for d in yaml.safe_load_all(podrunner.kwok_stages(text, image)) if d]
    assert [d["metadata"]["name"] for d in written] == [d["metadata"]["name"] for d in _stages()]
    for stage in written:
        keys = [e["key"] for e in stage["spec"]["selector"]["matchExpressions"]]
        assert not any(podrunner.IMAGE_PLACEHOLDER in key for key in keys)
        if stage["metadata"]["name"].startswith(podrunner.STAGE_PREFIX):
            assert any(key.startswith('[.spec.containers[].image] | all(startswith("registry.example:5000/tensorfleet:") '
                                      'or startswith("registry.example:5000/tensorfleet@") or test(') for key in keys)
            assert ('[.spec.initContainers[]?.image] | all(startswith("registry.example:5000/tensorfleet:") or '
                    'startswith("registry.example:5000/tensorfleet@"))') in keys
    without = [d for d in yaml.safe_load_all(podrunner.kwok_stages(text, None)) if d]
    assert [d["metadata"]["name"] for d in without] == [d["metadata"]["name"] for d in _named("e2e-fault-")]
