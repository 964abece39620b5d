"""The rollout's decisions as pure functions, and what roll_groups may delete."""

from __future__ import annotations

import asyncio
from typing import Any

from tensorfleet.api.models import RolloutSpec
from tensorfleet.controller.children import Context
from tensorfleet.controller.observe import observe
from tensorfleet.controller.rollout import STEADY, Mode, decide, replacements
from tensorfleet.controller.statefulsets import roll_groups
from tensorfleet.controller.status import progress

OLD, NEW = "rev-old", "rev-new"


def pod(stage: int, index: int, *, revision: str = OLD, ready: bool = True, controller: str | None = "sts") -> dict[str, Any]:
    refs = [{"kind": "StatefulSet", "name": f"demo-stage-{stage}", "uid": f"{controller}-{stage}",
             "controller": True}] if controller else []
    return {"metadata": {"name": f"demo-stage-{stage}-{index}", "namespace": "default", "uid": f"p-{stage}-{index}",
                         "resourceVersion": "1", "ownerReferences": refs,
                         "labels": {"tensorfleet.dev/stage": str(stage), "apps.kubernetes.io/pod-index": str(index),
                                    "controller-revision-hash": revision}},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                       "lastTransitionTime": "2026-11-24T10:00:00Z"}]}}


def sts(stage: int) -> dict[str, Any]:
    return {"metadata": {"uid": f"sts-{stage}"}, "status": {"updateRevision": NEW}}


def test_a_surge_starts_while_groups_are_outdated_and_stays_until_the_rest_are_ready() -> None:
    outdated = observe(1, 1, [pod(0, 0)], {0: sts(0)}, None)
    assert decide(outdated, RolloutSpec(), running_surge=0, previous_reason=None) == Mode(surge=1, in_place=False)
    loading = observe(1, 1, [pod(0, 0, revision=NEW, ready=False), pod(0, 1, revision=NEW)], {0: sts(0)}, None, surge=1)
    assert decide(loading, RolloutSpec(), running_surge=1, previous_reason=None).surge == 1
    done = observe(1, 1, [pod(0, 0, revision=NEW)], {0: sts(0)}, None)
    assert decide(done, RolloutSpec(), running_surge=1, previous_reason=None) == STEADY
    assert decide(outdated, RolloutSpec(strategy="Replace"), running_surge=0, previous_reason=None).in_place


def test_a_serving_old_group_goes_only_when_the_surge_serves() -> None:
    surge_loading = observe(1, 1, [pod(0, 0), pod(0, 1, revision=NEW, ready=False)], {0: sts(0)}, None, surge=1)
    assert replacements(surge_loading, Mode(surge=1, in_place=False)) == []
    surge_ready = observe(1, 1, [pod(0, 0), pod(0, 1, revision=NEW)], {0: sts(0)}, None, surge=1)
    assert replacements(surge_ready, Mode(surge=1, in_place=False)) == [0]


def test_nothing_is_replaced_while_a_statefulset_has_not_seen_its_new_template() -> None:
    # The apply just changed the template: generation 2, but the StatefulSet controller's status (observed
    # generation 1) still names the old template's revision, which every pod runs. "All updated" would be a lie.
    behind = {"metadata": {"uid": "sts-0", "generation": 2}, "status": {"updateRevision": OLD, "observedGeneration": 1}}
    obs = observe(1, 2, [pod(0, 0), pod(0, 1, ready=False)], {0: behind}, None)
    assert obs.revisions_pending
    assert replacements(obs, Mode(surge=0, in_place=True)) == []
    assert decide(obs, RolloutSpec(), running_surge=0, previous_reason=None) == STEADY
    all_ready = observe(1, 2, [pod(0, 0), pod(0, 1)], {0: behind}, None)
    assert progress(all_ready, STEADY)[:2] == ("True", "WaitingForStatefulSet")
    # Once it has, the old pods are outdated and the idle one goes at once.
    caught_up = {"metadata": {"uid": "sts-0", "generation": 2}, "status": {"updateRevision": NEW, "observedGeneration": 2}}
    obs = observe(1, 2, [pod(0, 0), pod(0, 1, ready=False)], {0: caught_up}, None)
    assert not obs.revisions_pending and replacements(obs, Mode(surge=0, in_place=True)) == [1]


class _Recorder:
    def __init__(self) -> None:
        self.deleted: list[str] = []

    async def delete(self, kind: Any, namespace: str, name: str, **_: Any) -> dict[str, Any]:
        self.deleted.append(name)
        return {}

    async def normal(self, *_: Any) -> None:
        return None

    async def warning(self, *_: Any) -> None:
        return None


def test_a_group_with_a_pod_no_statefulset_holds_yet_is_never_deleted() -> None:
    """An immutable-field recreate releases the pods; until the new StatefulSet adopts them, hands off."""
    recorder = _Recorder()
    cache = type("Cache", (), {"deleted": lambda *a: None})()
    ctx = Context(kube=recorder, cache=cache, events=recorder,  # type: ignore[arg-type]  # duck-typed stand-ins
                  owner={"metadata": {"name": "demo", "namespace": "default", "uid": "isvc"}})
    # Both groups are outdated and idle, so both are due; group 0's stage-1 pod is an orphan.
    obs = observe(2, 2, [pod(0, 0, ready=False), pod(1, 0, ready=False, controller=None),
                         pod(0, 1, ready=False), pod(1, 1, ready=False)], {0: sts(0), 1: sts(1)}, None)
    assert replacements(obs, STEADY) == [0, 1]
    asyncio.run(roll_groups(ctx, obs, STEADY))
    assert "demo-stage-0-0" not in recorder.deleted and "demo-stage-1-0" not in recorder.deleted
    assert sorted(recorder.deleted) == ["demo-stage-0-1", "demo-stage-1-1"]
