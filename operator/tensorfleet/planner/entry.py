"""The planner's entry point: one pool (`plan.plan_pool`), or a prefill and a decode pool (`disagg`). Design:
docs/planner.md#choosing-the-layout."""

from __future__ import annotations

from tensorfleet.api.errors import SpecError
from tensorfleet.api.models import InferenceServiceSpec
from tensorfleet.catalog import ModelFacts
from tensorfleet.planner.disagg import plan_disaggregated
from tensorfleet.planner.plan import Plan, plan_pool


def make_plan(spec: InferenceServiceSpec, facts: ModelFacts | None = None) -> Plan:
    """Plan the InferenceService: its one pool, or with spec.prefill its decode pool carrying the prefill pool's
    plan. Raises SpecError naming the field."""
    if spec.prefill is not None:
        return plan_disaggregated(spec, facts)
    if spec.kv_transfer is not None:
        raise SpecError("spec.kvTransfer", "applies only with spec.prefill (a prefill pool to move KV from); "
                                           "add spec.prefill or remove spec.kvTransfer")
    return plan_pool(spec, facts)
