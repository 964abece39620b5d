"""Zero-downtime rollouts: a replacement group is surged before an old one goes (the emulated API server).

Before: a spec change on a one-replica service deleted its only pod before the
successor had loaded (StatefulSet RollingUpdate), an outage as long as the
model load. The in-place behaviour is still there as `rollout.strategy:
Replace` (test_operator.py's rollout tests pin it).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import ReadyGate, existing, existing_isvc, rollout_completed, sim_doc

from tensorfleet.testing.operator_harness import Cluster, cluster, running_operator
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio
STS = ("apps/v1", "statefulsets")


def _pods(c: Cluster) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in c.all("v1", "pods", "default")
            if p["metadata"]["name"].startswith("demo-stage-")}


def _ready(pod: dict[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _ready_groups(c: Cluster, pipeline: int) -> int:
    pods = _pods(c)
    indexes = {int(n.rsplit("-", 1)[1]) for n in pods}
    return sum(1 for i in indexes if all(_ready(pods.get(f"demo-stage-{k}-{i}", {"metadata": {}, "status": {}}))
                                         for k in range(pipeline)))


def _progressing(c: Cluster) -> dict[str, Any]:
    return c.condition("demo", "Progressing") or {}


async def _settled(c: Cluster) -> None:
    def done() -> bool:
        isvc = c.isvc("demo") or {}
        return _progressing(c).get("status") == "False" and \
            isvc.get("status", {}).get("observedGeneration") == isvc.get("metadata", {}).get("generation")
    await eventually(done, message="converged")


async def _watch_capacity(c: Cluster, pipeline: int, wanted: int, until: Any, gate: ReadyGate) -> list[int]:
    """Drive a rollout by opening each new pod's gate one group at a time, sampling ready groups throughout."""
    samples: list[int] = []
    for _ in range(400):  # bounded: at most 20 s of 50 ms steps
        samples.append(_ready_groups(c, pipeline))
        if until():
            return samples
        pods = _pods(c)
        closed = sorted(n for n, p in pods.items() if p["metadata"]["uid"] not in gate.opened
                        and not p["metadata"].get("deletionTimestamp"))
        if closed:  # the next group to load: open all of its stages together
            index = closed[0].rsplit("-", 1)[1]
            for name in closed:
                if name.endswith(f"-{index}"):
                    gate.opened.add(pods[name]["metadata"]["uid"])
        await asyncio.sleep(0.05)
    raise AssertionError(f"the rollout did not finish; ready groups sampled: {samples[-20:]}")


@pytest.mark.parametrize(("pipeline", "replicas"), [(1, 1), (2, 1), (2, 2)])
async def test_a_rollout_never_drops_below_the_wanted_ready_groups(pipeline: int, replicas: int) -> None:
    gate = ReadyGate()
    async with cluster() as c, c.workloads(gate), running_operator(c):
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": pipeline}, replicas=replicas))
        await _settled(c)
        old = {n: p["metadata"]["uid"] for n, p in _pods(c).items()}
        gate.auto = False
        await c.patch("demo", {"spec": {"engine": {"image": "registry.example/sim:2"}}})
        # The surge group starts first; no old pod goes while it loads.
        await eventually(lambda: existing(c, *STS, "demo-stage-0")["spec"]["replicas"] == replicas + 1, message="surge")
        await eventually(lambda: f"demo-stage-0-{replicas}" in _pods(c), message="the surge group's pods")
        # The operator says so once it has seen the StatefulSet controller observe the new spec (until then it
        # says WaitingForStatefulSet: the pods' revisions are not yet known to be stale).
        await eventually(lambda: _progressing(c).get("reason") in ("Surging", "RollingOut"), message="Surging")
        assert {n: p["metadata"]["uid"] for n, p in _pods(c).items() if n in old} == old

        def rolled() -> bool:
            isvc = existing_isvc(c, "demo")
            return _progressing(c).get("status") == "False" and isvc["status"].get("updatedReplicas") == replicas \
                and existing(c, *STS, "demo-stage-0")["spec"]["replicas"] == replicas

        samples = await _watch_capacity(c, pipeline, replicas, rolled, gate)
        assert min(samples) >= replicas, f"ready groups fell below {replicas}: {samples}"
        assert all(uid not in old.values() for uid in (p["metadata"]["uid"] for p in _pods(c).values()))
        assert sorted(_pods(c)) == sorted(f"demo-stage-{k}-{i}" for k in range(pipeline) for i in range(replicas))
        reasons = [e["reason"] for e in c.events("demo")]
        assert reasons.count("RolloutGroupReplaced") == replicas
        # Posted after the status write that ends the rollout, and naming its generation (not the creation's).
        await eventually(lambda: rollout_completed(c), message="this rollout's RolloutComplete event")


