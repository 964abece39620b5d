"""Scale to zero and back (autoscaling.minReplicas 0): the real operator against the emulated API server.

The operator's clock is moved forward past the idle period instead of
waiting it out; the routers' side is the router's own DemandLease class,
renewing the Lease through the same API server.
"""

from __future__ import annotations

import datetime
import time

import pytest
from conftest import existing, existing_isvc, sim_doc

from tensorfleet.controller.idle import parse_time
from tensorfleet.kube.connection import Connection
from tensorfleet.render.autoscaling import DEFAULT_SCALE_DOWN, IDLE_SCALE_DOWN
from tensorfleet.router.demand import DemandLease
from tensorfleet.testing.operator_harness import Cluster, cluster, running_operator
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio

STS = ("apps/v1", "statefulsets")
LEASES = ("coordination.k8s.io/v1", "leases")
IDLE_SECONDS = 60


def _replicas(c: Cluster, stages: int) -> set[int]:
    return {(c.get(*STS, f"demo-stage-{k}") or {}).get("spec", {}).get("replicas", -1) for k in range(stages)}


def _reasons(c: Cluster) -> list[str]:
    return [e["reason"] for e in c.events("demo")]


async def test_an_idle_multi_node_fleet_goes_to_zero_and_a_request_wakes_it() -> None:
    offset = {"seconds": 0.0}
    async with cluster() as c, c.workloads(), running_operator(c) as op:
        def shifted() -> str:
            moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset["seconds"])
            return moment.strftime("%Y-%m-%dT%H:%M:%SZ")

        op.reconciler.now = shifted
        doc = sim_doc(parallelism={"tensor": 1, "pipeline": 2},
                      autoscaling={"minReplicas": 0, "maxReplicas": 3, "scaleToZeroAfterSeconds": IDLE_SECONDS})
        del doc["spec"]["replicas"]
        await c.create(doc)

        # It starts at the HPA's floor, 1 group, with the demand Lease the routers may renew (and nothing else).
        lease = await eventually(lambda: c.get(*LEASES, "demo-demand"), message="demand Lease")
        assert lease["metadata"]["ownerReferences"][0]["name"] == "demo"
        await eventually(lambda: _replicas(c, 2) == {1}, message="one group")
        hpa = await eventually(lambda: c.get("autoscaling/v2", "horizontalpodautoscalers", "demo"))
        assert hpa["spec"]["minReplicas"] == 1
        role = existing(c, "rbac.authorization.k8s.io/v1", "roles", "demo-router")
        assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["demo-demand"],
                "verbs": ["get", "patch"]} in role["rules"]
        args = existing(c, "apps/v1", "deployments", "demo-router")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--demand-lease") + 1] == "demo-demand"
        await eventually(lambda: (c.condition("demo", "Ready") or {}).get("status") == "True", message="Ready")
        assert "idleSince" not in existing_isvc(c, "demo")["status"]

        # Not idle yet: a reconcile before the period ends changes nothing, and comes back when it ends.
        requeue = await op.reconciler.reconcile("default", "demo")
        assert requeue is not None and 0 < requeue <= IDLE_SECONDS
        assert _replicas(c, 2) == {1}

        # No request for longer than the period: every stage goes to zero, and status says since when.
        offset["seconds"] = IDLE_SECONDS + 5
        assert op.queue is not None, "the running operator has its work queue"
        op.queue.add(("default", "demo"))
        await eventually(lambda: _replicas(c, 2) == {0}, message="scaled to zero")
        status = await eventually(lambda: (existing_isvc(c, "demo").get("status") or {}).get("idleSince")
                                  and existing_isvc(c, "demo")["status"])
        ready = next(x for x in status["conditions"] if x["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("True", "ScaledToZero")
        await eventually(lambda: "ScaledToZero" in _reasons(c), message="ScaledToZero event")
        # At zero the HPA may bring spec.replicas to its floor at once, so a wake starts small.
        await eventually(lambda: existing(c, "autoscaling/v2", "horizontalpodautoscalers", "demo")["spec"]["behavior"]
                         ["scaleDown"] == IDLE_SCALE_DOWN, message="idle scale-down")
        # The HPA's field was never written by the operator: spec.replicas is still the CRD default.
        assert existing_isvc(c, "demo")["spec"]["replicas"] == 1
        idle_since = parse_time(status["idleSince"])
        assert idle_since is not None

        # A router sees a request: it renews the Lease, and the Lease's watch event alone wakes the fleet.
        demand = DemandLease("demo-demand", "default", Connection(server=c.url), identity="demo-router-abc",
                             wall=lambda: time.time() + offset["seconds"] + 1)
        demand.touch(urgent=True)
        await demand.close()
        assert demand.writes == 1, demand.failures
        renewed = existing(c, *LEASES, "demo-demand")
        assert renewed["spec"]["holderIdentity"] == "demo-router-abc"
        assert renewed["metadata"]["ownerReferences"] == lease["metadata"]["ownerReferences"]
        await eventually(lambda: _replicas(c, 2) == {1}, message="woken from zero")
        await eventually(lambda: "idleSince" not in (existing_isvc(c, "demo").get("status") or {}), message="idleSince cleared")
        await eventually(lambda: "ScaledFromZero" in _reasons(c), message="ScaledFromZero event")
        await eventually(lambda: (c.condition("demo", "Ready") or {}).get("reason") == "Serving", message="serving")
        assert existing(c, "autoscaling/v2", "horizontalpodautoscalers", "demo")["spec"]["behavior"]["scaleDown"][
            "policies"] == DEFAULT_SCALE_DOWN["policies"]
        # Both transitions were the operator's own decisions, not drift it reverted.
        assert "ChildReverted" not in _reasons(c)

        # Turning scale-to-zero off removes the Lease and the router's right to it.
        await c.patch("demo", {"spec": {"autoscaling": {"minReplicas": 1}}})
        await eventually(lambda: c.get(*LEASES, "demo-demand") is None, message="Lease pruned")
        role = await eventually(lambda: (r := c.get("rbac.authorization.k8s.io/v1", "roles", "demo-router"))
                                and len(r["rules"]) == 1 and r)
        assert role["rules"][0]["resources"] == ["endpointslices"]

