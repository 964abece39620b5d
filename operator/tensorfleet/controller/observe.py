"""What the cluster shows about one InferenceService's groups (ordinal i of every stage StatefulSet): which serve
(every pod Ready on a Ready node), which run the current spec (every pod at its stage's update revision), and which
are broken and must restart. Pure functions. Design: docs/architecture.md#rollouts-and-group-restarts.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorfleet import contract
from tensorfleet.controller.diagnose import READINESS_LOST, NodeState, diagnose, pod_condition, readiness_lost
from tensorfleet.controller.idle import parse_time

REVISION_LABEL = "controller-revision-hash"


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def pod_group(pod: dict[str, Any]) -> int | None:
    """The pod's ordinal: the StatefulSet pod-index label, else its name's suffix."""
    index = _labels(pod).get(contract.LABEL_POD_INDEX)
    if index is None:
        index = pod.get("metadata", {}).get("name", "").rsplit("-", 1)[-1]
    return int(index) if str(index).isdigit() else None


def pod_stage(pod: dict[str, Any]) -> int | None:
    stage = _labels(pod).get(contract.LABEL_STAGE)
    return int(stage) if stage is not None and stage.isdigit() else None


def is_terminating(obj: dict[str, Any]) -> bool:
    return bool(obj.get("metadata", {}).get("deletionTimestamp"))


def pod_ready(pod: dict[str, Any]) -> bool:
    if is_terminating(pod):
        return False
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def pod_unschedulable(pod: dict[str, Any]) -> bool:
    """The scheduler found no node for the pod (PodScheduled=False, reason Unschedulable)."""
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
               for c in pod.get("status", {}).get("conditions") or [])


def pod_gpus(pod: dict[str, Any]) -> int:
    """GPUs the pod's containers ask for (their nvidia.com/gpu limits, which the scheduler counts)."""
    total = 0
    for container in pod.get("spec", {}).get("containers") or []:
        resources = container.get("resources") or {}
        value = (resources.get("limits") or {}).get(contract.GPU_RESOURCE) or \
            (resources.get("requests") or {}).get(contract.GPU_RESOURCE)
        try:
            total += int(value or 0)
        except (TypeError, ValueError):
            continue
    return total


def pod_problem(pod: dict[str, Any]) -> str | None:
    """Why a pod cannot become ready without someone acting (one line, see diagnose.py), or None."""
    found = diagnose(pod)
    return found.line if found else None


