"""InferenceService + Plan -> the Kubernetes objects that serve it. Pure (no I/O, no clock, no randomness), because
the operator applies the output with server-side apply, `tensorfleet render` prints it and the tests validate it
against the Kubernetes OpenAPI schemas, and all three must see the same objects.
Design: docs/architecture.md#layers-one-way-only.
"""

from __future__ import annotations

from typing import Any

from tensorfleet import contract
from tensorfleet.api.models import InferenceService
from tensorfleet.planner import Plan
from tensorfleet.render.autoscaling import demand_lease, hpa, pdb
from tensorfleet.render.claims import claims_gpus, gpu_claim_templates
from tensorfleet.render.engine import desired_replicas, statefulsets
from tensorfleet.render.meta import (
    DEFAULT_IMAGES,
    Context,
    Images,
    engine_selector,
    leader_selector,
    router_selector,
    selector_string,
    stage_selector,
)
from tensorfleet.render.network import network_policies
from tensorfleet.render.router import deployment, role, role_binding, service_account
from tensorfleet.render.services import services

__all__ = [
    "DEFAULT_IMAGES",
    "Images",
    "claims_gpus",
    "desired_replicas",
    "engine_selector",
    "leader_selector",
    "render",
    "router_selector",
    "selector_string",
    "stage_selector",
]


def render(
    isvc: InferenceService,
    plan: Plan,
    *,
    namespace: str | None = None,
    standalone: bool = False,
    images: Images = DEFAULT_IMAGES,
    surge: int = 0,
    idle: bool = False,
    operator_namespace: str | None = None,
    gpu_device_class: str = contract.DEFAULT_GPU_DEVICE_CLASS,
) -> list[dict[str, Any]]:
    """Every object the InferenceService owns, in the order to apply them.

    namespace: overrides metadata.namespace (default "default").
    standalone: write no ownerReferences, for manifests meant to outlive
    the operator (they are also omitted when the input has no uid).
    images: the default worker and control-plane images.
    surge: extra groups the StatefulSets run during a rollout (the operator's
    decision; 0 for a printed render).
    idle: the fleet is at zero (minReplicas 0 and no demand for the idle
    period; the operator's decision, controller/idle.py).
    operator_namespace: where the operator's pods run; with LoRA they load
    adapters into the engines, and the engines' NetworkPolicy admits them.
    gpu_device_class: the DeviceClass GPU claims name (spec.accelerator.allocation deviceClass).
    """
    ctx = Context(
        isvc=isvc,
        plan=plan,
        namespace=namespace or isvc.metadata.namespace or "default",
        standalone=standalone,
        images=images,
        surge=surge,
        idle=idle,
        operator_namespace=operator_namespace,
        gpu_device_class=gpu_device_class,
    )
    # Dependencies first: identities and RBAC before the pods using them,
    # Services before the pods that resolve them, the NetworkPolicies and the
    # PDB before the pods they protect (no pod starts unisolated), the GPU
    # claim templates before the pods naming them, the HPA last since it
    # scales what already exists.
    objects: list[dict[str, Any]] = [
        service_account(ctx),
        role(ctx),
        role_binding(ctx),
        *services(ctx),
        *network_policies(ctx),
        pdb(ctx),
        *gpu_claim_templates(ctx),
        *statefulsets(ctx),
    ]
    lease = demand_lease(ctx)
    if lease is not None:
        objects.append(lease)  # before the routers that renew it
    objects.append(deployment(ctx))
    autoscaler = hpa(ctx)
    if autoscaler is not None:
        objects.append(autoscaler)
    return objects
