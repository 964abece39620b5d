"""Facts about GPUs and models the planner sizes with."""

from tensorfleet.catalog.gpus import GPUS, GPUType, find_gpu, gpu_names
from tensorfleet.catalog.models import MODELS, ModelEntry, find_model, normalise

__all__ = ["GPUS", "MODELS", "GPUType", "ModelEntry", "find_gpu", "find_model", "gpu_names", "normalise"]
