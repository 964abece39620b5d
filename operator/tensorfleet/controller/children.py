"""Applying one child object: what every kind shares (`ChildHandler`: server-side apply, the answer kept in the cache
until its watch event arrives), which a kind with more to do extends in a module of its own, and the ownership
test before any write: only objects this InferenceService controls are written (`controlled_by`), and nothing is
made that would use one it does not (`uses`). Design: docs/architecture.md#the-reconcile-loop.
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


def controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The ownerReference with controller: true, or None."""
    return next((ref for ref in (obj.get("metadata") or {}).get("ownerReferences") or [] if ref.get("controller")),
                None)


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether `obj`'s controller (the ownerReference with controller: true) is the object with `uid`."""
    controller = controller_of(obj)
    return controller is not None and controller.get("uid") == uid


def whose(obj: dict[str, Any]) -> str:
    """Who controls `obj`, for a person reading a conflict message."""
    controller = controller_of(obj)
    if controller is None:
        return "it was not created by this InferenceService"
    return f"it is controlled by {controller.get('kind')} {controller.get('name')} (uid {controller.get('uid')})"


def uses(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """The (kind, name) of the identities `obj` would run as or grant: its pods' ServiceAccount, a binding's Role."""
    found: list[tuple[str, str]] = []
    pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    if pod.get("serviceAccountName"):
        found.append(("ServiceAccount", pod["serviceAccountName"]))
    if obj.get("kind") == "RoleBinding":
        ref = obj.get("roleRef") or {}
        found.append((ref.get("kind", "Role"), ref.get("name", "")))
        found += [("ServiceAccount", s["name"]) for s in obj.get("subjects") or [] if s.get("kind") == "ServiceAccount"]
    return found


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

    def in_use(self, ctx: Context, live: dict[str, Any], children: dict[Kind, dict[str, dict[str, Any]]]) -> bool:
        """Whether `live`, which the spec no longer wants, must outlive this reconcile (CHILDREN: the owner's
        children as this reconcile found them). Never, by default: it is pruned."""
        return False

    async def delete(self, ctx: Context, kind: Kind, live: dict[str, Any], *, grace_seconds: int | None = None) -> None:
        """Delete `live` (exactly that object: its uid is a precondition) and remember it in the cache."""
        meta = live["metadata"]
        answer = await ctx.kube.delete(kind, meta["namespace"], meta["name"], uid=meta.get("uid"),
                                       grace_seconds=grace_seconds)
        ctx.cache.deleted(kind, live, answer)
