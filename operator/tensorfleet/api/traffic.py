"""spec.traffic: an InferenceService's share of new conversations at the gateway among those in its namespace that
serve the same model name (a traffic group), and the one rule that turns the members' weights into shares, read by
the gateway (which splits by it) and the operator (which reports it). Part of the API models (models.py). Design:
docs/gateway.md#traffic-groups-and-weights.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

from pydantic import Field

from tensorfleet.api.base import ApiModel


class TrafficSpec(ApiModel):
    weight: int | None = Field(
        default=None, ge=0, le=100,
        description=(
            "Percent of the new conversations the gateway sends to the InferenceServices in this namespace serving "
            "the same model name (spec.model.servedName, else model.name) that this one takes, e.g. 10 for a canary "
            "of a new revision beside the one in service. Members without a weight share what the weighted ones "
            "leave; weights summing past 100 are scaled down to 100. 0 takes no new conversations. A conversation "
            "stays on the InferenceService it started on while the weights stay. Default: an equal share of the rest."
        ),
    )


K = TypeVar("K", bound=Hashable)


def shares(weights: Mapping[K, int | None]) -> dict[K, float]:
    """Each member's percent of a group's new conversations, from its spec.traffic.weight (None: unset): the
    weighted take their weights (scaled down to 100 together when they pass it, or scaled to 100 when every member
    is weighted), and the unweighted split the rest evenly. All 0 when every member is weighted 0."""
    weighted = {name: weight for name, weight in weights.items() if weight is not None}
    rest = [name for name, weight in weights.items() if weight is None]
    total = sum(weighted.values())
    result = dict.fromkeys(weights, 0.0)
    if rest and total < 100:
        result.update(weighted)
        result.update(dict.fromkeys(rest, (100.0 - total) / len(rest)))
    elif total > 0:
        result.update({name: 100.0 * weight / total for name, weight in weighted.items()})
    return {name: float(share) for name, share in result.items()}


def served_and_weight(obj: Mapping[str, Any]) -> tuple[str, int | None] | None:
    """An InferenceService object's (as the API server holds it) traffic group name, spec.model.servedName else
    spec.model.name, and its spec.traffic.weight (None: unset, or not a weight); None without a model name. The
    gateway and the operator both read groups with it, so they agree on them."""
    spec = obj.get("spec") or {}
    model = spec.get("model") or {}
    name = model.get("name")
    if not isinstance(name, str) or not name:
        return None
    served = model.get("servedName")
    weight = (spec.get("traffic") or {}).get("weight")
    if not isinstance(weight, int) or isinstance(weight, bool) or not 0 <= weight <= 100:
        weight = None
    return (served if isinstance(served, str) and served else name), weight
