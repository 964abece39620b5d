"""The real operator (kopf + reconciler) against the emulated API server."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from conftest import ReadyGate, existing, existing_isvc, isvc_doc, rollout_completed, sim_doc

from tensorfleet import contract
from tensorfleet.controller.observe import pod_ready
from tensorfleet.controller.operator import Operator, OperatorConfig
from tensorfleet.kube.connection import Connection
from tensorfleet.testing.kube_emulator import Faults
from tensorfleet.testing.loopback import free_port
from tensorfleet.testing.operator_harness import cluster, running_operator
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio

STS = ("apps/v1", "statefulsets")


async def test_create_makes_every_child_owned_and_reports_status() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        await c.create(sim_doc())
        uid = existing_isvc(c, "demo")["metadata"]["uid"]
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
        # Ready is True once one of the two groups is; the status settles when both are (Progressing False).
        await eventually(lambda: (c.condition("demo", "Ready") or {}).get("status") == "True", message="Ready")
        await eventually(lambda: (c.condition("demo", "Progressing") or {}).get("status") == "False", message="settled")
        status = existing_isvc(c, "demo")["status"]
        assert status["readyReplicas"] == 2 and status["replicas"] == 2 and status["updatedReplicas"] == 2
        assert status["endpoint"] == "http://demo.default.svc/v1"
        assert status["selector"] == ",".join(sorted([f"{contract.LABEL_INFERENCE_SERVICE}=demo",
                                                      f"{contract.LABEL_INSTANCE}=demo", f"{contract.LABEL_STAGE}=0"]))
        assert status["plan"]["tensor"] == 1 and status["plan"]["kvCacheTokens"] > 0
        assert status["observedGeneration"] == existing_isvc(c, "demo")["metadata"]["generation"]
        assert {x["type"]: x["status"] for x in status["conditions"]} == {
            "PlanValid": "True", "Progressing": "False", "Ready": "True", "Degraded": "False", "Reconciling": "False",
            "Stalled": "False"}
        meta = existing_isvc(c, "demo")["metadata"]
        leaked = [k for k in {**meta.get("annotations", {}), **{f: 1 for f in meta.get("finalizers", [])}} if "kopf" in k]
        assert not leaked, leaked


async def test_update_rolls_into_children() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        await c.create(sim_doc())
        await eventually(lambda: c.get(*STS, "demo-stage-0"))
        await c.patch("demo", {"spec": {"engine": {"image": "registry.example/sim:2", "args": ["--foo"]},
                                        "router": {"strategy": "round-robin"}}})

        def updated() -> bool:
            sts = existing(c, *STS, "demo-stage-0")
            container = sts["spec"]["template"]["spec"]["containers"][0]
            env = {e["name"]: e.get("value") for e in container["env"]}
            router = existing(c, "apps/v1", "deployments", "demo-router")
            args = router["spec"]["template"]["spec"]["containers"][0]["args"]
            return container["image"] == "registry.example/sim:2" and env[contract.ENV_EXTRA_ARGS] == '["--foo"]' \
                and args[args.index("--strategy") + 1] == "round-robin"

        await eventually(updated, message="children updated")


async def test_scale_subresource_drives_every_stage() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}))
        await eventually(lambda: c.get(*STS, "demo-stage-1"))
        scale = await c.scale("demo", 3)
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
        await eventually(lambda: all(existing(c, *STS, f"demo-stage-{k}")["spec"]["replicas"] == 3 for k in (0, 1)))
        await eventually(lambda: (existing_isvc(c, "demo").get("status") or {}).get("readyReplicas") == 3)
        assert any(e["reason"] == "Scaled" for e in c.events("demo"))


async def test_hpa_owns_replicas_and_is_never_fought() -> None:
    async with cluster() as c, c.workloads(), running_operator(c) as op:
        doc = sim_doc(autoscaling={"minReplicas": 2, "maxReplicas": 5})
        del doc["spec"]["replicas"]  # as a GitOps manifest under autoscaling leaves it out
        await c.create(doc)
        hpa = await eventually(lambda: c.get("autoscaling/v2", "horizontalpodautoscalers", "demo"))
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "name": "demo"}
        # The operator runs minReplicas at once rather than waiting for the HPA's first sync...
        await eventually(lambda: existing(c, *STS, "demo-stage-0")["spec"]["replicas"] == 2)
        await eventually(lambda: (existing_isvc(c, "demo").get("status") or {}).get("selector"))
        # ...and the CRD default gives /scale a replica count, so the HPA does not see "scaling disabled" (0).
        scale = await c.request("GET", f"/apis/{contract.API_VERSION}/namespaces/default/{contract.PLURAL}/demo/scale")
        assert scale["spec"]["replicas"] == 1 and scale["status"]["selector"]
        await c.scale("demo", 4)  # what the HPA controller does
        await eventually(lambda: existing(c, *STS, "demo-stage-0")["spec"]["replicas"] == 4)
        assert op.queue is not None, "the running operator has its work queue"
        op.queue.add(("default", "demo"))
        await op.queue.wait_idle()
        assert existing_isvc(c, "demo")["spec"]["replicas"] == 4
        # Removing autoscaling prunes the HPA.
        await c.patch("demo", {"spec": {"autoscaling": None}})
        await eventually(lambda: c.get("autoscaling/v2", "horizontalpodautoscalers", "demo") is None, message="HPA pruned")


def _pods(c: Any, name: str = "demo") -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in c.all("v1", "pods", "default")
            if p["metadata"]["labels"].get(contract.LABEL_INSTANCE) == name}


def _revision(pod: dict[str, Any]) -> str:
    return pod["metadata"]["labels"]["controller-revision-hash"]


async def wait_converged(c: Any, name: str = "demo") -> None:
    def done() -> bool:
        status = (c.isvc(name) or {}).get("status") or {}
        progressing: dict[str, Any] = next((x for x in status.get("conditions", []) if x["type"] == "Progressing"), {})
        return progressing.get("status") == "False" and status.get("observedGeneration") == c.isvc(name)["metadata"]["generation"]
    await eventually(done, message=f"{name} converged")


async def _new_revision(c: Any, change: dict[str, Any]) -> None:
    """Apply a spec change and wait until both stage StatefulSets carry a new update revision."""
    before = {k: c.get(*STS, f"demo-stage-{k}")["status"]["updateRevision"] for k in (0, 1)}
    await c.patch("demo", {"spec": change})
    await eventually(lambda: all(c.get(*STS, f"demo-stage-{k}")["status"]["updateRevision"] != before[k] for k in (0, 1)),
                     message="new revision")


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
    async with cluster() as c, c.workloads(gate), running_operator(c):
        # In place (the Replace strategy): at most one group down at any moment.
        # The default surges instead; see test_operator_rollout.py.
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}, replicas=3, rollout={"strategy": "Replace"}))
        await wait_converged(c)
        assert existing(c, *STS, "demo-stage-0")["spec"]["updateStrategy"] == {"type": "OnDelete"}
        gate.auto = False
        await _new_revision(c, {"engine": {"image": "registry.example/sim:2"}})
        assert await _roll_one_group_at_a_time(c, gate, groups=3) == 3
        await wait_converged(c)
        status = existing_isvc(c, "demo")["status"]
        assert status["updatedReplicas"] == 3 and status["readyReplicas"] == 3
        reasons = [e["reason"] for e in c.events("demo")]
        assert reasons.count("RolloutGroupReplaced") == 3
        await eventually(lambda: rollout_completed(c), message="this rollout's RolloutComplete event")


async def test_scaling_during_a_rollout() -> None:
    gate = ReadyGate()
    async with cluster() as c, c.workloads(gate), running_operator(c):
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}, replicas=2, rollout={"strategy": "Replace"}))
        await wait_converged(c)
        gate.auto = False
        await _new_revision(c, {"engine": {"image": "registry.example/sim:2"}})
        await _roll_one_group_at_a_time(c, gate, groups=2, stop_after=1)
        await c.scale("demo", 3)
        gate.auto = True
        await wait_converged(c)
        status = existing_isvc(c, "demo")["status"]
        assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (3, 3, 3)


async def test_operator_restart_mid_rollout_resumes_without_duplicates_or_orphans() -> None:
    gate = ReadyGate()
    async with cluster() as c, c.workloads(gate):
        async with running_operator(c):
            await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}, replicas=3,
                                   rollout={"strategy": "Replace"}))
            await wait_converged(c)
            before = set(c.children("demo"))
            gate.auto = False
            await _new_revision(c, {"engine": {"image": "registry.example/sim:2"}})
            assert await _roll_one_group_at_a_time(c, gate, groups=3, stop_after=1) == 1
        # Operator gone mid-rollout; a new one takes over from what the cluster shows.
        async with running_operator(c):
            gate.auto = True
            await wait_converged(c)
        assert set(c.children("demo")) == before
        uid = existing_isvc(c, "demo")["metadata"]["uid"]
        for obj in [*c.children("demo").values()]:
            assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid]
        assert existing_isvc(c, "demo")["status"]["updatedReplicas"] == 3


async def test_drift_is_restored_without_waiting_for_resync() -> None:
    async with cluster() as c, c.workloads(), running_operator(c, resync_seconds=3600):
        await c.create(sim_doc())
        await wait_converged(c)
        await c.remove("v1", "services", "default", "demo-engine")
        restored = await eventually(lambda: c.get("v1", "services", "demo-engine"), message="service restored")
        assert restored["spec"]["clusterIP"] == "None"
        sts = existing(c, *STS, "demo-stage-0")
        tampered = copy.deepcopy(sts)
        tampered["spec"]["template"]["spec"]["containers"][0]["image"] = "evil/image:latest"
        await c.upsert("apps/v1", "statefulsets", tampered)
        await eventually(lambda: existing(c, *STS, "demo-stage-0")["spec"]["template"]["spec"]["containers"][0]["image"]
                         != "evil/image:latest", message="edit reverted")
        # Each event is posted after the write it reports.
        await eventually(lambda: {"ChildRestored", "ChildReverted"} <= {e["reason"] for e in c.events("demo")},
                         message="ChildRestored and ChildReverted events")


async def test_invalid_spec_creates_nothing_then_recovers() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        await c.create(isvc_doc({"parallelism": {"tensor": 3}}))  # 3 does not divide 32 heads
        condition = await eventually(lambda: c.condition("demo", "PlanValid"))
        assert condition["status"] == "False" and condition["reason"] == "InvalidSpec"
        assert "spec.parallelism.tensor" in condition["message"]
        warning = await eventually(lambda: [e for e in c.events("demo") if e["reason"] == "PlanRejected"])
        assert warning[0]["type"] == "Warning"
        assert not c.children("demo") and not c.all(*STS)
        await c.patch("demo", {"spec": {"parallelism": {"tensor": 2}}})
        await eventually(lambda: (c.condition("demo", "PlanValid") or {}).get("status") == "True")
        await eventually(lambda: c.get(*STS, "demo-stage-0"))
        assert existing_isvc(c, "demo")["status"]["plan"]["tensor"] == 2


async def test_invalid_update_keeps_the_running_version() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        await c.create(sim_doc())
        await wait_converged(c)
        image = existing(c, *STS, "demo-stage-0")["spec"]["template"]["spec"]["containers"][0]["image"]
        await c.patch("demo", {"spec": {"engine": {"image": "x:2"}, "accelerator": {"type": "Z100"}}})
        await eventually(lambda: (c.condition("demo", "PlanValid") or {}).get("status") == "False")
        assert existing(c, *STS, "demo-stage-0")["spec"]["template"]["spec"]["containers"][0]["image"] == image
        assert (c.condition("demo", "Ready") or {}).get("status") == "True"


async def test_pipeline_shrink_prunes_stages_and_deletion_takes_children() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 3}))
        await eventually(lambda: c.get(*STS, "demo-stage-2"))
        await c.patch("demo", {"spec": {"parallelism": {"pipeline": 1}}})
        await eventually(lambda: c.get(*STS, "demo-stage-1") is None and c.get(*STS, "demo-stage-2") is None)
        # Every StatefulSet is OnDelete: the operator rolls stage 0 to its single-stage template itself.
        assert existing(c, *STS, "demo-stage-0")["spec"]["updateStrategy"]["type"] == "OnDelete"
        await wait_converged(c)
        revision = existing(c, *STS, "demo-stage-0")["status"]["updateRevision"]
        assert all(_revision(p) == revision for p in _pods(c).values()), "stage 0 still runs the 3-stage template"
        await c.delete("demo")
        await eventually(lambda: not c.children("demo") and not _pods(c), message="children collected")


def _desired_state(c: Any, name: str = "demo") -> dict[tuple[str, str], Any]:
    """Children without server-set fields: what must match with and without faults."""
    out = {}
    for key, obj in c.children(name).items():
        meta = {k: v for k, v in obj["metadata"].items()
                if k in ("name", "namespace", "labels", "annotations")}
        out[key] = {**{k: v for k, v in obj.items() if k not in ("metadata", "status")}, "metadata": meta}
    return out


async def _scenario(c: Any) -> None:
    """Create, update, scale, and wait for convergence."""
    await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}, autoscaling={"minReplicas": 1, "maxReplicas": 4}))
    await wait_converged(c)
    await _new_revision(c, {"engine": {"image": "registry.example/sim:2"}, "router": {"replicas": 2}})
    await c.scale("demo", 3)
    await eventually(lambda: c.isvc("demo")["status"].get("updatedReplicas") == 3
                     and c.isvc("demo")["status"]["observedGeneration"] == c.isvc("demo")["metadata"]["generation"],
                     timeout=60, message="rolled out")
    await wait_converged(c)


async def test_injected_api_faults_converge_to_the_same_state() -> None:
    async with cluster() as clean, clean.workloads(), running_operator(clean):
        await _scenario(clean)
        expected = _desired_state(clean)
        expected_status = {k: v for k, v in existing_isvc(clean, "demo")["status"].items() if k != "conditions"}
    async with cluster() as faulty, faulty.workloads(), \
            running_operator(faulty, api_timeout_seconds=1.0) as op:
        faulty.emulator.faults = Faults(rate=0.25, seed=11, hang_seconds=1.5)
        await _scenario(faulty)
        injected = dict(faulty.emulator.faults.injected)
        faulty.emulator.faults = None
        assert op.queue is not None, "the running operator has its work queue"
        op.queue.add(("default", "demo"))
        await op.queue.wait_idle()
        assert sum(injected.values()) >= 5, injected
        assert {"500", "409"} <= set(injected) and injected.keys() & {"timeout-lost", "timeout-stored"}, injected
        assert _desired_state(faulty) == expected
        assert {k: v for k, v in existing_isvc(faulty, "demo")["status"].items() if k != "conditions"} == expected_status
        pods = _pods(faulty)
        assert sorted(pods) == sorted(f"demo-stage-{k}-{i}" for k in (0, 1) for i in range(3))


async def test_a_refused_child_write_is_said_in_degraded_and_an_event_until_one_gets_through() -> None:
    """The API server refusing a child (as kube-apiserver does a Service once its ClusterIP range is full): the
    person reading the InferenceService learns which object and why, not only the operator's log."""
    async with cluster() as c, c.workloads(), running_operator(c) as op:
        c.emulator.faults = Faults(rate=1.0, kinds=("500",), plurals=frozenset({"services"}))
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 1}))
        degraded = await eventually(lambda: (found := c.condition("demo", "Degraded")) and
                                    found["reason"] == "WriteRefused" and found, message="Degraded WriteRefused")
        assert degraded["status"] == "True", degraded
        assert "Service demo-" in degraded["message"] and "500 InternalError: injected fault" in degraded["message"]
        warning = await eventually(lambda: [e for e in c.events("demo") if e["reason"] == "WriteRefused"])
        assert warning[0]["type"] == "Warning" and warning[0]["message"] == degraded["message"], warning
        c.emulator.faults = None
        assert op.queue is not None, "the running operator has its work queue"
        op.queue.add(("default", "demo"))   # rather than wait out the retry's backoff
        await wait_converged(c)
        assert (c.condition("demo", "Degraded") or {}).get("reason") != "WriteRefused"


