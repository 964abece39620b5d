"""Engine StatefulSets, one per pipeline stage (ordinal i of every stage forms group i): pods that run the launcher,
copied in by an init container, in any vLLM image, with one env variable per `engine_settings` row, readiness on
the launcher's `/health` and Pod Security `restricted`, and their variants for vLLM's CPU backend and for the
simulator. Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, replace
from typing import Any

from tensorfleet import contract, engine_settings
from tensorfleet.api.models import InferenceServiceSpec, ResourceRequirements
from tensorfleet.catalog import find_gpu
from tensorfleet.engine_settings import SETTINGS
from tensorfleet.render.claims import claims_gpus, gpu_claim_template_name
from tensorfleet.render.meta import (
    Context,
    is_cpu,
    is_gpu,
    is_vllm,
    metadata,
    pod_labels,
    prefill_context,
    prefill_stage_selector,
    publishes_kv_events,
    resources_block,
    stage_selector,
)

CONTAINER_NAME = "engine"
REVISION_HISTORY_LIMIT = 3
STARTUP_PERIOD_SECONDS = 10
SIMULATOR_REQUESTS = {"cpu": "100m", "memory": "256Mi"}
# The init container copies one file of about 300 KiB.
LAUNCHER_REQUESTS = {"cpu": "10m", "memory": "64Mi"}
LAUNCHER_LIMITS = {"memory": "128Mi"}
LAUNCHER_VOLUME_SIZE = "64Mi"


def desired_replicas(spec: InferenceServiceSpec, *, idle: bool = False) -> int:
    """Model replicas (groups): what every stage StatefulSet runs.

    Under autoscaling the HPA's bounds apply at once: the API server defaults
    spec.replicas to 1 before the HPA first writes it, and the HPA would clamp
    any value outside [minReplicas, maxReplicas] on its next sync anyway (its
    floor is 1 even with minReplicas 0). IDLE: the operator took the fleet to
    zero (minReplicas 0, no request for scaleToZeroAfterSeconds); only it
    decides that, and spec.replicas stays the HPA's.
    """
    if spec.autoscaling is not None:
        bounds = spec.autoscaling
        if idle and bounds.scales_to_zero:
            return 0
        floor = max(1, bounds.min_replicas)
        wanted = spec.replicas if spec.replicas is not None else floor
        return min(max(wanted, floor), bounds.max_replicas)
    return spec.replicas if spec.replicas is not None else 1


def simulates_gpus(ctx: Context) -> bool:
    """A simulator pod, which stands in for a GPU one (the planner refuses it accelerator CPU): its launcher serves
    GPU health and gauges from simulated GPUs, whose state is the pod's ANNOTATION_SIMULATED_GPU_STATE
    (worker/simgpu.py)."""
    return ctx.spec.engine.kind == "simulator"


def serves_gpu_metrics(ctx: Context) -> bool:
    """The launcher's `gpu-metrics` port: GPU gauges and the pod's /health, real or simulated GPUs."""
    return is_gpu(ctx) or simulates_gpus(ctx)


def statefulsets(ctx: Context) -> list[dict[str, Any]]:
    """The engine StatefulSets: one per pipeline stage, and with spec.prefill the prefill pool's after them."""
    prefill = prefill_context(ctx)
    if prefill is None:
        return [statefulset(ctx, stage) for stage in range(ctx.plan.pipeline)]
    decode = replace(ctx, pool=contract.POOL_DECODE)
    return [*(statefulset(decode, stage) for stage in range(ctx.plan.pipeline)),
            *(statefulset(prefill, stage) for stage in range(prefill.plan.pipeline))]


def _role(stage: int) -> str:
    return contract.ROLE_LEADER if stage == 0 else contract.ROLE_WORKER


def _stage_labels(ctx: Context, stage: int) -> dict[str, str]:
    """A stage's labels; a prefill pod's stage is LABEL_PREFILL_STAGE, so the decode pool's selectors miss it."""
    if ctx.pool == contract.POOL_PREFILL:
        return {contract.LABEL_PREFILL_STAGE: str(stage), contract.LABEL_ROLE: _role(stage),
                contract.LABEL_POOL: contract.POOL_PREFILL}
    labels = {contract.LABEL_STAGE: str(stage), contract.LABEL_ROLE: _role(stage)}
    if ctx.pool is not None:
        labels[contract.LABEL_POOL] = ctx.pool
    return labels


