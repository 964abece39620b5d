"""Pydantic models of the InferenceService API (tensorfleet.dev/v1alpha1), the single source of truth: the CRD is
generated from them (`crd.py`), the CLI and the operator parse and write status with them, every `description` is
what `kubectl explain` shows, and the defaults live here, not in the CRD.
Design: docs/api.md#the-models-are-the-source-of-truth."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from tensorfleet import contract, vllm_defaults
from tensorfleet.api.architecture import ArchitectureSpec
from tensorfleet.api.base import (
    DNS_1035_PATTERN,
    DNS_1123_LABEL_PATTERN,
    ENV_NAME_PATTERN,
    LABEL_KEY_PATTERN,
    MAX_NAME_LENGTH,
    ApiModel,
    Quantity,
)
from tensorfleet.api.status import InferenceServiceStatus
from tensorfleet.api.traffic import TrafficSpec
from tensorfleet.engine_settings import WORKER_ENV_VARS, engine_arg_problem

# --- spec.model --------------------------------------------------------------


class ModelSpec(ApiModel):
    name: str = Field(
        min_length=1, max_length=512,
        description="Hugging Face model id (e.g. meta-llama/Llama-3.1-70B-Instruct) or a path inside the model cache.",
    )
    served_name: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="Name clients pass as the OpenAI `model`. Default: model.name.",
    )
    revision: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="Model revision (branch, tag or commit) to download. Default: the repository's default branch.",
    )
    dtype: Literal["auto", "bfloat16", "float16"] = Field(
        default="auto",
        description=(
            "Activation and weight dtype, passed to vLLM as --dtype. `auto` follows the checkpoint (an fp16 or AWQ "
            "one runs in float16); on a GPU without bfloat16 (T4) it is passed as float16. Default: auto."
        ),
    )
    quantization: Literal["none", "fp8", "awq", "gptq"] | None = Field(
        default=None,
        description=(
            "Weight quantization. Omit to serve the checkpoint as it ships (DeepSeek-V3 ships fp8, gpt-oss mxfp4). "
            "fp8 quantizes a 16-bit checkpoint at load time; awq and gptq need a checkpoint quantized that way."
        ),
    )
    max_model_len: int | None = Field(
        default=None, ge=128, le=10_000_000,
        description="Longest sequence (prompt + output) in tokens. Default: the model's full context length.",
    )
    architecture: ArchitectureSpec | None = Field(
        default=None,
        description="Model facts for a model the catalog does not know (`tensorfleet catalog` lists known ones). Wins over the catalog when given.",
    )


# --- spec.engine ---------------------------------------------------------------


class EnvVar(ApiModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=ENV_NAME_PATTERN, max_length=256, description="Variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None, alias="valueFrom",
        description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: set value or valueFrom, not both")
        return self


class ResourceRequirements(ApiModel):
    requests: dict[str, Quantity] = Field(default_factory=dict, description="e.g. {cpu: '16', memory: 200Gi}.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="e.g. {memory: 400Gi}.")


def _engine_arg(arg: str) -> str:
    """One item of spec.engine.args: no flag the operator sets, in any spelling vLLM reads (engine_settings)."""
    problem = engine_arg_problem(arg)
    if problem is not None:
        raise ValueError(problem)
    return arg


# Errors name the item: spec.engine.args[3].
EngineArg = Annotated[str, AfterValidator(_engine_arg)]


class EngineSpec(ApiModel):
    kind: contract.EngineKind = Field(
        default=contract.DEFAULT_ENGINE_KIND,
        description="`vllm` serves the model on GPUs; `simulator` runs a CPU-only vLLM stand-in with the same API and metrics (tests, demos, kind clusters). Default: vllm.",
    )
    image: str | None = Field(
        default=None, min_length=1, max_length=512,
        description=(
            "Engine image. vllm: any vLLM image (Python >= 3.10 with vLLM's pydantic 2); the launcher is copied in "
            "by an init container from the control-plane image. simulator: an image with `tensorfleet-worker`. "
            f"Default: {contract.DEFAULT_ENGINE_IMAGE} (vllm), {contract.CONTROL_PLANE_IMAGE} (simulator)."
        ),
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Kubernetes imagePullPolicy of the engine container. Default: Kubernetes' own."
    )
    gpu_memory_utilization: float = Field(
        default=vllm_defaults.GPU_MEMORY_UTILIZATION, ge=0.1, le=0.99,
        description=(
            "Share of each GPU's memory vLLM may use for weights, activations and KV cache. Not for accelerator "
            f"{contract.CPU_ACCELERATOR}, where spec.engine.resources.requests.memory sizes them. "
            f"Default: {vllm_defaults.GPU_MEMORY_UTILIZATION}."
        ),
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto", description="KV-cache element type; fp8 doubles KV capacity. Default: auto (the model dtype)."
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, le=65536,
        description=(
            "Most sequences the engine batches at once (vLLM --max-num-seqs). Default: vLLM's, "
            f"{vllm_defaults.LARGE_GPU_MAX_NUM_SEQS} on GPUs of {vllm_defaults.LARGE_GPU_MIN_MIB // 1024} GiB or more "
            f"other than A100, else {vllm_defaults.MAX_NUM_SEQS}."
        ),
    )
    args: list[EngineArg] = Field(
        default_factory=list, max_length=256,
        description=(
            "Extra engine flags, one flag or value per item (never one shell string), appended after the operator's own. "
            "Flags the operator sets from this spec (--max-model-len, --tensor-parallel-size, --port, ...) are refused "
            "in every spelling vLLM reads: --max_model_len, --max-model-len=N, -tp, abbreviations."
        ),
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=256, description="Extra environment variables for the engine container.")
    resources: ResourceRequirements | None = Field(
        default=None,
        description=(
            "CPU, memory and other requests/limits of the engine container. GPUs are set from the plan. With "
            f"accelerator {contract.CPU_ACCELERATOR}, requests.memory is required: the memory the planner fits the "
            "weights, the KV cache and vLLM's own processes in (e.g. 24Gi); give the engine whole cores in "
            "requests.cpu."
        ),
    )
    shm_size: Quantity = Field(
        default="16Gi", description="Size of the memory-backed /dev/shm (NCCL needs it for tensor parallelism). Default: 16Gi."
    )
    startup_timeout_seconds: int = Field(
        default=3600, ge=60, le=86400,
        description="How long a pod may take to download and load the model before it is restarted. Default: 3600.",
    )
    termination_grace_period_seconds: int = Field(
        default=120, ge=0, le=3600,
        description="Time a stopping engine gets to finish in-flight requests. Default: 120.",
    )
    lora: LoraSpec | None = Field(
        default=None,
        description=(
            "LoRA settings of the engines. Set with spec.adapters, or alone to have the engines ready for adapters "
            "added later without a restart. Default: the planner's, when spec.adapters lists any."
        ),
    )

    @field_validator("args", mode="before")
    @classmethod
    def _args_is_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError(  # noqa: TRY004 - pydantic reports only ValueError as a ValidationError; TypeError escapes
                "must be a list with one flag or value per item (e.g. [\"--enable-prefix-caching\"]), not one shell string"
            )
        return value

    @field_validator("env")
    @classmethod
    def _env_not_reserved(cls, value: list[EnvVar]) -> list[EnvVar]:
        for var in value:
            if var.name in WORKER_ENV_VARS:
                raise ValueError(f"{var.name} is set by the operator and cannot be overridden")
            if var.name == contract.ENV_RUNTIME_LORA_UPDATING:
                raise ValueError(f"{var.name} is set by the operator when spec.adapters lists adapters "
                                 "(it loads them through the engines' API)")
            if var.name == contract.ENV_CPU_KVCACHE_SPACE:
                raise ValueError(f"{var.name} is set by the operator for accelerator {contract.CPU_ACCELERATOR}, from "
                                 "the plan's KV cache; size it with spec.engine.resources.requests.memory")
            if var.name in (contract.ENV_NIXL_SIDE_CHANNEL_HOST, contract.ENV_NIXL_SIDE_CHANNEL_PORT):
                raise ValueError(f"{var.name} is set by the operator with spec.prefill (the pod's address and "
                                 f"port {contract.NIXL_SIDE_CHANNEL_PORT})")
        return value


# --- spec.adapters / spec.engine.lora --------------------------------------------

# The ranks vLLM's --max-lora-rank accepts (vllm/config/lora.py, MaxLoRARanks).
LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# An OpenAI model name as clients send it: no spaces, no control characters.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]*$"
MAX_ADAPTERS = 256


class LoraSpec(ApiModel):
    """How the engines hold LoRA adapters (vLLM's --max-loras, --max-lora-rank, --max-cpu-loras)."""

    max_loras: int | None = Field(
        default=None, ge=1, le=256,
        description=(
            "Adapters an engine holds in GPU memory at once, each in a slot sized for maxRank; a batch mixes at "
            "most this many (vLLM --max-loras). The slots' memory comes out of the KV cache. Default: the planner's, "
            "8, fewer when the slots would take more than a tenth of the KV cache (never the number of adapters "
            "listed, so that adding one restarts nothing)."
        ),
    )
    max_rank: int | None = Field(
        default=None,
        description=(
            f"Largest adapter rank the engines take (vLLM --max-lora-rank; one of {', '.join(map(str, LORA_RANKS))}). "
            "Default: the smallest of those that holds every adapter's rank, an adapter without `rank` counting as 16."
        ),
    )
    max_cpu_loras: int | None = Field(
        default=None, ge=1, le=4096,
        description=(
            "Adapters an engine keeps in host memory, so bringing one back into a GPU slot needs no read from disk "
            "(vLLM --max-cpu-loras; at least maxLoras). Default: twice maxLoras."
        ),
    )

    @field_validator("max_rank")
    @classmethod
    def _rank_supported(cls, value: int | None) -> int | None:
        if value is not None and value not in LORA_RANKS:
            higher = [rank for rank in LORA_RANKS if rank >= value]
            hint = f"; use {higher[0]}" if higher else ""
            raise ValueError(f"{value} is not a rank vLLM supports ({', '.join(map(str, LORA_RANKS))}){hint}")
        return value

    @model_validator(mode="after")
    def _cpu_holds_gpu(self) -> LoraSpec:
        if self.max_cpu_loras is not None and self.max_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"maxCpuLoras {self.max_cpu_loras} is less than maxLoras {self.max_loras}; vLLM needs at least as "
                "many adapters in host memory as in GPU slots"
            )
        return self