async def _stuck_surge(c: Cluster, gate: ReadyGate, strategy: str) -> dict[str, str]:
    await c.create(sim_doc(replicas=1, rollout={"strategy": strategy}))
    await _settled(c)
    old = {n: p["metadata"]["uid"] for n, p in _pods(c).items()}
    gate.auto = False
    await c.patch("demo", {"spec": {"engine": {"image": "registry.example/sim:2"}}})
    surge = await eventually(lambda: _pods(c).get("demo-stage-0-1"), message="the surge pod")
    # No node has the GPUs: the scheduler says so on the pod.
    surge["status"]["conditions"] = [
        {"type": "Ready", "status": "False"},
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]
    await c.upsert("v1", "pods", surge)
    return old


async def test_a_surge_the_cluster_cannot_schedule_waits_and_says_why() -> None:
    gate = ReadyGate()
    async with cluster() as c, c.workloads(gate), running_operator(c) as op:
        old = await _stuck_surge(c, gate, "Surge")
        await eventually(lambda: _progressing(c).get("reason") == "SurgeUnschedulable", message="SurgeUnschedulable")
        assert "no free GPUs for a replacement group" in _progressing(c)["message"]
        assert "SurgeOrReplace" in _progressing(c)["message"]
        assert op.queue is not None, "the running operator has its work queue"
        await op.queue.wait_idle()
        assert _pods(c)["demo-stage-0-0"]["metadata"]["uid"] == old["demo-stage-0-0"], "the serving pod went"


async def test_surge_or_replace_falls_back_to_replacing_in_place() -> None:
    gate = ReadyGate()
    async with cluster() as c, c.workloads(gate), running_operator(c):
        old = await _stuck_surge(c, gate, "SurgeOrReplace")
        await eventually(lambda: (_pods(c).get("demo-stage-0-0") or {}).get("metadata", {}).get("uid")
                         not in (None, old["demo-stage-0-0"]), message="replaced in place")
        # The event follows the deletion it reports.
        await eventually(lambda: any(e["reason"] == "RolloutGroupReplaced" and "in place" in e["message"]
                                     for e in c.events("demo")), message="a RolloutGroupReplaced event")
        gate.auto = True
        for pod in _pods(c).values():
            gate.opened.add(pod["metadata"]["uid"])
        await _settled(c)
        assert sorted(_pods(c)) == ["demo-stage-0-0"]


async def test_a_surge_is_no_scale_and_a_scale_is_one_scaled_event() -> None:
    """A surge raises the StatefulSets' replicas with the wanted groups unchanged: no `Scaled` event for it."""
    from tensorfleet import contract

    gate = ReadyGate()
    async with cluster() as c, c.workloads(gate), running_operator(c) as op:
        await c.create(sim_doc(replicas=1))
        await _settled(c)
        gate.auto = False
        await c.patch("demo", {"spec": {"engine": {"image": "registry.example/sim:2"}}})
        await eventually(lambda: existing(c, *STS, "demo-stage-0")["spec"]["replicas"] == 2, message="surge")
        assert existing(c, *STS, "demo-stage-0")["metadata"]["annotations"][contract.ANNOTATION_WANTED_GROUPS] == "1"

        def rolled() -> bool:
            return _progressing(c).get("status") == "False" and existing(c, *STS, "demo-stage-0")["spec"]["replicas"] == 1

        await _watch_capacity(c, 1, 1, rolled, gate)
        assert op.queue is not None, "the running operator has its work queue"
        await op.queue.wait_idle()
        assert not [e["message"] for e in c.events("demo") if e["reason"] == "Scaled"]
        gate.auto = True
        await c.scale("demo", 2)
        await eventually(lambda: [e["message"] for e in c.events("demo") if e["reason"] == "Scaled"]
                         == ["replicas 1 -> 2"], message="one Scaled event")
        assert existing(c, *STS, "demo-stage-0")["metadata"]["annotations"][contract.ANNOTATION_WANTED_GROUPS] == "2"


async def test_an_upgrade_records_the_wanted_groups_without_a_revert_warning() -> None:
    """StatefulSets an operator without the record made get it quietly: nobody changed them outside the operator."""
    from tensorfleet import contract

    async with cluster() as c, c.workloads(), running_operator(c) as op:
        await c.create(sim_doc(replicas=2))
        await _settled(c)
        assert op.queue is not None, "the running operator has its work queue"
        await op.queue.wait_idle()
        sts = existing(c, *STS, "demo-stage-0")
        del sts["metadata"]["annotations"][contract.ANNOTATION_WANTED_GROUPS]
        await c.upsert(*STS, sts)
        await eventually(lambda: (existing(c, *STS, "demo-stage-0")["metadata"].get("annotations") or {})
                         .get(contract.ANNOTATION_WANTED_GROUPS) == "2", message="recorded again")
        await op.queue.wait_idle()
        reasons = [e["reason"] for e in c.events("demo")]
        assert "ChildReverted" not in reasons and "Scaled" not in reasons, reasons
        # A change someone else made is still reverted, and said so.
        sts = existing(c, *STS, "demo-stage-0")
        sts["spec"]["replicas"] = 5
        await c.upsert(*STS, sts)
        await eventually(lambda: "ChildReverted" in [e["reason"] for e in c.events("demo")], message="reverted")
