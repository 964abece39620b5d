"""The operator with spec.prefill (emulated API server): both pools applied, the prefill pool counted apart."""

from __future__ import annotations

import pytest
from conftest import existing, existing_isvc, sim_doc

from tensorfleet import contract
from tensorfleet.testing.operator_harness import cluster, running_operator
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio

STS = ("apps/v1", "statefulsets")


async def test_both_pools_are_applied_and_the_prefill_pool_is_counted_apart() -> None:
    async with cluster() as c, c.workloads(), running_operator(c):
        await c.create(sim_doc(prefill={"replicas": 3}))
        await eventually(lambda: (existing_isvc(c, "demo").get("status") or {}).get("readyPrefillReplicas") == 3,
                         message="three prefill engines ready")
        # The decode pods and the router Deployment report on their own watches: wait for the whole fleet.
        await eventually(lambda: (c.condition("demo", "Progressing") or {}).get("status") == "False"
                         and (c.condition("demo", "Ready") or {}).get("status") == "True", message="settled")
        status = existing_isvc(c, "demo")["status"]
        # The decode pool's groups are its own: the prefill pods count in neither replicas nor readyReplicas.
        assert (status["replicas"], status["readyReplicas"], status["prefillReplicas"]) == (2, 2, 3)
        assert (c.condition("demo", "Ready") or {}).get("status") == "True"
        prefill = existing(c, *STS, contract.prefill_stage_name("demo", 0))
        assert prefill["spec"]["replicas"] == 3
        assert contract.ANNOTATION_WANTED_GROUPS not in (prefill["metadata"].get("annotations") or {})
        # Scaling the decode pool through /scale leaves the prefill pool as it is.
        await c.patch("demo", {"spec": {"replicas": 1}})
        await eventually(lambda: existing(c, *STS, "demo-stage-0")["spec"]["replicas"] == 1, message="decode scaled")
        assert existing(c, *STS, contract.prefill_stage_name("demo", 0))["spec"]["replicas"] == 3
        # Dropping spec.prefill prunes the pool.
        await c.patch("demo", {"spec": {"prefill": None}})
        await eventually(lambda: c.get(*STS, contract.prefill_stage_name("demo", 0)) is None, message="pruned")
        await eventually(lambda: "readyPrefillReplicas" not in (existing_isvc(c, "demo").get("status") or {}),
                         message="the prefill counts gone from status")
