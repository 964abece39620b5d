"""The gateway's view of the cluster: the InferenceServices in the namespaces it is given (or all) and the
EndpointSlices of their router Services, each listed then watched (kube/follow.py), fed into the model table; waiters
are woken on every change, so a request for a model whose router is still starting goes out the moment one is ready.
Design: docs/gateway.md#the-model-table.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from tensorfleet import contract
from tensorfleet.gateway.table import ModelTable, ServiceKey
from tensorfleet.kube.connection import Connection
from tensorfleet.kube.endpoints import SliceEndpoints, slice_endpoints
from tensorfleet.kube.follow import follow
from tensorfleet.kube.resources import ENDPOINT_SLICE, INFERENCE_SERVICE

log = logging.getLogger("tensorfleet.gateway.watch")

# The router Services' EndpointSlices: the EndpointSlice controller copies a Service's labels onto its slices.
ROUTER_SLICES = {contract.LABEL_COMPONENT: contract.COMPONENT_ROUTER, contract.LABEL_MANAGED_BY: contract.APP_NAME}


class Changes:
    """Wakes everyone waiting for the table to change."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def changed(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> bool:
        """Whether a change came within TIMEOUT seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
        except TimeoutError:
            return False
        return True


class ClusterView:
    """Follows InferenceServices and router EndpointSlices into TABLE; `listed` once every namespace's
    InferenceServices were listed, `failing` while a list or watch fails."""

    def __init__(self, table: ModelTable, connection: Connection, namespaces: Iterable[str], changes: Changes, *,
                 on_deleted: Callable[[str, str], None] | None = None) -> None:
        self.table = table
        self.on_deleted = on_deleted  # (namespace, name) of an InferenceService deleted
        self.connection = connection
        self.namespaces: tuple[str | None, ...] = tuple(namespaces) or (None,)
        self.changes = changes
        self._listed: set[str | None] = set()
        self.failing = False
        self._slices: dict[tuple[str, str], tuple[str, SliceEndpoints]] = {}  # (ns, slice) -> (service, endpoints)

    @property
    def listed(self) -> bool:
        return self._listed >= set(self.namespaces)

    # --- InferenceServices ---------------------------------------------------------------------------------
    def services_listed(self, namespace: str | None, items: Iterable[Mapping[str, Any]]) -> None:
        self.table.replace_services(items, namespace)
        self._listed.add(namespace)
        self.failing = False
        self.changes.changed()

    def service_event(self, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind in ("ADDED", "MODIFIED"):
            self.table.put_service(obj)
        elif kind == "DELETED":
            self.table.drop_service(obj)
            metadata = obj.get("metadata") or {}
            if self.on_deleted is not None:
                self.on_deleted(metadata.get("namespace", ""), metadata.get("name", ""))
        else:
            return
        self.changes.changed()

    # --- router endpoints --------------------------------------------------------------------------------
    def slices_listed(self, namespace: str | None, items: Iterable[Mapping[str, Any]]) -> None:
        self._slices = {k: v for k, v in self._slices.items() if namespace is not None and k[0] != namespace}
        for item in items:
            self._put_slice(item)
        self._publish_routers()

    def slice_event(self, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind in ("ADDED", "MODIFIED"):
            self._put_slice(obj)
        elif kind == "DELETED":
            metadata = obj.get("metadata") or {}
            self._slices.pop((metadata.get("namespace", ""), metadata.get("name", "")), None)
        else:
            return
        self._publish_routers()

    def _put_slice(self, obj: Mapping[str, Any]) -> None:
        metadata = obj.get("metadata") or {}
        labels = metadata.get("labels") or {}
        service = labels.get(contract.ENDPOINTSLICE_SERVICE_LABEL)
        if not service or any(labels.get(k) != v for k, v in ROUTER_SLICES.items()):
            return
        self._slices[metadata.get("namespace", ""), metadata.get("name", "")] = (service, slice_endpoints(obj))

    def _publish_routers(self) -> None:
        routers: dict[ServiceKey, set[str]] = {}
        for (namespace, _), (service, endpoints) in self._slices.items():
            routers.setdefault((namespace, service), set()).update(endpoints.ready)
        self.table.set_routers({key: tuple(sorted(urls)) for key, urls in routers.items()})
        self.changes.changed()

    def _failed(self) -> None:
        self.failing = True

    # --- loop ----------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Follow both kinds in every namespace until cancelled; never raises for API trouble."""
        tasks = []
        for namespace in self.namespaces:
            where = namespace or "all namespaces"
            tasks.append(follow(self.connection, INFERENCE_SERVICE, namespace, {},
                                component=contract.GATEWAY_COMPONENT,
                                on_list=partial(self.services_listed, namespace), on_event=self.service_event,
                                on_failure=self._failed, what=f"InferenceServices in {where}"))
            tasks.append(follow(self.connection, ENDPOINT_SLICE, namespace, ROUTER_SLICES,
                                component=contract.GATEWAY_COMPONENT,
                                on_list=partial(self.slices_listed, namespace), on_event=self.slice_event,
                                on_failure=self._failed, what=f"router EndpointSlices in {where}"))
        await asyncio.gather(*tasks)
