"""The gateway's HTTP face: the router's allow-list of OpenAI routes, and per request the router's own admission (API
key, per-tenant limits, body bounds; router/admission.py), then the model table for the `model` it names (404 at
once for one no InferenceService serves), the traffic split for its conversation, and the forward to that
InferenceService's router; GET /v1/models from the table. Design: docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import hdrs, web
from prometheus_client import Counter, Gauge

from tensorfleet import contract
from tensorfleet.gateway.config import GatewayConfig
from tensorfleet.gateway.split import conversation, pick
from tensorfleet.gateway.table import Ambiguous, Group, ModelTable, Service
from tensorfleet.gateway.upstream import Upstream
from tensorfleet.gateway.watch import Changes, ClusterView
from tensorfleet.router.admission import Admission
from tensorfleet.router.budget import Body, BodyBudget
from tensorfleet.router.clients import (
    GENERATION_PATHS,
    RETRY_AFTER_SECONDS,
    ClientMetrics,
    Requests,
    drain,
    openai_app,
    reject,
)
from tensorfleet.router.relay import RelayedStream
from tensorfleet.router.resume import CHAT_PATH, ask_usage, usage_asked
from tensorfleet.router.tenants import UsageMeter, open_keys

log = logging.getLogger("tensorfleet.gateway")

# The client headers a router gets; Authorization only when the gateway checks no keys itself.
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id", "traceparent", "tracestate", contract.SESSION_HEADER)


class Gateway:
    """One OpenAI endpoint over the InferenceServices in TABLE (filled by a ClusterView from config.kube, or by
    the caller)."""

    def __init__(self, config: GatewayConfig, table: ModelTable | None = None) -> None:
        self.config = config
        self.table = table if table is not None else ModelTable()
        self.changes = Changes()  # the table changed: whoever fills it says so
        self.view = (ClusterView(self.table, config.kube, config.namespaces, self.changes, on_deleted=self._forget)
                     if config.kube is not None else None)
        self.requests = Requests()
        self.metrics = ClientMetrics(contract.GATEWAY_CLIENT_METRICS)
        self.keys = open_keys(config.api_keys)  # KeysError at start for a path that cannot be read
        self.admission = Admission(config, self.metrics, BodyBudget(config.max_body_bytes_in_flight), self.keys)
        self._forwarded = tuple(h for h in _FORWARDED_HEADERS if self.keys is None or h != hdrs.AUTHORIZATION)
        self._conversations = Counter(contract.GATEWAY_METRIC_CONVERSATIONS,
                                      "New conversations sent to each InferenceService of a traffic group (the "
                                      "model name it serves): the split the weights made.",
                                      [contract.GATEWAY_LABEL_NAMESPACE, contract.GATEWAY_LABEL_SERVICE,
                                       contract.GATEWAY_LABEL_GROUP], registry=self.metrics.registry)
        self._counted: dict[tuple[str, str], set[str]] = {}  # (namespace, name) -> groups with a conversations series
        Gauge(contract.GATEWAY_METRIC_MODELS, "Models /v1/models lists.", registry=self.metrics.registry
              ).set_function(lambda: len(self.table.listing()))
        self.upstream = Upstream(config, self.table, self.changes, self.metrics)

    def _forget(self, namespace: str, name: str) -> None:
        """A deleted InferenceService's series go with it (the labels' values stay bounded by what exists)."""
        self.metrics.forget_backend(f"{namespace}/{name}")
        for group in self._counted.pop((namespace, name), set()):
            self._conversations.remove(namespace, name, group)

    @property
    def listed(self) -> bool:
        return self.view is None or self.view.listed

    # --- app ---------------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = openai_app(self.config, self.metrics, "gateway", inference=self.inference, models=self.models,
                         health=self.health)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, _: web.Application) -> AsyncIterator[None]:
        self.upstream.open()
        tasks = []
        if self.view is not None:
            tasks.append(asyncio.create_task(self.view.run(), name="gateway-view"))
        if self.keys is not None:
            tasks.append(asyncio.create_task(self.admission.follow_keys(), name="gateway-api-keys"))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.upstream.close()

    async def drain(self, runner: web.AppRunner) -> None:
        """SIGTERM: serve on for the drain delay, then give the requests in flight the grace (the runner's
        cleanup ends what is left)."""
        await drain(runner, self.requests, self.config.drain_delay, self.config.shutdown_grace, log)

    # --- plain endpoints ------------------------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        """200 while serving: the InferenceServices listed or not (a request waits for the list itself)."""
        return web.json_response({"status": "ok", "listed": self.listed, "models": len(self.table.models),
                                  "failing": self.view is not None and self.view.failing,
                                  "draining": self.requests.draining})

    async def models(self, request: web.Request) -> web.Response:
        """Every model a Ready InferenceService serves, adapters with their parent."""
        refused = self.admission.authenticate(request)
        if isinstance(refused, web.Response):
            return refused
        if not await self._wait_listed():
            return self._not_listed()
        return web.json_response({"object": "list", "data": self.table.listing()})

    async def _wait_listed(self) -> bool:
        if self.listed:
            return True
        assert self.view is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.cold_start_timeout
        while not self.view.listed and (left := deadline - loop.time()) > 0:
            await self.changes.wait(left)
        return self.view.listed

    def _not_listed(self) -> web.Response:
        return reject(self.metrics, 503, "the gateway has not listed the InferenceServices yet (the API server is not "
                                         "answering it); retry later", headers={"Retry-After": RETRY_AFTER_SECONDS})

    # --- inference ----------------------------------------------------------------------------------------------
    async def inference(self, request: web.Request) -> web.StreamResponse:
        """One OpenAI API request, refused here or answered by an InferenceService's router (Admission.serve)."""
        return await self.admission.serve(request, self.requests, self._inference, asyncio.get_running_loop().time,
                                          who="gateway")

    async def _inference(self, request: web.Request, start: float, tenant: str | None) -> web.StreamResponse:
        resource = request.match_info.route.resource
        assert resource is not None
        path = resource.canonical
        body = Body(self.admission.body_budget)
        meter: UsageMeter | None = None
        charged = 0
        try:
            parsed = await self.admission.receive(request, tenant, body)
            if isinstance(parsed, web.Response):
                return parsed
            model = parsed.get("model")
            if not isinstance(model, str) or not model:
                return reject(self.metrics, 400, "the request names no `model`: the gateway routes by it "
                                                 "(GET /v1/models lists them)", param="model")
            if not await self._wait_listed():
                return self._not_listed()
            entry = self.table.lookup(model)
            if entry is None:
                return reject(self.metrics, 404, f"The model `{model[:200]}` does not exist; GET /v1/models lists "
                                                 "the models this gateway serves.", param="model",
                              code="model_not_found")
            if isinstance(entry, Ambiguous):
                return reject(self.metrics, 409, entry.message, param="model")
            if tenant is not None and self.admission.key_limits.counts_tokens:
                admitted = self.admission.admit_tokens(tenant, path, parsed)
                if isinstance(admitted, web.Response):
                    return admitted
                meter, charged = admitted
            service = self._place(entry, request, parsed)
            if service is None:
                return reject(self.metrics, 503, f"every InferenceService serving `{model}` has spec.traffic.weight "
                                                 "0: none takes new conversations",
                              headers={"Retry-After": RETRY_AFTER_SECONDS})
            relay: RelayedStream | None = None
            data: bytes | bytearray = body.data
            if meter is not None and path in GENERATION_PATHS and parsed.get("stream") is True:
                # The key's tokens: the router's usage, asked for here and cut from what the client did not ask.
                asked = usage_asked(parsed)
                if asked is not None:
                    asking = ask_usage(data, parsed)
                    added = asking is not None and body.replace(asking[0])
                    data = body.data
                    relay = RelayedStream(chat=path == CHAT_PATH, usage=asked, added=added)
            del parsed
            headers = {name: request.headers[name] for name in self._forwarded if name in request.headers}
            headers[hdrs.CONTENT_TYPE] = "application/json"
            return await self.upstream.forward(request, service, path, data, headers, start=start, relay=relay,
                                               meter=meter)
        finally:
            body.release()
            if meter is not None and tenant is not None:
                self.admission.settle(tenant, charged, meter)

    def _place(self, group: Group, request: web.Request, parsed: dict[str, Any]) -> Service | None:
        """The member of GROUP this request's conversation goes to (counted when the request opens it)."""
        key, first = conversation(request.headers, parsed)
        name = pick(key, group.candidates())
        if name is None:
            return None
        service = group.member(name)
        if first:
            self._conversations.labels(service.namespace, service.name, group.model).inc()
            self._counted.setdefault(service.key, set()).add(group.model)
        return service
