"""controller/idle.py: when a minReplicas-0 fleet goes to zero and when it comes back, as a pure function."""

from __future__ import annotations

import datetime
from typing import Any

from tensorfleet.api.models import InferenceServiceSpec
from tensorfleet.controller.idle import NOT_IDLE, SCALED_FROM_ZERO, SCALED_TO_ZERO, decide, parse_time
from tensorfleet.render import desired_replicas

T0 = datetime.datetime(2026, 11, 24, 12, 0, 0, tzinfo=datetime.UTC)
CREATED = "2026-11-24T12:00:00Z"


def spec(**autoscaling: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "accelerator": {"type": "L4"},
        **({"autoscaling": {"maxReplicas": 4, **autoscaling}} if autoscaling else {}),
    })


def lease(seconds: float) -> dict[str, Any]:
    moment = T0 + datetime.timedelta(seconds=seconds)
    return {"spec": {"renewTime": moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "holderIdentity": "r"}}


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def test_only_minreplicas_zero_ever_idles() -> None:
    assert decide(spec(), {}, lease(0), CREATED, at(10_000)) == NOT_IDLE
    assert decide(spec(minReplicas=1), {}, lease(0), CREATED, at(10_000)) == NOT_IDLE


def test_idle_after_the_period_without_demand_counted_from_the_last_renewal_or_creation() -> None:
    zero = spec(minReplicas=0, scaleToZeroAfterSeconds=300)
    # No renewal yet: counted from creation.
    early = decide(zero, {}, None, CREATED, at(100))
    assert not early.idle and early.requeue == 200
    gone = decide(zero, {}, None, CREATED, at(301))
    assert gone.idle and gone.since == "2026-11-24T12:05:01Z" and gone.event and gone.event[0] == SCALED_TO_ZERO
    # A renewal restarts the period.
    busy = decide(zero, {}, lease(250), CREATED, at(301))
    assert not busy.idle and busy.requeue == 249


def test_stays_at_zero_until_a_renewal_after_it_went_idle() -> None:
    zero = spec(minReplicas=0, scaleToZeroAfterSeconds=300)
    status = {"idleSince": "2026-11-24T12:10:00Z"}
    held = decide(zero, status, lease(500), CREATED, at(5000))
    assert held.idle and held.since == "2026-11-24T12:10:00Z" and held.event is None and held.requeue is None
    woken = decide(zero, status, lease(601.5), CREATED, at(602))
    assert not woken.idle and woken.since is None and woken.event and woken.event[0] == SCALED_FROM_ZERO
    assert woken.requeue == 299.5  # the period counts again from the request that woke it


def test_turning_scale_to_zero_off_while_idle_wakes_the_fleet() -> None:
    woken = decide(spec(minReplicas=1), {"idleSince": "2026-11-24T12:10:00Z"}, lease(0), CREATED, at(5000))
    assert not woken.idle and woken.event and woken.event[0] == SCALED_FROM_ZERO


def test_malformed_times_are_no_demand_rather_than_an_error() -> None:
    assert parse_time("yesterday") is None and parse_time(None) is None and parse_time("") is None
    zero = spec(minReplicas=0, scaleToZeroAfterSeconds=300)
    assert decide(zero, {}, {"spec": {"renewTime": "garbage"}}, None, at(10)) == NOT_IDLE


def test_desired_replicas_idle_is_zero_otherwise_the_hpa_floor_of_one() -> None:
    zero = spec(minReplicas=0)
    assert desired_replicas(zero) == 1
    assert desired_replicas(zero, idle=True) == 0
    assert desired_replicas(spec(minReplicas=2), idle=True) == 2  # idle means nothing without minReplicas 0


def test_at_zero_the_hpa_may_drop_to_its_floor_at_once_so_a_wake_starts_small() -> None:
    from tensorfleet.api import load_inference_service
    from tensorfleet.planner import make_plan
    from tensorfleet.render import render
    from tensorfleet.render.autoscaling import DEFAULT_SCALE_DOWN, IDLE_SCALE_DOWN

    isvc = load_inference_service({
        "apiVersion": "tensorfleet.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "m"},
        "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "accelerator": {"type": "L4"},
                 "autoscaling": {"minReplicas": 0, "maxReplicas": 8,
                                 "behavior": {"scaleDown": {"stabilizationWindowSeconds": 60}}}},
    })
    plan = make_plan(isvc.spec)

    def scale_down(idle: bool) -> dict[str, Any]:
        [hpa] = [o for o in render(isvc, plan, idle=idle) if o["kind"] == "HorizontalPodAutoscaler"]
        return dict(hpa["spec"]["behavior"]["scaleDown"])
    serving = scale_down(False)
    assert serving["stabilizationWindowSeconds"] == 60 and serving["policies"] == DEFAULT_SCALE_DOWN["policies"]
    assert scale_down(True) == IDLE_SCALE_DOWN
