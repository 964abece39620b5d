"""How a spec change reaches running groups (OnDelete StatefulSets, whole groups replaced): a surge of new groups
first, then old ones retired only while spec.replicas others are Ready, or in place per spec.rollout.strategy.
Pure. Design: docs/architecture.md#rollouts-and-group-restarts.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorfleet.api.models import RolloutSpec
from tensorfleet.controller.observe import Group, Observation, pod_unschedulable

# Progressing reasons this module sets, and reads back.
SURGING, IN_PLACE, SURGE_UNSCHEDULABLE = "Surging", "ReplacingInPlace", "SurgeUnschedulable"


@dataclass(frozen=True)
class Mode:
    """This reconcile's rollout decision, made before the StatefulSets are applied."""

    surge: int                   # extra ordinals the StatefulSets run now
    in_place: bool               # replace serving groups without a surge
    blocked: str | None = None   # why the surge cannot start (Surge strategy waits)


# Nothing to roll: no surge, nothing in place.
STEADY = Mode(surge=0, in_place=False)


def _outdated(obs: Observation) -> list[Group]:
    """Wanted groups running an old revision (and not already going away)."""
    return [g for g in obs.current() if not g.updated(obs.revisions) and not g.terminating()]


def decide(obs: Observation, rollout: RolloutSpec, *, running_surge: int, previous_reason: str | None) -> Mode:
    """The surge to render and whether to replace in place, from what the cluster shows now.

    `running_surge` is how many ordinals beyond spec.replicas the StatefulSets
    run (their live spec.replicas minus the wanted count); `previous_reason` is
    the Progressing reason last written.
    """
    if obs.revisions_pending:
        # Which groups are outdated is unknown until the StatefulSet controller has seen the new template
        # (its status update is a watch event, so a reconcile follows): keep what runs, start nothing.
        in_place = rollout.strategy == "Replace" or (rollout.strategy == "SurgeOrReplace" and previous_reason == IN_PLACE)
        return Mode(surge=0 if in_place else max(running_surge, 0), in_place=in_place)
    outdated = _outdated(obs)
    if rollout.strategy == "Replace":
        return Mode(surge=0, in_place=True)
    stuck = [pod["metadata"]["name"] for g in obs.surge_groups() for pod in g.pods.values() if pod_unschedulable(pod)]
    if outdated and rollout.strategy == "SurgeOrReplace" and (stuck or previous_reason == IN_PLACE):
        return Mode(surge=0, in_place=True)
    if outdated:
        blocked = None
        if stuck:
            blocked = (f"the surge cannot be scheduled ({', '.join(stuck[:3])} pending): no free GPUs for a "
                       f"replacement group; free {obs.pipeline} node(s) worth of GPUs, or set "
                       "spec.rollout.strategy: SurgeOrReplace to replace in place")
        return Mode(surge=min(rollout.max_surge, len(outdated)), in_place=False, blocked=blocked)
    settled = all(g.ready(obs.pipeline) and g.updated(obs.revisions) for g in obs.current()) \
        and len(obs.current()) >= obs.desired
    if running_surge > 0 and not settled:
        return Mode(surge=running_surge, in_place=False)  # the last replacements are still loading
    return STEADY


def replacements(obs: Observation, mode: Mode) -> list[int]:
    """Groups to delete now: idle outdated ones at once; serving ones only as the mode's capacity allows."""
    if obs.revisions_pending:
        return []  # the update revision is the old template's until the StatefulSet controller catches up
    outdated = _outdated(obs)
    idle = [g.index for g in outdated if not g.ready(obs.pipeline)]
    if idle:
        return idle
    serving = [g.index for g in outdated]
    if not serving:
        return []
    if mode.in_place:
        # At most one group down, and only while every other one serves.
        return serving[:1] if obs.ready_replicas == obs.desired else []
    ready = sum(1 for g in obs.current() + obs.surge_groups() if g.ready(obs.pipeline))
    return serving[:max(0, ready - obs.desired)]