def statefulset(ctx: Context, stage: int) -> dict[str, Any]:
    spec = ctx.spec
    cache = spec.cache
    # The operator replaces whole groups itself (controller/rollout.py): the
    # StatefulSet controller would roll each stage on its own, mixing versions
    # inside a group, and take a pod down before its replacement has loaded.
    prefill = ctx.pool == contract.POOL_PREFILL
    body: dict[str, Any] = {
        # The prefill pool holds spec.prefill.replicas (no HPA scales it), and idles with the fleet.
        "replicas": (0 if prefill and ctx.idle else desired_replicas(spec, idle=ctx.idle) + ctx.surge),
        "serviceName": contract.workers_service_name(ctx.name),
        # Groups load for minutes; ordered start-up would serialise that.
        "podManagementPolicy": "Parallel",
        "revisionHistoryLimit": REVISION_HISTORY_LIMIT,
        "selector": {"matchLabels": (prefill_stage_selector if prefill else stage_selector)(ctx.name, stage)},
        # Prefill engines are single-stage: the StatefulSet controller replaces them one at a time, and the
        # routers send prompts to decode engines meanwhile (no group to keep together, no request lost).
        "updateStrategy": {"type": "RollingUpdate"} if prefill else {"type": "OnDelete"},
        "template": _pod_template(ctx, stage),
    }
    if cache.size:
        body["persistentVolumeClaimRetentionPolicy"] = {
            "whenDeleted": cache.retention_policy,
            "whenScaled": cache.retention_policy,
        }
        body["volumeClaimTemplates"] = [_cache_claim(ctx)]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(ctx, (contract.prefill_stage_name if prefill else contract.stage_name)(ctx.name, stage),
                             contract.COMPONENT_ENGINE, _stage_labels(ctx, stage)),
        "spec": body,
    }


def _cache_claim(ctx: Context) -> dict[str, Any]:
    cache = ctx.spec.cache
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name:
        claim["storageClassName"] = cache.storage_class_name
    # volumeClaimTemplates cannot be changed after creation: only labels that
    # stay fixed for the InferenceService's life (no version) go here.
    return {
        "metadata": {"name": contract.CACHE_VOLUME, "labels": pod_labels(ctx.name, contract.COMPONENT_ENGINE)},
        "spec": claim,
    }


def _pod_template(ctx: Context, stage: int) -> dict[str, Any]:
    spec = ctx.spec
    pod: dict[str, Any] = {
        # Kubernetes injects `<SERVICE>_PORT=tcp://...` for every Service in
        # the namespace; one named `vllm` yields VLLM_PORT, which vLLM reads.
        "enableServiceLinks": False,
        # The engine never talks to the API server.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": spec.engine.termination_grace_period_seconds,
        "securityContext": _pod_security(ctx),
        "containers": [_container(ctx, stage)],
        "volumes": _volumes(ctx),
    }
    if is_vllm(ctx):
        pod["initContainers"] = [_launcher_init_container(ctx)]
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": ref.name} for ref in spec.image_pull_secrets]
    if claims_gpus(ctx.spec, ctx.plan):
        # The scheduler allocates devices of the planned type from the DeviceClass: no node label is read.
        pod["resourceClaims"] = [{"name": contract.GPU_CLAIM, "resourceClaimTemplateName": gpu_claim_template_name(ctx)}]
    elif is_gpu(ctx) and spec.accelerator.node_affinity == "auto":
        pod["affinity"] = _gpu_affinity(ctx)
    if spec.parallelism.group_topology_key and ctx.plan.pipeline > 1:
        pod.setdefault("affinity", {})["podAffinity"] = _group_affinity(ctx, spec.parallelism.group_topology_key)
    if spec.accelerator.node_selector:
        pod["nodeSelector"] = dict(sorted(spec.accelerator.node_selector.items()))
    tolerations = _tolerations(ctx)
    if tolerations:
        pod["tolerations"] = tolerations
    return {
        "metadata": {"labels": {**pod_labels(ctx.name, contract.COMPONENT_ENGINE), **_stage_labels(ctx, stage)}},
        "spec": pod,
    }


