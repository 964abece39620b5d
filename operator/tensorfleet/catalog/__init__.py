"""Facts about GPUs and models, and the bytes a model's weights and KV cache take: `facts.ModelFacts` is what the
planner sizes a model with, `modelconfig` reads them from a config.json (pure: `tensorfleet.modelinfo` fetches the
files), `models` is the built-in catalog, the offline fallback, and `sizes` computes the bytes.
Design: docs/planner.md#model-facts-what-a-model-is-sized-with."""

from tensorfleet.catalog import sizes
from tensorfleet.catalog.facts import ModelFacts, ModelSource
from tensorfleet.catalog.formats import WeightFormat
from tensorfleet.catalog.modelconfig import ModelConfigError, parse_model_config
from tensorfleet.catalog.models import MODELS, ModelEntry, catalog_facts, find_model, normalise
from tensorfleet.gpus import CPU, GPUS, GPUType, accelerator_names, find_gpu, gpu_names, is_cpu

__all__ = [
    "CPU", "GPUS", "MODELS", "GPUType", "ModelConfigError", "ModelEntry", "ModelFacts", "ModelSource", "WeightFormat",
    "accelerator_names", "catalog_facts", "find_gpu", "find_model", "gpu_names", "is_cpu", "normalise",
    "parse_model_config", "sizes",
]
