"""A model of the Kubernetes HorizontalPodAutoscaler controller, for the autoscaling benchmark.

It follows kubernetes pkg/controller/podautoscaler (autoscaling/v2: replica_calculator.go,
horizontal.go, metrics/utilization.go), written afresh from reading them; the benchmark drives it
with the simulated clock instead of running kube-controller-manager. What it keeps:

- metric values in milli-units, as the HPA reads them from prometheus-adapter
  (a sample v becomes int(v x 1000)); averages are integer divisions, as in Go;
- a Pods metric (`pods_metric_replicas`): the average over the pods that have
  a sample, compared with the target within a tolerance (0.1 by default);
  pods being deleted or finished are ignored; Pending pods are unready; pods
  without a sample are missing. When some pods are unready or missing the
  ratio is computed again with missing pods at the target (on a scale-down)
  or at 0 (on a scale-up) and unready pods at 0 (on a scale-up only), and the
  replicas stay as they are when that second ratio is within tolerance or
  points the other way. Only for the CPU resource does readiness matter to a
  pod that reports; for these custom metrics a Running, not-Ready pod that
  reports counts;
- an Object metric with an AverageValue target (`object_average_replicas`):
  ratio = value / (target x status.replicas); outside tolerance the count is
  ceil(value / target), whatever the pods' readiness;
- a sync (`Autoscaler.sync`): the target's spec.replicas clamped to
  [minReplicas, maxReplicas] when outside it; otherwise the metric's proposal,
  stabilised (the lowest recommendation of the scale-up window and the
  highest of the scale-down window bound it, around the current count) and
  then rate-limited by the behaviour's policies (the replicas added or
  removed within each policy's period count against it; selectPolicy Max
  takes the policy allowing the largest change), within [min, max]. A sync
  with no valid metric changes nothing. Recommendations and scale events are
  kept and recycled as the controller does.

The behaviours themselves are the operator's (tensorfleet.render.autoscaling);
this module only interprets them. Times are seconds on any monotonic clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TOLERANCE = 0.1
DEFAULT_SCALE_DOWN_STABILIZATION = 300  # kube-controller-manager --horizontal-pod-autoscaler-downscale-stabilization


class MetricError(Exception):
    """No replica count can be computed from this metric this sync (the HPA sets ScalingActive False)."""


def milli(value: float) -> int:
    """A sample as the HPA receives it: a milli-quantity, truncated."""
    return int(value * 1000)


@dataclass(frozen=True)
class PodSample:
    """One pod the scale target's selector matches, and the metric's latest sample for it (None: none)."""

    name: str
    value: float | None
    phase: str = "Running"   # Pending, Running, Succeeded or Failed
    deleting: bool = False   # metadata.deletionTimestamp is set


def _ratio(values: Mapping[str, int], target: int) -> tuple[float, int]:
    total = sum(values.values())
    usage = int(total / len(values)) if total >= 0 else -int(-total / len(values))  # Go's truncating division
    return usage / target, usage


def _within(ratio: float, tolerance: float) -> bool:
    return (1.0 - tolerance) <= ratio <= (1.0 + tolerance)


def pods_metric_replicas(current: int, target: float, pods: Sequence[PodSample],
                         tolerance: float = TOLERANCE) -> tuple[int, int]:
    """(replicas, average usage in milli) for a Pods metric with an AverageValue TARGET."""
    if not pods:
        raise MetricError("no pods returned by selector while calculating replica count")
    target_milli = milli(target)
    metrics: dict[str, int] = {}
    ready = 0
    unready: list[str] = []
    missing: list[str] = []
    for pod in pods:
        if pod.deleting or pod.phase in ("Succeeded", "Failed"):
            continue  # ignored
        if pod.phase == "Pending":
            unready.append(pod.name)
            continue
        if pod.value is None:
            missing.append(pod.name)
            continue
        metrics[pod.name] = milli(pod.value)
        ready += 1
    if not metrics:
        raise MetricError("did not receive metrics for targeted pods (pods might be unready)")
    ratio, usage = _ratio(metrics, target_milli)
    scale_up_with_unready = bool(unready) and ratio > 1.0
    if not scale_up_with_unready and not missing:
        if _within(ratio, tolerance):
            return current, usage
        return math.ceil(ratio * ready), usage
    if missing:
        if ratio < 1.0:
            metrics.update(dict.fromkeys(missing, target_milli))
        elif ratio > 1.0:
            metrics.update(dict.fromkeys(missing, 0))
    if scale_up_with_unready:
        metrics.update(dict.fromkeys(unready, 0))
    new_ratio, _ = _ratio(metrics, target_milli)
    if _within(new_ratio, tolerance) or (ratio < 1.0 < new_ratio) or (new_ratio < 1.0 < ratio):
        return current, usage
    replicas = math.ceil(new_ratio * len(metrics))
    if (new_ratio < 1.0 and replicas > current) or (new_ratio > 1.0 and replicas < current):
        return current, usage
    return replicas, usage


def _go_divide(a: float, b: float) -> float:
    """a / b with IEEE semantics (Go's), where Python would raise on b == 0."""
    if b != 0:
        return a / b
    if a == 0 or math.isnan(a):
        return math.nan
    return math.copysign(math.inf, a)


def object_average_replicas(status_replicas: int, target: float, value: float,
                            tolerance: float = TOLERANCE) -> tuple[int, int]:
    """(replicas, usage per replica in milli) for an Object metric with an AverageValue TARGET."""
    target_milli, usage = milli(target), milli(value)
    replicas = status_replicas
    ratio = _go_divide(usage, target_milli * status_replicas)
    if not _within(ratio, tolerance):  # NaN is never within
        replicas = math.ceil(usage / target_milli)
    per_pod = 0 if status_replicas == 0 else math.ceil(usage / status_replicas)
    return replicas, per_pod


@dataclass
class _Event:
    change: int
    at: float
    outdated: bool = False


@dataclass
class Rules:
    """One direction of spec.behavior (HPAScalingRules)."""

    stabilization: float
    select: str
    policies: list[tuple[str, int, float]]  # (type, value, periodSeconds)

    @classmethod
    def parse(cls, rules: Mapping[str, Any], default_stabilization: float) -> Rules:
        window = rules.get("stabilizationWindowSeconds")
        return cls(stabilization=float(default_stabilization if window is None else window),
                   select=rules.get("selectPolicy") or "Max",
                   policies=[(p["type"], int(p["value"]), float(p["periodSeconds"])) for p in rules["policies"]])

    @property
    def longest_period(self) -> float:
        return max((period for _, _, period in self.policies), default=0.0)


def _changed_within(period: float, events: Sequence[_Event], now: float) -> int:
    cutoff = now - period
    return sum(e.change for e in events if e.at > cutoff)


@dataclass
class Autoscaler:
    """One HPA's controller state: its recommendations and scale events, and the rules that use them."""

    min_replicas: int
    max_replicas: int
    scale_up: Rules
    scale_down: Rules
    recommendations: list[tuple[int, float]] = field(default_factory=list)
    up_events: list[_Event] = field(default_factory=list)
    down_events: list[_Event] = field(default_factory=list)

    @classmethod
    def from_behavior(cls, min_replicas: int, max_replicas: int, scale_up: Mapping[str, Any],
                      scale_down: Mapping[str, Any]) -> Autoscaler:
        return cls(min_replicas, max_replicas, Rules.parse(scale_up, 0), Rules.parse(scale_down,
                                                                                     DEFAULT_SCALE_DOWN_STABILIZATION))

    def sync(self, now: float, current: int, proposal: int | None) -> int:
        """One reconcile of the HPA: the replica count it leaves on the target (CURRENT when it does not rescale).
        CURRENT is the target's spec.replicas; PROPOSAL the metric's replica count, None when the metric failed."""
        if not self.recommendations:
            self.recommendations.append((current, now))
        if current == 0:
            return 0  # scaling is disabled while the target is at zero (without the HPAScaleToZero gate)
        if current > self.max_replicas:
            desired = self.max_replicas
        elif current < self.min_replicas:
            desired = self.min_replicas
        else:
            if proposal is None:
                return current
            desired = self._rate_limited(now, current, self._stabilized(now, current, proposal))
        if desired != current:
            self._store_event(now, current, desired)
        return desired

    def _stabilized(self, now: float, current: int, desired: int) -> int:
        up_cutoff = now - self.scale_up.stabilization
        down_cutoff = now - self.scale_down.stabilization
        up, down = desired, desired
        old: int | None = None
        for i, (recommendation, at) in enumerate(self.recommendations):
            if at > up_cutoff:
                up = min(recommendation, up)
            if at > down_cutoff:
                down = max(recommendation, down)
            if at < up_cutoff and at < down_cutoff:
                old = i
        recommendation = max(current, up)
        recommendation = min(recommendation, down)
        if old is not None:
            self.recommendations[old] = (desired, now)
        else:
            self.recommendations.append((desired, now))
        return recommendation

    def _limit(self, now: float, current: int, rules: Rules, up: bool) -> int:
        if rules.select == "Disabled":
            return current
        pick_min = (rules.select == "Min") == up  # Min for up / Max for down favour the smaller change
        result: int | None = None
        for kind, value, period in rules.policies:
            start = (current - _changed_within(period, self.up_events, now)
                     + _changed_within(period, self.down_events, now))
            if kind == "Pods":
                proposed = start + value if up else start - value
            elif up:
                proposed = math.ceil(start * (1 + value / 100))
            else:
                proposed = int(start * (1 - value / 100))
            if result is None:
                result = proposed
            else:
                result = min(result, proposed) if pick_min else max(result, proposed)
        return current if result is None else result

    def _rate_limited(self, now: float, current: int, desired: int) -> int:
        if desired > current:
            limit = max(self._limit(now, current, self.scale_up, up=True), current)
            return min(desired, self.max_replicas, limit)
        if desired < current:
            limit = min(self._limit(now, current, self.scale_down, up=False), current)
            return max(desired, self.min_replicas, limit)
        return desired

    def _store_event(self, now: float, before: int, after: int) -> None:
        up = after > before
        events = self.up_events if up else self.down_events
        cutoff = now - (self.scale_up if up else self.scale_down).longest_period
        old: int | None = None
        for i, event in enumerate(events):
            if event.at < cutoff:
                event.outdated = True
            if event.outdated:
                old = i
        new = _Event(abs(after - before), now)
        if old is not None:
            events[old] = new
        else:
            events.append(new)
