"""The operator never takes over, borrows or deletes what it did not create (the emulated API server).

The same findings run against the real API server in e2e/test_ownership.py;
these are the fast versions, with the operator's own API calls inspected.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import existing, existing_isvc, present, sim_doc

from tensorfleet import contract
from tensorfleet.controller.webhook import review
from tensorfleet.testing.kube_emulator import rfc3339_now
from tensorfleet.testing.operator_harness import Cluster, cluster, running_operator
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio


def foreign_service(name: str) -> dict[str, Any]:
    """A Service someone else made: their selector and port, no owner."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default", "labels": {"team": "other"}},
            "spec": {"selector": {"app": "theirs"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}


def degraded(c: Cluster, name: str = "demo") -> dict[str, Any] | None:
    condition = c.condition(name, "Degraded")
    return condition if condition and condition["reason"] == "ChildConflict" else None


def operator_writes_to(c: Cluster, plural: str, name: str) -> list[str]:
    return [f"{r.method.value} {r.url.path}" for r in c.requests()
            if r.headers.get("User-Agent", "").startswith(contract.OPERATOR_COMPONENT)
            and str(r.method.value).upper() in ("POST", "PATCH", "PUT", "DELETE")
            and r.resource is not None and r.resource.plural == plural and r.name == name]


async def test_a_foreign_service_is_neither_rewritten_nor_collected() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        theirs = await c.upsert("v1", "services", foreign_service("demo-engine"))
        await c.create(sim_doc())
        condition = await eventually(lambda: degraded(c), message="Degraded=ChildConflict")
        assert "Service demo-engine already exists" in condition["message"]
        assert "not created by this InferenceService" in condition["message"]
        assert any(e["reason"] == "ChildConflict" and e["type"] == "Warning" for e in c.events("demo"))
        # Everything else is served: the children whose names are free exist.
        await eventually(lambda: c.get("apps/v1", "deployments", "demo-router"), message="router Deployment")
        await eventually(lambda: c.get("apps/v1", "statefulsets", "demo-stage-0"), message="StatefulSet")
        live = existing(c, "v1", "services", "demo-engine")
        assert live["spec"] == theirs["spec"] and live["metadata"]["labels"] == {"team": "other"}
        assert not live["metadata"].get("ownerReferences")
        assert operator_writes_to(c, "services", "demo-engine") == []
        # Deleting the InferenceService collects its own children only.
        await c.delete("demo")
        await eventually(lambda: c.get("apps/v1", "statefulsets", "demo-stage-0") is None, message="GC")
        assert c.get("v1", "services", "demo-engine") is not None
        # The name freed, the next InferenceService of that name gets the whole set.
        await c.remove("v1", "services", "default", "demo-engine")
        await c.create(sim_doc())
        await eventually(lambda: (c.get("v1", "services", "demo-engine") or {}).get("metadata", {})
                         .get("ownerReferences"), message="the engine Service, ours this time")
        await eventually(lambda: (c.condition("demo", "Degraded") or {}).get("reason") == "AsExpected",
                         message="Degraded back to AsExpected")


async def test_a_manifest_cannot_borrow_an_existing_service_account() -> None:
    """A ServiceAccount NAME-router that exists (bound to anything) is never run as, nor bound to our Role."""
    async with cluster() as c, c.workloads(), running_operator(c):
        await c.upsert("v1", "serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                 "metadata": {"name": "demo-router", "namespace": "default"}})
        await c.create(sim_doc(router={"image": "registry.example/attacker:1"}))
        condition = await eventually(lambda: degraded(c), message="Degraded=ChildConflict")
        assert "ServiceAccount demo-router already exists" in condition["message"]
        await eventually(lambda: c.get("apps/v1", "statefulsets", "demo-stage-0"), message="engines still served")
        await asyncio.sleep(0.5)  # let any (wrong) write land
        assert c.get("apps/v1", "deployments", "demo-router") is None, "the router would run as the foreign account"
        assert c.get("rbac.authorization.k8s.io/v1", "rolebindings", "demo-router") is None
        assert operator_writes_to(c, "serviceaccounts", "demo-router") == []
        assert operator_writes_to(c, "deployments", "demo-router") == []


async def test_a_foreign_statefulset_leaves_a_status_that_says_so() -> None:
    async with cluster() as c, running_operator(c):
        await c.upsert("apps/v1", "statefulsets", {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "demo-stage-0", "namespace": "default"},
            "spec": {"serviceName": "x", "replicas": 1, "selector": {"matchLabels": {"app": "x"}},
                     "template": {"metadata": {"labels": {"app": "x"}},
                                  "spec": {"containers": [{"name": "x", "image": "x"}]}}}})
        await c.create(sim_doc())
        condition = await eventually(lambda: degraded(c), message="Degraded=ChildConflict")
        assert "StatefulSet demo-stage-0" in condition["message"]
        status = existing_isvc(c, "demo")["status"]
        assert status["observedGeneration"] == 1 and status["plan"]
        assert existing(c, "apps/v1", "statefulsets", "demo-stage-0")["spec"]["serviceName"] == "x"


async def test_two_inference_services_whose_children_collide_do_not_fight() -> None:
    """`demo`'s engine Service is `demo-engine`'s router Service: the first owner keeps it, nothing flaps."""
    async with cluster() as c, c.workloads(), running_operator(c) as op:
        await c.create(sim_doc("demo"))
        await eventually(lambda: c.get("v1", "services", "demo-engine"), message="demo's engine Service")
        await c.create(sim_doc("demo-engine"))
        condition = await eventually(lambda: degraded(c, "demo-engine"), message="the second one reports")
        assert "Service demo-engine already exists" in condition["message"]
        assert "InferenceService demo" in condition["message"]
        assert op.queue is not None, "the running operator has its work queue"
        await op.queue.wait_idle()
        before = len(operator_writes_to(c, "services", "demo-engine"))
        for _ in range(3):  # resyncs
            op.queue.add(("default", "demo"))
            op.queue.add(("default", "demo-engine"))
            await op.queue.wait_idle()
        assert len(operator_writes_to(c, "services", "demo-engine")) == before
        owner = existing(c, "v1", "services", "demo-engine")["metadata"]["ownerReferences"][0]
        assert owner["name"] == "demo"
        assert existing(c, "v1", "services", "demo-engine")["spec"]["selector"][contract.LABEL_INSTANCE] == "demo"


async def test_the_webhook_refuses_a_name_whose_children_collide() -> None:
    async with cluster() as c, running_operator(c):
        await c.create(sim_doc("llama"))

        async def lookup(namespace: str, name: str) -> dict[str, Any] | None:
            return c.isvc(name, namespace)

        def request(document: dict[str, Any]) -> dict[str, Any]:
            return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                    "request": {"uid": "1", "operation": "CREATE", "namespace": "default", "object": document}}

        for name in ("llama-engine", "llama-workers"):  # their router Service is llama's engine / workers Service
            answer = (await review(request(sim_doc(name)), lookup=lookup))["response"]
            assert answer["allowed"] is False, name
            assert answer["status"]["message"].startswith(f"metadata.name: {name} would share the Service {name} "
                                                          "with InferenceService llama"), answer
        await c.create(sim_doc("big-engine"))
        answer = (await review(request(sim_doc("big")), lookup=lookup))["response"]  # the other direction
        assert answer["allowed"] is False and "Service big-engine" in answer["status"]["message"]
        assert (await review(request(sim_doc("llama-2")), lookup=lookup))["response"]["allowed"] is True


