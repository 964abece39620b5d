"""Engine discovery from the EndpointSlices of the headless `NAME-engine` Service.

List, then watch from the list's resourceVersion; a watch that ends is
resumed from the last version seen, a 410 Gone (history compacted) relists,
and errors back off exponentially. Only endpoints whose `ready` condition is
not false count (the API defines an absent condition as ready); terminating
pods are never ready. The Role the operator renders grants get/list/watch on
endpointslices in the namespace and nothing else.

aiohttp talks to the API server directly: the kubernetes client is
synchronous, and a router thread blocked on a watch is one more thing to
manage. In a pod the API address, CA and token come from the service-account
mount; the token is reread on every connection because bound tokens rotate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from tensorfleet import contract

log = logging.getLogger("tensorfleet.router.discovery")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_TIMEOUT_SECONDS = 290  # the API server ends watches after 5-10 min anyway
BACKOFF_START, BACKOFF_MAX = 0.5, 30.0


def in_cluster_namespace() -> str | None:
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip() or None
    except OSError:
        return None


def slice_urls(endpoint_slice: Mapping[str, Any]) -> list[str]:
    """Engine base URLs of the ready endpoints of one EndpointSlice."""
    ports = endpoint_slice.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == contract.PORT_NAME_HTTP), None)
    if port is None:
        port = next((p.get("port") for p in ports if p.get("port")), contract.ENGINE_PORT)
    family = endpoint_slice.get("addressType", "IPv4")
    urls = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False:
            continue
        addresses = endpoint.get("addresses") or []
        if not addresses:
            continue
        # Addresses of one endpoint are fungible; the first serves.
        host = f"[{addresses[0]}]" if family == "IPv6" else addresses[0]
        urls.append(f"http://{host}:{port}")
    return urls


class EndpointSliceWatcher:
    def __init__(self, service: str, namespace: str, on_change: Callable[[list[str]], None], *,
                 api: str | None = None) -> None:
        self.service = service
        self.namespace = namespace
        self.on_change = on_change
        self.api = api
        self.slices: dict[str, list[str]] = {}
        self._resource_version: str | None = None
        self._ssl: ssl.SSLContext | bool = True

    # --- connection ----------------------------------------------------------------
    def _base_and_headers(self) -> tuple[str, dict[str, str]]:
        headers = {"Accept": "application/json"}
        if self.api:
            return self.api.rstrip("/"), headers
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not in a cluster (KUBERNETES_SERVICE_HOST unset); use --kube-api or --backend")
        token = (SERVICE_ACCOUNT_DIR / "token").read_text().strip()
        headers["Authorization"] = f"Bearer {token}"
        if isinstance(self._ssl, bool):
            self._ssl = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT_DIR / "ca.crt"))
        host = f"[{host}]" if ":" in host else host
        return f"https://{host}:{port}", headers

    def _url(self, base: str) -> str:
        return f"{base}/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    def _params(self) -> dict[str, str]:
        return {"labelSelector": f"{contract.ENDPOINTSLICE_SERVICE_LABEL}={self.service}"}

    def _ours(self, obj: Mapping[str, Any]) -> bool:
        # The server filters by label already; checking again keeps a
        # misbehaving proxy or emulator from mixing in other Services.
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return labels.get(contract.ENDPOINTSLICE_SERVICE_LABEL) == self.service

    # --- state -----------------------------------------------------------------------
    def urls(self) -> list[str]:
        return sorted({url for urls in self.slices.values() for url in urls})

    def _publish(self, before: list[str]) -> None:
        after = self.urls()
        if after != before:
            log.info("engines of %s/%s: %s", self.namespace, self.service, ", ".join(after) or "none ready")
            self.on_change(after)

    def apply_list(self, items: Iterable[Mapping[str, Any]]) -> None:
        before = self.urls()
        self.slices = {
            item["metadata"]["name"]: slice_urls(item) for item in items if self._ours(item)
        }
        self._publish(before)

    def apply_event(self, event: Mapping[str, Any]) -> None:
        obj = event.get("object") or {}
        kind = event.get("type")
        metadata = obj.get("metadata") or {}
        if metadata.get("resourceVersion"):
            self._resource_version = metadata["resourceVersion"]
        if kind == "BOOKMARK" or not self._ours(obj):
            return
        before = self.urls()
        name = metadata.get("name", "")
        if kind == "DELETED":
            self.slices.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.slices[name] = slice_urls(obj)
        self._publish(before)

    # --- loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        backoff = BACKOFF_START
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=WATCH_TIMEOUT_SECONDS + 30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    if self._resource_version is None:
                        await self._list(session)
                    await self._watch(session)
                    backoff = BACKOFF_START
                except asyncio.CancelledError:
                    raise
                except _Gone:
                    self._resource_version = None
                except Exception as exc:  # noqa: BLE001 - any failure: back off and relist
                    log.warning("watching EndpointSlices of %s/%s failed: %s; retrying in %.1fs",
                                self.namespace, self.service, exc, backoff)
                    self._resource_version = None
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX)

    async def _list(self, session: aiohttp.ClientSession) -> None:
        base, headers = self._base_and_headers()
        async with session.get(self._url(base), params=self._params(), headers=headers, ssl=self._ssl) as resp:
            if resp.status != 200:
                raise RuntimeError(f"list endpointslices: HTTP {resp.status}: {(await resp.text())[:200]}")
            body = await resp.json(content_type=None)
        self.apply_list(body.get("items") or [])
        self._resource_version = (body.get("metadata") or {}).get("resourceVersion") or ""

    async def _watch(self, session: aiohttp.ClientSession) -> None:
        base, headers = self._base_and_headers()
        params = {**self._params(), "watch": "true", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(WATCH_TIMEOUT_SECONDS)}
        if self._resource_version:
            params["resourceVersion"] = self._resource_version
        async with session.get(self._url(base), params=params, headers=headers, ssl=self._ssl) as resp:
            if resp.status == 410:
                raise _Gone()
            if resp.status != 200:
                raise RuntimeError(f"watch endpointslices: HTTP {resp.status}: {(await resp.text())[:200]}")
            buffer = b""
            # Lines can exceed aiohttp's readline limit (a slice of 100
            # endpoints is tens of KiB), so split them here.
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        self._handle_line(line)

    def _handle_line(self, line: bytes) -> None:
        event = json.loads(line)
        if event.get("type") == "ERROR":
            status = event.get("object") or {}
            if status.get("code") == 410:
                raise _Gone()
            raise RuntimeError(f"watch error: {status.get('message', status)}")
        self.apply_event(event)


class _Gone(Exception):
    """The resourceVersion is too old: relist."""