async def test_no_writes_and_no_lists_when_nothing_changes() -> None:
    async with cluster() as c, c.workloads(), running_operator(c) as op:
        await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}))
        await wait_converged(c)
        assert op.queue is not None, "the running operator has its work queue"
        await op.queue.wait_idle()
        writes = sum(op.kube.writes.values())
        before = len(c.requests())
        for _ in range(5):
            op.queue.add(("default", "demo"))
            await op.queue.wait_idle()
        assert sum(op.kube.writes.values()) == writes, op.kube.writes
        # Children and pods come from the watch-fed cache: the only reads are GETs of the InferenceService.
        calls = [(_verb(r), r.resource.plural if r.resource else r.url.path) for r in c.requests()[before:]
                 if r.headers.get("User-Agent", "").startswith(contract.OPERATOR_COMPONENT)]
        assert calls == [("get", contract.PLURAL)] * 5, calls
        # The watches on children and pods are filtered by the API server, not after the fact.
        watches = [r for r in c.requests() if r.params.get("watch") == "true" and r.resource
                   and r.resource.plural in ("pods", "statefulsets")]
        assert watches and all(r.params.get("labelSelector") == f"{contract.LABEL_MANAGED_BY}={contract.APP_NAME}"
                               for r in watches)


async def test_two_replicas_elect_one_leader_and_fail_over() -> None:
    async with cluster() as c, c.workloads():
        def replica(identity: str) -> Operator:
            config = OperatorConfig(leader_election=True, lease_namespace="default", lease_name="tf", identity=identity,
                                    lease_duration_seconds=3, lease_renew_seconds=0.2, health_port=None,
                                    child_debounce_seconds=0.05)
            return Operator(config, Connection(server=c.url))

        replicas = [replica("a"), replica("b")]
        # Both start together, as two pods of one Deployment do.
        tasks = [asyncio.create_task(r.run()) for r in replicas]
        try:
            await eventually(lambda: any(r.leading for r in replicas), message="a leader")
            leader, standby = sorted(replicas, key=lambda r: not r.leading)
            await c.create(sim_doc())
            await eventually(lambda: c.get(*STS, "demo-stage-0"))
            assert not standby.leading
            assert {k: n for k, n in standby.kube.writes.items() if k[1] != "Lease"} == {}, "the standby reconciled"
            lease = existing(c, "coordination.k8s.io/v1", "leases", "tf")["spec"]
            assert lease["holderIdentity"] == leader.config.identity
            # The leader stops (rollout, node drain): it releases the lease and the standby takes over.
            leader.stop()
            await tasks[replicas.index(leader)]
            await eventually(lambda: standby.leading, timeout=10, message="standby took over")
            await c.remove("v1", "services", "default", "demo-engine")
            await eventually(lambda: c.get("v1", "services", "demo-engine"), message="restored by the new leader")
            assert existing(c, "coordination.k8s.io/v1", "leases", "tf")["spec"]["holderIdentity"] == standby.config.identity
        finally:
            for r in replicas:
                r.stop()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)



