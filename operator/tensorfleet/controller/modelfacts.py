"""The model's facts at reconcile and at admission: read from its config.json once per model identity (name,
revision, the `tensorfleet.dev/model-facts-refresh` annotation), in a thread and bounded in time, then pinned in
status.modelFacts so that later plans never ask the Hub again (`resolve`; `for_admission` for the webhook).
Design: docs/architecture.md#model-facts-read-once-then-pinned.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tensorfleet import contract, modelinfo
from tensorfleet.api import InferenceService
from tensorfleet.api.errors import one_line
from tensorfleet.api.status import ModelFactsStatus
from tensorfleet.catalog.facts import FactsEncodingError, ModelFacts, facts_digest, facts_from_json, facts_to_json
from tensorfleet.catalog.models import catalog_facts

REFRESH_ANNOTATION = contract.ANNOTATION_MODEL_FACTS_REFRESH
CATALOG_SOURCES = ("catalog", "catalog+id-markers")


@dataclass(frozen=True)
class ModelFactsConfig:
    """How the operator reads model facts (`tensorfleet run --no-hub`, `--hub-timeout-seconds`)."""

    hub: bool = True                       # read config.json (Hub, then cache); False: the catalog only
    timeout_seconds: float = 5.0           # what one reconcile waits for it at most
    admission_timeout_seconds: float = 2.0  # what the webhook waits (the API server gives it 10 s in all)
    retry_seconds: float = 10.0            # first retry of a model no source gives; doubles up to max_retry_seconds
    max_retry_seconds: float = 300.0
    cache_dir: str | None = None           # Hugging Face cache; default HF_HUB_CACHE, else under the temp dir

    def hub_cache(self) -> str:
        """Where config.json files are downloaded: the pod's root filesystem is read-only, /tmp is not."""
        return self.cache_dir or os.environ.get("HF_HUB_CACHE") or os.path.join(tempfile.gettempdir(),
                                                                                  "tensorfleet-hf-cache")

    def retry_after(self, failures: int) -> float:
        """Seconds before the next try after FAILURES failed ones in a row (1, 2, ...)."""
        return min(self.max_retry_seconds, self.retry_seconds * 2 ** max(failures - 1, 0))


DEFAULT_MODEL_FACTS = ModelFactsConfig()
CATALOG_ONLY = ModelFactsConfig(hub=False)


class FactsUnavailable(Exception):
    """No facts for a model the catalog does not know either; str() is PlanValid's message (after the field)."""


@dataclass(frozen=True)
class Resolved:
    """What to plan with, and what to pin."""

    facts: ModelFacts | None           # None: the planner's own (spec.model.architecture, or the catalog's verdict)
    pin: ModelFactsStatus | None       # status.modelFacts; None: nothing pinned (spec.model.architecture)
    warning: str | None = None         # for PlanValid: the Hub failed and the catalog answered

    @property
    def note(self) -> str | None:
        """Where the facts came from, for PlanValid's message."""
        if self.pin is None:
            return None
        if self.pin.commit:
            return f"model facts: {self.pin.source} (config.json at {self.pin.commit[:12]})"
        return f"model facts: {self.pin.source}"


NOT_PINNED = Resolved(None, None)


def identity(isvc: InferenceService) -> tuple[str, str | None, str | None]:
    """(model, revision, refresh): what the pinned facts are for; a change reads them again."""
    return isvc.spec.model.name, isvc.spec.model.revision, isvc.metadata.annotations.get(REFRESH_ANNOTATION)


def pinned(isvc: InferenceService, status: Mapping[str, Any] | None) -> Resolved | None:
    """The facts pinned in STATUS when they were read for ISVC's model identity as it is now; else None."""
    raw = (status or {}).get("modelFacts")
    if not isinstance(raw, dict):
        return None
    try:
        pin = ModelFactsStatus.model_validate(raw)
    except ValidationError:
        return None
    if (pin.model, pin.revision, pin.refresh) != identity(isvc):
        return None
    try:
        facts = facts_from_json(pin.facts)
    except FactsEncodingError:
        return None  # written by an operator that encoded facts otherwise: read them again
    if facts_digest(facts) != pin.digest:
        return None
    return Resolved(facts, pin, _fallback_warning(pin))


def _fallback_warning(pin: ModelFactsStatus) -> str | None:
    if pin.hub_error is None:
        return None
    return (f"model facts from the built-in catalog: {pin.hub_error}; they stay pinned until spec.model changes or "
            f"the {REFRESH_ANNOTATION} annotation gets a new value")


