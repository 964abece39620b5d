"""Nodes that stop being Ready under engine pods: the diagnosis, the group's readiness, and the restart of a
multi-node group after the operator's grace (controller/nodes.py), pure and against the emulated API server."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from conftest import existing, sim_doc

from tensorfleet.controller.diagnose import (
    CRASH_LOOP,
    NODE_NOT_READY,
    READINESS_LOST,
    SEVERITY,
    UNSCHEDULABLE,
    diagnose,
    diagnose_all,
    rank,
)
from tensorfleet.controller.nodes import NotReadyNodes
from tensorfleet.controller.observe import observe
from tensorfleet.testing.operator_harness import Cluster, cluster, running_operator
from tensorfleet.testing.wait import eventually

FORMED = "2026-12-01T10:00:00Z"
SINCE = "2026-12-01T11:00:00Z"


def node(name: str, status: str | None, reason: str = "KubeletNotReady", message: str = "PLEG is not healthy"
         ) -> dict[str, Any]:
    conditions = [] if status is None else [
        {"type": "MemoryPressure", "status": "False"},
        {"type": "Ready", "status": status, "reason": reason, "message": message,
         "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "status": {"conditions": conditions}}


def pod(name: str, stage: int, group: int, on: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": "2026-12-01T09:59:00Z",
                         "labels": {"tensorfleet.dev/stage": str(stage), "apps.kubernetes.io/pod-index": str(group)}},
            "spec": {"nodeName": on},
            "status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": FORMED}]}}


def test_only_readiness_transitions_count_and_a_node_keeps_the_time_it_was_first_seen_not_ready() -> None:
    nodes = NotReadyNodes()
    assert not nodes.observed(node("gpu-1", "True"), SINCE)
    assert not nodes.observed(node("gpu-1", None), SINCE), "a node registering (no Ready yet) is not tracked"
    assert nodes.observed(node("gpu-1", "False"), SINCE)
    # The condition's lastTransitionTime is not trusted (KWOK keeps the node's creation time there).
    assert nodes.under([pod("a", 0, 0, "gpu-1")])["gpu-1"].since == SINCE
    assert not nodes.observed(node("gpu-1", "False"), "2026-12-01T11:00:30Z"), "a heartbeat changes nothing"
    assert nodes.under([pod("a", 0, 0, "gpu-1")])["gpu-1"].since == SINCE
    assert nodes.observed(node("gpu-1", "Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status."),
                          "2026-12-01T11:00:40Z"), "the node controller's verdict replaces the kubelet's"
    assert nodes.under([pod("a", 0, 0, "gpu-1")])["gpu-1"].since == SINCE
    assert nodes.under([pod("b", 0, 0, "gpu-2")]) == {}
    assert nodes.observed(node("gpu-1", "True"), "2026-12-01T11:01:00Z")
    assert nodes.under([pod("a", 0, 0, "gpu-1")]) == {}
    assert nodes.observed(node("gpu-1", "False"), "2026-12-01T11:02:00Z")
    assert nodes.observed(node("gpu-1", "False"), "2026-12-01T11:03:00Z", deleted=True)
    assert not nodes.observed(node("gpu-1", "False"), "2026-12-01T11:03:00Z", deleted=True)


def test_a_pod_on_a_node_that_is_not_ready_is_diagnosed_with_the_node_and_its_words() -> None:
    nodes = NotReadyNodes()
    nodes.observed(node("gpu-1", "False", "KubeletNotReady", "container runtime is down"), SINCE)
    found = diagnose(pod("m-stage-1-0", 1, 0, "gpu-1"), nodes.under([pod("x", 1, 0, "gpu-1")]))
    assert found is not None and found.reason == NODE_NOT_READY
    assert found.line == ("pod m-stage-1-0: NodeNotReady: node gpu-1 is not Ready (Ready=False, KubeletNotReady: "
                          f"container runtime is down) since {SINCE}")
    assert diagnose(pod("m-stage-1-0", 1, 0, "gpu-2"), nodes.under([pod("x", 1, 0, "gpu-1")])) is None
    # Right after no node at all: it is what stops the pod, before anything of its containers.
    assert [r for tied in SEVERITY for r in tied][:2] == [UNSCHEDULABLE, NODE_NOT_READY]
    assert [d.pod for d in diagnose_all([pod("ok", 0, 0, "gpu-2"), pod("stranded", 1, 0, "gpu-1")],
                                        nodes.under([pod("x", 1, 0, "gpu-1")]))] == ["stranded"]


def _observe(pipeline: int, at: str, *, terminating: bool = False, deleted: bool = False,
             graceless: bool = False) -> Any:
    """Two groups of PIPELINE stages at AT, the last stage of group 0 on node gpu-1: not Ready since SINCE, or
    DELETED then; TERMINATING: group 0's leader being deleted; GRACELESS: the pod on gpu-1 deleted with no grace."""
    nodes = NotReadyNodes()
    nodes.observed(node("gpu-1", "True" if deleted else "False"), SINCE, deleted=deleted)
    pods = [pod(f"m-stage-{s}-{g}", s, g, "gpu-1" if (s, g) == (pipeline - 1, 0) else f"gpu-{9 - s - g}")
            for g in range(2) for s in range(pipeline)]
    if terminating:
        pods[0]["metadata"]["deletionTimestamp"] = at
    if graceless:
        pods[pipeline - 1]["metadata"].update(deletionTimestamp=SINCE, deletionGracePeriodSeconds=0)
    now = datetime.datetime.fromisoformat(at)
    return observe(pipeline, 2, pods, {}, None, nodes=nodes.under(pods), node_grace_s=60, now=now)


