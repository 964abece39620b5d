"""Engine discovery from the EndpointSlices of the headless `NAME-engine` Service, listed then watched through
`tensorfleet.kube`: the ready endpoints are the engines to route to, and those neither ready nor terminating are
engine pods still starting (a cold start). Design: docs/routing.md#admission-and-the-queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tensorfleet import contract
from tensorfleet.kube.client import Gone, Kube
from tensorfleet.kube.connection import Connection
from tensorfleet.kube.resources import ENDPOINT_SLICE

log = logging.getLogger("tensorfleet.router.discovery")

WATCH_TIMEOUT_SECONDS = 290  # the API server ends watches after 5-10 min anyway
BACKOFF_START, BACKOFF_MAX = 0.5, 30.0


@dataclass(frozen=True)
class SliceEndpoints:
    """The engine base URLs one EndpointSlice lists: ready ones, and starting ones (not ready, not terminating)."""

    ready: tuple[str, ...] = ()
    starting: tuple[str, ...] = ()


def slice_endpoints(endpoint_slice: Mapping[str, Any]) -> SliceEndpoints:
    """The ready and the starting endpoints of one EndpointSlice, as engine base URLs."""
    ports = endpoint_slice.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == contract.PORT_NAME_HTTP), None)
    if port is None:
        port = next((p.get("port") for p in ports if p.get("port")), contract.ENGINE_PORT)
    family = endpoint_slice.get("addressType", "IPv4")
    ready: list[str] = []
    starting: list[str] = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        addresses = endpoint.get("addresses") or []
        if not addresses:
            continue
        # Addresses of one endpoint are fungible; the first serves.
        host = f"[{addresses[0]}]" if family == "IPv6" else addresses[0]
        url = f"http://{host}:{port}"
        conditions = endpoint.get("conditions") or {}
        # The API defines an absent `ready` as ready; a terminating pod's endpoint is never ready. Pods with no
        # address yet (Pending) are in no slice at all.
        if conditions.get("ready") is not False:
            ready.append(url)
        elif conditions.get("terminating") is not True:
            starting.append(url)
    return SliceEndpoints(tuple(ready), tuple(starting))


def slice_urls(endpoint_slice: Mapping[str, Any]) -> list[str]:
    """Engine base URLs of the ready endpoints of one EndpointSlice."""
    return list(slice_endpoints(endpoint_slice).ready)


class EndpointSliceWatcher:
    """Follows the endpoints of one Service: calls `on_change` with the ready ones' URLs when they change, and
    `on_update` (no arguments) after every list, event and failure, for whoever reads `listed`, `failing` and
    `starting()`."""

    def __init__(self, service: str, namespace: str, on_change: Callable[[list[str]], None], *,
                 connection: Connection, on_update: Callable[[], None] | None = None) -> None:
        self.service = service
        self.namespace = namespace
        self.on_change = on_change
        self.on_update = on_update
        self.connection = connection
        self.slices: dict[str, SliceEndpoints] = {}
        self.listed = False   # a list has succeeded: the slices are known
        self.failing = False  # the last list or watch failed (until the next list succeeds)
        self._resource_version: str | None = None

    def _selector(self) -> dict[str, str]:
        return {contract.ENDPOINTSLICE_SERVICE_LABEL: self.service}

    def _ours(self, obj: Mapping[str, Any]) -> bool:
        # The server filters by label already; checking again keeps a
        # misbehaving proxy or emulator from mixing in other Services.
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return labels.get(contract.ENDPOINTSLICE_SERVICE_LABEL) == self.service

    # --- state -----------------------------------------------------------------------
    def urls(self) -> list[str]:
        """The ready endpoints: the engines to route to."""
        return sorted({url for endpoints in self.slices.values() for url in endpoints.ready})

    def starting(self) -> list[str]:
        """Endpoints listed but neither ready nor terminating (and not ready in another slice): starting pods."""
        ready = set(self.urls())
        return sorted({url for endpoints in self.slices.values() for url in endpoints.starting} - ready)

    def _publish(self, before: list[str]) -> None:
        after = self.urls()
        if after != before:
            starting = self.starting()
            log.info("engines of %s/%s: %s%s", self.namespace, self.service, ", ".join(after) or "none ready",
                     f" ({len(starting)} starting)" if starting else "")
            self.on_change(after)
        self._updated()

    def _updated(self) -> None:
        if self.on_update is not None:
            self.on_update()

    def apply_list(self, items: Iterable[Mapping[str, Any]]) -> None:
        before = self.urls()
        self.slices = {
            item["metadata"]["name"]: slice_endpoints(item) for item in items if self._ours(item)
        }
        self.listed = True
        self.failing = False
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
            self.slices[name] = slice_endpoints(obj)
        self._publish(before)

    # --- loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        """List, then watch from the list's resourceVersion, until cancelled: a watch that ends is resumed from the
        last version seen, a 410 Gone (history compacted) relists, and any other failure backs off exponentially
        (BACKOFF_START to BACKOFF_MAX) and relists; never raises for API trouble."""
        backoff = BACKOFF_START
        async with Kube(self.connection, component=contract.ROUTER_COMPONENT) as kube:
            while True:
                try:
                    if self._resource_version is None:
                        items, self._resource_version = await kube.list_versioned(
                            ENDPOINT_SLICE, self.namespace, self._selector())
                        self.apply_list(items)
                    async for event in kube.watch(ENDPOINT_SLICE, self.namespace, self._selector(),
                                                  resource_version=self._resource_version,
                                                  timeout_seconds=WATCH_TIMEOUT_SECONDS):
                        self.apply_event(event)
                    backoff = BACKOFF_START
                except asyncio.CancelledError:
                    raise
                except Gone:
                    self._resource_version = None
                except Exception as exc:  # noqa: BLE001 - any failure: back off and relist
                    log.warning("watching EndpointSlices of %s/%s failed: %s; retrying in %.1fs",
                                self.namespace, self.service, exc, backoff)
                    self._resource_version = None
                    self.failing = True
                    self._updated()
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX)