class AdapterSpec(ApiModel):
    """One LoRA adapter of the base model, served under its own name."""

    name: str = Field(
        min_length=1, max_length=256, pattern=ADAPTER_NAME_PATTERN,
        description="The OpenAI `model` clients send to use this adapter, e.g. sql-assistant. Unique, and not the base model's served name.",
    )
    source: str = Field(
        min_length=1, max_length=512,
        description=(
            "Where the engines read the adapter: a Hugging Face repository id (org/name; its default branch, read "
            "with spec.hfTokenSecretRef's token) or an absolute path inside the model cache volume (spec.cache, "
            f"mounted at {contract.CACHE_PATH}), e.g. {contract.CACHE_PATH}/adapters/sql."
        ),
    )
    rank: int | None = Field(
        default=None, ge=1, le=512,
        description=(
            "The adapter's rank (`r` in its adapter_config.json), for sizing. Default: spec.engine.lora.maxRank, "
            "the most an adapter can take."
        ),
    )

    @field_validator("source")
    @classmethod
    def _source_form(cls, value: str) -> str:
        if value.startswith("/"):
            if any(part in ("..", "") for part in value[1:].split("/")) and value != "/":
                raise ValueError(f"{value!r}: an absolute path without '..' or empty parts, e.g. {contract.CACHE_PATH}/adapters/sql")
            return value
        if "://" in value or value.count("/") != 1 or not all(value.split("/")):
            raise ValueError(
                f"{value!r} is neither a Hugging Face repository id (org/name) nor an absolute path in the model cache"
            )
        return value


