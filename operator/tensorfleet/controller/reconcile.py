"""One level-triggered, idempotent reconcile of one InferenceService: observe, model facts, plan, render, apply what
differs, prune, roll groups, write status if it changed; nothing is remembered between runs but what the cluster
says. Each child kind is applied through `CHILD_HANDLERS` (`children`, `statefulsets`); status is built in
`status`. Design: docs/architecture.md#the-reconcile-loop.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from tensorfleet import contract
from tensorfleet.api import InferenceService, SpecError, load_inference_service
from tensorfleet.api.errors import one_line
from tensorfleet.catalog import find_gpu, is_cpu
from tensorfleet.controller import adapters, metrics
from tensorfleet.controller.children import ChildHandler, Context, controlled_by, controller_of, uses, whose
from tensorfleet.controller.claimtemplates import ClaimTemplateHandler
from tensorfleet.controller.devices import Devices, Offer
from tensorfleet.controller.diff import contains
from tensorfleet.controller.idle import NOT_IDLE, SCALED_TO_ZERO, Idle, parse_time
from tensorfleet.controller.idle import decide as decide_idle
from tensorfleet.controller.modelfacts import (
    DEFAULT_MODEL_FACTS,
    NOT_PINNED,
    FactsUnavailable,
    ModelFactsConfig,
    Resolved,
)
from tensorfleet.controller.modelfacts import resolve as resolve_facts
from tensorfleet.controller.nodes import NotReadyNodes
from tensorfleet.controller.observe import Observation, is_terminating, observe, pod_ready
from tensorfleet.controller.policy import check_images
from tensorfleet.controller.rollout import Mode, decide
from tensorfleet.controller.statefulsets import (
    StatefulSetHandler,
    annotate_wanted_groups,
    records_wanted_groups_only,
    roll_groups,
)
from tensorfleet.controller.status import (
    KEEP,
    PLAN_VALID,
    PROGRESSING,
    READY,
    WRITE_REFUSED,
    condition_status,
    pod_causes,
    rejected_status,
    serving_status,
    write_refused_status,
)
from tensorfleet.controller.traffic import TrafficGroups
from tensorfleet.kube.cache import Cache
from tensorfleet.kube.client import ApiError, Kube
from tensorfleet.kube.events import EventRecorder
from tensorfleet.kube.resources import (
    CHILD_KINDS,
    DEPLOYMENT,
    INFERENCE_SERVICE,
    LEASE,
    POD,
    RESOURCE_CLAIM_TEMPLATE,
    STATEFUL_SET,
    Kind,
    kind_of,
)
from tensorfleet.planner import Plan, make_plan
from tensorfleet.render import (
    DEFAULT_IMAGES,
    Images,
    claims_gpus,
    desired_replicas,
    engine_selector,
    leader_selector,
    render,
    selector_string,
)

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
# Per child kind, how it is applied; kinds not listed need only server-side apply.
CHILD_HANDLERS: dict[Kind, ChildHandler] = {STATEFUL_SET: StatefulSetHandler(),
                                             RESOURCE_CLAIM_TEMPLATE: ClaimTemplateHandler()}
_DEFAULT_HANDLER = ChildHandler()


def _handler(kind: Kind) -> ChildHandler:
    return CHILD_HANDLERS.get(kind, _DEFAULT_HANDLER)


def spec_warnings(isvc: InferenceService) -> list[str]:
    """What an accepted spec asks for that a person should know it asked for."""
    accelerator = isvc.spec.accelerator
    # CPU engines (vLLM's CPU backend) select no GPU nodes either way.
    if isvc.spec.engine.kind == "vllm" and accelerator.node_affinity == "none" and not is_cpu(accelerator.type):
        pinned = ", ".join(f"{k}={v}" for k, v in sorted(accelerator.node_selector.items())) or "nothing"
        return [(f"spec.accelerator.nodeAffinity is none: engine pods are not held to {accelerator.type} nodes "
                 f"(spec.accelerator.nodeSelector pins {pinned}); on another GPU type the plan does not hold")]
    return []


def device_warnings(plan: Plan, offer: Offer | None) -> list[str]:
    """A spec whose engine pods claim more GPUs than any node offers through DRA. Said only once the driver's
    ResourceSlices are seen: the watch may not have listed them yet, and Degraded names a missing driver once
    pods wait."""
    short = offer.short_of(plan.tensor) if offer is not None and offer.driver_seen else None
    return [f"{short}; engine pods stay Pending until one does"] if short else []


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) taking OLD to NEW: NEW, with null for each key, at any depth, NEW lacks."""
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        before = old.get(key)
        patch[key] = merge_patch(before, value) if isinstance(value, dict) and isinstance(before, dict) else value
    return patch