@dataclass
class Group:
    index: int
    pods: dict[int, dict[str, Any]] = field(default_factory=dict)  # stage -> pod
    nodes: Mapping[str, NodeState] = field(default_factory=dict)  # the cluster's nodes that are not Ready

    def complete(self, pipeline: int) -> bool:
        return all(stage in self.pods for stage in range(pipeline))

    def ready(self, pipeline: int) -> bool:
        """Every stage's pod Ready, none of them on a node that is not (its Ready is stale: nobody reports it)."""
        return self.complete(pipeline) and all(pod_ready(pod) for pod in self.pods.values()) and not self.stranded()

    def stranded(self) -> list[tuple[int, dict[str, Any], NodeState]]:
        """(stage, pod, node) of each member on a node that is not Ready."""
        return [(stage, pod, node) for stage, pod in sorted(self.pods.items())
                if (node := self.nodes.get(pod.get("spec", {}).get("nodeName") or "")) is not None]

    def updated(self, revisions: dict[int, str | None]) -> bool:
        """Every pod runs its stage's update revision (unknown revisions count as current)."""
        for stage, pod in self.pods.items():
            wanted = revisions.get(stage)
            if wanted and _labels(pod).get(REVISION_LABEL) != wanted:
                return False
        return True

    def terminating(self) -> bool:
        return any(is_terminating(pod) for pod in self.pods.values())

    def broken(self, pipeline: int) -> str | None:
        """Why this multi-node group can no longer serve and must restart as a whole, or None.

        vLLM cannot take a lost pipeline stage back: once a member's engine
        process died (a container restart), or a member left the group after
        the leader formed it, the survivors hold a broken Ray cluster.
        LeaderWorkerSet answers this by recreating the group; so does this.

        "After the leader formed it" is read off timestamps, so no timer is
        needed and a group still starting is never mistaken for a broken one:
        a member created after the leader turned Ready is a replacement (the
        one it replaced was deleted or evicted), and a member whose Ready went
        False after that has failed (its readiness includes GPU health). A
        leader that is not Ready has failed when its Ready went False after
        its containers started (`diagnose.readiness_lost`): it had served. A
        member on a node that is not Ready is the node grace's to judge
        (`Observation._node_lost`), not this. A member stuck in a crash loop
        is left alone (restarting its group again cannot help, and Degraded
        says why), as is a group already going away
        (its leader goes first). A member being deleted while the leader it
        joined still serves (evicted, drained, its node gone) breaks the group
        too, and restarting it at once is what ends that member's wait: a
        stopping worker keeps running until its leader has drained and stopped,
        which otherwise happens only when its grace period runs out.
        """
        if pipeline < 2 or any((found := diagnose(pod)) is not None and found.reason != READINESS_LOST
                               for pod in self.pods.values()):
            return None
        leader = self.pods.get(0)
        formed = _ready_since(leader) if leader is not None and pod_ready(leader) else None
        if formed is not None:
            for stage, member in sorted(self.pods.items()):
                # Deleted after this leader formed the group: not a member left over from the group's last restart.
                if stage and (member.get("metadata", {}).get("deletionTimestamp") or "") > formed:
                    return (f"stage {stage} pod {member['metadata']['name']} is being deleted (evicted, drained, "
                            "or its node is gone) while its leader serves")
        if self.terminating():
            return None
        for stage, pod in sorted(self.pods.items()):
            restarted = max((c.get("restartCount") or 0 for c in pod.get("status", {}).get("containerStatuses") or []),
                            default=0)
            if restarted:
                return f"stage {stage} pod {pod['metadata']['name']} restarted (restartCount {restarted})"
        on_bad_node = {stage for stage, *_ in self.stranded()}   # the node's grace decides (Observation._node_lost)
        if formed is None:
            if leader is not None and 0 not in on_bad_node and readiness_lost(leader):
                return f"stage 0 pod {leader['metadata']['name']} stopped being Ready after it had served"
            return None
        for stage, member in sorted(self.pods.items()):
            if stage == 0:
                continue
            created = member.get("metadata", {}).get("creationTimestamp") or ""
            if created > formed:
                return f"stage {stage} pod {member['metadata']['name']} was replaced after the group formed"
            ready = pod_condition(member, "Ready")
            if ready is not None and ready.get("status") != "True" and stage not in on_bad_node \
                    and (ready.get("lastTransitionTime") or "") > formed:
                return f"stage {stage} pod {member['metadata']['name']} stopped being Ready"
        return None


def _ready_since(pod: dict[str, Any]) -> str | None:
    """When the pod turned Ready (RFC 3339, which sorts as text), or None when unknown."""
    ready = pod_condition(pod, "Ready")
    return (ready or {}).get("lastTransitionTime") or None


