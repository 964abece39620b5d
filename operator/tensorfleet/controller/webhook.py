"""The validating admission webhook: refuse at `kubectl apply` what the planner refuses.

It is stateless (parse + plan), so every operator replica serves it, leader
or standby: the webhook Service can route to any ready pod, and a rollout of
the operator never leaves the API server without a webhook to call.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tensorfleet import contract
from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.planner import make_plan

log = logging.getLogger(__name__)
WEBHOOK_PATH = contract.WEBHOOK_PATH


@dataclass
class WebhookConfig:
    port: int = contract.OPERATOR_WEBHOOK_PORT
    addr: str = "0.0.0.0"
    certfile: str | None = None
    keyfile: str | None = None
    # Plain HTTP: only for tests and local runs; the API server requires TLS.
    insecure: bool = False


def validate_document(document: dict[str, Any]) -> None:
    """What the webhook checks: the same parsing and planning the reconciler does."""
    isvc = load_inference_service(document)
    make_plan(isvc.spec)


def review(body: dict[str, Any]) -> dict[str, Any]:
    """An admission.k8s.io/v1 AdmissionReview response for an AdmissionReview request."""
    request = body.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    # Deletes and status writes carry no new spec to judge.
    if request.get("operation") in ("CREATE", "UPDATE") and not request.get("subResource"):
        try:
            validate_document(request.get("object") or {})
        except SpecError as exc:
            response = {**response, "allowed": False,
                        "status": {"code": 422, "reason": "Invalid", "message": str(exc)}}
    return {"apiVersion": body.get("apiVersion", "admission.k8s.io/v1"), "kind": "AdmissionReview",
            "response": response}


async def _handle(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"error": "expected an AdmissionReview JSON body"}, status=400)
    result = review(body if isinstance(body, dict) else {})
    if not result["response"]["allowed"]:
        log.info("admission denied: %s", result["response"]["status"]["message"])
    return web.json_response(result)


async def serve(config: WebhookConfig) -> web.AppRunner:
    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_post(WEBHOOK_PATH, _handle)
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