async def test_admission_webhook_rejects_what_the_planner_rejects() -> None:
    import aiohttp

    from tensorfleet.controller.webhook import WebhookConfig

    port = free_port()
    webhook = WebhookConfig(addr="127.0.0.1", port=port, insecure=True)
    async with cluster() as c, running_operator(c, webhook=webhook):
        async def review(document: dict[str, Any]) -> dict[str, Any]:
            body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                "uid": "0f6c", "operation": "CREATE", "object": document, "userInfo": {"username": "alice"},
                "kind": {"group": contract.GROUP, "version": contract.VERSION, "kind": contract.KIND},
                "resource": {"group": contract.GROUP, "version": contract.VERSION, "resource": contract.PLURAL},
                "name": document["metadata"]["name"], "namespace": "default"}}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"http://127.0.0.1:{port}/spec", json=body) as response,
            ):
                assert response.status == 200
                return (await response.json())["response"]

        async def listening() -> bool:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return True
            except OSError:
                return False

        for _ in range(200):  # the webhook server starts with the operator
            if await listening():
                break
            await asyncio.sleep(0.05)
        good = await review(sim_doc())
        assert good["allowed"] is True and good["uid"] == "0f6c"
        bad = await review(isvc_doc({"parallelism": {"tensor": 16}}))
        assert bad["allowed"] is False
        assert bad["status"]["code"] == 422
        assert bad["status"]["message"].startswith("spec.parallelism.tensor: 16 exceeds the 8 GPUs")


