"""The async Kubernetes API client every tensorfleet process shares: one aiohttp session; GET, LIST by label, WATCH
from a resourceVersion, server-side apply, status patches, create, replace and delete. Failures become ApiError
(Gone for a compacted watch), every write is counted (`writes`), and an optional `observe` callback sees each
request. Design: docs/architecture.md#the-kubernetes-layer.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import time
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, Self

import aiohttp

from tensorfleet import contract
from tensorfleet.kube.connection import Connection
from tensorfleet.kube.resources import Kind, kind_of

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"
CREDENTIAL_REFRESH_SECONDS = 60.0


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


# Called once per request with (method, kind, error): error is None on success,
# else the HTTP status code as text or "network".
Observer = Callable[[str, str, str | None], None]


class Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone, history compacted): list again."""


class Kube:
    """One API client per process. Use as an async context manager."""

    def __init__(self, connection: Connection, *, timeout: float = 30.0, field_manager: str = contract.FIELD_MANAGER,
                 component: str = contract.OPERATOR_COMPONENT, observe: Observer | None = None) -> None:
        self.connection = connection
        self.timeout = timeout
        self.field_manager = field_manager
        self.user_agent = f"{component}/{contract.__version__}"
        self.observe = observe
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

    def _note(self, method: str, kind: Kind, error: str | None) -> None:
        if self.observe is not None:
            self.observe(method, kind.kind, error)

    async def _headers(self) -> dict[str, str]:
        await self._refresh_credentials()
        headers = {"Accept": "application/json", "User-Agent": self.user_agent}
        if self.connection.token:
            headers["Authorization"] = f"Bearer {self.connection.token}"
        return headers

    def _url(self, path: str, params: dict[str, str] | None) -> str:
        url = self.connection.server + path
        return url + "?" + urllib.parse.urlencode(params) if params else url

    async def _request(self, method: str, path: str, kind: Kind, *, params: dict[str, str] | None = None,
                       body: Any = None, content_type: str = "application/json") -> Any:
        assert self._session is not None, "use `async with Kube(...)`"
        headers = await self._headers()
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        if method != "GET":
            self.writes[(method, kind.kind)] += 1
        try:
            async with self._session.request(method, self._url(path, params), data=data,
                                             headers=headers) as response:
                text = await response.text()
                if response.status >= 400:
                    self._note(method, kind, str(response.status))
                    raise _error(response.status, text)
                self._note(method, kind, None)
                return json.loads(text) if text else None
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._note(method, kind, "network")
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
        items, _ = await self.list_versioned(kind, namespace, selector)
        return items

    async def list_versioned(self, kind: Kind, namespace: str | None,
                             selector: dict[str, str]) -> tuple[builtins.list[dict[str, Any]], str]:
        """The items and the list's resourceVersion, from which a watch continues."""
        result = await self._request("GET", kind.path(namespace), kind, params=_selector(selector))
        items = (result or {}).get("items") or []
        # LIST responses omit apiVersion/kind on items; callers compare and apply them.
        for item in items:
            item.setdefault("apiVersion", kind.api_version)
            item.setdefault("kind", kind.kind)
        return items, str(((result or {}).get("metadata") or {}).get("resourceVersion") or "")

    async def watch(self, kind: Kind, namespace: str | None, selector: dict[str, str], *, resource_version: str,
                    timeout_seconds: int = 290) -> AsyncIterator[dict[str, Any]]:
        """Yield watch events (ADDED, MODIFIED, DELETED, BOOKMARK) from `resource_version` until the server ends it.

        Raises Gone when the version is too old, ApiError on any other failure.
        """
        assert self._session is not None, "use `async with Kube(...)`"
        params = {**(_selector(selector) or {}), "watch": "true", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(timeout_seconds)}
        if resource_version:
            params["resourceVersion"] = resource_version
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout, sock_read=timeout_seconds + 30)
        try:
            async with self._session.get(self._url(kind.path(namespace), params), headers=await self._headers(),
                                         timeout=timeout) as response:
                if response.status == 410:
                    self._note("WATCH", kind, "410")
                    raise Gone()
                if response.status >= 400:
                    self._note("WATCH", kind, str(response.status))
                    raise _error(response.status, await response.text())
                self._note("WATCH", kind, None)
                buffer = b""
                # One event can exceed aiohttp's readline limit (a slice of 100
                # endpoints is tens of KiB), so lines are split here.
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        if line.strip():
                            yield _event(line)
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._note("WATCH", kind, "network")
            raise ApiError(0, type(exc).__name__, str(exc) or "connection failed") from exc

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
                     uid: str | None = None, grace_seconds: int | None = None) -> dict[str, Any] | None:
        """Delete; None when it was already gone, else the server's answer.

        The answer is the object itself while finalizers or a grace period hold
        it (with its deletionTimestamp), or a Status once it is gone.
        `uid` guards against deleting a successor of the same name;
        `grace_seconds` overrides a pod's terminationGracePeriodSeconds (0: at once).
        """
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            answer = await self._request("DELETE", kind.path(namespace, name), kind, body=body)
            return answer if isinstance(answer, dict) else {}
        except ApiError as exc:
            if exc.not_found:
                return None
            raise


def _selector(selector: dict[str, str]) -> dict[str, str] | None:
    return {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))} if selector else None


def _event(line: bytes) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(line)
    if event.get("type") == "ERROR":
        status = event.get("object") or {}
        if status.get("code") == 410:
            raise Gone()
        raise ApiError(int(status.get("code") or 0), str(status.get("reason") or "Error"),
                       str(status.get("message") or status))
    return event


def _error(status: int, text: str) -> ApiError:
    try:
        payload = json.loads(text)
    except ValueError:
        payload = {}
    if not isinstance(payload, dict):
        payload = {}
    return ApiError(status, str(payload.get("reason") or "Error"), str(payload.get("message") or text[:300]))