def test_a_multi_node_group_with_a_stage_on_a_node_not_ready_is_restarted_after_the_grace_not_before() -> None:
    early = _observe(2, "2026-12-01T11:00:20Z")
    assert early.ready_replicas == 1, "the stranded group does not count as ready; the other does"
    assert early.groups_to_restart() == {}
    assert early.node_wait() == pytest.approx(40.0)
    late = _observe(2, "2026-12-01T11:01:00Z")
    assert list(late.groups_to_restart()) == [0]
    assert late.groups_to_restart()[0].startswith("stage 1 pod m-stage-1-0: node gpu-1 is not Ready")
    assert "--node-not-ready-seconds" in late.groups_to_restart()[0]
    assert late.node_wait() is None
    # A group already going away, and a single-node engine (Kubernetes' eviction moves it), are left alone.
    assert _observe(2, "2026-12-01T11:05:00Z", terminating=True).groups_to_restart() == {}
    single = _observe(1, "2026-12-01T11:05:00Z")
    assert single.groups_to_restart() == {} and single.node_wait() is None and single.ready_replicas == 1


# --- the operator, against the emulated API server -----------------------------------------------------------
async def _stranded_group(c: Cluster) -> dict[str, str]:
    """Two ready groups of pipeline 2, each pod on a node of its own; their pods' uids."""
    await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}))
    await eventually(lambda: (c.isvc("demo") or {}).get("status", {}).get("readyReplicas") == 2, message="2 groups")
    for i, name in enumerate(("demo-stage-0-0", "demo-stage-1-0", "demo-stage-0-1", "demo-stage-1-1")):
        await c.upsert("v1", "nodes", node(f"gpu-{i}", "True"))
        engine = existing(c, "v1", "pods", name)
        engine["spec"]["nodeName"] = f"gpu-{i}"
        await c.upsert("v1", "pods", engine)
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.all("v1", "pods", "default")}


@pytest.mark.asyncio
async def test_the_operator_says_which_node_and_restarts_the_stranded_group_after_the_grace() -> None:
    async with cluster() as c, c.workloads(), running_operator(c, node_not_ready_seconds=3.0):
        before = await _stranded_group(c)
        await c.upsert("v1", "nodes", node("gpu-1", "False", "KubeletNotReady", "container runtime is down"))
        degraded = await eventually(lambda: (found := c.condition("demo", "Degraded")) and found["status"] == "True"
                                    and found, message="Degraded names the node")
        assert degraded["reason"] == NODE_NOT_READY
        assert "pod demo-stage-1-0: NodeNotReady: node gpu-1 is not Ready (Ready=False, KubeletNotReady: container " \
               "runtime is down)" in degraded["message"], degraded
        ready = c.condition("demo", "Ready") or {}
        assert ready.get("status") == "True" and "1 of 2 groups ready" in ready.get("message", ""), ready
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.all("v1", "pods", "default")}
        assert uids["demo-stage-0-0"] == before["demo-stage-0-0"], "restarted before the grace ran out"
        # No watch event comes when the grace runs out: the reconcile asked to be requeued then.
        await eventually(lambda: {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.all("v1", "pods", "default")}
                         .get("demo-stage-0-0") not in (None, before["demo-stage-0-0"]), message="group 0 restarted",
                         timeout=20)
        # The event follows the deletions it reports.
        restarted = await eventually(lambda: [e["message"] for e in c.events("demo") if e["reason"] == "GroupRestarted"],
                                     message="a GroupRestarted event")
        assert any("stage 1 pod demo-stage-1-0: node gpu-1 is not Ready" in m for m in restarted), restarted
        after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.all("v1", "pods", "default")}
        assert after["demo-stage-0-1"] == before["demo-stage-0-1"], "group 1 is left alone"
        # The new pods are on no node yet: nothing is stranded, the service serves on both groups again.
        await eventually(lambda: (c.isvc("demo") or {}).get("status", {}).get("readyReplicas") == 2
                         and (c.condition("demo", "Degraded") or {}).get("status") == "False", message="recovered")


