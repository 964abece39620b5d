"""The HPA model of the autoscaling benchmark (benchmarks/hpa_model.py) against the Kubernetes algorithm.

Each expected count is worked out by hand in the comment beside it, from the HPA controller's rules
(kubernetes pkg/controller/podautoscaler: replica_calculator.go, horizontal.go): milli-unit values,
integer averages, the 0.1 tolerance, the unready/missing-pod rules, AverageValue Object metrics, and the
behaviour's stabilisation windows and rate policies, here the operator's defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from hpa_model import (
    Autoscaler,
    MetricError,
    PodSample,
    object_average_replicas,
    pods_metric_replicas,
)

from tensorfleet.render.autoscaling import DEFAULT_SCALE_DOWN, DEFAULT_SCALE_UP


def hpa(min_replicas: int = 1, max_replicas: int = 8) -> Autoscaler:
    return Autoscaler.from_behavior(min_replicas, max_replicas, DEFAULT_SCALE_UP, DEFAULT_SCALE_DOWN)


# --- Pods metric ----------------------------------------------------------------------------------

def test_pods_metric_average_over_reporting_pods() -> None:
    # (10000 + 6000) / 2 = 8000 milli; 8000 / 4000 = 2.0; ceil(2.0 x 2 ready) = 4
    assert pods_metric_replicas(2, 4, [PodSample("a", 10), PodSample("b", 6)]) == (4, 8000)


def test_pods_metric_within_tolerance_keeps_the_current_count() -> None:
    # 4200 / 4000 = 1.05, within 0.1: the current count stands, even one far from ceil(1.05 x 2) = 3
    assert pods_metric_replicas(5, 4, [PodSample("a", 4.2), PodSample("b", 4.2)]) == (5, 4200)


def test_pods_metric_average_is_an_integer_milli_value() -> None:
    # KV usage 0.9 and 0.95 -> 900 + 950 = 1850 / 2 = 925 milli; 925 / 800 = 1.15625; ceil(2.3125) = 3
    assert pods_metric_replicas(2, 0.8, [PodSample("a", 0.9), PodSample("b", 0.95)]) == (3, 925)
    # 0.85 and 0.86 -> 855 / 800 = 1.069: within tolerance
    assert pods_metric_replicas(2, 0.8, [PodSample("a", 0.85), PodSample("b", 0.86)]) == (2, 855)


def test_missing_pod_counts_as_zero_on_a_scale_up() -> None:
    # a = 12000 -> ratio 3.0 > 1; b has no sample: 0 -> (12000 + 0) / 2 = 6000 -> 1.5; ceil(1.5 x 2) = 3
    assert pods_metric_replicas(2, 4, [PodSample("a", 12), PodSample("b", None)])[0] == 3


def test_missing_pods_count_as_the_target_on_a_scale_down() -> None:
    # a = 1000 -> ratio 0.25 < 1; b, c missing: 4000 each -> 9000 / 3 = 3000 -> 0.75; ceil(0.75 x 3) = 3,
    # not above the current 3: 3 (without the rule it would be ceil(0.25 x 1) = 1)
    pods = [PodSample("a", 1), PodSample("b", None), PodSample("c", None)]
    assert pods_metric_replicas(3, 4, pods)[0] == 3


def test_pending_pod_counts_as_zero_on_a_scale_up_only() -> None:
    # scale-up: a = 12000 -> 3.0; the Pending pod joins at 0 -> 6000 -> 1.5; ceil(1.5 x 2) = 3
    assert pods_metric_replicas(2, 4, [PodSample("a", 12), PodSample("p", 5, phase="Pending")])[0] == 3
    # scale-down: a = 1000 -> 0.25; the Pending pod is left out: ceil(0.25 x 1 ready) = 1
    assert pods_metric_replicas(2, 4, [PodSample("a", 1), PodSample("p", None, phase="Pending")])[0] == 1


def test_a_running_not_ready_pod_that_reports_counts_for_custom_metrics() -> None:
    # Readiness is looked at for CPU only: a pod loading its model that reports 0 waiting dilutes the
    # average. (8000 + 0) / 2 = 4000 -> 1.0: no change from 2.
    assert pods_metric_replicas(2, 4, [PodSample("a", 8), PodSample("loading", 0)]) == (2, 4000)


def test_missing_pods_that_reverse_the_direction_keep_the_current_count() -> None:
    # a = 5000 -> 1.25 (up); b missing -> 0 -> 2500 -> 0.625 (down): a change of direction, keep 2
    assert pods_metric_replicas(2, 4, [PodSample("a", 5), PodSample("b", None)])[0] == 2


def test_deleting_and_finished_pods_are_ignored() -> None:
    # only a counts: 12000 / 4000 = 3.0; ceil(3.0 x 1) = 3
    pods = [PodSample("a", 12), PodSample("d", 100, deleting=True), PodSample("f", 100, phase="Failed")]
    assert pods_metric_replicas(1, 4, pods)[0] == 3


def test_no_pod_or_no_sample_is_a_metric_error() -> None:
    with pytest.raises(MetricError):
        pods_metric_replicas(1, 4, [])
    with pytest.raises(MetricError):
        pods_metric_replicas(1, 4, [PodSample("a", None), PodSample("p", 3, phase="Pending")])


# --- Object metric, AverageValue ---------------------------------------------------------------------

def test_object_average_value_asks_for_ceil_value_over_target() -> None:
    # 10 waiting over 2 replicas at target 4: 10000 / (4000 x 2) = 1.25 -> ceil(10000 / 4000) = 3
    assert object_average_replicas(2, 4, 10) == (3, 5000)
    # 8.5 / 8 = 1.0625: within tolerance, status.replicas stands
    assert object_average_replicas(2, 4, 8.5)[0] == 2
    # nothing waiting: ceil(0) = 0 (minReplicas is applied by the sync)
    assert object_average_replicas(3, 4, 0)[0] == 0


def test_object_average_value_ignores_readiness_and_survives_zero_status_replicas() -> None:
    # 30 waiting, 3 replicas of which any number may be loading: ceil(30 / 4) = 8
    assert object_average_replicas(3, 4, 30)[0] == 8
    # status.replicas 0 (the fleet at zero): Go divides by zero into +Inf / NaN, never within tolerance
    assert object_average_replicas(0, 4, 6) == (2, 0)
    assert object_average_replicas(0, 4, 0) == (0, 0)


# --- the sync: bounds, stabilisation, policies (the operator's defaults) ---------------------------------

def test_scale_up_is_limited_to_the_larger_of_doubling_and_four_pods_a_minute() -> None:
    a = hpa(max_replicas=20)
    # from 1: Percent 100 -> ceil(1 x 2) = 2; Pods 4 -> 5; selectPolicy Max -> 5
    assert a.sync(0, 1, 10) == 5
    # 30 s later the +4 is within both 60 s periods: the period started at 5 - 4 = 1 -> limit 5 again
    assert a.sync(30, 5, 10) == 5
    # 61 s after it the period starts at 5: Percent -> 10, Pods -> 9; Max -> 10
    assert a.sync(61, 5, 12) == 10


def test_scale_up_stops_at_max_replicas_and_has_no_stabilisation_window() -> None:
    a = hpa(max_replicas=3)
    assert a.sync(0, 2, 9) == 3          # limit max(4, 6) = 6, but maxReplicas 3
    b = hpa()
    assert b.sync(0, 2, 2) == 2
    assert b.sync(15, 2, 3) == 3          # window 0: the next sync that asks for more gets it


def test_scale_down_waits_out_the_window_then_goes_one_pod_per_five_minutes() -> None:
    a = hpa()
    assert a.sync(0, 4, 4) == 4
    assert a.sync(100, 4, 1) == 4         # the 4 recommended at 0 is within the 600 s window
    assert a.sync(599, 4, 1) == 4
    # at 601 the window (after 1 s) holds only 1s -> 1; Pods policy: 4 - 1 = 3
    assert a.sync(601, 4, 1) == 3
    # 700: the -1 at 601 is within 300 s: the period started at 3 + 1 = 4 -> limit 3: stay
    assert a.sync(700, 3, 1) == 3
    # 902: the -1 at 601 has left the period: 3 - 1 = 2
    assert a.sync(902, 3, 1) == 2


def test_bounds_apply_without_metrics_and_a_failed_metric_changes_nothing() -> None:
    a = hpa(min_replicas=1, max_replicas=8)
    assert a.sync(0, 9, None) == 8        # above maxReplicas: max, whatever the metric
    assert a.sync(15, 8, None) == 8       # a metric that failed: no change
    b = hpa(min_replicas=2)
    assert b.sync(0, 1, None) == 2        # below minReplicas: min
    c = hpa()
    assert c.sync(0, 1, 0) == 1           # a proposal of 0 stops at minReplicas 1
    assert hpa().sync(0, 0, 5) == 0       # at zero (no HPAScaleToZero gate) scaling is disabled


def test_recommendations_are_recycled_once_outside_both_windows() -> None:
    a = hpa()
    for t in range(0, 1300, 15):
        a.sync(t, 1, 1)
    # recommendations older than the 600 s window are overwritten rather than kept
    assert len(a.recommendations) <= 600 // 15 + 2