def run_as_user(ctx: Context) -> int:
    """The numeric user the engine image is built to run as."""
    return contract.WORKER_UID if is_vllm(ctx) else contract.CONTROL_PLANE_UID


def _pod_security(ctx: Context) -> dict[str, Any]:
    uid = run_as_user(ctx)
    security: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": uid}
    if not is_vllm(ctx):
        # The control-plane image's user has a group of its own; the worker
        # image's user is in group 0 (the image made its HOME group-writable),
        # which the runtime takes from the image when runAsGroup is unset.
        security["runAsGroup"] = uid
    # Group ownership makes a PVC-backed cache writable, and OnRootMismatch
    # avoids re-chowning hundreds of GB of weights on every start.
    security.update({
        "fsGroup": uid,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    })
    return security


def _container_security() -> dict[str, Any]:
    # No readOnlyRootFilesystem (not part of `restricted`): vLLM, Triton and
    # torch.compile write caches under $HOME, and Ray its session under /tmp.
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _image(ctx: Context) -> str:
    engine = ctx.spec.engine
    if engine.image:
        return engine.image
    if is_cpu(ctx):
        return ctx.images.cpu_worker
    return ctx.images.worker if is_gpu(ctx) else ctx.images.control_plane


def _launcher_init_container(ctx: Context) -> dict[str, Any]:
    """Copies the launcher zipapp from the control-plane image (the operator's, so launcher and env agree)."""
    return {
        "name": contract.LAUNCHER_INIT_CONTAINER,
        "image": ctx.images.control_plane,
        "command": list(contract.LAUNCHER_INSTALL_COMMAND),
        "resources": resources_block(dict(LAUNCHER_REQUESTS), dict(LAUNCHER_LIMITS)),
        "securityContext": {**_container_security(), "readOnlyRootFilesystem": True},
        # Its one-line error (say, an image built without the bundle) reaches Degraded.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": contract.LAUNCHER_VOLUME, "mountPath": contract.LAUNCHER_DIR}],
    }


def _container(ctx: Context, stage: int) -> dict[str, Any]:
    engine = ctx.spec.engine
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": _image(ctx),
    }
    if engine.image_pull_policy:
        container["imagePullPolicy"] = engine.image_pull_policy
    ports = [_port(contract.PORT_NAME_RAY, contract.RAY_PORT)]
    if stage == 0:
        ports.insert(0, _port(contract.PORT_NAME_HTTP, contract.ENGINE_PORT))
        if ctx.plan.kv_connector is not None:
            # NIXL's side channel, where the other pool's engines read this one's KV cache.
            ports.insert(1, _port(contract.NIXL_PORT_NAME, contract.NIXL_SIDE_CHANNEL_PORT))
        if publishes_kv_events(ctx):
            # The KV events the router indexes, and their replay.
            ports += [_port(contract.KV_EVENTS_PORT_NAME, contract.KV_EVENTS_PORT),
                      _port(contract.KV_EVENTS_REPLAY_PORT_NAME, contract.KV_EVENTS_REPLAY_PORT)]
    if serves_gpu_metrics(ctx):
        # Named, so a PodMonitor can scrape the GPU health gauges of every stage.
        ports.append(_port(contract.PORT_NAME_GPU_METRICS, contract.WORKER_METRICS_PORT))
    elif is_cpu(ctx):
        # The launcher's /health alone: no gauges for the PodMonitor (which scrapes `gpu-metrics`) to find.
        ports.append(_port(contract.PORT_NAME_POD_HEALTH, contract.WORKER_METRICS_PORT))
    container.update({
        "command": list(contract.LAUNCHER_COMMAND if is_vllm(ctx) else contract.WORKER_COMMAND),
        "env": _env(ctx, stage),
        "ports": ports,
        "resources": _resources(ctx),
        **_probes(ctx, stage),
        "securityContext": _container_security(),
        # A crash's last log lines (vLLM's exception) become the termination message,
        # which Degraded and the events show (controller/diagnose.py).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": contract.SHM_VOLUME, "mountPath": contract.SHM_PATH},
            {"name": contract.CACHE_VOLUME, "mountPath": contract.CACHE_PATH},
            *_launcher_mounts(ctx),
            *([{"name": contract.SIMULATED_GPU_VOLUME, "mountPath": contract.SIMULATED_GPU_DIR, "readOnly": True}]
              if simulates_gpus(ctx) else []),
        ],
    })
    return container