def _prefill_counts(sts: dict[str, Any] | None) -> tuple[int, int]:
    """(existing, ready) prefill engines, as the prefill pool's StatefulSet reports them."""
    status = (sts or {}).get("status") or {}
    return int(status.get("replicas") or 0), int(status.get("readyReplicas") or 0)


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    """Reconciles one InferenceService per call; children and pods are read from `cache`, never listed."""

    def __init__(self, kube: Kube, events: EventRecorder, cache: Cache, *, now: Callable[[], str] = utc_now,
                 images: Images = DEFAULT_IMAGES, allowed_registries: Sequence[str] = (),
                 model_facts: ModelFactsConfig = DEFAULT_MODEL_FACTS, operator_namespace: str | None = None,
                 adapter_sync: adapters.Sync = adapters.sync, node_not_ready_seconds: float = 60.0,
                 gpu_device_class: str = contract.DEFAULT_GPU_DEVICE_CLASS) -> None:
        self.kube = kube
        self.gpu_device_class = gpu_device_class
        # The nodes that are not Ready (the operator's Node watch fills it), and how long a multi-node group
        # with a pod on one is left before it is restarted.
        self.nodes = NotReadyNodes()
        # The GPUs NVIDIA's DRA driver offers per node (the operator's ResourceSlice watch fills it).
        self.devices = Devices()
        self.node_not_ready_seconds = node_not_ready_seconds
        # Where the operator's pods run (the engines' NetworkPolicy admits them when they load LoRA adapters),
        # and how adapters reach the engines (controller/adapters.py; tests give their own).
        self.operator_namespace = operator_namespace
        self.adapter_sync = adapter_sync
        self.model_facts = model_facts
        # Per InferenceService: model-facts reads that failed in a row, for the retry backoff.
        self._facts_failures: dict[Key, int] = {}
        self.allowed_registries = tuple(allowed_registries)
        self.cache = cache
        self.images = images
        self.events = events
        self.now = now
        # The traffic groups at the gateway (the operator's InferenceService watch and GatewayCounts feed it).
        self.traffic = TrafficGroups()
        # Per InferenceService: child counts by kind and Ready, for the gauges.
        self._managed: dict[Key, tuple[dict[str, int], str]] = {}

    async def __call__(self, key: Key) -> float | None:
        """The work queue's entry point: reconcile `key`, counting and timing it."""
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
        """Bring `namespace/name`'s children in line with its spec and report status; None: no requeue."""
        body = await self.kube.get(INFERENCE_SERVICE, namespace, name)
        if body is None or is_terminating(body):
            # Children carry ownerReferences: the garbage collector removes them.
            self._record((namespace, name), None)
            self._facts_failures.pop((namespace, name), None)
            return None
        meta = body["metadata"]
        status = body.get("status") or {}
        generation = meta.get("generation")
        facts: Resolved | None = None
        try:
            isvc = load_inference_service(body, ignore_status=True)
            facts = await resolve_facts(isvc, status, self.model_facts)
            plan = make_plan(isvc.spec, facts.facts)
            check_images(isvc, self.allowed_registries)
        except FactsUnavailable as exc:
            return await self._facts_unavailable(body, status, generation, exc)
        except SpecError as exc:
            await self._reject(body, status, generation, exc, facts)
            return None
        self._facts_failures.pop((namespace, name), None)
        if not meta.get("uid"):
            raise RuntimeError(f"{namespace}/{name} has no metadata.uid; children could not be owned")

        if condition_status(status.get("conditions") or [], PLAN_VALID) == "False":
            await self.events.normal(body, "PlanAccepted", "the spec is valid again; rolling it out")
        ctx = Context(kube=self.kube, cache=self.cache, events=self.events, owner=body)
        children = {kind: self.cache.owned(kind, namespace, name) for kind in CHILD_KINDS}
        zero = decide_idle(isvc.spec, status, children[LEASE].get(contract.demand_lease_name(name)),
                           meta.get("creationTimestamp"), parse_time(self.now()) or datetime.datetime.now(datetime.UTC))
        mode = self._rollout_mode(isvc, plan, status, children[STATEFUL_SET], meta["uid"], idle=zero.idle)
        desired = render(isvc, plan, images=self.images, surge=mode.surge, idle=zero.idle,
                         operator_namespace=self.operator_namespace, gpu_device_class=self.gpu_device_class)
        annotate_wanted_groups(desired, desired_replicas(isvc.spec, idle=zero.idle))
        first_time = not status.get("observedGeneration")  # absent, or 0: the CRD's default before a first write
        # Going to zero or coming back changes the StatefulSets by the operator's own decision: not a revert.
        idling = (status.get("idleSince") is not None) != (zero.since is not None)
        spec_unchanged = status.get("observedGeneration") == generation and not idling
        live_after: dict[tuple[str, str], dict[str, Any]] = {}
        conflicts: dict[tuple[str, str], str] = {}
        for obj in desired:
            kind = kind_of(obj)
            child = obj["metadata"]["name"]
            live, conflict = await self._claim(kind, obj, children[kind].get(child), meta["uid"], conflicts)
            if conflict:
                conflicts[(kind.kind, child)] = conflict
                continue
            try:
                live_after[(kind.kind, child)] = await self._apply(ctx, kind, obj, live, first_time, spec_unchanged)
            except ApiError as exc:
                await self._write_refused(body, status, generation, f"{kind.kind} {child}", exc)
                raise
        await self._prune(ctx, desired, children)
        for message in conflicts.values():
            await self.events.warning(body, "ChildConflict", message)

        sts = {k: live_after[key] for k in range(plan.pipeline)
               if (key := (STATEFUL_SET.kind, contract.stage_name(name, k))) in live_after}
        router = live_after.get((DEPLOYMENT.kind, contract.router_name(name)))
        pods = self._engine_pods(namespace, name, sts)
        obs = observe(plan.pipeline, desired_replicas(isvc.spec, idle=zero.idle), pods, sts, router, surge=mode.surge,
                      nodes=self.nodes.under(pods), node_grace_s=self.node_not_ready_seconds,
                      now=parse_time(self.now()))
        await roll_groups(ctx, obs, mode)
        lora = await self._sync_adapters(isvc, pods)
        prefill = (_prefill_counts(live_after.get((STATEFUL_SET.kind, contract.prefill_stage_name(name, 0))))
                   if isvc.spec.prefill is not None else None)
        offer = self._offer(isvc, plan)
        ready = await self._report(body, status, generation, plan, obs, mode, list(conflicts.values()),
                                   [*spec_warnings(isvc), *device_warnings(plan, offer)], zero, facts, lora, prefill,
                                   offer)
        for reason, message in lora.warnings if lora is not None else ():
            await self.events.warning(body, reason, message)
        if zero.event is not None:
            await self.events.normal(body, *zero.event)
        counts: dict[str, int] = {}
        for obj in desired:
            counts[obj["kind"]] = counts.get(obj["kind"], 0) + 1
        self._record((namespace, name), (counts, ready))
        waits = [t for t in (zero.requeue, lora.requeue if lora is not None else None, obs.node_wait())
                 if t is not None]
        return min(waits) if waits else None

    async def _sync_adapters(self, isvc: InferenceService, pods: list[dict[str, Any]]) -> adapters.Outcome | None:
        """With LoRA: load spec.adapters into every ready engine and unload the rest; None without LoRA."""
        if not isvc.spec.lora_enabled:
            return None
        engines = adapters.ready_engines(pods, pod_ready)
        results = await self.adapter_sync(engines, isvc.spec.adapters)
        return adapters.adapter_status(isvc.spec.adapters, results)

    def _offer(self, isvc: InferenceService, plan: Plan) -> Offer | None:
        """What the nodes offer of the planned GPU through DRA, when the engine pods claim their GPUs so."""
        gpu = find_gpu(plan.accelerator) if claims_gpus(isvc.spec, plan) else None
        return self.devices.offer(gpu, self.gpu_device_class) if gpu is not None else None

    def _engine_pods(self, namespace: str, name: str, sts: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """Engine pods from the cache that our StatefulSets control, or that no controller holds yet.

        A pod another controller holds is never used, even with our labels. An
        orphan is one of ours between StatefulSets (an immutable-field recreate
        releases the pods, the new StatefulSet adopts them): it still counts
        for its group, but is never deleted until adopted (statefulsets.py).
        """
        engine = engine_selector(name)
        ours = {s["metadata"].get("uid") for s in sts.values()} - {None}
        return [pod for pod in self.cache.owned(POD, namespace, name).values()
                if all((pod["metadata"].get("labels") or {}).get(k) == v for k, v in engine.items())
                and (any(controlled_by(pod, uid) for uid in ours) or controller_of(pod) is None)]

    def _rollout_mode(self, isvc: InferenceService, plan: Plan, status: dict[str, Any],
                      live: dict[str, dict[str, Any]], uid: str, *, idle: bool = False) -> Mode:
        """Decide the rollout's surge from the cluster as it is, before the StatefulSets are applied."""
        name = isvc.metadata.name
        sts = {k: live[n] for k in range(plan.pipeline)
               if (n := contract.stage_name(name, k)) in live and controlled_by(live[n], uid)}
        wanted = desired_replicas(isvc.spec, idle=idle)
        before = observe(plan.pipeline, wanted, self._engine_pods(isvc.metadata.namespace or "", name, sts), sts, None)
        running = max([int((s.get("spec") or {}).get("replicas") or 0) for s in sts.values()], default=wanted)
        previous = condition_status(status.get("conditions") or [], PROGRESSING, "reason")
        return decide(before, isvc.spec.rollout, running_surge=max(0, running - wanted), previous_reason=previous)

    async def _claim(self, kind: Kind, obj: dict[str, Any], cached: dict[str, Any] | None, uid: str,
                     conflicts: dict[tuple[str, str], str]) -> tuple[dict[str, Any] | None, str | None]:
        """The live object `obj` would be applied over, or why it must not be: (live, conflict message).

        The cache holds only objects carrying this InferenceService's labels, so
        a name not in it is looked up once (GET) before it is created: it may
        be taken by an object someone else made.
        """
        child = obj["metadata"]["name"]
        blocked = [f"{k} {n}" for k, n in uses(obj) if (k, n) in conflicts]
        if blocked:
            return None, (f"{kind.kind} {child} is not applied: it would use {', '.join(blocked)}, "
                          "which this InferenceService does not control")
        live = cached
        if live is None:
            live = await self.kube.get(kind, obj["metadata"]["namespace"], child)
        if live is None or controlled_by(live, uid):
            return live, None
        return None, (f"{kind.kind} {child} already exists and {whose(live)}; the operator will not take it over. "
                      f"Delete or rename that {kind.kind}, or give this InferenceService another name")

    async def _apply(self, ctx: Context, kind: Kind, obj: dict[str, Any], live: dict[str, Any] | None,
                     first_time: bool, spec_unchanged: bool) -> dict[str, Any]:
        """Apply one desired child unless the live one already matches; events for what a person should know."""
        if live is not None and not is_terminating(live) and contains(live, obj):
            return live
        handler = _handler(kind)
        applied = await handler.apply(ctx, kind, obj, live)
        name = obj["metadata"]["name"]
        if live is not None and applied["metadata"].get("uid") != live["metadata"].get("uid"):
            return applied  # the handler replaced the object, and said so in an event of its own
        log.info("%s %s %s/%s", "created" if live is None else "updated", kind.kind, ctx.namespace, name)
        if live is None and not first_time:
            await self.events.warning(ctx.owner, "ChildRestored", f"{kind.kind} {name} was missing; recreated it")
        elif live is not None and spec_unchanged and not records_wanted_groups_only(live, obj):
            await self.events.warning(ctx.owner, "ChildReverted",
                                      f"{kind.kind} {name} differed from the spec (changed outside the operator?); "
                                      "restored it")
        if live is not None:
            await handler.changed(ctx, kind, obj, live)
        return applied

    async def _prune(self, ctx: Context, desired: list[dict[str, Any]],
                     children: dict[Kind, dict[str, dict[str, Any]]]) -> None:
        """Delete children this operator owns that the spec no longer wants."""
        wanted = {(kind_of(o).kind, o["metadata"]["name"]) for o in desired}
        uid = ctx.owner["metadata"]["uid"]
        for kind in CHILD_KINDS:
            for name, live in children[kind].items():
                if (kind.kind, name) in wanted or is_terminating(live) or _handler(kind).in_use(ctx, live, children):
                    continue
                owners = live["metadata"].get("ownerReferences") or []
                if not any(ref.get("uid") == uid and ref.get("controller") for ref in owners):
                    continue  # carries our labels but is not ours: leave it alone
                await _handler(kind).delete(ctx, kind, live)
                log.info("pruned %s %s/%s", kind.kind, ctx.namespace, name)
                await self.events.normal(ctx.owner, "Pruned", f"deleted {kind.kind} {name}, no longer part of the spec")

    async def _report(self, body: dict[str, Any], status: dict[str, Any], generation: int | None, plan: Plan,
                      obs: Observation, mode: Mode, conflicts: list[str], warnings: list[str],
                      zero: Idle = NOT_IDLE, facts: Resolved = NOT_PINNED,
                      lora: adapters.Outcome | None = None, prefill: tuple[int, int] | None = None,
                      offer: Offer | None = None) -> str:
        """Write the serving status when it changed; events for rollout completion and readiness. Returns Ready."""
        meta = body["metadata"]
        new = serving_status(status, name=meta["name"], namespace=meta["namespace"], generation=generation, plan=plan,
                             obs=obs, selector=selector_string(leader_selector(meta["name"])), now=self.now(),
                             rollout=mode, conflicts=conflicts, warnings=[*filter(None, [facts.warning]), *warnings],
                             idle_since=zero.since, model_facts=facts.pin, facts_note=facts.note,
                             adapters=lora.status if lora is not None else None, prefill=prefill, offer=offer,
                             traffic=self.traffic.status(meta["namespace"], meta["name"]))
        await self._write_status(body, status, new)
        before = status.get("conditions") or []
        after = new["conditions"]
        if condition_status(before, PROGRESSING) == "True" and condition_status(after, PROGRESSING) == "False":
            # The generation names which rollout ended (the recorder drops repeats of one message in its window).
            done = f"all {obs.desired} groups ready and updated"
            await self.events.normal(body, "RolloutComplete", done if generation is None else f"generation {generation}: {done}")
        if condition_status(before, READY) != "True" and condition_status(after, READY) == "True":
            serving = condition_status(after, READY, "reason") != SCALED_TO_ZERO
            await self.events.normal(body, "Ready", f"serving at {new['endpoint']}" if serving
                                     else condition_status(after, READY, "message") or "scaled to zero")
        for reason, message in pod_causes(obs):  # the recorder posts each once per window
            await self.events.warning(body, reason, message)
        return condition_status(after, READY) or "False"

    async def _reject(self, body: dict[str, Any], status: dict[str, Any], generation: int | None, exc: SpecError,
                      facts: Resolved | None = None) -> None:
        """Record an invalid spec: PlanValid=False naming the field, and a Warning event; children are left as they are.

        Model facts read for it (FACTS) are pinned all the same: fixing another field must not read them again.
        """
        new = rejected_status(status, generation=generation, field=exc.field, message=exc.message, now=self.now(),
                              model_facts=facts.pin if facts is not None else KEEP)
        changed = await self._write_status(body, status, new)
        if changed:
            log.info("plan rejected for %s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], exc)
        if changed or condition_status(status.get("conditions") or [], PLAN_VALID) != "False":
            await self.events.warning(body, "PlanRejected", str(exc))

    async def _facts_unavailable(self, body: dict[str, Any], status: dict[str, Any], generation: int | None,
                                 exc: FactsUnavailable) -> float:
        """No facts for the model: PlanValid=False saying why, a Warning event, nothing rendered; retry with backoff."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        new = rejected_status(status, generation=generation, field="spec.model.name", message=str(exc), now=self.now(),
                              reason="ModelFactsUnavailable")
        changed = await self._write_status(body, status, new)
        if changed or condition_status(status.get("conditions") or [], PLAN_VALID) != "False":
            log.info("no model facts for %s/%s: %s", *key, exc)
            await self.events.warning(body, "ModelFactsUnavailable", str(exc))
        failures = self._facts_failures[key] = self._facts_failures.get(key, 0) + 1
        return self.model_facts.retry_after(failures)

    async def _write_refused(self, body: dict[str, Any], status: dict[str, Any], generation: int | None, what: str,
                             exc: ApiError) -> None:
        """The API server refused a child's write (an answer: not a lost connection, nor a conflict the retry
        resolves): Degraded and a Warning event name the object and the server's reason, where a person looks
        rather than the operator's log. The work queue retries with backoff."""
        if exc.status < 400 or exc.conflict:
            return
        message = f"{what} could not be written: {one_line(str(exc), 600)}"
        try:
            new = write_refused_status(status, generation=generation, message=message, now=self.now())
            changed = await self._write_status(body, status, new)
        except ApiError as failed:
            log.warning("could not report the refused write of %s: %s", what, failed)
            return
        if changed:
            await self.events.warning(body, WRITE_REFUSED, message)

    async def _write_status(self, body: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> bool:
        """Patch the status subresource when `new` differs from `old`; True when it wrote."""
        if {k: v for k, v in old.items() if v is not None} == {k: v for k, v in new.items() if v is not None}:
            return False
        patch = merge_patch(old, new)
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