async def test_images_from_registries_the_policy_does_not_allow_are_refused() -> None:
    from tensorfleet.controller.policy import image_allowed

    allowed = ("registry.example.com", "nvcr.io/nvidia")
    assert image_allowed("registry.example.com/vllm/vllm-openai:v0.19.1", allowed)
    assert image_allowed("nvcr.io/nvidia/tritonserver:25.01", allowed)
    assert not image_allowed("nvcr.io/nvidia-evil/x:1", allowed)
    assert not image_allowed("registry.example.com.evil.io/x:1", allowed)
    assert not image_allowed("vllm/vllm-openai:v0.19.1", allowed)  # docker.io
    assert image_allowed("vllm/vllm-openai:v0.19.1", ("docker.io/vllm",))
    assert image_allowed("anything", ())

    request = {"request": {"uid": "1", "operation": "CREATE", "namespace": "default",
                           "object": sim_doc(router={"image": "ghcr.io/attacker/router:1"})}}
    answer = (await review(request, allowed_registries=allowed))["response"]
    assert answer["allowed"] is False
    assert answer["status"]["message"].startswith("spec.router.image: ghcr.io/attacker/router:1 is not from an "
                                                  "allowed registry")
    # Admitted before the policy: the reconciler refuses it too, and deploys nothing.
    async with cluster() as c, running_operator(c, allowed_registries=allowed):
        await c.create(sim_doc(engine={"image": "ghcr.io/attacker/engine:1"}))
        await eventually(lambda: (c.condition("demo", "PlanValid") or {}).get("status") == "False",
                         message="PlanValid=False")
        assert present(c.condition("demo", "PlanValid"), "the PlanValid condition")["message"].startswith(
            "spec.engine.image: ghcr.io/attacker/engine:1")
        assert c.children("demo") == {}


