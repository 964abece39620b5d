"""The GPU ResourceClaimTemplate of engine pods under Dynamic Resource Allocation (spec.accelerator.allocation
deviceClass): each pod's claim asks for parallelism.tensor devices of the operator's DeviceClass that are the
planned GPU type by NVIDIA's DRA driver's attributes. A template's spec is immutable, so its name carries a
digest of it and a changed request gets a new template (docs/dra.md).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

from tensorfleet import contract
from tensorfleet.api.models import InferenceServiceSpec
from tensorfleet.catalog import find_gpu
from tensorfleet.planner import Plan
from tensorfleet.render.meta import Context, metadata, pod_labels, prefill_context, uses_gpus

API_VERSION = "resource.k8s.io/v1"
DIGEST_LENGTH = 10


def claims_gpus(spec: InferenceServiceSpec, plan: Plan) -> bool:
    """The pool's engine pods get their GPUs by a ResourceClaim rather than the device plugin's extended resource."""
    return uses_gpus(spec, plan) and spec.accelerator.allocation == contract.ALLOCATION_DEVICE_CLASS


def _claim_spec(ctx: Context) -> dict[str, Any]:
    gpu = find_gpu(ctx.plan.accelerator)
    if gpu is None:
        raise ValueError(f"spec.accelerator.type: the plan names {ctx.plan.accelerator!r}, which is not in the GPU catalog")
    return {"devices": {"requests": [{"name": contract.GPU_CLAIM, "exactly": {
        "deviceClassName": ctx.gpu_device_class,
        "allocationMode": "ExactCount",
        "count": ctx.plan.tensor,
        "selectors": [{"cel": {"expression": gpu.dra_selector()}}],
    }}]}}


def gpu_claim_template_name(ctx: Context) -> str:
    """The name of the pool's template: the service's, the pool's, and a digest of what it asks for."""
    digest = hashlib.sha256(json.dumps(_claim_spec(ctx), sort_keys=True).encode()).hexdigest()[:DIGEST_LENGTH]
    return contract.gpu_claim_template_name(ctx.name, digest, ctx.pool)


def gpu_claim_template(ctx: Context) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": metadata(ctx, gpu_claim_template_name(ctx), contract.COMPONENT_ENGINE),
        # The claims made from it carry the engine labels, so a person finds them beside the pods.
        "spec": {"metadata": {"labels": pod_labels(ctx.name, contract.COMPONENT_ENGINE)}, "spec": _claim_spec(ctx)},
    }


def gpu_claim_templates(ctx: Context) -> list[dict[str, Any]]:
    """The templates every pool's pods name: none with the extended resource (the default)."""
    prefill = prefill_context(ctx)
    pools = [ctx] if prefill is None else [replace(ctx, pool=contract.POOL_DECODE), prefill]
    return [gpu_claim_template(pool) for pool in pools if claims_gpus(pool.spec, pool.plan)]
