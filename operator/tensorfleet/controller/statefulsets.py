"""What only engine StatefulSets need: recreation (Orphan deletion, pods kept) on a change the API server refuses in
place, Scaled events, and `roll_groups`, which restarts broken groups and replaces groups as `rollout` allows,
whole and leader first. Design: docs/architecture.md#rollouts-and-group-restarts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tensorfleet import contract
from tensorfleet.controller.children import ChildHandler, Context, controller_of
from tensorfleet.controller.diff import contains
from tensorfleet.controller.observe import Observation
from tensorfleet.controller.rollout import Mode, replacements
from tensorfleet.kube.client import ApiError
from tensorfleet.kube.resources import POD, STATEFUL_SET, Kind

log = logging.getLogger(__name__)
# How long a reconcile waits for the garbage collector to finish an Orphan deletion.
ORPHAN_DELETE_TIMEOUT_SECONDS = 30.0


WANTED_GROUPS = contract.ANNOTATION_WANTED_GROUPS


def annotate_wanted_groups(desired: list[dict[str, Any]], wanted: int) -> None:
    """Record on each engine StatefulSet in DESIRED the groups the spec wants (WANTED).

    Its replicas also count a rollout's surge groups, so they cannot say
    whether the wanted count moved; `StatefulSetHandler.changed` reads this.
    """
    for obj in desired:
        prefill = obj["metadata"].get("labels", {}).get(contract.LABEL_POOL) == contract.POOL_PREFILL
        if obj.get("kind") == STATEFUL_SET.kind and not prefill:  # the prefill pool holds its own count
            obj["metadata"].setdefault("annotations", {})[WANTED_GROUPS] = str(wanted)


def wanted_groups(sts: dict[str, Any]) -> str | None:
    """The groups a StatefulSet was applied for (annotate_wanted_groups); its replicas when it has no record."""
    recorded = ((sts.get("metadata") or {}).get("annotations") or {}).get(WANTED_GROUPS)
    if recorded is not None:
        return str(recorded)
    replicas = (sts.get("spec") or {}).get("replicas")
    return None if replicas is None else str(replicas)


def records_wanted_groups_only(live: dict[str, Any], obj: dict[str, Any]) -> bool:
    """Whether applying OBJ over LIVE only adds the wanted-groups record: the first reconcile after an
    upgrade from an operator that kept none, which is no change made outside the operator."""
    recorded = (obj["metadata"].get("annotations") or {}).get(WANTED_GROUPS)
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    if recorded is None or WANTED_GROUPS in annotations:
        return False
    with_record = {**live, "metadata": {**live["metadata"], "annotations": {**annotations, WANTED_GROUPS: recorded}}}
    return contains(with_record, obj)


class StatefulSetHandler(ChildHandler):
    """Engine stages: recreate on an immutable-field change, and a Scaled event when the wanted groups change."""

    async def apply(self, ctx: Context, kind: Kind, obj: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
        """Apply; on 422 for an existing StatefulSet, recreate it keeping its pods."""
        try:
            return await super().apply(ctx, kind, obj, live)
        except ApiError as exc:
            if not exc.invalid or live is None:
                raise
            name, namespace = obj["metadata"]["name"], obj["metadata"]["namespace"]
            log.info("recreating StatefulSet %s/%s: %s", namespace, name, exc.message)
            answer = await ctx.kube.delete(STATEFUL_SET, namespace, name, propagation="Orphan",
                                           uid=live["metadata"].get("uid"))
            ctx.cache.deleted(STATEFUL_SET, live, answer)
            await wait_deleted(ctx, namespace, name, live["metadata"]["uid"])
            applied = await super().apply(ctx, kind, obj, None)
            await ctx.events.normal(ctx.owner, "StatefulSetRecreated",
                                    f"{name}: an immutable field changed; recreated it keeping its pods")
            return applied

    async def changed(self, ctx: Context, kind: Kind, obj: dict[str, Any], live: dict[str, Any]) -> None:
        """A Scaled event when the groups the spec wants (stage 0's record of them) moved.

        Not when only the replicas did: a rollout's surge groups come and go
        with the wanted count unchanged.
        """
        before, after = wanted_groups(live), wanted_groups(obj)
        if before != after and obj["metadata"]["name"] == contract.stage_name(ctx.name, 0):
            await ctx.events.normal(ctx.owner, "Scaled", f"replicas {before} -> {after}")


async def wait_deleted(ctx: Context, namespace: str, name: str, uid: str) -> None:
    """Wait out an Orphan deletion, which the garbage collector finishes after the DELETE returns.

    Until then the old object is still there (with a deletionTimestamp and the
    `orphan` finalizer), and applying its successor would patch it, failing the
    same immutable-field validation again. GETs, not the cache: this waits on
    the garbage collector, and returns as soon as it is done.
    """
    deadline = time.monotonic() + ORPHAN_DELETE_TIMEOUT_SECONDS
    delay = 0.05
    while True:
        current = await ctx.kube.get(STATEFUL_SET, namespace, name)
        if current is None or current["metadata"].get("uid") != uid:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"StatefulSet {namespace}/{name} is still being deleted after "
                               f"{ORPHAN_DELETE_TIMEOUT_SECONDS:.0f}s (is the garbage collector running?)")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


async def roll_groups(ctx: Context, obs: Observation, mode: Mode) -> None:
    """Restart broken groups, then delete the pods of the groups a rollout replaces now.

    Each stage's StatefulSet recreates the deleted pods, at its update revision.
    """
    pods = ChildHandler()
    # A group with a pod no StatefulSet holds yet (released by a recreate, not yet
    # adopted) is left alone this time: only a controlled pod is ever deleted.
    settled = {i for i, g in obs.groups.items() if all(controller_of(p) is not None for p in g.pods.values())}
    restart = {i: why for i, why in obs.groups_to_restart().items() if i in settled}
    orphans = obs.orphans()
    for index, reason in sorted(restart.items()):
        await _delete_group(ctx, pods, obs, index, frozenset(p["metadata"]["uid"] for _, p, _ in orphans))
        log.info("restarting group %d of %s/%s: %s", index, ctx.namespace, ctx.name, reason)
        await ctx.events.warning(ctx.owner, "GroupRestarted",
                                 f"restarting group {index} (all {obs.pipeline} stages): {reason}; "
                                 "vLLM cannot take a lost pipeline stage back")
    for index, pod, node in orphans:
        if index in restart or controller_of(pod) is None:
            continue
        await pods.delete(ctx, POD, pod, grace_seconds=0)
        log.info("deleted orphan pod %s/%s: %s", ctx.namespace, pod["metadata"]["name"], node.detail)
        await ctx.events.warning(ctx.owner, "OrphanDeleted",
                                 f"deleted pod {pod['metadata']['name']} at once: {node.detail}, so no kubelet will "
                                 "ever stop it; its StatefulSet makes it anew on a node that exists")
    for index in replacements(obs, mode):
        if index in restart or index not in settled:
            continue
        await _delete_group(ctx, pods, obs, index)
        log.info("replacing group %d of %s/%s", index, ctx.namespace, ctx.name)
        how = "in place" if mode.in_place else f"{mode.surge} surge group(s) serving meanwhile"
        await ctx.events.normal(
            ctx.owner, "RolloutGroupReplaced",
            f"replacing group {index} (all {obs.pipeline} stages, {how}); "
            f"{obs.updated_replicas} of {obs.desired} groups updated",
        )


async def _delete_group(ctx: Context, pods: ChildHandler, obs: Observation, index: int,
                        orphans: frozenset[str] = frozenset()) -> None:
    """Delete every pod of group `index`, the leader first so routers drop its endpoint before anything else;
    those of ORPHANS (uids of pods on deleted nodes) with no grace period, since no kubelet would end theirs."""
    for _, pod in sorted(obs.groups[index].pods.items()):
        await pods.delete(ctx, POD, pod, grace_seconds=0 if pod["metadata"].get("uid") in orphans else None)
