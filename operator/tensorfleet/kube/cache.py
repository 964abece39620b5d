"""The operator's informer cache: kopf's indexes of what it watches, keyed by (namespace, owning InferenceService),
plus its own recent writes, each kept in an overlay until its watch event arrives (or `ttl` passes), so that a
reconcile reads its children from memory and sees its own writes. Design: docs/architecture.md#the-kubernetes-layer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kopf

from tensorfleet import contract
from tensorfleet.kube.resources import Kind

# An overlay entry expires, so a lost watch event costs at most one stale read per object, never a permanent ghost.
OVERLAY_TTL_SECONDS = 60.0
_MANAGED = {contract.LABEL_MANAGED_BY: contract.APP_NAME}
Owner = tuple[str, str]  # (namespace, InferenceService name)


# resourceVersions compare as integers, which is what etcd-backed API servers hand out; where one is not (None),
# the overlay gives way to the next event.
def _version(obj: Mapping[str, Any] | None) -> int | None:
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")
    except ValueError:
        return None


@dataclass
class _Write:
    obj: dict[str, Any] | None  # None: deleted
    version: int | None          # the first resourceVersion that supersedes this write
    at: float


def _index_id(kind: Kind) -> str:
    return f"tensorfleet_{kind.plural}_by_owner"


def _by_owner(body: kopf.Body, labels: Mapping[str, str], namespace: str | None, **_: object) -> Any:
    owner = labels.get(contract.LABEL_INSTANCE)
    if not owner or namespace is None:
        return None
    return {(namespace, owner): dict(body)}


def _by_namespace(namespace: str | None, name: str | None, **_: object) -> Any:
    return {namespace: name} if namespace is not None and name else None


class Cache:
    """Children and pods of each InferenceService, and the InferenceServices themselves, from kopf's watches."""

    def __init__(self, owner_kind: Kind, kinds: Sequence[Kind], *, ttl: float = OVERLAY_TTL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.owner_kind = owner_kind
        self.kinds = tuple(kinds)
        self.ttl = ttl
        self.clock = clock
        self._indexes: dict[str, kopf.Index[Any, Any]] = {}
        self._written: dict[tuple[str, str, str], dict[str, _Write]] = {}  # (kind, namespace, owner) -> name -> write
        self._owner_of: dict[tuple[str, str, str], str] = {}  # (kind, namespace, name) -> owner
        self.synced = asyncio.Event()  # every index filled from its initial listing

    def mark_synced(self) -> None:
        """A kopf handler ran: kopf holds them back until every index is filled, so the cache is complete."""
        self.synced.set()

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """Add the indexes to `registry`, and a startup handler that takes hold of them."""
        for kind in self.kinds:
            kopf.index(kind.group, kind.version, kind.plural, registry=registry, id=_index_id(kind),
                       labels=_MANAGED)(_by_owner)
        owner = self.owner_kind
        kopf.index(owner.group, owner.version, owner.plural, registry=registry, id=_index_id(owner))(_by_namespace)

        @kopf.on.startup(registry=registry)
        async def take_indexes(**indexes: Any) -> None:
            """kopf hands its indexes to handlers only; keep them for the reconciler."""
            for kind in (*self.kinds, owner):
                self._indexes[kind.kind] = indexes[_index_id(kind)]

    # --- reads ---------------------------------------------------------------
    def owned(self, kind: Kind, namespace: str, owner: str) -> dict[str, dict[str, Any]]:
        """Live objects of `kind` labelled as `owner`'s, by name, as of the latest watch event or our own write."""
        index = self._indexes[kind.kind]
        live = {obj["metadata"]["name"]: obj for obj in index.get((namespace, owner), ())}
        writes = self._written.get((kind.kind, namespace, owner))
        if writes:
            now = self.clock()
            for name, write in list(writes.items()):
                if now - write.at > self.ttl:
                    self._forget(kind.kind, namespace, owner, name)
                elif write.obj is None:
                    live.pop(name, None)
                else:
                    live[name] = write.obj
        return live

    def owners(self) -> Iterator[Owner]:
        """Every InferenceService kopf sees, as (namespace, name)."""
        for namespace, store in self._indexes[self.owner_kind.kind].items():
            for name in store:
                yield namespace, name

    def owners_on_node(self, kind: Kind, node: str) -> set[Owner]:
        """The InferenceServices with a `kind` object (a pod) scheduled to NODE."""
        return {owner for owner, objs in self._indexes[kind.kind].items()
                if any((obj.get("spec") or {}).get("nodeName") == node for obj in objs)}

    # --- writes and their echoes ---------------------------------------------
    def wrote(self, kind: Kind, obj: Mapping[str, Any]) -> None:
        """Remember what an apply, create or replace returned until its watch event arrives."""
        meta = obj.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(contract.LABEL_INSTANCE)
        if owner:
            self._remember(kind, meta.get("namespace", ""), owner, meta["name"],
                           _Write(dict(obj), _version(obj), self.clock()))

    def deleted(self, kind: Kind, live: Mapping[str, Any], answer: Mapping[str, Any] | None) -> None:
        """Remember a delete of `live`: its successor state is `answer` when the server returned the object."""
        meta = live.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(contract.LABEL_INSTANCE)
        if not owner:
            return
        if answer and answer.get("kind") == kind.kind and (answer.get("metadata") or {}).get("deletionTimestamp"):
            write = _Write(dict(answer), _version(answer), self.clock())  # still there, terminating
        else:
            before = _version(live)
            write = _Write(None, None if before is None else before + 1, self.clock())
        self._remember(kind, meta.get("namespace", ""), owner, meta["name"], write)

    def observed(self, kind: Kind, obj: Mapping[str, Any]) -> None:
        """A watch event reached the index: drop the writes it supersedes."""
        meta = obj.get("metadata") or {}
        key = (kind.kind, meta.get("namespace", ""), meta.get("name", ""))
        owner = self._owner_of.get(key)
        if owner is None:
            return
        write = self._written.get((kind.kind, key[1], owner), {}).get(key[2])
        version = _version(obj)
        if write is None or write.version is None or version is None or version >= write.version:
            self._forget(kind.kind, key[1], owner, key[2])

    def _remember(self, kind: Kind, namespace: str, owner: str, name: str, write: _Write) -> None:
        self._written.setdefault((kind.kind, namespace, owner), {})[name] = write
        self._owner_of[(kind.kind, namespace, name)] = owner

    def _forget(self, kind: str, namespace: str, owner: str, name: str) -> None:
        writes = self._written.get((kind, namespace, owner))
        if writes is not None:
            writes.pop(name, None)
            if not writes:
                del self._written[(kind, namespace, owner)]
        self._owner_of.pop((kind, namespace, name), None)
