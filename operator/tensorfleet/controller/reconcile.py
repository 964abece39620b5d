"""One level-triggered, idempotent reconcile of one InferenceService.

observe the InferenceService -> plan -> render -> apply what differs
(server-side apply) -> prune what is no longer wanted -> roll multi-stage
groups -> write status if it changed. Nothing is remembered between runs:
everything is read back from the cluster, so a restarted operator picks up
exactly where the last one stopped, and running it twice changes nothing.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensorfleet import contract
from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.controller import metrics
from tensorfleet.controller.diff import contains
from tensorfleet.controller.events import EventRecorder
from tensorfleet.controller.kube import ApiError, Kube
from tensorfleet.controller.observe import Observation, condition_status, is_terminating, observe
from tensorfleet.controller.resources import (
    CHILD_KINDS,
    DEPLOYMENT,
    INFERENCE_SERVICE,
    POD,
    STATEFUL_SET,
    Kind,
    kind_of,
)
from tensorfleet.controller.status import PLAN_VALID, PROGRESSING, READY, rejected_status, serving_status
from tensorfleet.planner import Plan, make_plan
from tensorfleet.render import (
    DEFAULT_IMAGES,
    Images,
    desired_replicas,
    engine_selector,
    leader_selector,
    render,
    selector_string,
)

log = logging.getLogger(__name__)
# How long a reconcile waits for the garbage collector to finish an Orphan deletion.
ORPHAN_DELETE_TIMEOUT_SECONDS = 30.0

Key = tuple[str, str]  # (namespace, name)


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Children:
    """Live children of one InferenceService, by kind and name."""

    by_kind: dict[str, dict[str, dict[str, Any]]]

    def get(self, kind: Kind, name: str) -> dict[str, Any] | None:
        return self.by_kind.get(kind.kind, {}).get(name)


class Reconciler:
    def __init__(self, kube: Kube, events: EventRecorder, *, now: Callable[[], str] = utc_now,
                 images: Images = DEFAULT_IMAGES) -> None:
        self.kube = kube
        self.images = images
        self.events = events
        self.now = now
        # Per InferenceService: child counts by kind and Ready, for the gauges.
        self._managed: dict[Key, tuple[dict[str, int], str]] = {}

    async def __call__(self, key: Key) -> float | None:
        started = time.perf_counter()
        try:
            result = await self.reconcile(*key)
            metrics.RECONCILES.labels(result="ok").inc()
            return result
        except Exception:
            metrics.RECONCILES.labels(result="error").inc()
            raise
        finally:
            metrics.RECONCILE_DURATION.observe(time.perf_counter() - started)

    async def reconcile(self, namespace: str, name: str) -> float | None:
        body = await self.kube.get(INFERENCE_SERVICE, namespace, name)
        if body is None or is_terminating(body):
            # Children carry ownerReferences: the garbage collector removes them.
            self._record((namespace, name), None)
            return None
        meta = body["metadata"]
        status = body.get("status") or {}
        generation = meta.get("generation")
        try:
            isvc = load_inference_service({k: v for k, v in body.items() if k != "status"})
            plan = make_plan(isvc.spec)
        except SpecError as exc:
            await self._reject(body, status, generation, exc)
            return None
        if not meta.get("uid"):
            raise RuntimeError(f"{namespace}/{name} has no metadata.uid; children could not be owned")

        if condition_status(status.get("conditions") or [], PLAN_VALID) == "False":
            await self.events.normal(body, "PlanAccepted", "the spec is valid again; rolling it out")
        desired = render(isvc, plan, images=self.images)
        children = await self._children(namespace, name)
        first_time = status.get("observedGeneration") is None
        spec_unchanged = status.get("observedGeneration") == generation
        live_after: dict[tuple[str, str], dict[str, Any]] = {}
        for obj in desired:
            kind = kind_of(obj)
            live = children.get(kind, obj["metadata"]["name"])
            live_after[(kind.kind, obj["metadata"]["name"])] = await self._apply(body, kind, obj, live,
                                                                                  first_time, spec_unchanged)
        await self._prune(body, desired, children)

        sts = {k: live_after[(STATEFUL_SET.kind, contract.stage_name(name, k))] for k in range(plan.pipeline)}
        router = live_after[(DEPLOYMENT.kind, contract.router_name(name))]
        pods = await self.kube.list(POD, namespace, engine_selector(name))
        obs = observe(plan.pipeline, desired_replicas(isvc.spec), pods, sts, router)
        if plan.pipeline > 1:
            await self._roll_groups(body, obs)
        ready = await self._report(body, status, generation, plan, obs)
        counts: dict[str, int] = {}
        for obj in desired:
            counts[obj["kind"]] = counts.get(obj["kind"], 0) + 1
        self._record((namespace, name), (counts, ready))
        return None

    async def _children(self, namespace: str, name: str) -> Children:
        selector = {contract.LABEL_INSTANCE: name, contract.LABEL_MANAGED_BY: contract.APP_NAME}
        by_kind: dict[str, dict[str, dict[str, Any]]] = {}
        for kind in CHILD_KINDS:
            items = await self.kube.list(kind, namespace, selector)
            by_kind[kind.kind] = {item["metadata"]["name"]: item for item in items}
        return Children(by_kind)

    async def _apply(self, owner: dict[str, Any], kind: Kind, obj: dict[str, Any], live: dict[str, Any] | None,
                     first_time: bool, spec_unchanged: bool) -> dict[str, Any]:
        if live is not None and not is_terminating(live) and contains(live, obj):
            return live
        name = obj["metadata"]["name"]
        try:
            applied = await self.kube.apply(obj)
        except ApiError as exc:
            if not (exc.invalid and kind is STATEFUL_SET and live is not None):
                raise
            # A change to an immutable StatefulSet field (volumeClaimTemplates):
            # delete the StatefulSet but orphan its pods, which the new one adopts
            # and then replaces under its update strategy, so serving never stops.
            log.info("recreating StatefulSet %s/%s: %s", obj["metadata"]["namespace"], name, exc.message)
            await self.kube.delete(STATEFUL_SET, obj["metadata"]["namespace"], name, propagation="Orphan",
                                   uid=live["metadata"].get("uid"))
            await self._wait_deleted(STATEFUL_SET, obj["metadata"]["namespace"], name, live["metadata"]["uid"])
            applied = await self.kube.apply(obj)
            await self.events.normal(owner, "StatefulSetRecreated",
                                     f"{name}: an immutable field changed; recreated it keeping its pods")
            return applied
        log.info("%s %s %s/%s", "created" if live is None else "updated", kind.kind, obj["metadata"]["namespace"], name)
        if live is None and not first_time:
            await self.events.warning(owner, "ChildRestored", f"{kind.kind} {name} was missing; recreated it")
        elif live is not None and spec_unchanged:
            await self.events.warning(owner, "ChildReverted", f"{kind.kind} {name} differed from the spec (changed outside the operator?); restored it")
        if kind is STATEFUL_SET and live is not None:
            before = (live.get("spec") or {}).get("replicas")
            after = obj["spec"]["replicas"]
            if before != after and name == contract.stage_name(owner["metadata"]["name"], 0):
                await self.events.normal(owner, "Scaled", f"replicas {before} -> {after}")
        return applied

    async def _wait_deleted(self, kind: Kind, namespace: str, name: str, uid: str) -> None:
        """Wait out an Orphan deletion, which the garbage collector finishes after the DELETE returns.

        Until then the old object is still there (with a deletionTimestamp and the
        `orphan` finalizer), and applying its successor would patch it, failing the
        same immutable-field validation again.
        """
        deadline = time.monotonic() + ORPHAN_DELETE_TIMEOUT_SECONDS
        delay = 0.05
        while True:
            current = await self.kube.get(kind, namespace, name)
            if current is None or current["metadata"].get("uid") != uid:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{kind.kind} {namespace}/{name} is still being deleted after "
                                   f"{ORPHAN_DELETE_TIMEOUT_SECONDS:.0f}s (is the garbage collector running?)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _prune(self, owner: dict[str, Any], desired: list[dict[str, Any]], children: Children) -> None:
        wanted = {(kind_of(o).kind, o["metadata"]["name"]) for o in desired}
        uid = owner["metadata"]["uid"]
        for kind in CHILD_KINDS:
            for name, live in children.by_kind.get(kind.kind, {}).items():
                if (kind.kind, name) in wanted or is_terminating(live):
                    continue
                owners = live["metadata"].get("ownerReferences") or []
                if not any(ref.get("uid") == uid and ref.get("controller") for ref in owners):
                    continue  # carries our labels but is not ours: leave it alone
                await self.kube.delete(kind, live["metadata"]["namespace"], name, uid=live["metadata"].get("uid"))
                log.info("pruned %s %s/%s", kind.kind, live["metadata"]["namespace"], name)
                await self.events.normal(owner, "Pruned", f"deleted {kind.kind} {name}, no longer part of the spec")

    async def _roll_groups(self, owner: dict[str, Any], obs: Observation) -> None:
        replace = obs.groups_to_replace()
        for index in replace:
            group = obs.groups[index]
            for pod in group.pods.values():
                meta = pod["metadata"]
                await self.kube.delete(POD, meta["namespace"], meta["name"], uid=meta.get("uid"))
            log.info("replacing group %d of %s/%s", index, owner["metadata"]["namespace"], owner["metadata"]["name"])
            await self.events.normal(
                owner, "RolloutGroupReplaced",
                f"replacing group {index} (all {obs.pipeline} stages); {obs.updated_replicas} of {obs.desired} groups updated",
            )

    async def _report(self, body: dict[str, Any], status: dict[str, Any], generation: int | None, plan: Plan,
                      obs: Observation) -> str:
        meta = body["metadata"]
        new = serving_status(status, name=meta["name"], namespace=meta["namespace"], generation=generation, plan=plan,
                             obs=obs, selector=selector_string(leader_selector(meta["name"])), now=self.now())
        await self._write_status(body, status, new)
        before = status.get("conditions") or []
        after = new["conditions"]
        if condition_status(before, PROGRESSING) == "True" and condition_status(after, PROGRESSING) == "False":
            await self.events.normal(body, "RolloutComplete", f"all {obs.desired} groups ready and updated")
        if condition_status(before, READY) != "True" and condition_status(after, READY) == "True":
            await self.events.normal(body, "Ready", f"serving at {new['endpoint']}")
        return condition_status(after, READY) or "False"

    async def _reject(self, body: dict[str, Any], status: dict[str, Any], generation: int | None, exc: SpecError) -> None:
        new = rejected_status(status, generation=generation, field=exc.field, message=exc.message, now=self.now())
        changed = await self._write_status(body, status, new)
        if changed:
            log.info("plan rejected for %s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], exc)
        if changed or condition_status(status.get("conditions") or [], PLAN_VALID) != "False":
            await self.events.warning(body, "PlanRejected", str(exc))

    async def _write_status(self, body: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> bool:
        if {k: v for k, v in old.items() if v is not None} == {k: v for k, v in new.items() if v is not None}:
            return False
        patch = {**{k: None for k in old if k not in new}, **new}
        meta = body["metadata"]
        await self.kube.patch_status(INFERENCE_SERVICE, meta["namespace"], meta["name"], patch)
        return True

    def _record(self, key: Key, entry: tuple[dict[str, int], str] | None) -> None:
        if entry is None:
            self._managed.pop(key, None)
        else:
            self._managed[key] = entry
        totals: dict[str, int] = {kind.kind: 0 for kind in CHILD_KINDS}
        ready: dict[str, int] = {"True": 0, "False": 0}
        for counts, is_ready in self._managed.values():
            for kind, count in counts.items():
                totals[kind] = totals.get(kind, 0) + count
            ready[is_ready] = ready.get(is_ready, 0) + 1
        for kind, count in totals.items():
            metrics.MANAGED_OBJECTS.labels(kind=kind).set(count)
        for value, count in ready.items():
            metrics.INFERENCE_SERVICES.labels(ready=value).set(count)