# --- spec.parallelism / accelerator ------------------------------------------


class ParallelismSpec(ApiModel):
    tensor: int | None = Field(
        default=None, ge=1, le=64,
        description="Tensor-parallel size: GPUs per pod, all on one node. Omit to let the planner choose the smallest layout that fits.",
    )
    pipeline: int | None = Field(
        default=None, ge=1, le=64,
        description="Pipeline-parallel size: pods (nodes) per model replica, joined with Ray. Omit to let the planner choose.",
    )
    group_topology_key: str | None = Field(
        default=None, max_length=316, pattern=LABEL_KEY_PATTERN,
        description=(
            "A node label whose value every pod of one pipeline group shares: the stages of a group are placed "
            "on nodes of one domain, e.g. one NVLink domain with nvidia.com/gpu.clique (GPU feature discovery's "
            "label on multi-node NVLink systems such as GB200 NVL72). Each worker stage must land in its group "
            "leader's domain (podAffinity with matchLabelKeys on the StatefulSet pod index; Kubernetes 1.31+). "
            "Only for pipeline > 1. Default: none, stages go wherever their GPUs are."
        ),
    )


class Toleration(ApiModel):
    key: str | None = Field(default=None, max_length=316, description="Taint key; empty with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal. Default: Equal.")
    value: str | None = Field(default=None, max_length=63, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(default=None, description="Taint effect; empty matches all.")
    toleration_seconds: int | None = Field(default=None, description="For NoExecute: how long the pod stays bound after the taint appears.")


class AcceleratorSpec(ApiModel):
    type: str = Field(
        min_length=1, max_length=64,
        description=(
            "GPU type from the catalog, e.g. H100-80GB, A100-80GB, A100-40GB, H200-141GB, L40S, L4, A10G (`tensorfleet "
            f"catalog` lists them), or {contract.CPU_ACCELERATOR}: vLLM's CPU backend (engine kind vllm, pipeline "
            "1, tensor parallel as worker processes in the one pod, the vLLM CPU image by default). A CPU pod requests no GPU, selects no GPU node and tolerates "
            "no GPU taint; the planner sizes weights and KV cache from spec.engine.resources.requests.memory, "
            f"which it then requires, and hands vLLM the KV cache as {contract.ENV_CPU_KVCACHE_SPACE}."
        ),
    )
    gpus_per_node: int | None = Field(
        default=None, ge=1, le=16,
        description="GPUs on each node of this type; bounds parallelism.tensor. Default: the catalog's usual count (8 for data-centre GPUs).",
    )
    allocation: Literal["extendedResource", "deviceClass"] = Field(
        default="extendedResource",
        description=(
            f"How engine pods get their GPUs. `extendedResource`: parallelism.tensor of {contract.GPU_RESOURCE} "
            "(the NVIDIA device plugin) on a node labelled with this GPU type (nodeAffinity). `deviceClass`: "
            "Dynamic Resource Allocation (Kubernetes 1.34+, resource.k8s.io/v1): a ResourceClaimTemplate asking "
            "parallelism.tensor devices of the operator's DeviceClass (chart value dra.deviceClassName, default "
            f"{contract.DEFAULT_GPU_DEVICE_CLASS}) whose productName and memory, as NVIDIA's DRA driver publishes "
            "them, are this GPU type's; the scheduler allocates them, so nodeAffinity is not used. Default: "
            "extendedResource."
        ),
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Extra node labels engine pods require, merged with the GPU product affinity."
    )
    node_affinity: Literal["auto", "none"] = Field(
        default="auto",
        description=(
            "`auto`: engine pods require a node labelled with this GPU type by GPU feature discovery "
            "(nvidia.com/gpu.product), GKE (cloud.google.com/gke-accelerator), Karpenter "
            "(karpenter.k8s.aws/instance-gpu-name) or an AKS GPU VM size (node.kubernetes.io/instance-type). "
            "`none`: no GPU-type affinity, for nodes labelled otherwise; pin them with nodeSelector (status "
            "warns, since a pod on another GPU type gets a plan made for this one). Default: auto."
        ),
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Extra tolerations; the nvidia.com/gpu taint is always tolerated."
    )


# --- spec.autoscaling / router / cache -----------------------------------------


class ScalingPolicy(ApiModel):
    type: Literal["Pods", "Percent"] = Field(description="Pods or Percent.")
    value: int = Field(ge=1, description="Amount of change allowed per period.")
    period_seconds: int = Field(ge=1, le=1800, description="Window the value applies to.")


class ScalingRules(ApiModel):
    stabilization_window_seconds: int | None = Field(
        default=None, ge=0, le=3600, description="Past recommendations considered before acting."
    )
    select_policy: Literal["Max", "Min", "Disabled"] | None = Field(default=None, description="Which policy wins.")
    policies: list[ScalingPolicy] | None = Field(default=None, max_length=8, description="Rate limits on change.")


class ScalingBehavior(ApiModel):
    scale_up: ScalingRules | None = Field(
        default=None,
        description="Default: no stabilization window, up to doubling or +4 replicas a minute, whichever is more (the target is absolute, so a queue that stays long while new replicas load does not ask for more again).",
    )
    scale_down: ScalingRules | None = Field(
        default=None, description="Default: 10-minute stabilization window, at most 1 replica per 5 minutes."
    )


class AutoscalingSpec(ApiModel):
    min_replicas: int = Field(
        default=1, ge=0, le=1000,
        description=(
            "Fewest model replicas. 0 lets the fleet go to zero after scaleToZeroAfterSeconds without a request; "
            "the routers stay up, hold arriving requests and wake the fleet at once (the HPA itself never goes "
            "below 1: the operator owns zero, the HPA owns 1..maxReplicas). Default: 1."
        ),
    )
    max_replicas: int = Field(ge=1, le=1000, description="Most model replicas.")
    target_pending_requests: int = Field(
        default=4, ge=1, le=100000,
        description=(
            "Requests waiting per replica the HPA aims for, counting every queue: requests held at the routers "
            f"({contract.ROUTER_METRIC_PENDING}) plus requests waiting inside the engines "
            f"({contract.VLLM_METRIC_WAITING}), summed over the service and divided by its replicas (an Object "
            f"metric `{contract.HPA_METRIC_PENDING}` on the InferenceService, so replicas still loading count "
            "too). Default: 4."
        ),
    )
    scale_to_zero_after_seconds: int = Field(
        default=900, ge=30, le=604800,
        description=(
            "With minReplicas 0: seconds without a request at any router before the operator takes the fleet to "
            "zero (the Scaled event and status.idleSince say when). Ignored otherwise. Default: 900."
        ),
    )
    behavior: ScalingBehavior | None = Field(default=None, description="HPA scaling behaviour; fields left out keep Tensorfleet's defaults.")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} is greater than maxReplicas {self.max_replicas}")
        return self

    @property
    def scales_to_zero(self) -> bool:
        """The operator, not the HPA, takes this fleet to zero when idle."""
        return self.min_replicas == 0


