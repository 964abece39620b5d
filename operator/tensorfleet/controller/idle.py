"""Scale to zero and back: whether a fleet with autoscaling.minReplicas 0 is idle, decided (`decide`, pure) from the
spec, the last status, the demand Lease the routers renew and the clock. The operator owns status.idleSince, the
HPA spec.replicas and the routers the Lease, so nothing is written by two parties.
Design: docs/autoscaling.md#scale-to-zero-and-back.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorfleet.api.models import InferenceServiceSpec

SCALED_TO_ZERO = "ScaledToZero"
SCALED_FROM_ZERO = "ScaledFromZero"


@dataclass(frozen=True)
class Idle:
    """What the reconciler does about zero this time."""

    idle: bool                          # render no groups
    since: str | None                   # status.idleSince
    requeue: float | None = None        # seconds until the decision could change without any event
    event: tuple[str, str] | None = None  # (reason, message) of a transition, posted as a Normal event


NOT_IDLE = Idle(idle=False, since=None)


def parse_time(value: Any) -> datetime.datetime | None:
    """An RFC 3339 timestamp (Time or MicroTime) as an aware datetime; None when absent or malformed."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=datetime.UTC)


def format_time(value: datetime.datetime) -> str:
    return value.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def last_demand(lease: Mapping[str, Any] | None, created: str | None) -> datetime.datetime | None:
    """When a router last saw a request (the Lease's renewTime), or the InferenceService's creation if later."""
    renewed = parse_time(((lease or {}).get("spec") or {}).get("renewTime"))
    born = parse_time(created)
    candidates = [t for t in (renewed, born) if t is not None]
    return max(candidates) if candidates else None


def decide(spec: InferenceServiceSpec, status: Mapping[str, Any], lease: Mapping[str, Any] | None,
           created: str | None, now: datetime.datetime) -> Idle:
    """Whether the fleet is (still, or newly) at zero, from the last demand the routers recorded."""
    auto = spec.autoscaling
    since = parse_time(status.get("idleSince"))
    if auto is None or not auto.scales_to_zero:
        if since is not None:
            return Idle(False, None, event=(SCALED_FROM_ZERO, ("autoscaling.minReplicas is no longer 0; "
                                                              "starting the fleet")))
        return NOT_IDLE
    period = auto.scale_to_zero_after_seconds
    last = last_demand(lease, created)
    if since is not None:
        if last is not None and last > since:
            return Idle(False, None, requeue=_remaining(period, last, now),
                        event=(SCALED_FROM_ZERO, (f"a request arrived at {format_time(last)} after "
                                                 f"{format_time(since)}; starting the fleet")))
        return Idle(True, format_time(since))
    if last is None:
        return NOT_IDLE
    remaining = _remaining(period, last, now)
    if remaining > 0:
        return Idle(False, None, requeue=remaining)
    return Idle(True, format_time(now), event=(SCALED_TO_ZERO, (f"no request for {period}s (last at "
                                                                f"{format_time(last)}); scaled to zero, the next "
                                                                "request starts the fleet")))


def _remaining(period: int, last: datetime.datetime, now: datetime.datetime) -> float:
    return max(0.0, period - (now - last).total_seconds())
