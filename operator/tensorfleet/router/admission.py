"""What the router answers itself before an engine sees a request: the API key (401), the tenant's requests and tokens
per minute (429), and the body within the router's bounds (size, the in-flight budget, the body timeout, JSON nesting
and size). Each refusal is an OpenAI-style error counted against no engine, and a request refused unread has its
connection closed. Design: docs/security.md#clients-of-the-router.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import hdrs, web

from tensorfleet.httpapi import error_response, rate_limited_logger
from tensorfleet.router.budget import Body, BodyBudget
from tensorfleet.router.clients import (
    CLIENT_CLOSED,
    CLIENT_LOG,
    GENERATION_PATHS,
    RETRY_AFTER_SECONDS,
    ClientGone,
    ClientMetrics,
    Requests,
    reject,
)
from tensorfleet.router.config import ClientConfig
from tensorfleet.router.tenants import KeyRing, Limits, Refusal, UsageMeter
from tensorfleet.router.tokencount import estimate_prompt_tokens, stated_max_tokens

# A request's handling past its key: (the request, its start, its tenant) -> the answer.
Handler = Callable[[web.Request, float, "str | None"], Awaitable[web.StreamResponse]]

log = logging.getLogger("tensorfleet.router")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests containers more than `limit` deep (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


class Admission:
    """A request's key, limits and body, each either accepted or answered with the router's own refusal."""

    def __init__(self, config: ClientConfig, metrics: ClientMetrics, body_budget: BodyBudget,
                 keys: KeyRing | None) -> None:
        self.config = config
        self.metrics = metrics
        self.body_budget = body_budget
        self.keys = keys
        self.key_limits = Limits(config.requests_per_minute, config.tokens_per_minute)
        self.clients_log = rate_limited_logger(CLIENT_LOG)

    async def follow_keys(self, on_change: Callable[[frozenset[str]], None] | None = None) -> None:
        """Read the API keys again whenever their files changed (checked each reload interval), until cancelled:
        the limits and metrics of tenants gone are dropped, and ON_CHANGE told the tenants in force."""
        keys = self.keys
        assert keys is not None
        while True:
            await asyncio.sleep(self.config.api_keys_reload_interval)
            if keys.refresh():
                self.key_limits.retain(keys.tenants)
                self.metrics.forget_tenants(keys.tenants)
                if on_change is not None:
                    on_change(keys.tenants)

    def tenant_done(self, tenant: str | None, code: str) -> None:
        """Count an answer to TENANT's request (None: no key), while the tenant is still one."""
        if tenant is not None and self.keys is not None and tenant in self.keys.tenants:
            self.metrics.tenant_done(tenant, code)

    async def serve(self, request: web.Request, requests: Requests, handle: Handler, now: Callable[[], float], *,
                    who: str, done: Callable[[str, float], None] | None = None) -> web.StreamResponse:
        """One client request, start to end: counted in REQUESTS for the drain, its key checked, then HANDLE's
        answer (given the request, its start on NOW's clock and its tenant), an OpenAI-style 500 for a bug; its
        status counted (DONE, else the client metrics) and its tenant's. While draining, the answer closes its
        connection, so the client reconnects to a replica that stays. WHO (router, gateway) names the process."""
        start = now()
        code = CLIENT_CLOSED
        tenant: str | None = None
        response: web.StreamResponse
        requests.request_started()
        try:
            found = self.authenticate(request)
            if isinstance(found, web.Response):
                response = found
            else:
                tenant = found
                response = await handle(request, start, tenant)
            code = str(response.status)
        except ClientGone as gone:
            return gone.response
        except Exception:
            # A bug, not a backend's failure: still an OpenAI-shaped answer.
            log.exception("%s error serving %s", who, request.path)
            code = "500"
            response = error_response(500, f"internal {who} error; the {who}'s log has the details")
        finally:
            elapsed = now() - start
            if done is not None:
                done(code, elapsed)
            else:
                self.metrics.request_done(code, elapsed)
            self.tenant_done(tenant, code)
            requests.request_done()
        if requests.draining and not response.prepared:
            response.force_close()
        return response

    def authenticate(self, request: web.Request) -> str | web.Response | None:
        """The tenant whose API key the request carries; None without --api-keys; a 401 without a key in force
        (the body left unread)."""
        if self.keys is None:
            return None
        header = request.headers.get(hdrs.AUTHORIZATION)
        tenant = self.keys.tenant(header)
        if tenant is not None:
            return tenant
        reason = "invalid" if header else "missing"
        self.metrics.auth_failed(reason)
        self.clients_log.info("refused a request from %s: %s API key", request.remote, reason)
        message = ("no API key: send one as `Authorization: Bearer KEY`" if reason == "missing"
                   else "invalid API key: the Authorization header does not carry a key in force (`Bearer KEY`)")
        return reject(self.metrics, 401, message, type_="invalid_request_error", code="invalid_api_key",
                      headers={"WWW-Authenticate": "Bearer"}, close=request.can_read_body)

    def head(self, request: web.Request, tenant: str | None) -> web.Response | None:
        """What the request's head alone refuses, its body unread: a compressed body (415), one longer than the
        limit (413), a tenant out of requests (429)."""
        # vLLM does not decode compressed request bodies and OpenAI clients do not send them: refused unread, they
        # lose nothing legitimate, and no decompression bomb can cost CPU or memory.
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
        if encoding not in ("", "identity"):
            return reject(self.metrics, 415, "compressed request bodies are not accepted (Content-Encoding must be "
                                             "identity); send the JSON as is", close=True)
        length = request.content_length
        limit = self.config.max_body_bytes
        if length is not None and length > limit:
            return reject(self.metrics, 413, f"request body exceeds the router's limit of {limit} bytes", close=True)
        if tenant is not None:
            return self._over_limit(tenant, self.key_limits.admit_request(tenant), close=True)
        return None

    def _over_limit(self, tenant: str, refusal: Refusal | None, *, close: bool = False) -> web.Response | None:
        """The 429 for a tenant over one of its limits; None when it is not."""
        if refusal is None:
            return None
        self.metrics.tenant_rejected(tenant, refusal.limit)
        return reject(self.metrics, 429, refusal.message, type_=refusal.limit, code="rate_limit_exceeded",
                      headers={"Retry-After": str(refusal.retry_after)}, close=close)

    def admit_tokens(self, tenant: str, path: str, parsed: Mapping[str, Any]) -> tuple[UsageMeter, int] | web.Response:
        """Charge the tenant the request's token estimate: the meter that settles it and the charge, or the 429."""
        prompt = estimate_prompt_tokens(parsed)
        estimate = prompt + self.completion_estimate(path, parsed)
        refused = self._over_limit(tenant, self.key_limits.admit_tokens(tenant, estimate))
        if refused is not None:
            return refused
        return UsageMeter(prompt), estimate

    def completion_estimate(self, path: str, body: Mapping[str, Any]) -> int:
        """The most tokens a request may generate, as charged at admission: max_tokens (else
        --default-max-tokens) for each of its `n` choices; 0 for what generates nothing."""
        if path not in GENERATION_PATHS:
            return 0
        limit = stated_max_tokens(body)
        if limit is None:
            limit = self.config.default_max_tokens
        n = body.get("n")
        return limit * (n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1)

    def settle(self, tenant: str, charged: int, meter: UsageMeter) -> None:
        """Charge what the request used instead of its estimate."""
        used = meter.used()
        final = charged if used is None else used
        self.key_limits.settle(tenant, charged, final)
        if self.keys is not None and tenant in self.keys.tenants:
            self.metrics.tenant_tokens(tenant, final)

    async def receive(self, request: web.Request, tenant: str | None, body: Body) -> dict[str, Any] | web.Response:
        """The request's body as a JSON object, read into BODY once its head passed (`head`); or the refusal."""
        refused = self.head(request, tenant)
        return refused if refused is not None else await self.read(request, body)

    async def read(self, request: web.Request, body: Body) -> dict[str, Any] | web.Response:
        """The request's body as a JSON object, read into BODY; or the answer refusing it."""
        refused = await self._read(request, body)
        return refused if refused is not None else self._parse(body.data)

    async def _read(self, request: web.Request, body: Body) -> web.Response | None:
        """Read the body within the size limit, the in-flight budget and the body timeout; an answer if it can't."""
        cfg = self.config
        content = request.content
        try:
            if content.is_eof():  # the usual case: the whole body came with the head, no need for a timer
                return self._take(body, content.read_nowait())
            async with asyncio.timeout(cfg.body_timeout):
                while chunk := await content.readany():
                    refused = self._take(body, chunk)
                    if refused is not None:
                        return refused
        except TimeoutError:
            self.clients_log.info("closed a connection from %s: request body not complete within %gs", request.remote,
                                  cfg.body_timeout)
            return reject(self.metrics, 408, f"the request body did not arrive within {cfg.body_timeout:g}s",
                          close=True)
        except web.RequestPayloadError:
            return reject(self.metrics, 400, "the request body is malformed (bad chunked encoding)", close=True)
        return None

    def _take(self, body: Body, chunk: bytes) -> web.Response | None:
        """Add a chunk to the body, or the answer refusing it: too large (413), or over the budget (503)."""
        limit = self.config.max_body_bytes
        if len(body.data) + len(chunk) > limit:
            return reject(self.metrics, 413, f"request body exceeds the router's limit of {limit} bytes", close=True)
        if body.add(chunk):
            return None
        self.clients_log.warning("refused a request: the router already holds %d bytes of request bodies (limit %d)",
                                 self.body_budget.used, self.body_budget.limit)
        return reject(self.metrics, 503, "the router is holding too many request bytes right now; retry later",
                      headers={"Retry-After": RETRY_AFTER_SECONDS}, close=True)

    def _parse(self, raw: bytearray) -> dict[str, Any] | web.Response:
        """The body as a JSON object, or a 400 that says which limit it broke."""
        cfg = self.config
        # An upper bound on the values, taken on the bytes before parsing: no body can inflate into millions of objects.
        containers = raw.count(b"[") + raw.count(b"{")
        if containers + raw.count(b",") >= cfg.max_json_values:
            return reject(self.metrics, 400, f"request body has more than {cfg.max_json_values} JSON values")
        try:
            body = json.loads(raw)
        except RecursionError:
            return reject(self.metrics, 400, f"request body nests JSON deeper than {cfg.max_json_depth} levels")
        except (ValueError, UnicodeDecodeError) as exc:
            return reject(self.metrics, 400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return reject(self.metrics, 400, "request body must be a JSON object")
        if containers > cfg.max_json_depth and _deeper_than(body, cfg.max_json_depth):
            return reject(self.metrics, 400, f"request body nests JSON deeper than {cfg.max_json_depth} levels")
        return body