def _verb(request: Any) -> str:
    method = str(request.method.value).upper()
    if method == "GET":
        return "watch" if request.params.get("watch") == "true" else ("get" if request.name else "list")
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]


async def test_every_api_call_is_covered_by_the_rbac_rules() -> None:
    """The RBAC table in kube/resources.py against what the running operator actually calls."""
    from tensorfleet.kube.resources import rbac_rules

    allowed = {(group, resource, verb) for rule in rbac_rules()
               for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}
    gate = ReadyGate()
    async with cluster() as c, c.workloads(gate):
        async with running_operator(c, leader_election=True, lease_namespace="default", lease_renew_seconds=0.2):
            await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2},
                                   autoscaling={"minReplicas": 1, "maxReplicas": 3}))
            await wait_converged(c)
            gate.auto = False
            await _new_revision(c, {"engine": {"image": "registry.example/sim:2"}})
            gate.auto = True
            await c.patch("demo", {"spec": {"cache": {"size": "10Gi"}}})  # immutable: recreate the StatefulSets
            await eventually(lambda: any(e["reason"] == "StatefulSetRecreated" for e in c.events("demo")))
            await c.patch("demo", {"spec": {"autoscaling": None, "replicas": 1, "parallelism": {"pipeline": 1}}})
            await eventually(lambda: c.get(*STS, "demo-stage-1") is None)
            await c.patch("demo", {"spec": {"accelerator": {"type": "Z100"}}})  # rejected: a Warning event
            await eventually(lambda: (c.condition("demo", "PlanValid") or {}).get("status") == "False")
        requests = c.requests()
    used = set()
    for request in requests:
        agent = request.headers.get("User-Agent", "")
        if request.resource is None or request.resource.plural is None \
                or not agent.startswith(("tensorfleet-operator", "kopf")):
            continue
        plural = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        used.add((request.resource.group, plural, _verb(request)))
    assert used, "no API calls recorded"
    missing = sorted(u for u in used if u not in allowed)
    assert not missing, f"API calls the RBAC rules do not allow: {missing}"