class RouterAuthSpec(ApiModel):
    """API keys the router requires, and what each key may use."""

    secret_ref: LocalObjectReference = Field(
        description=(
            "Secret (in this namespace) of API keys: each data key is a tenant name (1-253 of -._a-zA-Z0-9, shown "
            "in the router's metrics) and its value that tenant's key, e.g. `kubectl create secret generic llm-keys "
            "--from-literal=team-a=KEY`. Mounted read-only in the router pods, which do not start without it; "
            "changes reach running routers without a restart, within the kubelet's sync period (about a minute)."
        ),
    )
    requests_per_minute: int | None = Field(
        default=None, ge=1, le=10_000_000,
        description=(
            "Requests each key may send per minute, per router pod (with N router replicas a key may reach N times "
            "this). A token bucket: up to a minute's worth at once, refilled evenly; over it, 429 with Retry-After. "
            "Default: no limit."
        ),
    )
    tokens_per_minute: int | None = Field(
        default=None, ge=1, le=1_000_000_000,
        description=(
            "Prompt and completion tokens each key may use per minute, per router pod. A request is admitted while "
            "the key's bucket holds its estimate (its prompt's characters / 3, plus max_tokens times n, or 1024 "
            "without max_tokens); the estimate is then settled to the usage the engine reports (for a stream, the "
            "engine's own running counts, which the router asks for). Over it, 429 with Retry-After. Default: no "
            "limit."
        ),
    )