@dataclass
class Observation:
    pipeline: int
    desired: int
    groups: dict[int, Group]
    revisions: dict[int, str | None]
    router_available: int
    surge: int = 0  # extra ordinals run during a rollout (see rollout.py)
    # A StatefulSet whose controller has not yet seen its latest spec (status.observedGeneration behind
    # metadata.generation): its updateRevision is the old template's, so which pods are updated is unknown.
    revisions_pending: bool = False
    nodes: Mapping[str, NodeState] = field(default_factory=dict)  # the nodes under our pods that are not Ready
    # A multi-node group with a member on a node not Ready this long is restarted (--node-not-ready-seconds).
    node_grace_s: float = 60.0
    now: datetime.datetime | None = None

    @property
    def existing(self) -> int:
        """Groups with at least one pod, surge groups left out."""
        return sum(1 for i in self.groups if i < self.desired or i >= self.desired + self.surge)

    def current(self) -> list[Group]:
        """The wanted groups, ordinals [0, desired), in order."""
        return [g for i, g in sorted(self.groups.items()) if i < self.desired]

    def surge_groups(self) -> list[Group]:
        """Groups beyond the wanted count: a rollout's surge, or what a scale-down leaves until it goes."""
        return [g for i, g in sorted(self.groups.items()) if i >= self.desired]

    @property
    def ready_replicas(self) -> int:
        return sum(1 for g in self.current() if g.ready(self.pipeline))

    @property
    def updated_replicas(self) -> int:
        return sum(1 for g in self.current() if g.complete(self.pipeline) and g.updated(self.revisions))

    def problems(self) -> list[str]:
        found = []
        for group in self.current():
            for stage in sorted(group.pods):
                problem = pod_problem(group.pods[stage])
                if problem:
                    found.append(problem)
        return found

    def unschedulable(self) -> list[dict[str, Any]]:
        """Pods of the wanted groups that the scheduler could not place."""
        return [pod for group in self.current() for _, pod in sorted(group.pods.items()) if pod_unschedulable(pod)]

    def groups_to_restart(self) -> dict[int, str]:
        """Broken multi-node groups (see Group.broken and `_stranded_for`), by index, with the reason."""
        found = {}
        for group in self.current():
            reason = group.broken(self.pipeline) or self._node_lost(group)
            if reason:
                found[group.index] = reason
        return found

    def _stranded_for(self, group: Group) -> list[tuple[int, dict[str, Any], NodeState, float]]:
        """(stage, pod, node, seconds the node has been seen not Ready) of a multi-node group's members.

        A pipeline stage on a node that stopped being Ready holds the whole
        group: its peers cannot reach it, and its pod cannot be evicted before
        the taint manager's toleration (300 s by default) runs out. After
        `node_grace_s`, so that a node's blip costs no model load, the group
        is restarted: the scheduler places the new pods on Ready nodes. A
        deleted node is not waited for. A group already going away, and a
        single-node engine (Kubernetes' eviction moves it), are left alone."""
        if self.pipeline < 2 or group.terminating() or self.now is None:
            return []
        now = self.now
        return [(stage, pod, node, max(0.0, (now - (parse_time(node.since) or now)).total_seconds()))
                for stage, pod, node in group.stranded()]

    def _node_lost(self, group: Group) -> str | None:
        for stage, pod, node, waited in self._stranded_for(group):
            if node.gone:
                return f"stage {stage} pod {pod['metadata']['name']}: {node.detail}"
            if waited >= self.node_grace_s:
                return (f"stage {stage} pod {pod['metadata']['name']}: {node.detail}, longer than the "
                        f"{self.node_grace_s:g} s the operator waits for it (--node-not-ready-seconds)")
        return None

    def node_wait(self) -> float | None:
        """Seconds until a multi-node group's member has been on a not-Ready node for `node_grace_s`, or None."""
        left = [self.node_grace_s - waited for group in self.current()
                for _, _, node, waited in self._stranded_for(group) if not node.gone and waited < self.node_grace_s]
        return max(0.5, min(left)) if left else None

    def orphans(self) -> list[tuple[int, dict[str, Any], NodeState]]:
        """(group, pod, node) of every pod, surge groups' included, on a node that was deleted and that is not
        already being deleted with no grace period.

        No kubelet will ever stop such a pod or report it, so its graceful
        deletion would never end, and its StatefulSet cannot make it anew
        before the pod garbage collector force-deletes it, 40 s after it
        noticed the node gone (a quarantine against its own cache lagging a
        node just registered). The operator saw the deletion in its own watch."""
        return [(group.index, pod, node) for group in self.groups.values() for _, pod in sorted(group.pods.items())
                if (node := group.nodes.get(pod.get("spec", {}).get("nodeName") or "")) is not None and node.gone
                and pod.get("metadata", {}).get("deletionGracePeriodSeconds") != 0]


def observe(pipeline: int, desired: int, pods: list[dict[str, Any]], statefulsets: dict[int, dict[str, Any]],
            router: dict[str, Any] | None, *, surge: int = 0, nodes: Mapping[str, NodeState] | None = None,
            node_grace_s: float = 60.0, now: datetime.datetime | None = None) -> Observation:
    groups: dict[int, Group] = {}
    nodes = nodes or {}
    for pod in pods:
        stage, index = pod_stage(pod), pod_group(pod)
        if stage is None or index is None or stage >= pipeline:
            continue
        groups.setdefault(index, Group(index, nodes=nodes)).pods[stage] = pod
    revisions = {stage: (sts.get("status") or {}).get("updateRevision") for stage, sts in statefulsets.items()}
    pending = any(_status_behind(sts) for sts in statefulsets.values())
    available = int(((router or {}).get("status") or {}).get("availableReplicas") or 0)
    return Observation(pipeline=pipeline, desired=desired, groups=groups, revisions=revisions,
                       router_available=available, surge=surge, revisions_pending=pending, nodes=nodes,
                       node_grace_s=node_grace_s, now=now)



def _status_behind(obj: dict[str, Any]) -> bool:
    """Whether OBJ's controller has yet to observe its latest spec (status.observedGeneration < generation)."""
    generation = (obj.get("metadata") or {}).get("generation")
    observed = (obj.get("status") or {}).get("observedGeneration")
    return isinstance(generation, int) and isinstance(observed, int) and observed < generation
