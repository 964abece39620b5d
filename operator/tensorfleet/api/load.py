"""Parse an InferenceService document (a dict from YAML or the API server). Design:
docs/api.md#reading-a-manifest-file."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tensorfleet import contract
from tensorfleet.api.base import MAX_NAME_LENGTH
from tensorfleet.api.errors import SpecError, from_validation_error, one_line, quote
from tensorfleet.api.models import MAX_DISAGGREGATED_NAME_LENGTH, InferenceService
from tensorfleet.api.strict import check_document


def load_inference_service(document: Any, *, strict: bool = False, ignore_status: bool = False) -> InferenceService:
    """Validate one document; raise SpecError naming the first bad field.

    strict: check it first as the API server would (`api/strict.py`: unknown
    fields, types, schema bounds), for input that has not been through one:
    `tensorfleet plan` and `render` read files with it. Documents the
    operator gets from the API server have been.

    ignore_status: leave `status` out (the result's status is None). The
    reconciler and the webhook judge objects read from the API server by
    their spec alone: the status is the operator's own output, and one an
    older operator wrote must not make a valid spec fail to load.
    """
    if not isinstance(document, dict):
        raise SpecError("(document)", f"expected a mapping (an InferenceService object), got {type(document).__name__}")
    if ignore_status and "status" in document:
        document = {k: v for k, v in document.items() if k != "status"}
    api_version = document.get("apiVersion")
    kind = document.get("kind")
    if kind != contract.KIND or api_version != contract.API_VERSION:
        raise SpecError(
            "apiVersion/kind",
            f"got {one_line(str(api_version), 80)}/{one_line(str(kind), 80)}; expected apiVersion: {contract.API_VERSION}, kind: {contract.KIND}",
        )
    if strict:
        document = check_document(document)
    metadata = document.get("metadata")
    if not isinstance(metadata, dict) or not metadata.get("name"):
        raise SpecError("metadata.name", "required: the InferenceService needs a name")
    name = metadata["name"]
    if isinstance(name, str) and len(name) > MAX_NAME_LENGTH:
        raise SpecError(
            "metadata.name",
            f"{quote(name)} is {len(name)} characters; at most {MAX_NAME_LENGTH} so that generated pod and revision names stay valid",
        )
    spec = document.get("spec")
    if isinstance(name, str) and isinstance(spec, dict) and spec.get("prefill") is not None \
            and len(name) > MAX_DISAGGREGATED_NAME_LENGTH:
        raise SpecError(
            "metadata.name",
            f"{quote(name)} is {len(name)} characters; with spec.prefill at most {MAX_DISAGGREGATED_NAME_LENGTH}, "
            "so that the prefill pool's pod and revision names (NAME-prefill-stage-K-...) stay valid",
        )
    try:
        return InferenceService.model_validate(document)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
