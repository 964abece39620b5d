"""The InferenceService API: models, parsing and CRD generation. Design: docs/api.md."""

from tensorfleet.api.errors import SpecError
from tensorfleet.api.load import load_inference_service
from tensorfleet.api.models import InferenceService, InferenceServiceSpec

__all__ = ["InferenceService", "InferenceServiceSpec", "SpecError", "load_inference_service"]
