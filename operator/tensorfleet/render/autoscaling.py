"""HorizontalPodAutoscaler on pending requests, and the engine PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

from tensorfleet import contract
from tensorfleet.api.models import ScalingRules
from tensorfleet.render.meta import Context, engine_selector, metadata

# A new replica takes minutes to load, and until then the queue it is meant
# to drain stays long: faster steps would keep adding replicas that are not
# serving yet. Scale-down waits out bursts before giving back GPUs.
DEFAULT_SCALE_UP: dict[str, Any] = {
    "stabilizationWindowSeconds": 0,
    "selectPolicy": "Max",
    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 180}],
}
DEFAULT_SCALE_DOWN: dict[str, Any] = {
    "stabilizationWindowSeconds": 600,
    "selectPolicy": "Max",
    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}],
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
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [{
                "type": "Pods",
                "pods": {
                    "metric": {"name": contract.HPA_METRIC_WAITING},
                    "target": {"type": "AverageValue", "averageValue": str(auto.target_pending_requests)},
                },
            }],
            "behavior": {
                "scaleUp": _rules(DEFAULT_SCALE_UP, behavior.scale_up if behavior else None),
                "scaleDown": _rules(DEFAULT_SCALE_DOWN, behavior.scale_down if behavior else None),
            },
        },
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