# --- nodes deleted under engine pods ---------------------------------------------------------------------------
def test_a_deleted_node_is_kept_as_gone_until_a_node_of_its_name_registers_again() -> None:
    nodes = NotReadyNodes()
    assert nodes.observed(node("gpu-1", "True"), SINCE, deleted=True), "a Ready node deleted: its pods are orphans"
    gone = nodes.under([pod("a", 0, 0, "gpu-1")])["gpu-1"]
    assert gone.gone and gone.since == SINCE and gone.detail == f"node gpu-1 was deleted (seen at {SINCE})"
    assert not nodes.observed(node("gpu-1", "True"), "2026-12-01T11:05:00Z", deleted=True)
    assert nodes.under([pod("a", 0, 0, "gpu-1")])["gpu-1"].since == SINCE, "a repeated deletion keeps the time"
    assert nodes.observed(node("gpu-1", "False"), "2026-12-01T11:06:00Z"), "registered again, not Ready yet"
    again = nodes.under([pod("a", 0, 0, "gpu-1")])["gpu-1"]
    assert not again.gone and again.since == "2026-12-01T11:06:00Z"
    assert nodes.observed(node("gpu-1", "True"), "2026-12-01T11:07:00Z") and nodes.under([pod("a", 0, 0, "gpu-1")]) == {}


def test_deleted_nodes_remembered_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tensorfleet.controller.nodes.GONE_KEPT", 3)
    nodes = NotReadyNodes()
    nodes.observed(node("sick", "False"), SINCE)
    for i in range(5):
        nodes.observed(node(f"gpu-{i}", "True"), SINCE, deleted=True)
    held = nodes.under([pod("x", 0, 0, n) for n in ("sick", *(f"gpu-{i}" for i in range(5)))])
    assert sorted(held) == ["gpu-2", "gpu-3", "gpu-4", "sick"], "a node not Ready is never forgotten for room"


def test_a_group_with_a_stage_on_a_deleted_node_is_restarted_at_once_and_that_pod_is_an_orphan() -> None:
    obs = _observe(2, SINCE, deleted=True)
    assert obs.ready_replicas == 1
    assert obs.groups_to_restart() == {0: f"stage 1 pod m-stage-1-0: node gpu-1 was deleted (seen at {SINCE})"}
    assert obs.node_wait() is None, "no grace is waited for a node that is gone"
    assert [(i, p["metadata"]["name"]) for i, p, _ in obs.orphans()] == [(0, "m-stage-1-0")]
    single = _observe(1, SINCE, deleted=True)
    assert single.groups_to_restart() == {} and single.ready_replicas == 1
    assert [(i, p["metadata"]["name"]) for i, p, _ in single.orphans()] == [(0, "m-stage-0-0")]
    assert _observe(1, SINCE, deleted=True, graceless=True).orphans() == [], "already being deleted with no grace"


# --- a leader that stops being Ready after it served -------------------------------------------------------------
def _leader_group(ready: str, changed: str, *, leader_node: str = "gpu-8", not_ready: tuple[str, ...] = ()) -> Any:
    nodes = NotReadyNodes()
    for name in not_ready:
        nodes.observed(node(name, "False"), SINCE)
    pods = [pod("m-stage-0-0", 0, 0, leader_node), pod("m-stage-1-0", 1, 0, "gpu-7")]
    pods[0]["status"]["conditions"] = [{"type": "Ready", "status": ready, "lastTransitionTime": changed}]
    pods[0]["status"]["containerStatuses"] = [
        {"name": "engine", "ready": ready == "True", "restartCount": 0,
         "state": {"running": {"startedAt": "2026-12-01T09:59:05Z"}}}]
    return observe(2, 1, pods, {}, None, nodes=nodes.under(pods), node_grace_s=60,
                   now=datetime.datetime.fromisoformat(SINCE))


