"""Names every part of Tensorfleet agrees on, defined once.

The renderer writes these into objects and pod env; the worker launcher, the
router, the simulator and the controller read them. Import from here; never
spell one of these strings anywhere else.
"""

from __future__ import annotations

from typing import Final

__version__: Final = "0.1.0"

# --- API -------------------------------------------------------------------
GROUP: Final = "tensorfleet.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "InferenceService"
PLURAL: Final = "inferenceservices"
SINGULAR: Final = "inferenceservice"
SHORT_NAMES: Final = ("infsvc",)
CATEGORIES: Final = ("tensorfleet",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"
FIELD_MANAGER: Final = "tensorfleet"

# --- Images ----------------------------------------------------------------
# The worker image is vLLM plus our launcher; the control-plane image runs the
# operator, the router and the simulator. Both are versioned with this package.
IMAGE_REGISTRY: Final = "ghcr.io/tensorfleet"
WORKER_IMAGE: Final = f"{IMAGE_REGISTRY}/tensorfleet-worker:{__version__}"
CONTROL_PLANE_IMAGE: Final = f"{IMAGE_REGISTRY}/tensorfleet:{__version__}"

# --- Labels ----------------------------------------------------------------
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_VERSION: Final = "app.kubernetes.io/version"
LABEL_INFERENCE_SERVICE: Final = f"{GROUP}/inference-service"
LABEL_STAGE: Final = f"{GROUP}/stage"
LABEL_ROLE: Final = f"{GROUP}/role"
# Set by the StatefulSet controller on every pod since Kubernetes 1.28.
LABEL_POD_INDEX: Final = "apps.kubernetes.io/pod-index"

APP_NAME: Final = "tensorfleet"
COMPONENT_ENGINE: Final = "engine"
COMPONENT_ROUTER: Final = "router"
ROLE_LEADER: Final = "leader"
ROLE_WORKER: Final = "worker"

# GPU feature discovery and the NVIDIA device plugin.
GPU_RESOURCE: Final = "nvidia.com/gpu"
GPU_PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
GPU_TAINT_KEY: Final = "nvidia.com/gpu"
# Well-known node label the kubelet sets; spreads router pods over nodes.
LABEL_HOSTNAME: Final = "kubernetes.io/hostname"

# --- Ports -----------------------------------------------------------------
ENGINE_PORT: Final = 8000          # vLLM's OpenAI server (and the simulator)
RAY_PORT: Final = 6379             # Ray GCS on the group leader
ROUTER_PORT: Final = 8080          # router container
SERVICE_PORT: Final = 80           # user-facing Service NAME
WORKER_METRICS_PORT: Final = 9400  # GPU health exporter beside the engine
PORT_NAME_HTTP: Final = "http"
PORT_NAME_RAY: Final = "ray"
PORT_NAME_GPU_METRICS: Final = "gpu-metrics"

# --- Paths -----------------------------------------------------------------
HEALTH_PATH: Final = "/health"
METRICS_PATH: Final = "/metrics"
SHM_PATH: Final = "/dev/shm"
CACHE_PATH: Final = "/cache"
HF_HOME_PATH: Final = f"{CACHE_PATH}/huggingface"

# --- Worker launcher env (renderer writes, launcher reads) -----------------
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
# JSON list of strings: extra engine flags, passed through as argv items.
ENV_EXTRA_ARGS: Final = "TF_EXTRA_ARGS"
# The GPU type and the planner's KV-cache size: the simulator times itself
# from them, and the launcher logs them beside vLLM's own figure.
ENV_ACCELERATOR: Final = "TF_ACCELERATOR"
ENV_KV_CACHE_TOKENS: Final = "TF_KV_CACHE_TOKENS"
ENV_GPU_METRICS_PORT: Final = "TF_GPU_METRICS_PORT"
# Standard names read by huggingface_hub / vLLM themselves.
ENV_HF_TOKEN: Final = "HF_TOKEN"
ENV_HF_HOME: Final = "HF_HOME"

WORKER_ENV_VARS: Final = (
    ENV_ENGINE_KIND, ENV_INFERENCE_SERVICE, ENV_NAMESPACE, ENV_POD_NAME,
    ENV_GROUP_INDEX, ENV_STAGE_INDEX, ENV_LEADER_ADDRESS, ENV_RAY_PORT,
    ENV_ENGINE_PORT, ENV_TENSOR_PARALLEL, ENV_PIPELINE_PARALLEL, ENV_MODEL,
    ENV_SERVED_MODEL_NAME, ENV_MODEL_REVISION, ENV_DTYPE, ENV_QUANTIZATION,
    ENV_KV_CACHE_DTYPE, ENV_MAX_MODEL_LEN, ENV_GPU_MEMORY_UTILIZATION,
    ENV_MAX_NUM_SEQS, ENV_EXTRA_ARGS, ENV_ACCELERATOR, ENV_KV_CACHE_TOKENS, ENV_GPU_METRICS_PORT,
)

# --- Commands --------------------------------------------------------------
WORKER_COMMAND: Final = ("tensorfleet-worker",)
WORKER_HEALTH_COMMAND: Final = ("tensorfleet-worker", "health")
ROUTER_COMMAND: Final = ("tensorfleet", "router")

# --- Metrics ---------------------------------------------------------------
# vLLM's own metric, and the name prometheus-adapter exposes it under.
VLLM_METRIC_WAITING: Final = "vllm:num_requests_waiting"
HPA_METRIC_WAITING: Final = "vllm_num_requests_waiting"


# --- Object names (DESIGN.md's naming contract) ----------------------------
def stage_name(name: str, stage: int) -> str:
    return f"{name}-stage-{stage}"


def workers_service_name(name: str) -> str:
    return f"{name}-workers"


def engine_service_name(name: str) -> str:
    return f"{name}-engine"


def router_name(name: str) -> str:
    return f"{name}-router"


def hpa_name(name: str) -> str:
    return name


def pdb_name(name: str) -> str:
    return f"{name}-engine"


CACHE_VOLUME: Final = "model-cache"
SHM_VOLUME: Final = "dshm"