async def test_changing_an_immutable_statefulset_field_keeps_pods_serving() -> None:
    from prometheus_client import REGISTRY

    def failed() -> float:
        return REGISTRY.get_sample_value("tensorfleet_reconciles_total", {"result": "error"}) or 0.0

    failed_before = failed()
    gate = ReadyGate()
    async with cluster() as c, c.workloads(gate), running_operator(c):
        await c.create(sim_doc(replicas=2))
        await wait_converged(c)
        old_sts = existing(c, *STS, "demo-stage-0")
        old_pods = {n: p["metadata"]["uid"] for n, p in _pods(c).items()}
        # Pods made from now on never turn Ready, so the rollout that follows the recreation (a surge ordinal
        # first) cannot replace an adopted pod before the test looks: what is checked is the adoption, not a race.
        gate.auto = False
        await c.patch("demo", {"spec": {"cache": {"size": "100Gi"}}})
        sts = await eventually(lambda: (s := c.get(*STS, "demo-stage-0")) and s.get("spec", {}).get("volumeClaimTemplates")
                               and s, message="recreated with a claim template")
        assert sts["metadata"]["uid"] != old_sts["metadata"]["uid"]
        assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "100Gi"
        # The event is posted after the new StatefulSet is created.
        await eventually(lambda: any(e["reason"] == "StatefulSetRecreated" for e in c.events("demo")),
                         message="a StatefulSetRecreated event")
        # The orphaned pods were adopted by the new StatefulSet, not deleted with the old one (the same pods, by
        # uid, still serving); any other pod is the rollout's surge, beyond the wanted ordinals.
        adopted = await eventually(lambda: all([r["uid"] for r in p["metadata"].get("ownerReferences") or []]
                                               == [sts["metadata"]["uid"]] for p in _pods(c).values()) and _pods(c))
        assert {n: adopted[n]["metadata"]["uid"] for n in old_pods if n in adopted} == old_pods
        assert all(pod_ready(adopted[n]) for n in old_pods)
        assert all(int(n.rsplit("-", 1)[1]) >= 2 for n in set(adopted) - set(old_pods))
        # The re-apply waited for the garbage collector instead of failing on the terminating StatefulSet.
        assert failed() == failed_before


