"""The running operator: kopf's watches feed the work queue and the cache, workers reconcile; kopf keeps no state in
users' objects, and the resync, leader election, health and metrics are ours.
Design: docs/architecture.md#the-reconcile-loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from aiohttp import web

from tensorfleet import contract
from tensorfleet.controller import metrics, webhook
from tensorfleet.controller.modelfacts import ModelFactsConfig
from tensorfleet.controller.queue import WorkQueue
from tensorfleet.controller.reconcile import Key, Reconciler
from tensorfleet.controller.traffic import GatewayCounts
from tensorfleet.controller.webhook import WebhookConfig
from tensorfleet.kube.cache import Cache
from tensorfleet.kube.client import ApiError, Kube
from tensorfleet.kube.connection import Connection
from tensorfleet.kube.events import EventRecorder
from tensorfleet.kube.lease import LeaderElector, LostLease
from tensorfleet.kube.resources import CHILD_KINDS, INFERENCE_SERVICE, NODE, POD, RESOURCE_SLICE, Kind
from tensorfleet.render import Images

log = logging.getLogger(__name__)


@dataclass
class OperatorConfig:
    namespaces: list[str] = field(default_factory=list)  # empty: every namespace
    workers: int = 4
    resync_seconds: float = 300.0
    child_debounce_seconds: float = 0.5
    # A multi-node group with a pod on a node not Ready this long is restarted (controller/nodes.py).
    node_not_ready_seconds: float = 60.0
    leader_election: bool = True
    lease_namespace: str = "default"
    lease_name: str = contract.OPERATOR_LEASE_NAME
    lease_duration_seconds: int = 15
    lease_renew_seconds: float = 5.0
    identity: str = field(default_factory=lambda: os.environ.get(contract.ENV_OPERATOR_POD_NAME) or socket.gethostname())
    health_port: int | None = contract.OPERATOR_HEALTH_PORT
    api_timeout_seconds: float = 30.0
    webhook: WebhookConfig | None = None
    images: Images = field(default_factory=Images)
    # The DeviceClass of GPU claims (spec.accelerator.allocation deviceClass).
    gpu_device_class: str = contract.DEFAULT_GPU_DEVICE_CLASS
    # Image prefixes InferenceServices may name (empty: any), enforced by webhook and reconciler alike.
    allowed_registries: tuple[str, ...] = ()
    # The gateway's Service (namespace, name), whose pods' conversation counts status.traffic shows; how often.
    gateway_service: tuple[str, str] | None = None
    gateway_poll_seconds: float = 30.0
    # How model facts are read (the Hub, bounds, retries), at reconcile and admission alike.
    model_facts: ModelFactsConfig = field(default_factory=ModelFactsConfig)


def build_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Nothing of kopf's may land in users' objects under kopf's own prefix.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=contract.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=contract.GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{contract.GROUP}/finalizer"
    # Our own Lease election replaces kopf's peering (which needs its own CRDs).
    settings.peering.standalone = True
    settings.posting.level = logging.WARNING
    settings.queueing.idle_timeout = 1.0
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    # Watch only our own children and pods, filtered by the API server: an
    # operator must not stream every pod of a large cluster.
    for kind in (*CHILD_KINDS, POD):
        settings.watching.label_selectors[(kind.group, kind.version, kind.plural)] = \
            f"{contract.LABEL_MANAGED_BY}={contract.APP_NAME}"
    return settings


# The API server gives a webhook 10 s by default; a lookup must leave room for the answer.
WEBHOOK_API_TIMEOUT_SECONDS = 5.0


def _count_request(method: str, kind: str, error: str | None) -> None:
    metrics.API_REQUESTS.labels(method=method, kind=kind).inc()
    if error is not None:
        metrics.API_ERRORS.labels(method=method, kind=kind, code=error).inc()


class Operator:
    """One operator replica: a standby until it holds the Lease, then kopf, the queue and its workers."""

    def __init__(self, config: OperatorConfig, connection: Connection) -> None:
        self.config = config
        self.connection = connection
        self.kube = Kube(connection, timeout=config.api_timeout_seconds, observe=_count_request)
        self.cache = Cache(INFERENCE_SERVICE, (*CHILD_KINDS, POD))
        self.reconciler = Reconciler(self.kube, EventRecorder(self.kube, instance=config.identity), self.cache,
                                     images=config.images, allowed_registries=config.allowed_registries,
                                     model_facts=config.model_facts,
                                     operator_namespace=os.environ.get(contract.ENV_OPERATOR_POD_NAMESPACE) or None,
                                     node_not_ready_seconds=config.node_not_ready_seconds,
                                     gpu_device_class=config.gpu_device_class)
        self.queue: WorkQueue[Key] | None = None
        self.stop_flag = asyncio.Event()
        self.ready_flag = asyncio.Event()
        self.leading = False
        self._kopf_task: asyncio.Task[None] | None = None

    def registry(self, queue: WorkQueue[Key]) -> kopf.OperatorRegistry:
        registry = kopf.OperatorRegistry()
        connection = self.connection
        debounce = self.config.child_debounce_seconds
        cache = self.cache
        traffic = self.reconciler.traffic
        cache.register(registry)

        # Handlers are coroutines: kopf runs plain functions in threads, away from the queue's loop.
        @kopf.on.login(registry=registry)
        def login(**_: object) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(
                server=connection.server, token=connection.token, ca_path=connection.ca_file,
                certificate_path=connection.cert_file, private_key_path=connection.key_file,
                insecure=connection.insecure, scheme="Bearer" if connection.token else None)

        @kopf.on.event(INFERENCE_SERVICE.group, INFERENCE_SERVICE.version, INFERENCE_SERVICE.plural, registry=registry)
        # kopf types `namespace` as optional (for cluster-scoped kinds); every kind watched here is namespaced.
        async def inference_service_changed(event: kopf.RawEvent, namespace: str | None, name: str,
                                            **_: object) -> None:
            """An InferenceService changed (or was listed at start): reconcile it."""
            metrics.WATCH_EVENTS.labels(kind=INFERENCE_SERVICE.kind, type=str(event.get("type"))).inc()
            cache.mark_synced()
            if namespace is not None:
                queue.add((namespace, name))
            # Its traffic group's members show each other's shares: theirs changed too.
            for member in traffic.observed(event["object"], deleted=event.get("type") == "DELETED"):
                queue.add(member)

        def owner_changed(kind: Kind) -> Any:
            async def handler(event: kopf.RawEvent, labels: Mapping[str, str], namespace: str | None,
                              **_: object) -> None:
                """A child or engine pod changed: its index is current now; reconcile its InferenceService."""
                metrics.WATCH_EVENTS.labels(kind=kind.kind, type=str(event.get("type"))).inc()
                cache.mark_synced()
                cache.observed(kind, event["object"])
                owner = labels.get(contract.LABEL_INSTANCE)
                if owner and namespace is not None:
                    # Our own applies echo back as events; a short delay folds them into one reconcile.
                    queue.add((namespace, owner), debounce)
            return handler

        for kind in (*CHILD_KINDS, POD):
            kopf.on.event(kind.group, kind.version, kind.plural, registry=registry, id=f"owned-{kind.plural}",
                          labels={contract.LABEL_MANAGED_BY: contract.APP_NAME})(owner_changed(kind))

        reconciler = self.reconciler

        @kopf.on.event(NODE.group, NODE.version, NODE.plural, registry=registry, id="nodes")
        async def node_changed(event: kopf.RawEvent, name: str, **_: object) -> None:
            """A Node changed: when it turned Ready or stopped being so, reconcile what has pods on it."""
            metrics.WATCH_EVENTS.labels(kind=NODE.kind, type=str(event.get("type"))).inc()
            cache.mark_synced()
            if reconciler.nodes.observed(event["object"], reconciler.now(), deleted=event.get("type") == "DELETED"):
                for owner in cache.owners_on_node(POD, name):
                    queue.add(owner, debounce)

        @kopf.on.event(RESOURCE_SLICE.group, RESOURCE_SLICE.version, RESOURCE_SLICE.plural, registry=registry,
                       id="resourceslices")
        async def slice_changed(event: kopf.RawEvent, **_: object) -> None:
            """A ResourceSlice changed: what the nodes offer through DRA, read at the next reconcile. (On a cluster
            without resource.k8s.io/v1, kopf finds no such resource and never calls this.)"""
            metrics.WATCH_EVENTS.labels(kind=RESOURCE_SLICE.kind, type=str(event.get("type"))).inc()
            reconciler.devices.observed(event["object"], deleted=event.get("type") == "DELETED")

        return registry

    async def run(self) -> None:
        """Run until stopped, or until the leader lease is lost (then raise LostLease)."""
        health = await self._serve_health()
        # Every replica validates, standbys included. The webhook has a client of
        # its own (its own connection pool and a short timeout), so reviews
        # cannot take the reconciler's connections, nor the reverse.
        reviews = Kube(self.connection, timeout=WEBHOOK_API_TIMEOUT_SECONDS, observe=_count_request)
        admission = None
        try:
            if self.config.webhook is not None:
                await reviews.__aenter__()

                async def lookup(namespace: str, name: str) -> dict[str, Any] | None:
                    """Another InferenceService, for the collision check; None when it cannot be read."""
                    try:
                        return await reviews.get(INFERENCE_SERVICE, namespace, name)
                    except ApiError as exc:  # admit: the reconciler still refuses to take over what is not ours
                        log.warning("admission: could not read InferenceService %s/%s: %s", namespace, name, exc)
                        return None

                admission = await webhook.serve(self.config.webhook, lookup=lookup, model_facts=self.config.model_facts)
            async with self.kube:
                elector = None
                if self.config.leader_election:
                    elector = LeaderElector(self.kube, self.config.lease_namespace, self.config.lease_name,
                                            self.config.identity, lease_seconds=self.config.lease_duration_seconds,
                                            renew_seconds=self.config.lease_renew_seconds,
                                            on_leading=lambda leading: metrics.IS_LEADER.set(int(leading)))
                    acquired = asyncio.create_task(elector.acquire())
                    stopped = asyncio.create_task(self.stop_flag.wait())
                    await asyncio.wait({acquired, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    stopped.cancel()
                    if not acquired.done():
                        acquired.cancel()
                        return
                self.leading = True
                try:
                    await self._lead(elector)
                finally:
                    self.leading = False
        finally:
            if admission is not None:
                await admission.cleanup()
            await reviews.close()
            if health is not None:
                await health.cleanup()

    async def _lead(self, elector: LeaderElector | None) -> None:
        # Workers start once the cache is whole: a reconcile from half-filled
        # indexes would report children missing (a restart flapping Ready).
        self.queue = queue = WorkQueue(self.reconciler, workers=self.config.workers, gate=self.cache.synced)
        ours = {asyncio.create_task(queue.run()), asyncio.create_task(self._resync(queue))}
        if self.config.gateway_service is not None:
            traffic = self.reconciler.traffic

            def counted(totals: dict[Key, int]) -> None:
                for member in traffic.counted(totals):
                    queue.add(member)

            counts = GatewayCounts(self.connection, *self.config.gateway_service, counted,
                                   poll=self.config.gateway_poll_seconds, observe=_count_request)
            ours.add(asyncio.create_task(counts.run()))
        if elector is not None:
            ours.add(asyncio.create_task(elector.hold()))
        # kopf treats every task created after it starts as its own and cancels
        # them at exit; let ours (and the queue's workers) exist before it starts.
        await asyncio.sleep(0)
        namespaces = self.config.namespaces
        self._kopf_task = kopf_task = asyncio.create_task(kopf.operator(
            registry=self.registry(queue), settings=build_settings(self.config), standalone=True,
            clusterwide=not namespaces, namespaces=namespaces, stop_flag=self.stop_flag, ready_flag=self.ready_flag,
        ))
        stopping = asyncio.create_task(self.stop_flag.wait())
        try:
            done, _ = await asyncio.wait({kopf_task, stopping, *ours}, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {kopf_task, stopping}:
                if not task.cancelled() and (error := task.exception()) is not None:
                    raise error
        finally:
            self.stop_flag.set()
            stopping.cancel()
            for task in ours:
                task.cancel()
            for task in ours:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if elector is not None:
                await elector.release()
            # Our connections closed first: kopf waits for every task it did not
            # start (their server-side ends included, where the API is in-process).
            await self.kube.close()
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(kopf_task, 30)

    async def _resync(self, queue: WorkQueue[Key]) -> None:
        """Re-check every InferenceService now and then, in case an event was missed.

        Our own loop rather than a kopf timer: kopf guards timers with a
        finalizer on every object, and this operator needs none. The keys come
        from kopf's index of InferenceServices, not from a LIST.
        """
        while True:
            await asyncio.sleep(self.config.resync_seconds)
            if self.cache.synced.is_set():
                for key in list(self.cache.owners()):
                    queue.add(key)

    def stop(self) -> None:
        self.stop_flag.set()

    async def _serve_health(self) -> web.AppRunner | None:
        if self.config.health_port is None:
            return None

        async def healthz(_: web.Request) -> web.Response:
            broken = self._kopf_task is not None and self._kopf_task.done() and not self.stop_flag.is_set()
            return web.Response(status=500 if broken else 200, text="kopf stopped\n" if broken else "ok\n")

        async def readyz(_: web.Request) -> web.Response:
            # A standby is ready too: it serves the webhook and waits to lead.
            ready = self.ready_flag.is_set() if self.leading else True
            return web.Response(status=200 if ready else 503, text="ready\n" if ready else "not ready\n")

        app = web.Application()
        app.router.add_get(contract.OPERATOR_LIVENESS_PATH, healthz)
        app.router.add_get(contract.OPERATOR_READINESS_PATH, readyz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "0.0.0.0", self.config.health_port).start()
        return runner


__all__ = ["LostLease", "Operator", "OperatorConfig", "WebhookConfig", "build_settings"]
