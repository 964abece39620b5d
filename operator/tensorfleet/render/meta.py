"""Labels, selectors and ownership shared by every rendered object."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tensorfleet import contract
from tensorfleet.api.models import InferenceService, InferenceServiceSpec
from tensorfleet.planner import Plan
from tensorfleet.planner.kvcache import FULL


@dataclass(frozen=True)
class Images:
    """Default images when a spec names none; the operator's flags can point them at a mirror.

    worker: the GPU engine image (a stock vLLM image by default). control_plane:
    the router's and the simulator's, and the one vLLM engine pods' init
    container copies the launcher from. cpu_worker: the engine image of
    accelerator CPU (vLLM's CPU build of the same release by default).
    """

    worker: str = contract.DEFAULT_ENGINE_IMAGE
    control_plane: str = contract.CONTROL_PLANE_IMAGE
    cpu_worker: str = contract.VLLM_CPU_IMAGE


# The images when no flag overrides them (frozen, so one instance serves every default).
DEFAULT_IMAGES = Images()



@dataclass(frozen=True)
class Context:
    """One render's inputs, resolved once so every module agrees on them."""

    isvc: InferenceService
    plan: Plan
    namespace: str
    standalone: bool
    images: Images = DEFAULT_IMAGES
    surge: int = 0  # groups beyond spec.replicas during a rollout (the operator decides; see controller/rollout.py)
    idle: bool = False  # the fleet is at zero (minReplicas 0; the operator decides, see controller/idle.py)
    # Where the operator runs, whose pods load LoRA adapters into the engines (None: not known, any namespace).
    operator_namespace: str | None = None
    # The DeviceClass engine pods' GPU claims name (spec.accelerator.allocation deviceClass; the operator's flag).
    gpu_device_class: str = contract.DEFAULT_GPU_DEVICE_CLASS
    # With spec.prefill: which pool this context renders (contract.POOL_PREFILL or POOL_DECODE); None:
    # colocated engines. The prefill pool's context carries that pool's spec and plan (prefill_context).
    pool: str | None = None

    @property
    def name(self) -> str:
        return self.isvc.metadata.name

    @property
    def spec(self) -> InferenceServiceSpec:
        return self.isvc.spec

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.spec.model.name


def is_vllm(ctx: Context) -> bool:
    """A vLLM engine pod (on GPUs or CPU): the stock image, the launcher copied in by the init container."""
    return ctx.spec.engine.kind == "vllm"


def publishes_kv_events(ctx: Context) -> bool:
    """An engine whose KV-cache events the router indexes (docs/routing.md#the-kv-cache-index): vLLM, or the
    simulator standing for it, serving a model whose layers all keep full attention. vLLM turns its hybrid
    KV-cache manager off beside KV events, which changes the cache of a model with sliding, chunked or state
    layers (and stops a hybrid one starting), so those publish none."""
    return all(spec == FULL for spec in ctx.plan.kv_pool.specs)   # both engine kinds publish


def uses_gpus(spec: InferenceServiceSpec, plan: Plan) -> bool:
    """vLLM on GPUs: what requests, selects and tolerates GPUs, and serves their gauges."""
    return spec.engine.kind == "vllm" and not plan.cpu


def is_gpu(ctx: Context) -> bool:
    """`uses_gpus` of the context's spec and plan."""
    return uses_gpus(ctx.spec, ctx.plan)


def is_cpu(ctx: Context) -> bool:
    """vLLM on its CPU backend (accelerator CPU)."""
    return is_vllm(ctx) and ctx.plan.cpu


def scales_to_zero(ctx: Context) -> bool:
    """autoscaling.minReplicas is 0: the routers renew a demand Lease and the operator may idle the fleet."""
    auto = ctx.spec.autoscaling
    return auto is not None and auto.scales_to_zero


def pod_labels(name: str, component: str) -> dict[str, str]:
    # No version label here: pod templates carry these, and a label change
    # would restart every GPU pod on an operator upgrade.
    return {
        contract.LABEL_NAME: contract.APP_NAME,
        contract.LABEL_INSTANCE: name,
        contract.LABEL_COMPONENT: component,
        contract.LABEL_MANAGED_BY: contract.APP_NAME,
        contract.LABEL_INFERENCE_SERVICE: name,
    }


def object_labels(name: str, component: str) -> dict[str, str]:
    return {**pod_labels(name, component), contract.LABEL_VERSION: contract.__version__}


def _instance_selector(name: str) -> dict[str, str]:
    # Selectors are immutable on StatefulSets and Deployments: keep them to
    # labels that never change for the life of the InferenceService.
    return {contract.LABEL_INSTANCE: name, contract.LABEL_INFERENCE_SERVICE: name}


def stage_selector(name: str, stage: int) -> dict[str, str]:
    return {**_instance_selector(name), contract.LABEL_STAGE: str(stage)}


def prefill_stage_selector(name: str, stage: int) -> dict[str, str]:
    """The prefill pool's stage-K pods: they carry LABEL_PREFILL_STAGE, never LABEL_STAGE, so no selector of the
    decode pool (stage_selector, leader_selector: the scale subresource's) matches them."""
    return {**_instance_selector(name), contract.LABEL_PREFILL_STAGE: str(stage)}


def prefill_context(ctx: Context) -> Context | None:
    """The prefill pool's render context: the spec with spec.prefill's replicas, parallelism and accelerator in
    place of the decode pool's, and the prefill plan; None without spec.prefill."""
    prefill, plan = ctx.spec.prefill, ctx.plan.prefill
    if prefill is None or plan is None:
        return None
    spec = ctx.spec.model_copy(update={
        "replicas": prefill.replicas, "autoscaling": None, "parallelism": prefill.parallelism,
        "accelerator": prefill.accelerator or ctx.spec.accelerator,
    })
    isvc = ctx.isvc.model_copy(update={"spec": spec})
    return replace(ctx, isvc=isvc, plan=plan, surge=0, pool=contract.POOL_PREFILL)


def leader_selector(name: str) -> dict[str, str]:
    """Stage-0 pods: one per group. What the scale subresource's selector must match."""
    return stage_selector(name, 0)


def engine_selector(name: str) -> dict[str, str]:
    """Every engine pod of every stage."""
    return {**_instance_selector(name), contract.LABEL_COMPONENT: contract.COMPONENT_ENGINE}


def router_selector(name: str) -> dict[str, str]:
    return {**_instance_selector(name), contract.LABEL_COMPONENT: contract.COMPONENT_ROUTER}


def selector_string(labels: dict[str, str]) -> str:
    """A label selector in the `k=v,k=v` form `.status.selector` and kubectl use."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def owner_references(ctx: Context) -> list[dict[str, Any]]:
    # Without a uid a reference cannot be complete, and the API server
    # rejects incomplete ones; standalone output is meant to outlive us.
    uid = ctx.isvc.metadata.uid
    if ctx.standalone or not uid:
        return []
    return [{
        "apiVersion": contract.API_VERSION,
        "kind": contract.KIND,
        "name": ctx.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }]


def metadata(ctx: Context, name: str, component: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ctx.namespace,
        "labels": {**object_labels(ctx.name, component), **(extra_labels or {})},
    }
    owners = owner_references(ctx)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def resources_block(requests: dict[str, Any], limits: dict[str, Any]) -> dict[str, Any]:
    """A container's `resources`, keys sorted and empty halves left out, so renders compare stably."""
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = dict(sorted(limits.items()))
    if requests:
        out["requests"] = dict(sorted(requests.items()))
    return out