async def test_a_standby_replica_serves_the_webhook_and_is_ready() -> None:
    """Only the leader reconciles, but validation is stateless: every replica answers it."""
    import aiohttp

    from tensorfleet.controller.webhook import WebhookConfig

    port = free_port()
    async with cluster() as c:
        far_future = "2999-01-01T00:00:00.000000Z"
        await c.upsert("coordination.k8s.io/v1", "leases", {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "tensorfleet-operator", "namespace": "default"},
            "spec": {"holderIdentity": "someone-else", "leaseDurationSeconds": 15, "renewTime": far_future}})
        config = OperatorConfig(leader_election=True, lease_namespace="default", identity="standby", health_port=None,
                                webhook=WebhookConfig(addr="127.0.0.1", port=port, insecure=True))
        standby = Operator(config, Connection(server=c.url))
        task = asyncio.create_task(standby.run())
        try:
            body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                "uid": "1", "operation": "CREATE", "object": isvc_doc({"accelerator": {"type": "B100"}})}}
            answer = None
            for _ in range(200):
                try:
                    async with (
                        aiohttp.ClientSession() as session,
                        session.post(f"http://127.0.0.1:{port}/spec", json=body) as response,
                    ):
                        answer = (await response.json())["response"]
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            assert answer is not None and answer["allowed"] is False
            assert answer["status"]["message"].startswith("spec.accelerator.type: unknown GPU type 'B100'")
            assert not standby.leading
        finally:
            standby.stop()
            await asyncio.wait_for(task, 30)