# --- multi-node groups restart as a whole ---------------------------------------------------------
def _pod_uids(c: Cluster, name: str = "demo") -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.all("v1", "pods", "default")
            if p["metadata"]["name"].startswith(f"{name}-stage-")}


async def _two_ready_groups(c: Cluster) -> dict[str, str]:
    await c.create(sim_doc(parallelism={"tensor": 1, "pipeline": 2}))
    await eventually(lambda: (c.isvc("demo") or {}).get("status", {}).get("readyReplicas") == 2, message="2 groups")
    return _pod_uids(c)


async def test_a_group_whose_worker_process_died_restarts_as_a_whole() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        before = await _two_ready_groups(c)
        worker = existing(c, "v1", "pods", "demo-stage-1-0")
        worker["status"]["containerStatuses"] = [{"name": "engine", "restartCount": 1, "ready": True,
                                                  "state": {"running": {}}}]
        await c.upsert("v1", "pods", worker)
        await eventually(lambda: _pod_uids(c).get("demo-stage-0-0") not in (None, before["demo-stage-0-0"]),
                         message="the leader of group 0 replaced")
        await eventually(lambda: _pod_uids(c).get("demo-stage-1-0") not in (None, before["demo-stage-1-0"]),
                         message="the worker of group 0 replaced")
        after = _pod_uids(c)
        assert after["demo-stage-0-1"] == before["demo-stage-0-1"] and after["demo-stage-1-1"] == before["demo-stage-1-1"]
        # The event follows the deletions it reports.
        restarted = await eventually(lambda: [e for e in c.events("demo") if e["reason"] == "GroupRestarted"],
                                     message="a GroupRestarted event")
        assert "restarted (restartCount 1)" in restarted[0]["message"], restarted
        await eventually(lambda: existing_isvc(c, "demo")["status"]["readyReplicas"] == 2, message="serving again")


async def test_a_group_whose_worker_was_replaced_restarts_as_a_whole() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        before = await _two_ready_groups(c)
        await asyncio.sleep(1.1)  # timestamps have whole seconds: the replacement must be visibly later
        await c.remove("v1", "pods", "default", "demo-stage-1-1")  # evicted; its StatefulSet makes a new one
        await eventually(lambda: _pod_uids(c).get("demo-stage-0-1") not in (None, before["demo-stage-0-1"]),
                         message="the leader of group 1 replaced")
        assert _pod_uids(c)["demo-stage-0-0"] == before["demo-stage-0-0"]
        await eventually(lambda: any(e["reason"] == "GroupRestarted" and "was replaced after the group formed"
                                     in e["message"] for e in c.events("demo")), message="a GroupRestarted event")


