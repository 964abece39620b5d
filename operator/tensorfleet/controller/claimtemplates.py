"""GPU ResourceClaimTemplates (spec.accelerator.allocation deviceClass) outlive the spec that wanted them while
anything still names them: the resourceclaim controller makes a pod's claim from its template after the pod
exists, so a template pruned under a pod not yet given its claim would leave that pod Pending for good
(docs/dra.md).
"""

from __future__ import annotations

from typing import Any

from tensorfleet.controller.children import ChildHandler, Context
from tensorfleet.kube.resources import POD, STATEFUL_SET, Kind


def named_templates(pod_spec: dict[str, Any]) -> set[str]:
    """The ResourceClaimTemplates a pod (spec) names."""
    return {claim["resourceClaimTemplateName"] for claim in pod_spec.get("resourceClaims") or []
            if claim.get("resourceClaimTemplateName")}


class ClaimTemplateHandler(ChildHandler):
    """Server-side apply (the name carries a digest of the immutable spec, so an apply never changes one), and
    pruning only once neither a pod of the owner nor a StatefulSet as this reconcile found it names it."""

    def in_use(self, ctx: Context, live: dict[str, Any], children: dict[Kind, dict[str, dict[str, Any]]]) -> bool:
        name = live["metadata"]["name"]
        pods = ctx.cache.owned(POD, ctx.namespace, ctx.name).values()
        sets = (children.get(STATEFUL_SET) or {}).values()
        return any(name in named_templates(pod.get("spec") or {}) for pod in pods) or any(
            name in named_templates(((s.get("spec") or {}).get("template") or {}).get("spec") or {}) for s in sets)