def pin(isvc: InferenceService, facts: ModelFacts, hub_error: str | None = None) -> Resolved:
    """Pin FACTS for ISVC's model identity."""
    model, revision, refresh = identity(isvc)
    entry = ModelFactsStatus(model=model, source=facts.source, digest=facts_digest(facts), facts=facts_to_json(facts))
    for field_name, value in (("revision", revision), ("refresh", refresh), ("commit", facts.revision),
                              ("hub_error", hub_error)):
        if value is not None:
            setattr(entry, field_name, value)
    return Resolved(facts, entry, _fallback_warning(entry))


def _planned_from_catalog(status: Mapping[str, Any] | None) -> bool:
    """A plan in force that an operator without pins made from the catalog."""
    plan = (status or {}).get("plan")
    return isinstance(plan, dict) and plan.get("modelSource") in CATALOG_SOURCES and not (status or {}).get("modelFacts")


async def _read(name: str, revision: str | None, config: ModelFactsConfig, timeout: float) -> ModelFacts:
    """config.json through modelinfo, in a thread, for at most TIMEOUT seconds; ModelInfoError says why not."""
    read = asyncio.to_thread(modelinfo.resolve_model, name, revision, cache_dir=config.hub_cache(), timeout=timeout,
                             error_ttl=config.retry_seconds)
    try:
        # Past the bound the thread goes on, and what it reads lands in modelinfo's cache.
        return await asyncio.wait_for(read, timeout)
    except TimeoutError:
        raise modelinfo.ModelInfoError(f"the Hub did not answer within {timeout:g} s") from None


async def resolve(isvc: InferenceService, status: Mapping[str, Any] | None, config: ModelFactsConfig) -> Resolved:
    """What a reconcile plans ISVC with, at first sight of its model identity. Raises FactsUnavailable.

    - spec.model.architecture given: it wins; nothing is read or pinned.
    - facts pinned for this identity: those.
    - no pin, but a plan in force that an operator without pins made from the catalog (an upgrade): the
      catalog's facts are pinned, so the upgrade rolls nothing. The annotation reads config.json.
    - the Hub is off (`--no-hub`) or the name is no repository id: the catalog.
    - otherwise config.json through modelinfo, at most `timeout_seconds` (the blocking read runs in a thread;
      only this reconcile waits). Facts read are pinned with source `hub` (or `cache`: the Hub unreachable,
      the operator's own Hugging Face cache had them). When none can be read: the catalog's, pinned with the
      Hub's error in `hubError` and in PlanValid's message (a warning), until the annotation asks again; a
      model the catalog does not know either raises FactsUnavailable (PlanValid False naming the model and
      the error, nothing rendered, retried with backoff).
    """
    if isvc.spec.model.architecture is not None:
        return NOT_PINNED
    found = pinned(isvc, status)
    if found is not None:
        return found
    name, revision, _ = identity(isvc)
    catalog = catalog_facts(name)
    if catalog is not None and _planned_from_catalog(status):
        return pin(isvc, catalog)
    if not config.hub or not modelinfo.is_repo_id(name):
        return pin(isvc, catalog) if catalog is not None else NOT_PINNED  # the planner says what is missing
    try:
        return pin(isvc, await _read(name, revision, config, config.timeout_seconds))
    except modelinfo.ModelInfoError as exc:
        error = str(exc)
    offline = modelinfo.hub_offline()
    if catalog is not None:
        return pin(isvc, catalog, hub_error=None if offline else error)
    raise FactsUnavailable(
        f"no facts for model {name}: {error}; the built-in catalog does not know it either. The operator tries "
        "again; or give spec.model.architecture (from the model's config.json)"
    )


async def for_admission(isvc: InferenceService, statuses: tuple[Mapping[str, Any] | None, ...],
                        config: ModelFactsConfig) -> tuple[ModelFacts | None, str | None]:
    """(facts to plan with, or None for the planner's own; a warning when the plan must wait for the reconcile).

    STATUSES: the object's status and the stored object's (an update). Never
    waits more than config.admission_timeout_seconds, and never refuses because
    the Hub is slow: the facts pinned in a status when they match, else
    config.json read within that bound (modelinfo's cache answers at once for a
    model read recently), else the catalog's; a model no source gives in time is
    admitted with a warning, and the reconcile reports on it.
    """
    if isvc.spec.model.architecture is not None:
        return None, None
    for status in statuses:
        found = pinned(isvc, status)
        if found is not None:
            return found.facts, None
    name, revision, _ = identity(isvc)
    catalog = catalog_facts(name)
    if not config.hub or not modelinfo.is_repo_id(name):
        return catalog, None
    try:
        return await _read(name, revision, config, config.admission_timeout_seconds), None
    except modelinfo.ModelInfoError as exc:
        if catalog is not None:
            return catalog, None
        # The API server keeps warnings short and printable.
        return None, (f"spec.model.name: no facts for model {name} yet ({one_line(str(exc), 120)}); admitted "
                      "unchecked: the operator reads its config.json and reports in PlanValid")
