"""An EndpointSlice read as base URLs: its ready endpoints, and those still starting (neither ready nor terminating),
on the port named `http`. Shared by the router's engine discovery, the gateway's router table and the operator's
read of the gateway's pods. Design: docs/architecture.md#the-kubernetes-layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorfleet import contract


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