def _launcher_mounts(ctx: Context) -> list[dict[str, Any]]:
    if not is_vllm(ctx):
        return []
    return [
        {"name": contract.LAUNCHER_VOLUME, "mountPath": contract.LAUNCHER_DIR, "readOnly": True},
        {"name": contract.ENGINE_HOME_VOLUME, "mountPath": contract.ENGINE_HOME_PATH},
    ]


def _port(name: str, number: int) -> dict[str, Any]:
    # protocol is spelled out: it is part of the list-map key under
    # server-side apply, and leaving it to defaulting causes conflicts.
    return {"name": name, "containerPort": number, "protocol": "TCP"}


def _value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


@dataclass(frozen=True)
class _FieldRef:
    """A value the kubelet fills in from the pod itself (the downward API)."""

    path: str


def _settings_env(values: dict[str, str | _FieldRef | None]) -> list[dict[str, Any]]:
    """One variable per row of the settings table, in its order; a None value leaves the variable out."""
    rows = [setting.env for setting in SETTINGS]
    if set(values) != set(rows):
        raise ValueError(
            f"the engine env needs a value (or None) for exactly the rows of tensorfleet.engine_settings: "
            f"missing {sorted(set(rows) - set(values))}, unknown {sorted(set(values) - set(rows))}"
        )
    env: list[dict[str, Any]] = []
    for name in rows:
        value = values[name]
        if isinstance(value, _FieldRef):
            env.append(_field(name, value.path))
        elif value is not None:
            env.append(_value(name, value))
    return env


