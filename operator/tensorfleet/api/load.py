"""Parse an InferenceService document (a dict from YAML or the API server)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tensorfleet import contract
from tensorfleet.api.errors import SpecError, from_validation_error
from tensorfleet.api.models import MAX_NAME_LENGTH, InferenceService


def load_inference_service(document: Any) -> InferenceService:
    """Validate one document; raise SpecError naming the first bad field."""
    if not isinstance(document, dict):
        raise SpecError("(document)", f"expected a mapping (an InferenceService object), got {type(document).__name__}")
    api_version = document.get("apiVersion")
    kind = document.get("kind")
    if kind != contract.KIND or api_version != contract.API_VERSION:
        raise SpecError(
            "apiVersion/kind",
            f"got {api_version}/{kind}; expected apiVersion: {contract.API_VERSION}, kind: {contract.KIND}",
        )
    metadata = document.get("metadata")
    if not isinstance(metadata, dict) or not metadata.get("name"):
        raise SpecError("metadata.name", "required: the InferenceService needs a name")
    name = metadata["name"]
    if isinstance(name, str) and len(name) > MAX_NAME_LENGTH:
        raise SpecError(
            "metadata.name",
            f"{name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH} so that generated pod and revision names stay valid",
        )
    try:
        return InferenceService.model_validate(document)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
