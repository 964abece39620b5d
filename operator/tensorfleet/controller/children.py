"""Applying one child object: the behaviour every kind shares, which a kind may extend.

The reconciler looks each desired object's handler up by kind
(`reconcile.CHILD_HANDLERS`); kinds not listed there get `ChildHandler`:
server-side apply, then remember the result in the cache until its watch
event arrives. A kind with more to do (StatefulSets: recreate on an
immutable-field change, scale events) subclasses it in a module of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tensorfleet.kube.cache import Cache
from tensorfleet.kube.client import Kube
from tensorfleet.kube.events import EventRecorder
from tensorfleet.kube.resources import Kind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Context:
    """What a child handler may use during one reconcile of `owner` (the InferenceService body)."""

    kube: Kube
    cache: Cache
    events: EventRecorder
    owner: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.owner["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.owner["metadata"]["namespace"])


class ChildHandler:
    """Server-side apply, nothing more: Services, RBAC objects, the router Deployment, HPA, PDB."""

    async def apply(self, ctx: Context, kind: Kind, obj: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
        """Apply `obj` (which differs from `live`, or `live` is missing) and return what the server stored."""
        applied = await ctx.kube.apply(obj)
        ctx.cache.wrote(kind, applied)
        return applied

    async def changed(self, ctx: Context, kind: Kind, obj: dict[str, Any], live: dict[str, Any]) -> None:
        """Hook after an existing child was changed to `obj`: the kind's own events. None by default."""

    async def delete(self, ctx: Context, kind: Kind, live: dict[str, Any]) -> None:
        """Delete `live` (exactly that object: its uid is a precondition) and remember it in the cache."""
        meta = live["metadata"]
        answer = await ctx.kube.delete(kind, meta["namespace"], meta["name"], uid=meta.get("uid"))
        ctx.cache.deleted(kind, live, answer)
