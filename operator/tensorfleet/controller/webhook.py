"""The validating admission webhook: refuses at `kubectl apply` what the reconciler would refuse (parse, plan, the
registry policy) and names whose children would collide with another InferenceService's; every replica serves
it, it never waits long on the Hub, and it bounds what a caller can push.
Design: docs/security.md#callers-of-the-admission-webhook.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tensorfleet import contract
from tensorfleet.api import InferenceService, SpecError, load_inference_service
from tensorfleet.catalog.facts import ModelFacts
from tensorfleet.controller.modelfacts import CATALOG_ONLY, ModelFactsConfig, for_admission, pinned
from tensorfleet.controller.policy import check_images, colliding_owner_names
from tensorfleet.planner import Plan, make_plan
from tensorfleet.render import render

log = logging.getLogger(__name__)
WEBHOOK_PATH = contract.WEBHOOK_PATH
# An AdmissionReview carries the object and the old object, each at most etcd's 1.5 MiB.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_CONCURRENT_REVIEWS = 8
# The field the planner names when it has no facts for a model (not in the catalog, none given).
MODEL_FACTS_FIELD = "spec.model.architecture"
# (namespace, name) -> that InferenceService's body, or None.
Lookup = Callable[[str, str], Awaitable[dict[str, Any] | None]]


@dataclass
class WebhookConfig:
    port: int = contract.OPERATOR_WEBHOOK_PORT
    addr: str = "0.0.0.0"
    certfile: str | None = None
    keyfile: str | None = None
    # Plain HTTP: only for tests and local runs; the API server requires TLS.
    insecure: bool = False
    # Image prefixes InferenceServices may name (empty: any); see policy.image_allowed.
    allowed_registries: Sequence[str] = field(default_factory=tuple)


def validate_document(document: dict[str, Any], *, allowed_registries: Sequence[str] = (),
                      facts: ModelFacts | None = None) -> tuple[InferenceService, Plan]:
    """What the reconciler checks too: parsing, planning (with the model's FACTS, else the catalog's), the registry policy."""
    isvc = load_inference_service(document, ignore_status=True)
    plan = make_plan(isvc.spec, facts)
    check_images(isvc, allowed_registries)
    return isvc, plan


async def validate_request(request: dict[str, Any], *, allowed_registries: Sequence[str] = (),
                           model_facts: ModelFactsConfig = CATALOG_ONLY) -> tuple[InferenceService, Plan | None, str | None]:
    """validate_document for an AdmissionRequest: (the object, its plan, a warning).

    The plan is None, with a warning saying why, when the model's facts could
    not be had in time: the object is admitted and the reconcile plans it.
    """
    document = dict(request.get("object") or {})
    if request.get("namespace") and isinstance(document.get("metadata"), dict):
        document["metadata"] = {"namespace": request["namespace"], **document["metadata"]}
    isvc = load_inference_service(document, ignore_status=True)
    statuses = tuple((obj or {}).get("status") for obj in (request.get("object"), request.get("oldObject")))
    facts, deferred = await for_admission(isvc, statuses, model_facts)
    if deferred is not None:
        try:
            make_plan(isvc.spec)  # what needs no model facts: the GPU type
        except SpecError as exc:
            if exc.field != MODEL_FACTS_FIELD:
                raise
        check_images(isvc, allowed_registries)
        return isvc, None, deferred
    isvc, plan = validate_document(document, allowed_registries=allowed_registries, facts=facts)
    return isvc, plan, None


async def check_collisions(isvc: InferenceService, plan: Plan, lookup: Lookup) -> None:
    """Raise SpecError when an existing InferenceService would own an object of the same kind and name (a Service
    `foo-engine` is both `foo`'s engine Service and `foo-engine`'s router Service).

    The candidates come from name arithmetic (`colliding_owner_names`) and are read with a GET each, so every
    operator replica, leader or standby, answers without a cache.
    """
    namespace, name = isvc.metadata.namespace or "default", isvc.metadata.name
    ours = {(obj["kind"], obj["metadata"]["name"]) for obj in render(isvc, plan)}
    for other_name in sorted(colliding_owner_names(name, ours)):
        other = await lookup(namespace, other_name)
        if other is None:
            continue
        try:
            other_isvc = load_inference_service(other, ignore_status=True)
            their_facts = pinned(other_isvc, other.get("status"))
            their_plan = make_plan(other_isvc.spec, their_facts.facts if their_facts is not None else None)
            theirs = {(obj["kind"], obj["metadata"]["name"]) for obj in render(other_isvc, their_plan)}
        except SpecError:
            continue  # it serves nothing new; the reconciler reports any object it already holds
        shared = sorted(ours & theirs)
        if shared:
            kind, child = shared[0]
            raise SpecError("metadata.name", f"{name} would share the {kind} {child} with InferenceService "
                                             f"{other_name} in {namespace}; choose another name")


async def review(body: dict[str, Any], *, lookup: Lookup | None = None, allowed_registries: Sequence[str] = (),
                 model_facts: ModelFactsConfig = CATALOG_ONLY) -> dict[str, Any]:
    """An admission.k8s.io/v1 AdmissionReview response for an AdmissionReview request."""
    request = body.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    # Deletes and status writes carry no new spec to judge.
    if request.get("operation") in ("CREATE", "UPDATE") and not request.get("subResource"):
        try:
            isvc, plan, warning = await validate_request(request, allowed_registries=allowed_registries,
                                                         model_facts=model_facts)
            if warning is not None:
                # Unplanned, its children's names are not known: the reconciler still takes nothing it does not own.
                response["warnings"] = [warning]
            elif lookup is not None and plan is not None:
                await check_collisions(isvc, plan, lookup)
        except SpecError as exc:
            response = {**response, "allowed": False,
                        "status": {"code": 422, "reason": "Invalid", "message": str(exc)}}
    return {"apiVersion": body.get("apiVersion", "admission.k8s.io/v1"), "kind": "AdmissionReview",
            "response": response}


def _refuse(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _handler(config: WebhookConfig, lookup: Lookup | None,
             model_facts: ModelFactsConfig) -> Callable[[web.Request], Awaitable[web.Response]]:
    slots = asyncio.Semaphore(MAX_CONCURRENT_REVIEWS)

    async def handle(request: web.Request) -> web.Response:
        """Answer one AdmissionReview, within the size, encoding, nesting and concurrency bounds."""
        if request.headers.get("Content-Encoding", "identity").lower() != "identity":
            return _refuse(415, "compressed bodies are not accepted")
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return _refuse(413, f"the body exceeds {MAX_BODY_BYTES} bytes")
        if slots.locked():
            return _refuse(429, "too many reviews in flight")
        async with slots:
            try:
                raw = await request.read()  # the whole body; aiohttp stops at client_max_size
            except web.HTTPRequestEntityTooLarge:
                return _refuse(413, f"the body exceeds {MAX_BODY_BYTES} bytes")
            except (TimeoutError, ConnectionError):
                return _refuse(400, "the body could not be read")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python parses
                return _refuse(400, "expected an AdmissionReview JSON body")
            result = await review(body if isinstance(body, dict) else {}, lookup=lookup,
                                  allowed_registries=config.allowed_registries, model_facts=model_facts)
        if not result["response"]["allowed"]:
            log.info("admission denied: %s", result["response"]["status"]["message"])
        return web.json_response(result)

    return handle


async def serve(config: WebhookConfig, *, lookup: Lookup | None = None,
                model_facts: ModelFactsConfig = CATALOG_ONLY) -> web.AppRunner:
    """Start serving the webhook; `lookup` reads other InferenceServices for the collision check."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post(WEBHOOK_PATH, _handler(config, lookup, model_facts))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    context = None
    if not config.insecure:
        if not (config.certfile and config.keyfile):
            raise ValueError("the webhook needs --webhook-cert and --webhook-key (the API server only calls HTTPS)")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(config.certfile, config.keyfile)
    await web.TCPSite(runner, config.addr, config.port, ssl_context=context).start()
    return runner