def _env(ctx: Context, stage: int) -> list[dict[str, Any]]:
    spec, plan, name = ctx.spec, ctx.plan, ctx.name
    leader = (
        f"{contract.stage_name(name, 0)}-$({contract.ENV_GROUP_INDEX})"
        f".{contract.workers_service_name(name)}.$({contract.ENV_NAMESPACE}).svc"
    )
    quantization = spec.model.quantization
    lora = plan.lora
    # The table's order is the env's: $(VAR) expands only variables defined earlier in the list.
    env = _settings_env({
        contract.ENV_ENGINE_KIND: spec.engine.kind,
        contract.ENV_INFERENCE_SERVICE: name,
        contract.ENV_NAMESPACE: _FieldRef("metadata.namespace"),
        contract.ENV_POD_NAME: _FieldRef("metadata.name"),
        contract.ENV_GROUP_INDEX: _FieldRef(f"metadata.labels['{contract.LABEL_POD_INDEX}']"),
        contract.ENV_STAGE_INDEX: str(stage),
        contract.ENV_LEADER_ADDRESS: leader,
        contract.ENV_RAY_PORT: str(contract.RAY_PORT),
        contract.ENV_ENGINE_PORT: str(contract.ENGINE_PORT),
        # The plan's layout, not the spec's: the planner may have chosen it.
        contract.ENV_TENSOR_PARALLEL: str(plan.tensor),
        contract.ENV_PIPELINE_PARALLEL: str(plan.pipeline),
        contract.ENV_MODEL: spec.model.name,
        contract.ENV_SERVED_MODEL_NAME: ctx.served_name,
        contract.ENV_MODEL_REVISION: spec.model.revision or None,
        # What the spec says (auto included), not the dtype the planner sized with.
        contract.ENV_DTYPE: plan.engine_dtype,
        # "none" means "no quantization flag", the same as leaving it out.
        contract.ENV_QUANTIZATION: quantization if quantization and quantization != "none" else None,
        contract.ENV_KV_CACHE_DTYPE: spec.engine.kv_cache_dtype,
        contract.ENV_MAX_MODEL_LEN: str(plan.max_model_len),
        # vLLM's CPU backend sizes no KV cache from it: VLLM_CPU_KVCACHE_SPACE below does.
        contract.ENV_GPU_MEMORY_UTILIZATION: None if plan.cpu else str(spec.engine.gpu_memory_utilization),
        contract.ENV_MAX_NUM_SEQS: str(plan.max_num_seqs),
        # LoRA's sizes are the plan's, and do not follow the adapters listed: adding one restarts nothing.
        contract.ENV_ENABLE_LORA: "true" if lora is not None else None,
        contract.ENV_MAX_LORAS: str(lora.max_loras) if lora is not None else None,
        contract.ENV_MAX_LORA_RANK: str(lora.max_rank) if lora is not None else None,
        contract.ENV_MAX_CPU_LORAS: str(lora.max_cpu_loras) if lora is not None else None,
        # Both pools run the connector as kv_both: the router's first request makes an engine a producer.
        contract.ENV_KV_TRANSFER_CONFIG: (json.dumps({"kv_connector": plan.kv_connector, "kv_role": "kv_both"},
                                                     separators=(",", ":")) if plan.kv_connector else None),
        contract.ENV_KV_EVENTS_CONFIG: engine_settings.kv_events_config() if publishes_kv_events(ctx) else None,
        contract.ENV_EXTRA_ARGS: json.dumps(list(spec.engine.args)),
        contract.ENV_ACCELERATOR: plan.accelerator,
        contract.ENV_KV_CACHE_TOKENS: str(plan.kv_cache_tokens),
        # The launcher serves GPU health gauges (pynvml) and the pod's /health on this port; on CPU /health alone.
        contract.ENV_GPU_METRICS_PORT: str(contract.WORKER_METRICS_PORT) if is_vllm(ctx) or simulates_gpus(ctx)
        else None,
        contract.ENV_SIMULATED_GPU_STATE: contract.SIMULATED_GPU_STATE_PATH if simulates_gpus(ctx) else None,
    })
    env.append(_value(contract.ENV_HF_HOME, contract.HF_HOME_PATH))
    if is_cpu(ctx):
        # vLLM's CPU backend allocates this KV cache (GiB) instead of sizing one from GPU memory.
        env.append(_value(contract.ENV_CPU_KVCACHE_SPACE, str(plan.cpu_kv_cache_gib)))
    if lora is not None:
        # vLLM's own switch (the simulator reads it too): the operator loads spec.adapters through the API.
        env.append(_value(contract.ENV_RUNTIME_LORA_UPDATING, "True"))
    if plan.kv_connector is not None:
        # NIXL's side channel (vLLM's variables): the pod's own address, which the other pool's engines dial.
        env.append(_field(contract.ENV_NIXL_SIDE_CHANNEL_HOST, "status.podIP"))
        env.append(_value(contract.ENV_NIXL_SIDE_CHANNEL_PORT, str(contract.NIXL_SIDE_CHANNEL_PORT)))
    env += _home_env(ctx)
    token = spec.hf_token_secret_ref
    if token is not None:
        env.append({
            "name": contract.ENV_HF_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}},
        })
    # Copied so callers mutating the output cannot reach into the spec.
    env += [copy.deepcopy(var.model_dump(by_alias=True, exclude_none=True)) for var in spec.engine.env]
    return env


def _home_env(ctx: Context) -> list[dict[str, Any]]:
    """HOME and USER of a GPU engine, unless spec.engine.env sets them.

    Stock vLLM images have no passwd entry for WORKER_UID: HOME would be `/`,
    where vLLM, Triton and torch.compile cannot write their caches, and
    getpass.getuser() (torch's inductor cache) would fail. The same values as
    the worker image's user.
    """
    if not is_vllm(ctx):
        return []
    theirs = {var.name for var in ctx.spec.engine.env}
    ours = ((contract.ENV_HOME, contract.ENGINE_HOME_PATH), (contract.ENV_USER, contract.ENGINE_USER))
    return [_value(name, value) for name, value in ours if name not in theirs]


def _user_resources(resources: ResourceRequirements | None) -> tuple[dict[str, str], dict[str, str]]:
    if resources is None:
        return {}, {}
    return dict(resources.requests), dict(resources.limits)


def _resources(ctx: Context) -> dict[str, Any]:
    requests, limits = _user_resources(ctx.spec.engine.resources)
    if claims_gpus(ctx.spec, ctx.plan):
        return {**resources_block(requests, limits), "claims": [{"name": contract.GPU_CLAIM}]}
    if is_gpu(ctx):
        # Extended resources must have requests == limits; the plan decides
        # the count, so the user's resources cannot override it.
        gpus = str(ctx.plan.tensor)
        requests[contract.GPU_RESOURCE] = gpus
        limits[contract.GPU_RESOURCE] = gpus
    elif ctx.spec.engine.resources is None:
        requests = dict(SIMULATOR_REQUESTS)
    return resources_block(requests, limits)


