"""The HorizontalPodAutoscaler on pending requests (one Object metric on the InferenceService, an AverageValue target,
through its /scale subresource; zero is the operator's, not the HPA's), the demand Lease of scale to zero, and the
engine PodDisruptionBudget. Design: docs/autoscaling.md#the-signal-every-queue-per-replica.
"""

from __future__ import annotations

from typing import Any

from tensorfleet import contract
from tensorfleet.api.models import ScalingRules
from tensorfleet.render.meta import Context, engine_selector, metadata, scales_to_zero

# The target is absolute (replicas = waiting / target), so a queue that stays
# long while new replicas load asks for the same count again rather than
# more: scale-up can be fast, doubling (or 4 replicas) a minute, where one
# replica at a time would take hours from 0 to a large fleet. Scale-down waits
# out bursts before giving back GPUs, one replica per 5 minutes.
DEFAULT_SCALE_UP: dict[str, Any] = {
    "stabilizationWindowSeconds": 0,
    "selectPolicy": "Max",
    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 60},
                 {"type": "Pods", "value": 4, "periodSeconds": 60}],
}
DEFAULT_SCALE_DOWN: dict[str, Any] = {
    "stabilizationWindowSeconds": 600,
    "selectPolicy": "Max",
    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}],
}


# While the fleet is at zero (the operator's decision) there is no capacity to
# protect: the HPA may bring spec.replicas down to its floor within a sync or
# two, so the next request wakes the fleet at the size demand then asks for,
# not at what the HPA held when the traffic stopped (its usual scale-down
# would take minutes per replica). The operator owns this object; the HPA
# still owns spec.replicas.
IDLE_SCALE_DOWN: dict[str, Any] = {
    "stabilizationWindowSeconds": 0,
    "selectPolicy": "Max",
    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
}


def _rules(default: dict[str, Any], user: ScalingRules | None) -> dict[str, Any]:
    merged = {**default, "policies": [dict(p) for p in default["policies"]]}
    if user is not None:
        merged.update(user.model_dump(by_alias=True, exclude_none=True))
    return merged


def hpa(ctx: Context) -> dict[str, Any] | None:
    auto = ctx.spec.autoscaling
    if auto is None:
        return None
    behavior = auto.behavior
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(ctx, contract.hpa_name(ctx.name), contract.COMPONENT_ENGINE),
        "spec": {
            # Through the InferenceService's /scale, so every stage moves
            # together and the HPA counts each group once (its leader).
            "scaleTargetRef": {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "name": ctx.name},
            # The HPA never goes below 1 (zero is the operator's, see above).
            "minReplicas": max(1, auto.min_replicas),
            "maxReplicas": auto.max_replicas,
            "metrics": [{
                "type": "Object",
                "object": {
                    "describedObject": {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "name": ctx.name},
                    "metric": {"name": contract.HPA_METRIC_PENDING},
                    "target": {"type": "AverageValue", "averageValue": str(auto.target_pending_requests)},
                },
            }],
            "behavior": {
                "scaleUp": _rules(DEFAULT_SCALE_UP, behavior.scale_up if behavior else None),
                "scaleDown": (_rules(IDLE_SCALE_DOWN, None) if ctx.idle and auto.scales_to_zero
                              else _rules(DEFAULT_SCALE_DOWN, behavior.scale_down if behavior else None)),
            },
        },
    }


def demand_lease(ctx: Context) -> dict[str, Any] | None:
    """With minReplicas 0: the Lease the routers renew on demand (router/demand.py). The operator owns its
    metadata; the routers own spec.renewTime and spec.holderIdentity, which are therefore not rendered."""
    if not scales_to_zero(ctx):
        return None
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata(ctx, contract.demand_lease_name(ctx.name), contract.COMPONENT_ROUTER),
    }


def pdb(ctx: Context) -> dict[str, Any]:
    # One engine pod at a time across every group: a drain never takes out
    # two replicas (or two stages of one) together.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(ctx, contract.pdb_name(ctx.name), contract.COMPONENT_ENGINE),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": engine_selector(ctx.name)},
        },
    }
