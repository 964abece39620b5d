"""The operator's view of traffic groups (docs/gateway.md#traffic-groups-and-weights): which InferenceServices of a
namespace serve one model name, fed by the operator's own watch, and how many new conversations the gateway sent each
(read from the gateway pods' /metrics by GatewayCounts), turned into status.traffic. Which members to reconcile
again is said whenever a group or its counts change. Design: docs/gateway.md#status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp

from tensorfleet import contract, promtext
from tensorfleet.api.traffic import served_and_weight, shares
from tensorfleet.kube.client import Observer
from tensorfleet.kube.connection import Connection
from tensorfleet.kube.endpoints import SliceEndpoints, slice_endpoints
from tensorfleet.kube.follow import follow
from tensorfleet.kube.resources import ENDPOINT_SLICE

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
GroupKey = tuple[str, str]  # (namespace, served name)


def _percent(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".") + "%"


class TrafficGroups:
    """Members and weights of every traffic group, and the gateway's counts per member (None: no gateway read)."""

    def __init__(self) -> None:
        self._groups: dict[GroupKey, dict[str, int | None]] = {}
        self._group_of: dict[Key, GroupKey] = {}
        self.counts: dict[Key, int] | None = None

    def observed(self, obj: Mapping[str, Any], *, deleted: bool = False) -> set[Key]:
        """Take an InferenceService as watched; the InferenceServices whose status.traffic it changed."""
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        found = None if deleted else served_and_weight(obj)
        before = self._group_of.get(key)
        touched: set[GroupKey] = set()
        if before is not None and (found is None or before != (key[0], found[0])):
            self._groups[before].pop(key[1], None)
            if not self._groups[before]:
                del self._groups[before]
            del self._group_of[key]
            touched.add(before)
        if found is not None:
            group = (key[0], found[0])
            members = self._groups.setdefault(group, {})
            if key[1] not in members or members[key[1]] != found[1]:
                members[key[1]] = found[1]
                touched.add(group)
            self._group_of[key] = group
        return {(ns, name) for ns, served in touched for name in self._groups.get((ns, served), {})}

    def counted(self, counts: Mapping[Key, int]) -> set[Key]:
        """New totals from the gateway; the InferenceServices whose status.traffic they changed."""
        before, self.counts = self.counts or {}, dict(counts)
        out: set[Key] = set()
        for key in set(before) | set(counts):
            group = self._group_of.get(key)
            if group is not None and before.get(key) != counts.get(key):
                out.update((group[0], name) for name in self._groups[group])
        return out

    def status(self, namespace: str, name: str) -> dict[str, Any] | None:
        """status.traffic of one InferenceService (camelCase); None when the operator has not seen it."""
        group = self._group_of.get((namespace, name))
        if group is None:
            return None
        members = self._groups[group]
        split = shares(members)
        counted = {member: (self.counts or {}).get((namespace, member), 0) for member in members}
        total = sum(counted.values())
        out = []
        for member in sorted(members):
            entry: dict[str, Any] = {"name": member, "share": _percent(split[member])}
            if self.counts is not None:
                entry["conversations"] = counted[member]
                if total:
                    entry["observedShare"] = _percent(100.0 * counted[member] / total)
            out.append(entry)
        return {"group": group[1], "members": out}


def conversations(text: str) -> dict[Key, int]:
    """The gateway's tensorfleet_gateway_conversations_total from its /metrics text, per (namespace, name)."""
    out: dict[Key, int] = {}
    for sample in promtext.select(text, contract.GATEWAY_METRIC_CONVERSATIONS + "_total"):
        labels = sample.labels
        key = (labels.get(contract.GATEWAY_LABEL_NAMESPACE, ""), labels.get(contract.GATEWAY_LABEL_SERVICE, ""))
        out[key] = out.get(key, 0) + int(sample.value)
    return out


class GatewayCounts:
    """Every POLL seconds, the new conversations the gateway's ready pods (the Service NAMESPACE/NAME's endpoints,
    followed by a watch: no list per round) counted, summed over them and handed to ON_COUNTS; a round any pod
    misses is skipped, so a total never drops for a pod that did not answer."""

    def __init__(self, connection: Connection, namespace: str, name: str,
                 on_counts: Callable[[dict[Key, int]], None], *, poll: float = 30.0, timeout: float = 5.0,
                 observe: Observer | None = None) -> None:
        self.connection = connection
        self.namespace = namespace
        self.name = name
        self.on_counts = on_counts
        self.poll = poll
        self.timeout = timeout
        self.observe = observe
        self.slices: dict[str, SliceEndpoints] | None = None  # None until listed

    def _listed(self, items: Iterable[Mapping[str, Any]]) -> None:
        self.slices = {item["metadata"]["name"]: slice_endpoints(item) for item in items}

    def _event(self, event: Mapping[str, Any]) -> None:
        obj = event.get("object") or {}
        name = (obj.get("metadata") or {}).get("name", "")
        if self.slices is None or event.get("type") not in ("ADDED", "MODIFIED", "DELETED"):
            return
        if event.get("type") == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = slice_endpoints(obj)

    def _failed(self) -> None:
        self.slices = None  # until the next list: a round now would count a partial set of pods

    async def read(self, session: aiohttp.ClientSession) -> dict[Key, int] | None:
        """One round: the summed counts, or None when the endpoints are not known or a pod could not be read."""
        if self.slices is None:
            return None
        urls = sorted({url for endpoints in self.slices.values() for url in endpoints.ready})
        totals: dict[Key, int] = {}
        for url in urls:
            try:
                async with session.get(url + contract.METRICS_PATH) as resp:
                    resp.raise_for_status()
                    text = await resp.text()
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("gateway pod %s: /metrics not read (%s); conversations not counted this round", url, exc)
                return None
            for key, count in conversations(text).items():
                totals[key] = totals.get(key, 0) + count
        return totals

    async def run(self) -> None:
        watch = asyncio.create_task(follow(
            self.connection, ENDPOINT_SLICE, self.namespace, {contract.ENDPOINTSLICE_SERVICE_LABEL: self.name},
            component=contract.OPERATOR_COMPONENT, on_list=self._listed, on_event=self._event,
            on_failure=self._failed, what=f"EndpointSlices of the gateway {self.namespace}/{self.name}",
            observe=self.observe))
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session:
                while True:
                    totals = await self.read(session)
                    if totals is not None:
                        self.on_counts(totals)
                    await asyncio.sleep(self.poll)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
