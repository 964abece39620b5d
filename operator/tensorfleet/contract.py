"""Names every part of Tensorfleet agrees on, defined once: the renderer writes them into objects and pod env, and
the worker launcher, the router, the simulator and the controller read them. Import from here; never spell one of
these strings anywhere else. Design: docs/architecture.md#processes-and-what-crosses-between-them."""

from __future__ import annotations

from typing import Final, Literal, NamedTuple, TypeAlias, get_args

__version__: Final = "0.1.0"

# --- API -------------------------------------------------------------------
# The Literal types are the one spelling; the constants are read from them.
ApiVersion: TypeAlias = Literal["tensorfleet.dev/v1alpha1"]
ApiKind: TypeAlias = Literal["InferenceService"]
API_VERSION: Final[ApiVersion] = get_args(ApiVersion)[0]
KIND: Final[ApiKind] = get_args(ApiKind)[0]
GROUP: Final = API_VERSION.partition("/")[0]
VERSION: Final = API_VERSION.partition("/")[2]
PLURAL: Final = "inferenceservices"
SINGULAR: Final = "inferenceservice"
SHORT_NAMES: Final = ("infsvc",)
CATEGORIES: Final = ("tensorfleet",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"
FIELD_MANAGER: Final = "tensorfleet"

# --- Images ----------------------------------------------------------------
# The control-plane image runs the operator, the router and the simulator, and
# carries the engine launcher (LAUNCHER_BUNDLE_PATH) that an init container
# copies into every GPU engine pod; it is versioned with this package. GPU
# engines run any vLLM image, by default the upstream release the planner's
# figures were checked against (vllm_defaults.py); fully qualified, since CRI-O
# may refuse short names. The worker image (vLLM with the launcher installed,
# worker-image/) is optional.
IMAGE_REGISTRY: Final = "ghcr.io/tensorfleet"
CONTROL_PLANE_IMAGE: Final = f"{IMAGE_REGISTRY}/tensorfleet:{__version__}"
VLLM_VERSION: Final = "v0.19.1"
VLLM_IMAGE: Final = f"docker.io/vllm/vllm-openai:{VLLM_VERSION}"
DEFAULT_ENGINE_IMAGE: Final = VLLM_IMAGE
# vLLM's CPU build of the same release (x86-64), for accelerator CPU: the image vLLM's release publishes
# (and copies to Docker Hub as vllm/vllm-openai-cpu). CUDA images cannot run vLLM's CPU backend.
VLLM_CPU_IMAGE: Final = f"public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:{VLLM_VERSION}"
WORKER_IMAGE: Final = f"{IMAGE_REGISTRY}/tensorfleet-worker:{__version__}"

# --- Labels ----------------------------------------------------------------
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_VERSION: Final = "app.kubernetes.io/version"
LABEL_INFERENCE_SERVICE: Final = f"{GROUP}/inference-service"
LABEL_STAGE: Final = f"{GROUP}/stage"
LABEL_ROLE: Final = f"{GROUP}/role"
# With spec.prefill: which pool an engine pod serves (`tensorfleet.dev/role` already says leader or worker, and
# the decode pool's selectors name `tensorfleet.dev/stage`, which prefill pods do not carry: they carry
# LABEL_PREFILL_STAGE, so no selector of the decode pool ever matches them).
LABEL_POOL: Final = f"{GROUP}/pool"
LABEL_PREFILL_STAGE: Final = f"{GROUP}/prefill-stage"
POOL_PREFILL: Final = "prefill"
POOL_DECODE: Final = "decode"
# Set by the StatefulSet controller on every pod since Kubernetes 1.28.
LABEL_POD_INDEX: Final = "apps.kubernetes.io/pod-index"

# --- Annotations -------------------------------------------------------------
# On an InferenceService, set by its user: a new value makes the operator read the
# model's facts again (config.json from the Hub), replacing those pinned in status.
ANNOTATION_MODEL_FACTS_REFRESH: Final = f"{GROUP}/model-facts-refresh"
# On an engine StatefulSet, set by the operator: the groups the spec wants, without
# a rollout's surge groups (which its replicas include).
ANNOTATION_WANTED_GROUPS: Final = f"{GROUP}/wanted-groups"
# On a simulator engine pod: the state of its simulated GPUs (JSON, worker/simgpu.py), which its launcher reads
# through a downward-API file at SIMULATED_GPU_STATE_PATH, named by ENV_SIMULATED_GPU_STATE.
ANNOTATION_SIMULATED_GPU_STATE: Final = f"{GROUP}/simulated-gpu-state"
SIMULATED_GPU_VOLUME: Final = "simulated-gpu"
SIMULATED_GPU_DIR: Final = "/etc/tensorfleet/simulated-gpu"
SIMULATED_GPU_STATE_PATH: Final = f"{SIMULATED_GPU_DIR}/state"

APP_NAME: Final = "tensorfleet"
COMPONENT_ENGINE: Final = "engine"
COMPONENT_ROUTER: Final = "router"
COMPONENT_OPERATOR: Final = "operator"  # the chart's operator pods (charts/tensorfleet/templates/_helpers.tpl)
COMPONENT_GATEWAY: Final = "gateway"    # the chart's gateway pods (gateway.enabled; docs/gateway.md)
ROLE_LEADER: Final = "leader"
ROLE_WORKER: Final = "worker"

# GPU feature discovery and the NVIDIA device plugin.
GPU_RESOURCE: Final = "nvidia.com/gpu"
GPU_PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
# The node labels managed Kubernetes puts on GPU nodes without GPU feature
# discovery; gpus.py has each GPU type's values and their sources.
GKE_ACCELERATOR_LABEL: Final = "cloud.google.com/gke-accelerator"
KARPENTER_GPU_NAME_LABEL: Final = "karpenter.k8s.aws/instance-gpu-name"
KARPENTER_GPU_MEMORY_LABEL: Final = "karpenter.k8s.aws/instance-gpu-memory"  # MiB per GPU
INSTANCE_TYPE_LABEL: Final = "node.kubernetes.io/instance-type"
GPU_TAINT_KEY: Final = "nvidia.com/gpu"
# spec.accelerator.allocation: how engine pods get their GPUs. extendedResource: a count of GPU_RESOURCE (the
# device plugin) on a node of the GPU type; deviceClass: a ResourceClaim per pod (Dynamic Resource Allocation,
# resource.k8s.io/v1) for devices of a DeviceClass whose attributes match the GPU type (docs/dra.md).
ALLOCATION_EXTENDED_RESOURCE: Final = "extendedResource"
ALLOCATION_DEVICE_CLASS: Final = "deviceClass"
# NVIDIA's DRA driver for GPUs: its driver name, which is also the domain of the attributes and capacities it
# publishes per device (productName, architecture, ..., memory), and the DeviceClass its chart installs for whole
# GPUs (the operator's --gpu-device-class, chart value dra.deviceClassName, may name another).
NVIDIA_DRA_DRIVER: Final = "gpu.nvidia.com"
DEFAULT_GPU_DEVICE_CLASS: Final = "gpu.nvidia.com"
# The claim in an engine pod (pod.spec.resourceClaims[].name, the container's resources.claims) and the request
# in its template (devices.requests[].name).
GPU_CLAIM: Final = "gpus"
# spec.accelerator.type of vLLM on its CPU backend: no GPU requested, selected or tolerated; the pod's
# memory request sizes the plan, and the launcher's /health needs no NVML (passed on as ENV_ACCELERATOR).
CPU_ACCELERATOR: Final = "CPU"
# Well-known node label the kubelet sets; spreads router pods over nodes.
LABEL_HOSTNAME: Final = "kubernetes.io/hostname"

# --- Ports -----------------------------------------------------------------
ENGINE_PORT: Final = 8000          # vLLM's OpenAI server (and the simulator)
# vLLM's API server closes a connection idle this long (the default of VLLM_HTTP_TIMEOUT_KEEP_ALIVE; the
# simulator does the same). Its clients drop an idle pooled connection a second sooner: a request sent on a
# connection the engine is closing fails (ServerDisconnectedError) and would count against a healthy engine.
ENGINE_KEEP_ALIVE_S: Final = 5
ENGINE_CLIENT_KEEP_ALIVE_S: Final = ENGINE_KEEP_ALIVE_S - 1
RAY_PORT: Final = 6379             # Ray GCS on the group leader
ROUTER_PORT: Final = 8080          # router container
SERVICE_PORT: Final = 80           # user-facing Service NAME
GATEWAY_PORT: Final = 8080         # gateway container (tensorfleet gateway; its Service on SERVICE_PORT)
WORKER_METRICS_PORT: Final = 9400  # GPU health exporter beside the engine
PORT_NAME_HTTP: Final = "http"
PORT_NAME_RAY: Final = "ray"
PORT_NAME_GPU_METRICS: Final = "gpu-metrics"
# The same port on a CPU engine pod (accelerator CPU), where the launcher serves only /health: no GPU
# gauges, so no `gpu-metrics` port for the chart's PodMonitor to scrape.
PORT_NAME_POD_HEALTH: Final = "pod-health"
# The uid GPU engine containers run as, whatever the image (the worker image
# creates it: worker-image/Dockerfile ARG TENSORFLEET_UID; stock vLLM images
# run it without a passwd entry, see ENGINE_HOME_PATH); engine pods use it as
# fsGroup so a PVC-backed model cache is writable.
WORKER_UID: Final = 10001
# The control-plane image's non-root user (./Dockerfile `USER 65532:65532`,
# distroless' conventional unprivileged uid): router and simulator pods run as
# it, numeric so runAsNonRoot can be verified whatever user an image names.
CONTROL_PLANE_UID: Final = 65532

# --- Paths -----------------------------------------------------------------
HEALTH_PATH: Final = "/health"
METRICS_PATH: Final = "/metrics"
# Router replicas post their placements to each other here (router/peers.py).
ROUTER_PEER_PATH: Final = "/tensorfleet/v1/placements"
SHM_PATH: Final = "/dev/shm"
CACHE_PATH: Final = "/cache"
HF_HOME_PATH: Final = f"{CACHE_PATH}/huggingface"
# Written by the worker launcher, read by `tensorfleet-worker health` (run by
# hand in the container): the launcher's phase and the GPU XID errors it saw.
WORKER_STATE_PATH: Final = "/tmp/tensorfleet-worker/state.json"
# The launcher reaches a GPU engine pod without being in its image: the
# control-plane image carries it as a self-contained zipapp (stdlib, plus the
# pure-Python prometheus-client and nvidia-ml-py inside; pydantic from the
# engine image, which vLLM's has), an init container of that image copies it
# into an emptyDir, and the engine container runs it with the image's Python.
LAUNCHER_BUNDLE_PATH: Final = "/opt/tensorfleet/launcher.pyz"
LAUNCHER_DIR: Final = "/tensorfleet"
LAUNCHER_PATH: Final = f"{LAUNCHER_DIR}/launcher.pyz"
LAUNCHER_VOLUME: Final = "tensorfleet-launcher"
LAUNCHER_INIT_CONTAINER: Final = "install-launcher"
# HOME of GPU engine containers (an emptyDir): stock vLLM images have no user
# WORKER_UID, so without it vLLM, Triton and torch.compile would cache under /.
ENGINE_HOME_PATH: Final = "/home/tensorfleet"
ENGINE_HOME_VOLUME: Final = "home"
ENGINE_USER: Final = "tensorfleet"

# --- Engine ----------------------------------------------------------------
# spec.engine.kind, passed to the launcher as ENV_ENGINE_KIND.
EngineKind: TypeAlias = Literal["vllm", "simulator"]
ENGINE_KINDS: Final[tuple[EngineKind, ...]] = get_args(EngineKind)
DEFAULT_ENGINE_KIND: Final[EngineKind] = "vllm"

# --- Worker launcher env (renderer writes, launcher reads) -----------------
# The table of what each one carries (Role field, engine flags) and the list of
# them all is tensorfleet.engine_settings.
ENV_ENGINE_KIND: Final = "TF_ENGINE_KIND"
ENV_INFERENCE_SERVICE: Final = "TF_INFERENCE_SERVICE"
ENV_NAMESPACE: Final = "TF_NAMESPACE"
ENV_POD_NAME: Final = "TF_POD_NAME"
ENV_GROUP_INDEX: Final = "TF_GROUP_INDEX"
ENV_STAGE_INDEX: Final = "TF_STAGE_INDEX"
ENV_LEADER_ADDRESS: Final = "TF_LEADER_ADDRESS"
ENV_RAY_PORT: Final = "TF_RAY_PORT"
ENV_ENGINE_PORT: Final = "TF_ENGINE_PORT"
ENV_TENSOR_PARALLEL: Final = "TF_TENSOR_PARALLEL_SIZE"
ENV_PIPELINE_PARALLEL: Final = "TF_PIPELINE_PARALLEL_SIZE"
ENV_MODEL: Final = "TF_MODEL"
ENV_SERVED_MODEL_NAME: Final = "TF_SERVED_MODEL_NAME"
ENV_MODEL_REVISION: Final = "TF_MODEL_REVISION"
ENV_DTYPE: Final = "TF_DTYPE"
ENV_QUANTIZATION: Final = "TF_QUANTIZATION"
ENV_KV_CACHE_DTYPE: Final = "TF_KV_CACHE_DTYPE"
ENV_MAX_MODEL_LEN: Final = "TF_MAX_MODEL_LEN"
ENV_GPU_MEMORY_UTILIZATION: Final = "TF_GPU_MEMORY_UTILIZATION"
ENV_MAX_NUM_SEQS: Final = "TF_MAX_NUM_SEQS"
# LoRA (spec.adapters, spec.engine.lora): "true" switches it on; the sizes are the plan's.
ENV_ENABLE_LORA: Final = "TF_ENABLE_LORA"
ENV_MAX_LORAS: Final = "TF_MAX_LORAS"
ENV_MAX_LORA_RANK: Final = "TF_MAX_LORA_RANK"
ENV_MAX_CPU_LORAS: Final = "TF_MAX_CPU_LORAS"
# vLLM's own: opens /v1/load_lora_adapter and /v1/unload_lora_adapter, through which the
# operator (controller/adapters.py) loads spec.adapters into running engines.
ENV_RUNTIME_LORA_UPDATING: Final = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# Prefill/decode disaggregation (spec.prefill, spec.kvTransfer): the connector config both pools get, as
# `--kv-transfer-config` JSON, and NIXL's side channel (vLLM's own variables), on a named container port.
ENV_KV_TRANSFER_CONFIG: Final = "TF_KV_TRANSFER_CONFIG"
ENV_NIXL_SIDE_CHANNEL_HOST: Final = "VLLM_NIXL_SIDE_CHANNEL_HOST"
ENV_NIXL_SIDE_CHANNEL_PORT: Final = "VLLM_NIXL_SIDE_CHANNEL_PORT"
NIXL_SIDE_CHANNEL_PORT: Final = 5600
NIXL_PORT_NAME: Final = "nixl"
KV_CONNECTORS: Final = ("NixlConnector",)   # what the router's two-phase protocol speaks (docs/disaggregation.md)
DEFAULT_KV_CONNECTOR: Final = "NixlConnector"
# KV-cache events (vLLM's `--kv-events-config`, JSON): every vLLM engine publishes the blocks it stores and
# evicts over ZeroMQ (PUB, with a ROUTER socket that replays missed batches), and the router indexes them
# (router/kvindex.py). Bound on all addresses: vLLM binds an endpoint only when it names `*`.
ENV_KV_EVENTS_CONFIG: Final = "TF_KV_EVENTS_CONFIG"
KV_EVENTS_PORT: Final = 5557
KV_EVENTS_REPLAY_PORT: Final = 5558
KV_EVENTS_PORT_NAME: Final = "kv-events"
KV_EVENTS_REPLAY_PORT_NAME: Final = "kv-replay"
KV_EVENTS_TOPIC: Final = "kv"
KV_EVENTS_BUFFER_STEPS: Final = 10_000   # batches the engine keeps for replay (vLLM's default)
LORA_LOAD_PATH: Final = "/v1/load_lora_adapter"
LORA_UNLOAD_PATH: Final = "/v1/unload_lora_adapter"
# JSON list of strings: extra engine flags, passed through as argv items.
ENV_EXTRA_ARGS: Final = "TF_EXTRA_ARGS"
# The GPU type and the planner's KV-cache size: the simulator times itself from
# the GPU type and takes the size as its cache, and the launcher logs them
# beside vLLM's own figure.
ENV_ACCELERATOR: Final = "TF_ACCELERATOR"
ENV_KV_CACHE_TOKENS: Final = "TF_KV_CACHE_TOKENS"
# The launcher's port: the GPU gauges and the pod's /health (on a CPU engine pod, /health only).
ENV_GPU_METRICS_PORT: Final = "TF_GPU_METRICS_PORT"
ENV_SIMULATED_GPU_STATE: Final = "TF_SIMULATED_GPU_STATE"
# vLLM's own, on CPU engine pods (accelerator CPU): the KV cache in whole GiB, which its CPU backend
# allocates instead of sizing one from --gpu-memory-utilization; the operator sets it from the plan.
ENV_CPU_KVCACHE_SPACE: Final = "VLLM_CPU_KVCACHE_SPACE"
# vLLM's CPU backend: the cores each tensor-parallel worker's threads are bound to ("0-3|4-7"); vLLM binds by
# NUMA node itself and refuses more workers than NUMA nodes, so the launcher sets it from the pod's cores.
ENV_CPU_OMP_THREADS_BIND: Final = "VLLM_CPU_OMP_THREADS_BIND"
# Standard names read by huggingface_hub / vLLM themselves.
ENV_HF_TOKEN: Final = "HF_TOKEN"
ENV_HF_HOME: Final = "HF_HOME"
# GPU engines only, unless spec.engine.env sets them (see ENGINE_HOME_PATH).
ENV_HOME: Final = "HOME"
ENV_USER: Final = "USER"

# --- GPU health exporter (the launcher, on WORKER_METRICS_PORT) --------------
# Gauges read with pynvml, labelled `gpu` (index), `uuid` and `device` (NVML
# name). Counters are named without `_total`; prometheus-client appends it.
GPU_METRIC_NVML_UP: Final = "tensorfleet_gpu_nvml_up"                    # 1 when NVML answers
GPU_METRIC_VISIBLE: Final = "tensorfleet_gpus_visible"
GPU_METRIC_EXPECTED: Final = "tensorfleet_gpus_expected"                 # tensor-parallel size
GPU_METRIC_ALL_HEALTHY: Final = "tensorfleet_gpus_healthy"               # 1 when `health` would pass
GPU_METRIC_HEALTHY: Final = "tensorfleet_gpu_healthy"
GPU_METRIC_TEMPERATURE: Final = "tensorfleet_gpu_temperature_celsius"
GPU_METRIC_TEMPERATURE_LIMIT: Final = "tensorfleet_gpu_temperature_limit_celsius"
GPU_METRIC_MEMORY_USED: Final = "tensorfleet_gpu_memory_used_bytes"
GPU_METRIC_MEMORY_TOTAL: Final = "tensorfleet_gpu_memory_total_bytes"
GPU_METRIC_UTILIZATION: Final = "tensorfleet_gpu_utilization_ratio"      # 0-1
GPU_METRIC_POWER: Final = "tensorfleet_gpu_power_watts"
GPU_METRIC_POWER_LIMIT: Final = "tensorfleet_gpu_power_limit_watts"
GPU_METRIC_ECC_UNCORRECTABLE: Final = "tensorfleet_gpu_ecc_uncorrectable_volatile_errors"
GPU_METRIC_RETIRED_PAGES_PENDING: Final = "tensorfleet_gpu_retired_pages_pending"
GPU_METRIC_ROW_REMAP_PENDING: Final = "tensorfleet_gpu_row_remap_pending"
GPU_METRIC_ROW_REMAP_FAILURE: Final = "tensorfleet_gpu_row_remap_failure"
GPU_METRIC_XID_ERRORS: Final = "tensorfleet_gpu_xid_errors"              # counter: gpu, xid

# --- The operator process (`tensorfleet run`) -----------------------------------
# Its own ports and paths; the chart's values.yaml repeats the ports as defaults.
OPERATOR_HEALTH_PORT: Final = 8080
OPERATOR_METRICS_PORT: Final = 9090
OPERATOR_WEBHOOK_PORT: Final = 9443
OPERATOR_LIVENESS_PATH: Final = "/healthz"
OPERATOR_READINESS_PATH: Final = "/readyz"
# The validating webhook's path (the chart's ValidatingWebhookConfiguration uses it).
WEBHOOK_PATH: Final = "/spec"
OPERATOR_LEASE_NAME: Final = "tensorfleet-operator"
# Who the operator and the router say they are to the API server (User-Agent,
# the Events' reporting component).
OPERATOR_COMPONENT: Final = "tensorfleet-operator"
ROUTER_COMPONENT: Final = "tensorfleet-router"
GATEWAY_COMPONENT: Final = "tensorfleet-gateway"
# Its environment (the chart sets the first two through the downward API).
ENV_OPERATOR_POD_NAMESPACE: Final = "POD_NAMESPACE"
ENV_OPERATOR_POD_NAME: Final = "POD_NAME"            # the leader-election identity
ENV_WATCH_NAMESPACES: Final = "WATCH_NAMESPACES"     # comma-separated, like repeated -n
ENV_ALLOWED_REGISTRIES: Final = "TENSORFLEET_ALLOWED_REGISTRIES"  # comma-separated, like repeated --allowed-registry
ENV_DEFAULT_WORKER_IMAGE: Final = "TENSORFLEET_WORKER_IMAGE"
ENV_DEFAULT_CPU_WORKER_IMAGE: Final = "TENSORFLEET_CPU_WORKER_IMAGE"
ENV_DEFAULT_CONTROL_PLANE_IMAGE: Final = "TENSORFLEET_CONTROL_PLANE_IMAGE"
# The router pod's own IP (downward API): it leaves itself out of its peers, the router Service's endpoints.
ENV_ROUTER_POD_IP: Final = "TENSORFLEET_POD_IP"
# Its metrics. Counters are named without `_total`; prometheus-client appends it on the wire.
OPERATOR_METRIC_RECONCILES: Final = "tensorfleet_reconciles"                          # counter: result
OPERATOR_METRIC_RECONCILE_DURATION: Final = "tensorfleet_reconcile_duration_seconds"  # histogram
OPERATOR_METRIC_API_REQUESTS: Final = "tensorfleet_api_requests"                      # counter: method, kind
OPERATOR_METRIC_API_ERRORS: Final = "tensorfleet_api_errors"                          # counter: method, kind, code
OPERATOR_METRIC_MANAGED_OBJECTS: Final = "tensorfleet_managed_objects"                # gauge: kind
OPERATOR_METRIC_INFERENCE_SERVICES: Final = "tensorfleet_inference_services"          # gauge: ready
OPERATOR_METRIC_QUEUE_DEPTH: Final = "tensorfleet_work_queue_depth"                   # gauge
OPERATOR_METRIC_LEADER: Final = "tensorfleet_leader"                                  # gauge, 1/0
OPERATOR_METRIC_WATCH_EVENTS: Final = "tensorfleet_watch_events"                      # counter: kind, type

# --- Commands --------------------------------------------------------------
WORKER_COMMAND: Final = ("tensorfleet-worker",)
# GPU engine pods: the init container (control-plane image) installs the
# launcher, the engine container runs it with the engine image's Python.
LAUNCHER_INSTALL_COMMAND: Final = ("tensorfleet-worker", "install-launcher", LAUNCHER_DIR)
LAUNCHER_COMMAND: Final = ("python3", LAUNCHER_PATH)
ROUTER_COMMAND: Final = ("tensorfleet", "router")
# The CPU-only engine the launcher runs for engine.kind: simulator.
SIMULATOR_COMMAND: Final = ("tensorfleet", "sim")

# --- Metrics ---------------------------------------------------------------
# vLLM's own metric, and the name prometheus-adapter exposes it under (a Pods
# metric per engine leader pod, for HPAs of your own).
VLLM_METRIC_WAITING: Final = "vllm:num_requests_waiting"
HPA_METRIC_WAITING: Final = "vllm_num_requests_waiting"
# The demand signal the operator's HPAs scale on: an Object metric on the
# InferenceService, the sum of every request waiting for it, at its routers
# (ROUTER_METRIC_PENDING) and inside its engines (VLLM_METRIC_WAITING), and of
# those running on engines beyond the router's per-engine ceiling, the
# concurrency a replica is sized for (ROUTER_METRIC_BURST).
HPA_METRIC_PENDING: Final = "tensorfleet_pending_requests"
# The series label naming a pod's InferenceService, which the chart's
# PodMonitors copy from the pod label LABEL_INFERENCE_SERVICE (neither the
# router nor vLLM knows it) and prometheus-adapter maps to the object.
METRIC_LABEL_INFERENCE_SERVICE: Final = "inferenceservice"
# The rest of vLLM's /metrics that the simulator serves and the router reads.
# Counters are named without `_total`; prometheus-client appends it on the wire.
VLLM_METRIC_RUNNING: Final = "vllm:num_requests_running"
VLLM_METRIC_KV_CACHE_USAGE: Final = "vllm:kv_cache_usage_perc"      # 0-1
VLLM_METRIC_TTFT: Final = "vllm:time_to_first_token_seconds"
VLLM_METRIC_ITL: Final = "vllm:inter_token_latency_seconds"
VLLM_METRIC_E2E_LATENCY: Final = "vllm:e2e_request_latency_seconds"
VLLM_METRIC_QUEUE_TIME: Final = "vllm:request_queue_time_seconds"
VLLM_METRIC_PROMPT_TOKENS: Final = "vllm:prompt_tokens"
VLLM_METRIC_GENERATION_TOKENS: Final = "vllm:generation_tokens"
VLLM_METRIC_PREFIX_CACHE_QUERIES: Final = "vllm:prefix_cache_queries"  # in tokens
VLLM_METRIC_PREFIX_CACHE_HITS: Final = "vllm:prefix_cache_hits"        # in tokens
# Prompt tokens whose KV came from a KV connector (prefill/decode disaggregation), and per request the prompt
# tokens computed on the engine itself (neither cached nor transferred): a decode engine computes one.
VLLM_METRIC_EXTERNAL_PREFIX_CACHE_QUERIES: Final = "vllm:external_prefix_cache_queries"  # in tokens
VLLM_METRIC_EXTERNAL_PREFIX_CACHE_HITS: Final = "vllm:external_prefix_cache_hits"        # in tokens
VLLM_METRIC_PREFILL_KV_COMPUTED: Final = "vllm:request_prefill_kv_computed_tokens"        # histogram
# With --enable-lora: an info gauge whose labels name the adapters of running and waiting requests.
VLLM_METRIC_LORA_INFO: Final = "vllm:lora_requests_info"
VLLM_LABEL_LORA_RUNNING: Final = "running_lora_adapters"   # comma-separated adapter names
VLLM_LABEL_LORA_WAITING: Final = "waiting_lora_adapters"
VLLM_LABEL_MAX_LORA: Final = "max_lora"
# The simulator's own (vLLM has none): adapters brought into a GPU slot, by tier (disk, cpu).
SIM_METRIC_LORA_LOADS: Final = "tensorfleet_sim_lora_loads"
VLLM_METRIC_REQUEST_SUCCESS: Final = "vllm:request_success"
VLLM_METRIC_PREEMPTIONS: Final = "vllm:num_preemptions"
# Info-style gauge (value 1) whose labels carry block_size and num_gpu_blocks;
# the router sizes its prefix index per engine from it.
VLLM_METRIC_CACHE_CONFIG: Final = "vllm:cache_config_info"
VLLM_LABEL_MODEL_NAME: Final = "model_name"
VLLM_LABEL_ENGINE: Final = "engine"
VLLM_LABEL_FINISHED_REASON: Final = "finished_reason"

# The router's own metrics. The pending gauge (requests queued at the router
# for a free engine slot) is what the chart's HPA rule can use instead of the
# engine's waiting gauge; prometheus-adapter exposes it under the same name.
ROUTER_METRIC_REQUESTS: Final = "tensorfleet_router_requests"              # counter: backend, code
ROUTER_METRIC_PENDING: Final = "tensorfleet_router_pending_requests"       # gauge
# Requests running on engines beyond the per-engine ceiling (router/dispatch.py, burst), this router's share.
ROUTER_METRIC_BURST: Final = "tensorfleet_router_burst_requests"           # gauge
ROUTER_METRIC_IN_FLIGHT: Final = "tensorfleet_router_backend_in_flight"    # gauge: backend
ROUTER_METRIC_BACKEND_HEALTHY: Final = "tensorfleet_router_backend_healthy"  # gauge: backend, 1/0
ROUTER_METRIC_DURATION: Final = "tensorfleet_router_request_duration_seconds"  # histogram: code
ROUTER_METRIC_TTFT: Final = "tensorfleet_router_time_to_first_byte_seconds"    # histogram
ROUTER_METRIC_RETRIES: Final = "tensorfleet_router_retries"                # counter: reason
ROUTER_METRIC_EJECTIONS: Final = "tensorfleet_router_backend_ejections"    # counter: backend
ROUTER_METRIC_STREAM_ERRORS: Final = "tensorfleet_router_stream_errors"    # counter: backend
ROUTER_METRIC_STREAM_RESUMPTIONS: Final = "tensorfleet_router_stream_resumptions"  # counter: reason
# Placements exchanged with the other router replicas (router/peers.py OUTCOMES).
ROUTER_METRIC_PEER_PLACEMENTS: Final = "tensorfleet_router_peer_placements"  # counter: outcome
# Free engine slots left to a peer replica's cheaper waiter (router/yielding.py YIELD_OUTCOMES).
ROUTER_METRIC_PEER_YIELDS: Final = "tensorfleet_router_slots_left_to_peers"   # counter: outcome
# Prefill/decode disaggregation: how each request's prefill half went (router/prefill.py OUTCOMES).
ROUTER_METRIC_PREFILL: Final = "tensorfleet_router_prefill_requests"         # counter: outcome
ROUTER_LABEL_OUTCOME: Final = "outcome"
# Per LoRA adapter (the OpenAI model name of an adapter the engines serve).
ROUTER_METRIC_ADAPTER_REQUESTS: Final = "tensorfleet_router_adapter_requests"        # counter: adapter, code
ROUTER_METRIC_ADAPTER_TTFT: Final = "tensorfleet_router_adapter_time_to_first_byte_seconds"  # histogram: adapter
ROUTER_LABEL_ADAPTER: Final = "adapter"
# With API keys (spec.router.auth): per tenant, the tenants being the Secret's key names (never a key), so the
# label's values are bounded by the Secret.
ROUTER_METRIC_TENANT_REQUESTS: Final = "tensorfleet_router_tenant_requests"      # counter: tenant, code
ROUTER_METRIC_TENANT_REJECTIONS: Final = "tensorfleet_router_tenant_rejections"  # counter: tenant, reason
ROUTER_METRIC_TENANT_TOKENS: Final = "tensorfleet_router_tenant_tokens"          # counter: tenant (settled)
ROUTER_METRIC_TENANT_PENDING: Final = "tensorfleet_router_tenant_pending_requests"  # gauge: tenant
ROUTER_METRIC_AUTH_FAILURES: Final = "tensorfleet_router_auth_failures"          # counter: reason
ROUTER_METRIC_API_KEYS: Final = "tensorfleet_router_api_keys"                    # gauge: keys in force
# The KV-cache index from the engines' KV events (router --kv-events; router/kvfleet.py).
ROUTER_METRIC_KV_BLOCKS: Final = "tensorfleet_router_kv_index_blocks"      # gauge: backend
ROUTER_METRIC_KV_EVENTS: Final = "tensorfleet_router_kv_events"            # counter: backend
ROUTER_METRIC_KV_RESYNCS: Final = "tensorfleet_router_kv_resyncs"          # counter: backend
HPA_METRIC_ROUTER_PENDING: Final = ROUTER_METRIC_PENDING
ROUTER_LABEL_BACKEND: Final = "backend"
ROUTER_LABEL_CODE: Final = "code"
ROUTER_LABEL_TENANT: Final = "tenant"
ROUTER_LABEL_REASON: Final = "reason"


class ClientMetricNames(NamedTuple):
    """The metrics of a process's clients (router/clients.py ClientMetrics): the router's, and the gateway's."""

    requests: str           # counter: backend, code
    duration: str           # histogram: code
    first_byte: str         # histogram
    tenant_requests: str    # counter: tenant, code
    tenant_rejections: str  # counter: tenant, reason
    tenant_tokens: str      # counter: tenant
    auth_failures: str      # counter: reason


ROUTER_CLIENT_METRICS: Final = ClientMetricNames(
    ROUTER_METRIC_REQUESTS, ROUTER_METRIC_DURATION, ROUTER_METRIC_TTFT, ROUTER_METRIC_TENANT_REQUESTS,
    ROUTER_METRIC_TENANT_REJECTIONS, ROUTER_METRIC_TENANT_TOKENS, ROUTER_METRIC_AUTH_FAILURES)
# The gateway's (tensorfleet gateway, across InferenceServices): its `backend` label is an InferenceService,
# `namespace/name`.
GATEWAY_CLIENT_METRICS: Final = ClientMetricNames(
    "tensorfleet_gateway_requests", "tensorfleet_gateway_request_duration_seconds",
    "tensorfleet_gateway_time_to_first_byte_seconds", "tensorfleet_gateway_tenant_requests",
    "tensorfleet_gateway_tenant_rejections", "tensorfleet_gateway_tenant_tokens", "tensorfleet_gateway_auth_failures")
# New conversations each InferenceService of a traffic group was given (its status.traffic share).
GATEWAY_METRIC_CONVERSATIONS: Final = "tensorfleet_gateway_conversations"  # counter: namespace, inferenceservice, group
GATEWAY_METRIC_MODELS: Final = "tensorfleet_gateway_models"              # gauge: models listed
GATEWAY_LABEL_NAMESPACE: Final = "namespace"
GATEWAY_LABEL_SERVICE: Final = "inferenceservice"
GATEWAY_LABEL_GROUP: Final = "group"

# --- Router ----------------------------------------------------------------
# spec.router.strategy and `tensorfleet router --strategy`.
RouterStrategy: TypeAlias = Literal["cache-aware", "least-pending", "round-robin", "session", "prefix-aware"]
ROUTER_STRATEGIES: Final[tuple[RouterStrategy, ...]] = get_args(RouterStrategy)
DEFAULT_ROUTER_STRATEGY: Final[RouterStrategy] = "cache-aware"
# The router's shutdown: it keeps serving this long after SIGTERM while its pod
# leaves the Service's endpoints, then gives in-flight requests the grace; the
# Deployment's terminationGracePeriodSeconds covers both plus a margin.
ROUTER_DRAIN_SECONDS: Final = 5
ROUTER_SHUTDOWN_GRACE_SECONDS: Final = 60
ROUTER_TERMINATION_MARGIN_SECONDS: Final = 10
# Header a client sets to keep a conversation on one engine (`session`).
SESSION_HEADER: Final = "x-session-id"
# Response header naming the engine that served a request, for debugging.
BACKEND_HEADER: Final = "x-tensorfleet-backend"
# The label the EndpointSlice controller puts on every slice of a Service.
ENDPOINTSLICE_SERVICE_LABEL: Final = "kubernetes.io/service-name"
# spec.router.auth: the Secret of API keys, mounted read-only in the router pod (one file per tenant), and
# `tensorfleet router --api-keys` pointing at it.
ROUTER_API_KEYS_VOLUME: Final = "api-keys"
ROUTER_API_KEYS_PATH: Final = "/etc/tensorfleet/api-keys"


# --- Object names (DESIGN.md's naming contract) ----------------------------
def stage_name(name: str, stage: int) -> str:
    return f"{name}-stage-{stage}"


def prefill_stage_name(name: str, stage: int) -> str:
    """The prefill pool's StatefulSet (spec.prefill): `NAME-prefill-stage-K`."""
    return f"{name}-prefill-stage-{stage}"


def prefill_engine_service_name(name: str) -> str:
    """The headless Service of the prefill pool's ready leaders, which the routers discover."""
    return f"{name}-prefill-engine"


def workers_service_name(name: str) -> str:
    return f"{name}-workers"


def engine_service_name(name: str) -> str:
    return f"{name}-engine"


def router_name(name: str) -> str:
    return f"{name}-router"


def gpu_claim_template_name(name: str, digest: str, pool: str | None = None) -> str:
    """`NAME[-prefill]-gpus-DIGEST`: the ResourceClaimTemplate of a pool's engine pods. Its spec is immutable, so a
    new one (DIGEST: of its spec) replaces it when the GPUs asked for change."""
    return f"{name}{'-' + pool if pool == POOL_PREFILL else ''}-{GPU_CLAIM}-{digest}"


def hpa_name(name: str) -> str:
    return name


def pdb_name(name: str) -> str:
    return f"{name}-engine"


def demand_lease_name(name: str) -> str:
    """The Lease the routers renew on demand (autoscaling.minReplicas 0): the operator wakes the fleet from it."""
    return f"{name}-demand"


CACHE_VOLUME: Final = "model-cache"
SHM_VOLUME: Final = "dshm"
