"""Engine discovery from the EndpointSlices of the headless `NAME-engine` Service, listed then watched through
`tensorfleet.kube`: the ready endpoints are the engines to route to, and those neither ready nor terminating are
engine pods still starting (a cold start). Design: docs/routing.md#admission-and-the-queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tensorfleet import contract
from tensorfleet.kube.connection import Connection
from tensorfleet.kube.endpoints import SliceEndpoints, slice_endpoints
from tensorfleet.kube.follow import follow
from tensorfleet.kube.resources import ENDPOINT_SLICE

log = logging.getLogger("tensorfleet.router.discovery")


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
    def _failed(self) -> None:
        self.failing = True
        self._updated()

    async def run(self) -> None:
        """List, then watch, until cancelled (kube/follow.py); never raises for API trouble."""
        await follow(self.connection, ENDPOINT_SLICE, self.namespace, self._selector(),
                     component=contract.ROUTER_COMPONENT, on_list=self.apply_list, on_event=self.apply_event,
                     on_failure=self._failed, what=f"EndpointSlices of {self.namespace}/{self.service}")