def test_a_leader_whose_ready_went_false_after_it_started_breaks_its_group_and_one_still_starting_does_not() -> None:
    lost = _leader_group("False", FORMED)
    assert lost.groups_to_restart() == {0: "stage 0 pod m-stage-0-0 stopped being Ready after it had served"}
    # The kubelet writes Ready False before it starts the containers: unchanged since, the leader never served.
    assert _leader_group("False", "2026-12-01T09:59:01Z").groups_to_restart() == {}
    assert _leader_group("True", FORMED).groups_to_restart() == {}
    # On a node that is not Ready, the node's grace decides, not the pod's readiness.
    assert _leader_group("False", FORMED, leader_node="gpu-1", not_ready=("gpu-1",)).groups_to_restart() == {}


def test_a_worker_on_a_node_not_ready_is_left_to_the_node_grace_even_when_its_ready_went_false() -> None:
    nodes = NotReadyNodes()
    nodes.observed(node("gpu-1", "False"), SINCE)
    pods = [pod("m-stage-0-0", 0, 0, "gpu-8"), pod("m-stage-1-0", 1, 0, "gpu-1")]
    # The node lifecycle controller marks the pods of a node that stopped being Ready not Ready.
    pods[1]["status"]["conditions"] = [{"type": "Ready", "status": "False", "lastTransitionTime": SINCE}]
    early = observe(2, 1, pods, {}, None, nodes=nodes.under(pods), node_grace_s=60,
                    now=datetime.datetime.fromisoformat("2026-12-01T11:00:10Z"))
    assert early.groups_to_restart() == {} and early.node_wait() == pytest.approx(50.0)
    fine = observe(2, 1, pods, {}, None, now=datetime.datetime.fromisoformat("2026-12-01T11:00:10Z"))
    assert fine.groups_to_restart() == {0: "stage 1 pod m-stage-1-0 stopped being Ready"}, \
        "on a Ready node, a worker that stopped being Ready breaks its group at once"


@pytest.mark.asyncio
async def test_the_operator_deletes_at_once_an_engine_pod_whose_node_was_deleted() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        await c.create(sim_doc(replicas=1))
        await eventually(lambda: (c.isvc("demo") or {}).get("status", {}).get("readyReplicas") == 1, message="ready")
        await c.upsert("v1", "nodes", node("gpu-0", "True"))
        engine = existing(c, "v1", "pods", "demo-stage-0-0")
        engine["spec"]["nodeName"] = "gpu-0"
        await c.upsert("v1", "pods", engine)
        before = engine["metadata"]["uid"]
        await c.remove("v1", "nodes", None, "gpu-0")
        # Nothing else deletes it here (no pod garbage collector): the operator does, and the StatefulSet makes it anew.
        await eventually(lambda: (p := c.get("v1", "pods", "demo-stage-0-0")) is not None
                         and p["metadata"]["uid"] != before, message="the orphan replaced", timeout=20)
        said = [e["message"] for e in c.events("demo") if e["reason"] == "OrphanDeleted"]
        assert said and "deleted pod demo-stage-0-0 at once: node gpu-0 was deleted" in said[0], said


def test_an_engine_that_lost_readiness_after_it_served_is_diagnosed_so_and_one_still_loading_is_not() -> None:
    """A single-node engine whose GPU failed: nothing restarts it (no group), so Degraded must say why it left."""
    lost = _leader_group("False", FORMED).groups[0].pods[0]
    found = diagnose(lost)
    assert found is not None and found.reason == READINESS_LOST
    assert found.line.startswith(f"pod m-stage-0-0: ReadinessLost: not Ready since {FORMED}, after it had served")
    assert "kubectl describe pod m-stage-0-0" in found.line
    assert diagnose(_leader_group("False", "2026-12-01T09:59:01Z").groups[0].pods[0]) is None, "still loading"
    assert diagnose(_leader_group("True", FORMED).groups[0].pods[0]) is None
    # The least of the causes: anything that stops a pod before it could serve comes first.
    assert rank(READINESS_LOST) > rank(CRASH_LOOP) and rank(READINESS_LOST) == len(SEVERITY) - 1
