"""The real operator (kopf + reconciler) against the emulated API server."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from conftest import isvc_doc
from fake_workloads import FakeWorkloads
from operator_harness import cluster, eventually, running_operator
from tensorfleet import contract

pytestmark = pytest.mark.asyncio

STS = ("apps/v1", "statefulsets")


def sim_doc(name: str = "demo", **spec: Any) -> dict[str, Any]:
    base = {"engine": {"kind": "simulator"}, "parallelism": {"tensor": 1}, "accelerator": {"type": "L4"},
            "replicas": 2, "router": {"replicas": 1}}
    for key, value in spec.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return isvc_doc(base, name=name)


async def test_create_makes_every_child_owned_and_reports_status() -> None:
    async with cluster() as c, running_operator(c), FakeWorkloads(c.emulator):
        await c.create(sim_doc())
        uid = c.isvc("demo")["metadata"]["uid"]
        expected = {
            ("ServiceAccount", "demo-router"), ("Role", "demo-router"), ("RoleBinding", "demo-router"),
            ("Service", "demo-workers"), ("Service", "demo-engine"), ("Service", "demo"),
            ("PodDisruptionBudget", "demo-engine"), ("StatefulSet", "demo-stage-0"), ("Deployment", "demo-router"),
        }
        await eventually(lambda: expected <= set(c.children("demo")), message="all children")
        for (kind, name), obj in c.children("demo").items():
            refs = obj["metadata"]["ownerReferences"]
            assert refs == [{"apiVersion": contract.API_VERSION, "kind": contract.KIND, "name": "demo", "uid": uid,
                             "controller": True, "blockOwnerDeletion": True}], (kind, name)
        ready = await eventually(lambda: (c.condition("demo", "Ready") or {}).get("status") == "True", message="Ready")
        assert ready
        status = c.isvc("demo")["status"]
        assert status["readyReplicas"] == 2 and status["replicas"] == 2 and status["updatedReplicas"] == 2
        assert status["endpoint"] == "http://demo.default.svc/v1"
        assert status["selector"] == ",".join(sorted([f"{contract.LABEL_INFERENCE_SERVICE}=demo",
                                                      f"{contract.LABEL_INSTANCE}=demo", f"{contract.LABEL_STAGE}=0"]))
        assert status["plan"]["tensor"] == 1 and status["plan"]["kvCacheTokens"] > 0
        assert status["observedGeneration"] == c.isvc("demo")["metadata"]["generation"]
        assert {x["type"]: x["status"] for x in status["conditions"]} == {
            "PlanValid": "True", "Progressing": "False", "Ready": "True", "Degraded": "False"}
        meta = c.isvc("demo")["metadata"]
        leaked = [k for k in {**meta.get("annotations", {}), **{f: 1 for f in meta.get("finalizers", [])}} if "kopf" in k]
        assert not leaked, leaked


async def test_update_rolls_into_children() -> None:
    async with cluster() as c, running_operator(c), FakeWorkloads(c.emulator):
        await c.create(sim_doc())
        await eventually(lambda: c.get(*STS, "demo-stage-0"))
        await c.patch("demo", {"spec": {"engine": {"image": "registry.example/sim:2", "args": ["--foo"]},
                                        "router": {"strategy": "round-robin"}}})

        def updated() -> bool:
            sts = c.get(*STS, "demo-stage-0")
            container = sts["spec"]["template"]["spec"]["containers"][0]
            env = {e["name"]: e.get("value") for e in container["env"]}
            router = c.get("apps/v1", "deployments", "demo-router")
            args = router["spec"]["template"]["spec"]["containers"][0]["args"]
            return container["image"] == "registry.example/sim:2" and env[contract.ENV_EXTRA_ARGS] == '["--foo"]' \
                and args[args.index("--strategy") + 1] == "round-robin"

        await eventually(updated, message="children updated")


async def test_scale_subresource_drives_every_stage() -> None:
    async with cluster() as c, running_operator(c), FakeWorkloads(c.emulator):
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}))
        await eventually(lambda: c.get(*STS, "demo-stage-1"))
        scale = await c.scale("demo", 3)
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
        await eventually(lambda: all(c.get(*STS, f"demo-stage-{k}")["spec"]["replicas"] == 3 for k in (0, 1)))
        await eventually(lambda: (c.isvc("demo").get("status") or {}).get("readyReplicas") == 3)
        assert any(e["reason"] == "Scaled" for e in c.events("demo"))


async def test_hpa_owns_replicas_and_is_never_fought() -> None:
    async with cluster() as c, running_operator(c) as op, FakeWorkloads(c.emulator):
        doc = sim_doc(autoscaling={"minReplicas": 1, "maxReplicas": 5})
        del doc["spec"]["replicas"]
        await c.create(doc)
        hpa = await eventually(lambda: c.get("autoscaling/v2", "horizontalpodautoscalers", "demo"))
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "name": "demo"}
        await eventually(lambda: c.get(*STS, "demo-stage-0")["spec"]["replicas"] == 1)
        await c.scale("demo", 4)  # what the HPA controller does
        await eventually(lambda: c.get(*STS, "demo-stage-0")["spec"]["replicas"] == 4)
        op.queue.add(("default", "demo"))
        await op.queue.wait_idle()
        assert c.isvc("demo")["spec"]["replicas"] == 4
        # Removing autoscaling prunes the HPA.
        await c.patch("demo", {"spec": {"autoscaling": None}})
        await eventually(lambda: c.get("autoscaling/v2", "horizontalpodautoscalers", "demo") is None, message="HPA pruned")


def _pods(c: Any, name: str = "demo") -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in c.emulator.all("v1", "pods", "default")
            if p["metadata"]["labels"].get(contract.LABEL_INSTANCE) == name}


def _revision(pod: dict[str, Any]) -> str:
    return pod["metadata"]["labels"]["controller-revision-hash"]


class ReadyGate:
    """Pods become Ready only once the test opens them (a model load that takes a while)."""

    def __init__(self) -> None:
        self.opened: set[str] = set()
        self.auto = True

    def __call__(self, pod: dict[str, Any]) -> bool:
        if self.auto:
            self.opened.add(pod["metadata"]["uid"])
        return pod["metadata"]["uid"] in self.opened


async def _converged(c: Any, name: str = "demo") -> None:
    def done() -> bool:
        status = (c.isvc(name) or {}).get("status") or {}
        progressing = next((x for x in status.get("conditions", []) if x["type"] == "Progressing"), {})
        return progressing.get("status") == "False" and status.get("observedGeneration") == c.isvc(name)["metadata"]["generation"]
    await eventually(done, message=f"{name} converged")


async def _roll_one_group_at_a_time(c: Any, gate: ReadyGate, groups: int, stop_after: int | None = None) -> int:
    """Drive a multi-stage rollout, checking at most one group is down at any moment; returns groups rolled."""
    rolled: list[int] = []
    while len(rolled) < groups and (stop_after is None or len(rolled) < stop_after):
        def a_group_replaced() -> int | None:
            pods = _pods(c)
            sts = {k: c.get(*STS, f"demo-stage-{k}") for k in (0, 1)}
            for index in range(groups):
                if index in rolled:
                    continue
                names = [f"demo-stage-{k}-{index}" for k in (0, 1)]
                if all(n in pods and _revision(pods[n]) == sts[k]["status"]["updateRevision"] for k, n in enumerate(names)):
                    return index + 1  # +1 so group 0 is truthy
            return None
        index = await eventually(a_group_replaced, message="next group replaced") - 1
        pods = _pods(c)
        # The new group's pods load; every other group keeps serving meanwhile.
        unready_groups = {int(n.rsplit("-", 1)[1]) for n, p in pods.items()
                          if not any(x["type"] == "Ready" and x["status"] == "True" for x in p["status"]["conditions"])}
        assert unready_groups <= {index}, f"groups {unready_groups} down at once"
        # Both stages of the group were replaced together.
        assert all(_revision(pods[f"demo-stage-{k}-{index}"]) == c.get(*STS, f"demo-stage-{k}")["status"]["updateRevision"]
                   for k in (0, 1))
        for k in (0, 1):
            gate.opened.add(pods[f"demo-stage-{k}-{index}"]["metadata"]["uid"])
        rolled.append(index)
    return len(rolled)


async def test_pipeline_groups_roll_one_at_a_time() -> None:
    gate = ReadyGate()
    async with cluster() as c, running_operator(c), FakeWorkloads(c.emulator, gate):
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}, replicas=3))
        await _converged(c)
        assert c.get(*STS, "demo-stage-0")["spec"]["updateStrategy"] == {"type": "OnDelete"}
        gate.auto = False
        await c.patch("demo", {"spec": {"engine": {"image": "registry.example/sim:2"}}})
        await eventually(lambda: c.isvc("demo")["status"]["observedGeneration"] == c.isvc("demo")["metadata"]["generation"])
        assert await _roll_one_group_at_a_time(c, gate, groups=3) == 3
        await _converged(c)
        status = c.isvc("demo")["status"]
        assert status["updatedReplicas"] == 3 and status["readyReplicas"] == 3
        reasons = [e["reason"] for e in c.events("demo")]
        assert reasons.count("RolloutGroupReplaced") == 3 and "RolloutComplete" in reasons


async def test_scaling_during_a_rollout() -> None:
    gate = ReadyGate()
    async with cluster() as c, running_operator(c), FakeWorkloads(c.emulator, gate):
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}, replicas=2))
        await _converged(c)
        gate.auto = False
        await c.patch("demo", {"spec": {"engine": {"image": "registry.example/sim:2"}}})
        await _roll_one_group_at_a_time(c, gate, groups=2, stop_after=1)
        await c.scale("demo", 3)
        gate.auto = True
        await _converged(c)
        status = c.isvc("demo")["status"]
        assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (3, 3, 3)


async def test_operator_restart_mid_rollout_resumes_without_duplicates_or_orphans() -> None:
    gate = ReadyGate()
    async with cluster() as c, FakeWorkloads(c.emulator, gate):
        async with running_operator(c):
            await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}, replicas=3))
            await _converged(c)
            before = set(c.children("demo"))
            gate.auto = False
            await c.patch("demo", {"spec": {"engine": {"image": "registry.example/sim:2"}}})
            assert await _roll_one_group_at_a_time(c, gate, groups=3, stop_after=1) == 1
        # Operator gone mid-rollout; a new one takes over from what the cluster shows.
        async with running_operator(c):
            gate.auto = True
            await _converged(c)
        assert set(c.children("demo")) == before
        uid = c.isvc("demo")["metadata"]["uid"]
        for obj in [*c.children("demo").values()]:
            assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid]
        assert c.isvc("demo")["status"]["updatedReplicas"] == 3


async def test_drift_is_restored_without_waiting_for_resync() -> None:
    async with cluster() as c, running_operator(c, resync_seconds=3600), FakeWorkloads(c.emulator):
        await c.create(sim_doc())
        await _converged(c)
        await c.emulator.remove("v1", "services", "default", "demo-engine")
        restored = await eventually(lambda: c.get("v1", "services", "demo-engine"), message="service restored")
        assert restored["spec"]["clusterIP"] == "None"
        sts = c.get(*STS, "demo-stage-0")
        tampered = copy.deepcopy(sts)
        tampered["spec"]["template"]["spec"]["containers"][0]["image"] = "evil/image:latest"
        await c.emulator.upsert("apps/v1", "statefulsets", tampered)
        await eventually(lambda: c.get(*STS, "demo-stage-0")["spec"]["template"]["spec"]["containers"][0]["image"]
                         != "evil/image:latest", message="edit reverted")
        reasons = {e["reason"] for e in c.events("demo")}
        assert {"ChildRestored", "ChildReverted"} <= reasons


async def test_invalid_spec_creates_nothing_then_recovers() -> None:
    async with cluster() as c, running_operator(c), FakeWorkloads(c.emulator):
        await c.create(isvc_doc({"parallelism": {"tensor": 3}}))  # 3 does not divide 32 heads
        condition = await eventually(lambda: c.condition("demo", "PlanValid"))
        assert condition["status"] == "False" and condition["reason"] == "InvalidSpec"
        assert "spec.parallelism.tensor" in condition["message"]
        warning = await eventually(lambda: [e for e in c.events("demo") if e["reason"] == "PlanRejected"])
        assert warning[0]["type"] == "Warning"
        assert not c.children("demo") and not c.emulator.all(*STS)
        await c.patch("demo", {"spec": {"parallelism": {"tensor": 2}}})
        await eventually(lambda: (c.condition("demo", "PlanValid") or {}).get("status") == "True")
        await eventually(lambda: c.get(*STS, "demo-stage-0"))
        assert c.isvc("demo")["status"]["plan"]["tensor"] == 2


async def test_invalid_update_keeps_the_running_version() -> None:
    async with cluster() as c, running_operator(c), FakeWorkloads(c.emulator):
        await c.create(sim_doc())
        await _converged(c)
        image = c.get(*STS, "demo-stage-0")["spec"]["template"]["spec"]["containers"][0]["image"]
        await c.patch("demo", {"spec": {"engine": {"image": "x:2"}, "accelerator": {"type": "Z100"}}})
        await eventually(lambda: (c.condition("demo", "PlanValid") or {}).get("status") == "False")
        assert c.get(*STS, "demo-stage-0")["spec"]["template"]["spec"]["containers"][0]["image"] == image
        assert (c.condition("demo", "Ready") or {}).get("status") == "True"


async def test_pipeline_shrink_prunes_stages_and_deletion_takes_children() -> None:
    async with cluster() as c, running_operator(c), FakeWorkloads(c.emulator):
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 3}))
        await eventually(lambda: c.get(*STS, "demo-stage-2"))
        await c.patch("demo", {"spec": {"parallelism": {"pipeline": 1}}})
        await eventually(lambda: c.get(*STS, "demo-stage-1") is None and c.get(*STS, "demo-stage-2") is None)
        assert c.get(*STS, "demo-stage-0")["spec"]["updateStrategy"]["type"] == "RollingUpdate"
        await c.delete("demo")
        await eventually(lambda: not c.children("demo") and not _pods(c), message="children collected")