class RouterSpec(ApiModel):
    replicas: int = Field(default=2, ge=1, le=100, description="Router pods. Default: 2.")
    strategy: contract.RouterStrategy = Field(
        default=contract.DEFAULT_ROUTER_STRATEGY,
        description=f"How the router picks an engine. Default: {contract.DEFAULT_ROUTER_STRATEGY}.",
    )
    image: str | None = Field(default=None, min_length=1, max_length=512, description=f"Router image. Default: {contract.CONTROL_PLANE_IMAGE}.")
    max_concurrency_per_engine: int | None = Field(
        default=None, ge=1, le=65536,
        description=(
            "Requests in flight per engine before the router queues them itself (the autoscaler counts that queue "
            "too). Default: the requests the plan's KV cache holds at typicalRequestTokens each, at most the "
            "engine's maxNumSeqs: beyond it vLLM would only queue or preempt. With the default, an engine that "
            "reports room (nothing queued inside it, KV cache below 90%) may take more, up to maxNumSeqs, and the "
            "autoscaler counts those beyond the default as demand; a value set here is a hard limit. With "
            "prefix-aware or cache-aware the router replicas share it: each counts the others' requests on the "
            "engine, as they tell each other whenever it changes; with the other strategies it is per router pod."
        ),
    )
    typical_request_tokens: int = Field(
        default=2048, ge=16, le=10_000_000,
        description=(
            "Prompt plus output tokens of a typical request, which sizes the default maxConcurrencyPerEngine "
            "(capped at the model's maxModelLen). Default: 2048."
        ),
    )
    cold_start_timeout_seconds: int | None = Field(
        default=None, ge=1, le=86400,
        description=(
            "How long a request that finds no engine ready during a cold start (the fleet waking from zero, engines "
            "loading) may wait at the router before 503 with Retry-After. Default: twice the plan's estimated load "
            "time (status.plan.loadSeconds), within 120-1800."
        ),
    )
    max_queue: int | None = Field(
        default=None, ge=1, le=1_000_000,
        description="Requests waiting at the router before it answers 429. Default: twice the fleet's concurrency (maxConcurrencyPerEngine per engine), at least 64.",
    )
    queue_timeout_seconds: int | None = Field(
        default=None, ge=1, le=3600, description=(
            "How long a request may wait at the router for an engine before 503. Default: 30. With the cache-aware "
            "strategy the queue goes cheapest first (least uncached prompt), and a request waits behind cheaper ones "
            "for at most half of this."
        ),
    )
    resources: ResourceRequirements | None = Field(default=None, description="Router container resources. Default: 250m CPU, 256Mi memory.")
    auth: RouterAuthSpec | None = Field(
        default=None,
        description=(
            "Require an API key (`Authorization: Bearer KEY`) of every client request, except the router's /health "
            "and /metrics, with per-key rate limits; a tenant's waiting requests queue apart from the others', so "
            "none can starve them. Omit for none: anyone the NetworkPolicy admits may call the router."
        ),
    )


