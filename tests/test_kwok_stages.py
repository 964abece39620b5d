"""The KWOK stages e2e/cluster hands kwok (e2e/kwok-stages.yaml) fail pods only on request, never flap, and
produce the causes diagnose.py names. Rendering them is kwok's (the e2e suite runs them); this checks their shape."""

from __future__ import annotations

import re
from typing import Any

import yaml
from conftest import ROOT

from tensorfleet.controller.diagnose import SEVERITY

STAGES = ROOT / "e2e" / "kwok-stages.yaml"
MARKER = '.spec.containers[].env[]? | select(.name == "E2E_KWOK_FAULT") | .value'


def _stages() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(STAGES.read_text()) if doc]


def _expressions(stage: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["key"]: e for e in stage["spec"]["selector"]["matchExpressions"]}


def test_every_stage_is_a_pod_stage_chosen_only_for_marked_pods() -> None:
    faults: list[str] = []
    for stage in _stages():
        assert (stage["apiVersion"], stage["kind"]) == ("kwok.x-k8s.io/v1alpha1", "Stage")
        assert stage["metadata"]["name"].startswith("e2e-fault-"), "never a name of kwok's defaults, which it sits beside"
        assert stage["spec"]["resourceRef"] == {"apiGroup": "v1", "kind": "Pod"}
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
        (patch,) = stage["spec"]["next"]["patches"]
        assert (patch["subresource"], patch["root"]) == ("status", "status")
        template = patch["template"]
        assert not re.search(r"\bNow\b|\bStartTime\b|randAlpha|uuidv4", template), stage["metadata"]["name"]
        assert "E2E_KWOK_FAULT" in template