async def test_a_group_whose_worker_is_being_deleted_restarts_at_once() -> None:
    """A worker stopping (evicted, drained, its node gone) while its leader serves: the group restarts now. A
    stopping worker waits for its leader to stop, so waiting for its replacement would take its grace period."""
    async with cluster() as c, c.workloads(), running_operator(c):
        before = await _two_ready_groups(c)
        await asyncio.sleep(1.1)  # timestamps have whole seconds: the deletion must be visibly later than the group
        worker = existing(c, "v1", "pods", "demo-stage-1-0")
        worker["metadata"].update(deletionTimestamp=rfc3339_now(), deletionGracePeriodSeconds=120)
        await c.upsert("v1", "pods", worker)
        await eventually(lambda: _pod_uids(c).get("demo-stage-0-0") not in (None, before["demo-stage-0-0"]),
                         message="the leader of group 0 replaced")
        assert _pod_uids(c)["demo-stage-0-1"] == before["demo-stage-0-1"], "group 1 is left alone"
        restarted = await eventually(lambda: [e for e in c.events("demo") if e["reason"] == "GroupRestarted"],
                                     message="a GroupRestarted event")
        assert "pod demo-stage-1-0 is being deleted" in restarted[0]["message"], restarted


async def test_the_stand_in_kubelet_readies_a_leader_only_after_its_workers() -> None:
    """The emulator's kubelet must not let a leader serve before its workers exist, as a vLLM leader cannot (it
    waits for every stage in its Ray cluster): a worker created after its leader turned Ready reads as a
    replacement, and the operator would restart a group that only started."""
    from tensorfleet.api import load_inference_service
    from tensorfleet.planner import make_plan
    from tensorfleet.render import render

    isvc = load_inference_service(sim_doc(parallelism={"tensor": 1, "pipeline": 2}, replicas=1))
    stages = {obj["metadata"]["name"]: obj for obj in render(isvc, make_plan(isvc.spec), namespace="default")
              if obj["kind"] == "StatefulSet"}
    async with cluster() as c, c.workloads():
        await c.upsert("apps/v1", "statefulsets", stages["demo-stage-0"])
        await eventually(lambda: c.get("v1", "pods", "demo-stage-0-0"), message="the leader pod")
        await asyncio.sleep(0.5)   # ten syncs of the stand-in: a worker-less leader stays unready
        assert not _is_ready(existing(c, "v1", "pods", "demo-stage-0-0"))
        await c.upsert("apps/v1", "statefulsets", stages["demo-stage-1"])
        await eventually(lambda: _is_ready(c.get("v1", "pods", "demo-stage-0-0") or {}), message="the leader Ready")
        assert _is_ready(existing(c, "v1", "pods", "demo-stage-1-0"))


def _is_ready(pod: dict[str, Any]) -> bool:
    return any(x["type"] == "Ready" and x["status"] == "True" for x in pod.get("status", {}).get("conditions") or [])


async def test_groups_that_start_normally_are_never_restarted() -> None:
    async with cluster() as c, c.workloads(), running_operator(c) as op:
        await _two_ready_groups(c)
        assert op.queue is not None, "the running operator has its work queue"
        await op.queue.wait_idle()
        assert not [e for e in c.events("demo") if e["reason"] == "GroupRestarted"]


async def test_node_affinity_none_is_accepted_with_a_warning_in_status() -> None:
    from conftest import isvc_doc

    async with cluster() as c, running_operator(c):
        await c.create(isvc_doc({"accelerator": {"type": "H100-80GB", "nodeAffinity": "none",
                                                 "nodeSelector": {"pool": "h100"}}}))
        condition = await eventually(lambda: c.condition("demo", "PlanValid"), message="PlanValid")
        assert condition["status"] == "True" and condition["reason"] == "PlanAcceptedWithWarnings"
        assert "warning: spec.accelerator.nodeAffinity is none" in condition["message"]
        assert "pins pool=h100" in condition["message"]
        pod = existing(c, "apps/v1", "statefulsets", "demo-stage-0")["spec"]["template"]["spec"]
        assert "affinity" not in pod