class CacheSpec(ApiModel):
    size: Quantity | None = Field(
        default=None,
        description="Size of a model-cache PersistentVolumeClaim per engine pod. Omit to cache on the node (emptyDir), re-downloading on every new pod.",
    )
    storage_class_name: str | None = Field(default=None, min_length=1, max_length=253, description="StorageClass of the cache PVCs. Default: the cluster default.")
    retention_policy: Literal["Retain", "Delete"] = Field(
        default="Retain",
        description="What happens to cache PVCs when the InferenceService is deleted or scaled down. Default: Retain (re-downloading large weights costs time and egress).",
    )


NamespaceName = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_1123_LABEL_PATTERN)]
# ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128 is the longest CIDR.
Cidr = Annotated[str, Field(min_length=4, max_length=43)]
DEFAULT_MONITORING_NAMESPACES = ("monitoring",)


class NetworkPolicySpec(ApiModel):
    """Who may reach this InferenceService's pods: NetworkPolicies the operator renders and owns."""

    enabled: bool = Field(
        default=True,
        description=(
            "Render NetworkPolicies that isolate this InferenceService: engines accept the router, their own peers "
            "(Ray, NCCL) and metrics scrapers only; the router accepts the namespaces and CIDRs below. "
            "false renders none (the namespace's own policies, if any, apply). Default: true."
        ),
    )
    client_namespaces: list[NamespaceName] = Field(
        default_factory=list, max_length=64,
        description=(
            "Namespaces, besides the InferenceService's own, whose pods may call the router (the OpenAI endpoint), "
            "e.g. your Ingress or Gateway controller's (ingress-nginx). Default: none (only its own namespace)."
        ),
    )
    client_cidrs: list[Cidr] = Field(
        default_factory=list, max_length=64, alias="clientCIDRs",
        description=(
            "Addresses outside the pod network that may call the router, as CIDRs: an Ingress controller on the "
            "host network (its nodes' addresses), a load balancer that keeps client addresses. "
            "0.0.0.0/0 and ::/0 open it to anyone. Default: none."
        ),
    )
    monitoring_namespaces: list[NamespaceName] = Field(
        default_factory=lambda: list(DEFAULT_MONITORING_NAMESPACES), max_length=64,
        description=(
            "Namespaces whose pods may scrape metrics: the engines' /metrics on their API port 8000 (vLLM serves "
            "both on one port, and a NetworkPolicy cannot tell paths apart), their GPU gauges (9400), and the "
            "router's /metrics (8080). Prometheus must reach them for spec.autoscaling. [] for none. "
            f"Default: [{', '.join(DEFAULT_MONITORING_NAMESPACES)}]."
        ),
    )

    @field_validator("client_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        for index, text in enumerate(value):
            try:
                ipaddress.ip_network(text, strict=True)
            except ValueError as exc:
                raise ValueError(f"item {index} {text!r} is not a CIDR such as 10.0.0.0/8 or 2001:db8::/32 ({exc})") from None
            if "/" not in text:
                raise ValueError(f"item {index} {text!r} needs its prefix length, e.g. {text}/32")
        return value

    @field_validator("client_namespaces", "monitoring_namespaces")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed more than once")
        return value


class SecretKeyRef(ApiModel):
    name: str = Field(min_length=1, max_length=253, description="Secret name, in the InferenceService's namespace.")
    key: str = Field(default="token", min_length=1, max_length=253, description="Key holding the Hugging Face token. Default: token.")


class LocalObjectReference(ApiModel):
    name: str = Field(min_length=1, max_length=253, description="Secret name, in the InferenceService's namespace.")


class RolloutSpec(ApiModel):
    """How a spec change reaches running groups (LeaderWorkerSet's maxSurge, for whole groups)."""

    strategy: Literal["Surge", "SurgeOrReplace", "Replace"] = Field(
        default="Surge",
        description=(
            "`Surge`: start up to maxSurge replacement groups first, and take an old group down only while as many "
            "groups as spec.replicas stay Ready; when the cluster lacks the GPUs to surge, wait (Progressing says so). "
            "`SurgeOrReplace`: the same, but when the surge cannot be scheduled, replace groups in place, one at a "
            "time (capacity drops by one group meanwhile). `Replace`: in place only, never more GPUs than the "
            "replicas need (a one-replica service stops serving while its replacement loads). Default: Surge."
        ),
    )
    max_surge: int = Field(
        default=1, ge=1, le=100,
        description="Replacement groups started ahead of the old ones during a rollout (each needs a replica's GPUs). Default: 1.",
    )


# --- spec.prefill / spec.kvTransfer -----------------------------------------------

# The longest NAME with a prefill pool: `NAME-prefill-stage-K-<10-char revision hash>` must stay a label value.
MAX_DISAGGREGATED_NAME_LENGTH = 35


class PrefillSpec(ApiModel):
    """A pool of engines that only compute prompts, handing their KV cache to the decode pool (spec.replicas...)."""

    replicas: int = Field(
        default=1, ge=1, le=1000,
        description=(
            "Prefill engines (groups). The operator holds this count; the HPA scales the decode pool only, and the "
            "router sends a prompt to a decode engine itself while every prefill engine is busy. Default: 1."
        ),
    )
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec,
        description="Tensor parallelism of one prefill engine (pipeline must be 1). Omit to let the planner choose.",
    )
    accelerator: AcceleratorSpec | None = Field(
        default=None,
        description=(
            "GPUs of the prefill pool, e.g. compute-bound prefill on H100 beside memory-bound decode on H200. "
            "Default: spec.accelerator."
        ),
    )


