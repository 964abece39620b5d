"""A small async Kubernetes API client for the reconciler.

kopf owns the watches; this client makes the reconciler's own calls (GET,
LIST by label, server-side apply, status patches, deletes, events) with one
aiohttp session, counts every write for the metrics and benchmarks, and
turns API failures into ApiError with the status code the caller branches on.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Self

import aiohttp

from tensorfleet import contract
from tensorfleet.controller import metrics
from tensorfleet.controller.resources import Kind, kind_of

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"
CREDENTIAL_REFRESH_SECONDS = 60.0
USER_AGENT = f"tensorfleet-operator/{contract.__version__}"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def invalid(self) -> bool:
        return self.status == 422


@dataclass
class Connection:
    """Where the API server is and how to authenticate; shared with kopf's login."""

    server: str
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    # Refreshes `token` (exec plugins, rotated in-cluster tokens); from the kubernetes client.
    refresh: Any = field(default=None, repr=False)

    @classmethod
    def from_environment(cls, context: str | None = None) -> Connection:
        """In-cluster service account, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(context=context, client_configuration=cfg)
        connection = cls(
            server=cfg.host.rstrip("/"),
            ca_file=cfg.ssl_ca_cert,
            cert_file=cfg.cert_file,
            key_file=cfg.key_file,
            insecure=not cfg.verify_ssl,
        )

        def refresh() -> None:
            if cfg.refresh_api_key_hook is not None:
                cfg.refresh_api_key_hook(cfg)
            # The key's name differs across client versions; its header does not.
            header = next((auth["value"] for auth in cfg.auth_settings().values()
                           if isinstance(auth, dict) and auth.get("in") == "header"
                           and auth.get("key", "").lower() == "authorization"), None)
            connection.token = header.removeprefix("Bearer ").strip() if header else None

        refresh()
        connection.refresh = refresh
        return connection

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if self.insecure:
            return False
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


class Kube:
    """One API client per operator process. Use as an async context manager."""

    def __init__(self, connection: Connection, *, timeout: float = 30.0, field_manager: str = contract.FIELD_MANAGER) -> None:
        self.connection = connection
        self.timeout = timeout
        self.field_manager = field_manager
        self.writes: Counter[tuple[str, str]] = Counter()
        self._session: aiohttp.ClientSession | None = None
        self._refreshed_at = -CREDENTIAL_REFRESH_SECONDS

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.connection.ssl_context(), limit=64),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, kind: Kind, *, params: dict[str, str] | None = None,
                       body: Any = None, content_type: str = "application/json") -> Any:
        assert self._session is not None, "use `async with Kube(...)`"
        await self._refresh_credentials()
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if self.connection.token:
            headers["Authorization"] = f"Bearer {self.connection.token}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        url = self.connection.server + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        if method != "GET":
            self.writes[(method, kind.kind)] += 1
        metrics.API_REQUESTS.labels(method=method, kind=kind.kind).inc()
        try:
            async with self._session.request(method, url, data=data, headers=headers) as response:
                text = await response.text()
                if response.status >= 400:
                    metrics.API_ERRORS.labels(method=method, kind=kind.kind, code=str(response.status)).inc()
                    raise _error(response.status, text)
                return json.loads(text) if text else None
        except (TimeoutError, aiohttp.ClientError) as exc:
            metrics.API_ERRORS.labels(method=method, kind=kind.kind, code="network").inc()
            raise ApiError(0, type(exc).__name__, str(exc) or "connection failed") from exc

    async def _refresh_credentials(self) -> None:
        # Exec plugins and projected service-account tokens rotate; the
        # kubernetes client's hook re-reads them, and may shell out, so not per request.
        if self.connection.refresh is None:
            return
        now = time.monotonic()
        if now - self._refreshed_at >= CREDENTIAL_REFRESH_SECONDS:
            self._refreshed_at = now
            await asyncio.to_thread(self.connection.refresh)

    async def get(self, kind: Kind, namespace: str | None, name: str, subresource: str | None = None) -> dict[str, Any] | None:
        try:
            return await self._request("GET", kind.path(namespace, name, subresource), kind)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def list(self, kind: Kind, namespace: str | None, selector: dict[str, str]) -> list[dict[str, Any]]:
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))} if selector else None
        result = await self._request("GET", kind.path(namespace), kind, params=params)
        items = (result or {}).get("items") or []
        # LIST responses omit apiVersion/kind on items; callers compare and apply them.
        for item in items:
            item.setdefault("apiVersion", kind.api_version)
            item.setdefault("kind", kind.kind)
        return items

    async def apply(self, obj: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        """Server-side apply `obj` as this field manager."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        params = {"fieldManager": self.field_manager, "force": "true" if force else "false"}
        return await self._request("PATCH", kind.path(meta.get("namespace"), meta["name"]), kind,
                                   params=params, body=obj, content_type=APPLY_CONTENT_TYPE)

    async def patch_status(self, kind: Kind, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return await self._request("PATCH", kind.path(namespace, name, "status"), kind,
                                   body={"status": status}, content_type=MERGE_CONTENT_TYPE)

    async def create(self, kind: Kind, namespace: str | None, obj: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", kind.path(namespace), kind, body=obj)

    async def replace(self, kind: Kind, namespace: str | None, obj: dict[str, Any]) -> dict[str, Any]:
        return await self._request("PUT", kind.path(namespace, obj["metadata"]["name"]), kind, body=obj)

    async def delete(self, kind: Kind, namespace: str | None, name: str, *, propagation: str = "Background",
                     uid: str | None = None) -> bool:
        """Delete; False when it was already gone. `uid` guards against deleting a successor."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self._request("DELETE", kind.path(namespace, name), kind, body=body)
            return True
        except ApiError as exc:
            if exc.not_found:
                return False
            raise


def _error(status: int, text: str) -> ApiError:
    try:
        payload = json.loads(text)
    except ValueError:
        payload = {}
    if not isinstance(payload, dict):
        payload = {}
    return ApiError(status, str(payload.get("reason") or "Error"), str(payload.get("message") or text[:300]))