def _gpu_affinity(ctx: Context) -> dict[str, Any]:
    """Nodes with the planned GPU, under any labelling the catalog knows (GFD, GKE, Karpenter, AKS VM sizes)."""
    gpu = find_gpu(ctx.plan.accelerator)
    if gpu is None:
        raise ValueError(f"spec.accelerator.type: the plan names {ctx.plan.accelerator!r}, which is not in the GPU catalog")
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": gpu.node_selector_terms()},
        },
    }


def _group_affinity(ctx: Context, key: str) -> dict[str, Any]:
    """Every stage of a group in its leader's domain of node label KEY: the leader pods of this InferenceService
    whose StatefulSet pod index is the pod's own (matchLabelKeys adds it; the leader matches itself, so the first
    one placed chooses the domain)."""
    return {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": stage_selector(ctx.name, 0)},
        "matchLabelKeys": [contract.LABEL_POD_INDEX],
        "topologyKey": key,
    }]}


def _tolerations(ctx: Context) -> list[dict[str, Any]]:
    # Set explicitly: not every cluster runs the ExtendedResourceToleration
    # admission plugin that would add it for GPU requests.
    ours = (
        [{"key": contract.GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
        if is_gpu(ctx) else []
    )
    theirs = [t.model_dump(by_alias=True, exclude_none=True) for t in ctx.spec.accelerator.tolerations]
    return ours + theirs


def _volumes(ctx: Context) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        # NCCL exchanges tensor-parallel data through /dev/shm; the
        # container runtime's default of 64Mi is far too small.
        {"name": contract.SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": ctx.spec.engine.shm_size}},
    ]
    if not ctx.spec.cache.size:
        volumes.append({"name": contract.CACHE_VOLUME, "emptyDir": {}})
    if simulates_gpus(ctx):
        # Refreshed by the kubelet as the annotation changes: the launcher reads it at every check.
        volumes.append({"name": contract.SIMULATED_GPU_VOLUME, "downwardAPI": {"items": [{
            "path": contract.SIMULATED_GPU_STATE_PATH.rsplit("/", 1)[1],
            "fieldRef": {"fieldPath": f"metadata.annotations['{contract.ANNOTATION_SIMULATED_GPU_STATE}']"}}]}})
    if is_vllm(ctx):
        volumes += [
            {"name": contract.LAUNCHER_VOLUME, "emptyDir": {"sizeLimit": LAUNCHER_VOLUME_SIZE}},
            {"name": contract.ENGINE_HOME_VOLUME, "emptyDir": {}},
        ]
    return volumes


def _probes(ctx: Context, stage: int) -> dict[str, Any]:
    engine_health: dict[str, Any] = {"httpGet": {"path": contract.HEALTH_PATH, "port": contract.PORT_NAME_HTTP}}
    # The launcher's verdict on this pod: its GPUs (NVML, or simulated on a simulator; none on CPU), its engine,
    # Ray worker or stand-in running, and on stage 0 the engine's /health. It runs in the launcher, so a probe
    # costs no process and no NVML start-up. Stage 0's startup and liveness stay on vLLM's own /health: a restart
    # would not mend a GPU, only reload the model.
    port = contract.PORT_NAME_GPU_METRICS if serves_gpu_metrics(ctx) else contract.PORT_NAME_POD_HEALTH
    pod_health: dict[str, Any] = {"httpGet": {"path": contract.HEALTH_PATH, "port": port}}
    startup, readiness, liveness = (engine_health, pod_health, engine_health) if stage == 0 else (pod_health,) * 3
    # Downloading and loading a large model takes many minutes; the startup
    # probe holds off the others until then, so they can stay quick.
    startup_failures = math.ceil(ctx.spec.engine.startup_timeout_seconds / STARTUP_PERIOD_SECONDS)
    # Each probe gets its own copy: shared dicts would be dumped as YAML anchors.
    return {
        "startupProbe": {
            **copy.deepcopy(startup),
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": startup_failures,
        },
        "readinessProbe": {**copy.deepcopy(readiness), "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**copy.deepcopy(liveness), "periodSeconds": 15, "timeoutSeconds": 5, "failureThreshold": 4},
    }