class KvTransferSpec(ApiModel):
    connector: Literal["NixlConnector"] = Field(
        default=contract.DEFAULT_KV_CONNECTOR,
        description=(
            "vLLM's KV connector between the pools, passed as --kv-transfer-config with kv_role kv_both. "
            "NixlConnector (vLLM's NIXL: GPU to GPU over UCX/RDMA) is the one whose two-phase protocol the router "
            "speaks. Default: NixlConnector."
        ),
    )


# --- spec -----------------------------------------------------------------------


class InferenceServiceSpec(ApiModel):
    model: ModelSpec = Field(description="What to serve.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="How the engine runs.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="How one replica is split over GPUs and nodes.")
    accelerator: AcceleratorSpec = Field(description="Which GPUs (or CPU, for vLLM's CPU backend) to run on.")
    replicas: int | None = Field(
        default=None, ge=0, le=1000,
        description=(
            "Model replicas (each `pipeline` pods). Leave it out when autoscaling: the API server sets 1 and the HPA "
            "moves it within [minReplicas, maxReplicas] through /scale. Default: 1."
        ),
    )
    autoscaling: AutoscalingSpec | None = Field(default=None, description="Scale on pending requests with an HPA. Omit for a fixed replica count.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The load-aware router in front of the engines.")
    cache: CacheSpec = Field(default_factory=CacheSpec, description="Model cache volume of each engine pod.")
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None, alias="hfTokenSecretRef", description="Secret key holding a Hugging Face token, for gated models."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16,
        description=(
            "Secrets (type kubernetes.io/dockerconfigjson, in this namespace) for pulling the engine and router "
            "images from private registries; set on the engine and router pods. Default: none."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets_unique(cls, value: list[LocalObjectReference]) -> list[LocalObjectReference]:
        names = [ref.name for ref in value]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed more than once")
        return value
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec,
        description="NetworkPolicies isolating the engines and the router. Default: rendered (see networkPolicy.enabled).",
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="How a spec change rolls out. Default: surge one replacement group, so serving never drops.",
    )
    prefill: PrefillSpec | None = Field(
        default=None,
        description=(
            "Prefill/decode disaggregation: a separate pool computes the prompts and hands their KV cache to the "
            "engines above (replicas, parallelism, accelerator and autoscaling then describe the decode pool), "
            "so long prompts stop stalling running decodes. Omit for colocated engines. docs/disaggregation.md."
        ),
    )
    kv_transfer: KvTransferSpec | None = Field(
        default=None,
        description="How KV moves between the pools, with spec.prefill. Default: NixlConnector.",
    )
    traffic: TrafficSpec | None = Field(
        default=None,
        description=(
            "This InferenceService's share of new conversations at the gateway (`tensorfleet gateway`, chart value "
            "gateway.enabled) among those in its namespace serving the same model name: how a canary is run. "
            "Omit for an equal share. docs/gateway.md."
        ),
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list, max_length=MAX_ADAPTERS,
        description=(
            "LoRA adapters of the base model, each served under its own name. The operator loads them into the "
            "running engines and unloads the ones removed, without restarting them (status.adapters says where "
            "each is loaded). Going from none to some, or back, restarts the engines once: LoRA is switched on "
            "at engine start. Default: none."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    @field_validator("adapters")
    @classmethod
    def _adapter_names_unique(cls, value: list[AdapterSpec]) -> list[AdapterSpec]:
        names = [adapter.name for adapter in value]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"adapter name {', '.join(repeated)} listed more than once; each name is one OpenAI model")
        return value

    @property
    def lora_enabled(self) -> bool:
        """The engines start with LoRA on: some adapter is listed, or spec.engine.lora asks for it."""
        return bool(self.adapters) or self.engine.lora is not None


# --- status ---------------------------------------------------------------------
class ObjectMeta(BaseModel):
    """The parts of metadata Tensorfleet reads; everything else passes through."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=DNS_1035_PATTERN)
    namespace: str | None = Field(default=None, min_length=1, max_length=63, pattern=DNS_1123_LABEL_PATTERN)
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferenceService(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: contract.ApiVersion = Field(alias="apiVersion")
    kind: contract.ApiKind
    metadata: ObjectMeta
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace or "default"
