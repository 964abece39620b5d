"""The operator with spec.accelerator.allocation deviceClass (emulated API server): the GPU ResourceClaimTemplate
is applied with the StatefulSets that name it, and a replaced one outlives the pods that still name it."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import existing, isvc_doc
from test_operator import wait_converged

from tensorfleet import contract
from tensorfleet.testing.operator_harness import cluster, running_operator
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio

STS = ("apps/v1", "statefulsets")
TEMPLATES = ("resource.k8s.io/v1", "resourceclaimtemplates")


def _templates(c: Any) -> set[str]:
    return {t["metadata"]["name"] for t in c.all(*TEMPLATES, "default")}


def _named(c: Any) -> set[str]:
    """The templates the engine pods name."""
    return {claim["resourceClaimTemplateName"] for p in c.all("v1", "pods", "default")
            for claim in p["spec"].get("resourceClaims") or []}


async def test_the_claim_template_is_applied_replaced_and_pruned_only_once_no_pod_names_it() -> None:
    doc = isvc_doc({"accelerator": {"allocation": contract.ALLOCATION_DEVICE_CLASS}, "parallelism": {"tensor": 1},
                    "replicas": 2})
    async with cluster() as c, c.workloads(), running_operator(c):
        await c.create(doc)
        await wait_converged(c)
        (first,) = _templates(c)
        template = existing(c, *TEMPLATES, first)
        assert template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 1
        assert template["metadata"]["ownerReferences"][0]["kind"] == contract.KIND
        assert _named(c) == {first}
        # Two GPUs per pod: a new template (a template's spec is immutable), rolled out group by group.
        await c.patch("demo", {"spec": {"parallelism": {"tensor": 2}}})
        seen_both = False

        def rolled() -> bool:
            nonlocal seen_both
            names, named = _templates(c), _named(c)
            # Never pruned while a pod still names it.
            assert named <= names, (named, names)
            seen_both = seen_both or len(names) == 2
            pods = c.all("v1", "pods", "default")
            return len(names) == 1 and first not in names and len(pods) == 2 and named == names
        await eventually(rolled, timeout=60, message="the new template alone, named by every pod")
        assert seen_both, "the old template was pruned before its pods were replaced"
        (second,) = _templates(c)
        assert existing(c, *STS, "demo-stage-0")["spec"]["template"]["spec"]["resourceClaims"][0][
            "resourceClaimTemplateName"] == second
        await c.delete("demo")
        await eventually(lambda: not _templates(c), message="the template collected with its owner")
