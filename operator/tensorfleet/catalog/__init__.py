"""Facts about GPUs and models, and the bytes a model's weights and KV cache take (`sizes`)."""

from tensorfleet.catalog import sizes
from tensorfleet.catalog.gpus import GPUS, GPUType, find_gpu, gpu_names
from tensorfleet.catalog.models import MODELS, ModelEntry, find_model, normalise

__all__ = ["GPUS", "MODELS", "GPUType", "ModelEntry", "find_gpu", "find_model", "gpu_names", "normalise", "sizes"]
