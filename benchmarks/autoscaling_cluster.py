"""The simulated cluster of the autoscaling benchmark, on the compressed clock (`Clock`: TIME_SCALE wall seconds per
simulated second): engine pods as a StatefulSet would run them (`Fleet` of `Pod`s, each a real `tensorfleet sim`
process, with the kubelet's startup probe, the EndpointSlice controller's slice and the worker's drain), `Prometheus`
scraping the engines and the router, and `Control`, the HPA (hpa_model.py) on one `Signal` and the operator's own
scale-to-zero decision on the router's demand Lease. Part of benchmark 6, benchmarks/bench_autoscaling.py, which
defines the signals and the load ramp, runs them and reports; what it models and why:
benchmarks/README.md#6-autoscaling-signals-bench_autoscalingpy (section 6).
"""

from __future__ import annotations

import asyncio
import datetime
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from common import MODEL, RESULTS, Proc, engine_flags, free_port, metric_sum
from hpa_model import Autoscaler, MetricError, PodSample, object_average_replicas, pods_metric_replicas

from tensorfleet import contract
from tensorfleet.api.models import InferenceServiceSpec
from tensorfleet.controller.idle import decide, format_time, parse_time
from tensorfleet.planner import Plan
from tensorfleet.render.autoscaling import DEFAULT_SCALE_DOWN, DEFAULT_SCALE_UP
from tensorfleet.render.engine import STARTUP_PERIOD_SECONDS
from tensorfleet.testing import operator_harness

TIME_SCALE = 0.2
NAME, NAMESPACE = "bench", "default"
SYNC_SECONDS = 15.0          # kube-controller-manager --horizontal-pod-autoscaler-sync-period
SCRAPE_SECONDS = 15.0        # the chart's PodMonitor interval
TOLERANCE = 0.1              # --horizontal-pod-autoscaler-tolerance
SERVICE = contract.engine_service_name(NAME)
LEASE = contract.demand_lease_name(NAME)
LEASES = ("coordination.k8s.io/v1", "leases")
SLICES = ("discovery.k8s.io/v1", "endpointslices")


@dataclass(frozen=True)
class Signal:
    name: str
    kind: str               # "pods" or "object"
    metric: str             # what the HPA reads
    target: float
    concurrency: int        # router --max-concurrency-per-backend
    burst: int = 0          # router --burst-concurrency-per-backend (0: none)


class Clock:
    """Simulated seconds since the load started (negative before)."""

    def __init__(self) -> None:
        self.wall0 = time.perf_counter()
        self.epoch0 = time.time()

    def now(self) -> float:
        return (time.perf_counter() - self.wall0) / TIME_SCALE

    def of(self, perf: float) -> float:
        return (perf - self.wall0) / TIME_SCALE

    def date(self, sim: float) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.epoch0 + sim, datetime.UTC)

    def sim_of_epoch(self, epoch: float) -> float:
        return (epoch - self.epoch0) / TIME_SCALE

    async def sleep(self, sim_seconds: float) -> None:
        await asyncio.sleep(max(0.0, sim_seconds) * TIME_SCALE)

    async def until(self, sim: float) -> None:
        await self.sleep(sim - self.now())


def spawn(tag: str, name: str, args: Sequence[str], url: str) -> Proc:
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{tag}-{name}.log"
    process = subprocess.Popen([sys.executable, "-m", "tensorfleet.cli", *args], stdout=log.open("wb"),
                               stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Proc(name, url, process, log)


# --- the fleet: StatefulSet, kubelet probes, EndpointSlice controller, the worker's drain ----------------

@dataclass
class Pod:
    ordinal: int
    uid: int
    ip: str
    proc: Proc
    started: float                       # simulated
    loaded: float                        # when its engine answers (start + load time)
    ready: float | None = None           # its startup probe passed: listed ready
    terminating: float | None = None     # deletion requested: terminating endpoint, draining
    stopped: float | None = None
    next_probe: float = 0.0

    @property
    def name(self) -> str:
        return f"{NAME}-engine-{self.ordinal}"


class Fleet:
    """Engine pods as a StatefulSet (podManagementPolicy Parallel) would run them."""

    def __init__(self, c: operator_harness.Cluster, clock: Clock, plan: Plan, tag: str, startup_delay_wall: float,
                 grace: float) -> None:
        self.c, self.clock, self.plan, self.tag = c, clock, plan, tag
        self.startup_delay_wall = startup_delay_wall
        self.grace = grace
        self.port = free_port()
        self.pods: list[Pod] = []
        self.history: list[Pod] = []
        self.desired = 1
        self._uid = 0
        self._published: Any = None
        self._drains: set[asyncio.Task[None]] = set()
        self.session: aiohttp.ClientSession | None = None

    def live(self) -> list[Pod]:
        return [p for p in self.pods if p.terminating is None]

    def ready_count(self) -> int:
        return sum(1 for p in self.live() if p.ready is not None)

    def _start(self, ordinal: int) -> None:
        self._uid += 1
        # A fresh loopback address per pod, as a new pod gets a new IP; every engine on the same port.
        ip = f"127.1.{self._uid // 250}.{self._uid % 250 + 2}"
        args = ["sim", "--host", ip, "--port", str(self.port), "--served-model-name", MODEL, *engine_flags(self.plan),
                "--time-scale", str(TIME_SCALE), "--startup-delay", f"{self.startup_delay_wall:.3f}",
                "--seed", str(self._uid), "--log-level", "warning"]
        now = self.clock.now()
        proc = spawn(self.tag, f"engine-{self._uid}", args, f"http://{ip}:{self.port}")
        pod = Pod(ordinal, self._uid, ip, proc, started=now, loaded=now + self.plan.load_seconds,
                  next_probe=now + STARTUP_PERIOD_SECONDS)
        self.pods.append(pod)
        self.history.append(pod)

    def _endpoint_slice(self) -> dict[str, Any]:
        endpoints = []
        for p in sorted(self.pods, key=lambda p: p.ordinal):
            if p.terminating is not None:
                conditions = {"ready": False, "serving": False, "terminating": True}
            else:
                conditions = {"ready": p.ready is not None, "serving": p.ready is not None, "terminating": False}
            endpoints.append({"addresses": [p.ip], "conditions": conditions, "targetRef": {"kind": "Pod", "name": p.name}})
        return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": f"{SERVICE}-x7k2p", "namespace": NAMESPACE,
                             "labels": {contract.ENDPOINTSLICE_SERVICE_LABEL: SERVICE}},
                "addressType": "IPv4",
                "ports": [{"name": contract.PORT_NAME_HTTP, "port": self.port, "protocol": "TCP"}],
                "endpoints": endpoints}

    async def _publish(self) -> None:
        obj = self._endpoint_slice()
        if obj != self._published:
            await self.c.upsert(*SLICES, obj)
            self._published = obj

    async def _probe(self, pod: Pod) -> bool:
        assert self.session is not None
        try:
            async with self.session.get(pod.proc.url + contract.HEALTH_PATH,
                                        timeout=aiohttp.ClientTimeout(total=5 * TIME_SCALE + 1)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _in_flight(self, pod: Pod) -> int | None:
        assert self.session is not None
        try:
            async with self.session.get(pod.proc.url + contract.METRICS_PATH,
                                        timeout=aiohttp.ClientTimeout(total=2)) as resp:
                text = await resp.text()
            return int(metric_sum(text, contract.VLLM_METRIC_RUNNING) + metric_sum(text, contract.VLLM_METRIC_WAITING))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def _drain(self, pod: Pod) -> None:
        """The worker launcher's drain: SIGTERM the engine once nothing is in flight, or at the grace period."""
        deadline = pod.terminating + self.grace if pod.terminating is not None else self.clock.now()
        while self.clock.now() < deadline:
            count = await self._in_flight(pod)
            if not count:
                break
            await self.clock.sleep(1.0)
        await asyncio.to_thread(pod.proc.stop)
        pod.stopped = self.clock.now()
        self.pods.remove(pod)
        await self._publish()

    async def reconcile(self) -> None:
        now = self.clock.now()
        by_ordinal = {p.ordinal: p for p in self.pods}
        for ordinal in range(self.desired):
            if ordinal not in by_ordinal:  # one still terminating under that name is waited for
                self._start(ordinal)
        for p in self.live():
            if p.ordinal >= self.desired:
                p.terminating = now
                task = asyncio.create_task(self._drain(p))
                self._drains.add(task)
                task.add_done_callback(self._drains.discard)
        # The startup probe, every STARTUP_PERIOD_SECONDS from the container's start, makes a pod Ready.
        probes = []
        for p in self.live():
            if p.ready is None and now >= p.next_probe:
                p.next_probe += STARTUP_PERIOD_SECONDS * math.ceil((now - p.next_probe + 1e-9) / STARTUP_PERIOD_SECONDS)
                probes.append(p)
        for p, passed in zip(probes, await asyncio.gather(*(self._probe(p) for p in probes)), strict=True):
            if passed:
                p.ready = self.clock.now()
        await self._publish()

    async def run(self, stop: asyncio.Event) -> None:
        self.session = aiohttp.ClientSession()
        try:
            while not stop.is_set():
                await self.reconcile()
                await self.clock.sleep(STARTUP_PERIOD_SECONDS / 4)
        finally:
            await asyncio.gather(*self._drains, return_exceptions=True)
            await self.session.close()

    def stop_all(self) -> None:
        for p in self.pods:
            p.proc.stop()
            p.stopped = p.stopped if p.stopped is not None else self.clock.now()
        self.pods.clear()


# --- Prometheus, the HPA, the operator's idle decision ------------------------------------------------

class Prometheus:
    """Scrapes each target every SCRAPE_SECONDS at its own fixed offset; keeps the latest sample per series.

    An engine that is still loading its model does not answer (vLLM serves HTTP only once loaded), so it has
    no series until its first scrape after that; a pod that is gone has none (its series went stale)."""

    def __init__(self, clock: Clock, fleet: Fleet, router_url: str, rng: random.Random) -> None:
        self.clock, self.fleet, self.router_url, self.rng = clock, fleet, router_url, rng
        self.engine: dict[int, dict[str, float]] = {}
        self.router_pending: float | None = None
        self._next: dict[Any, float] = {}
        self.session: aiohttp.ClientSession | None = None

    async def _scrape(self, url: str) -> str | None:
        assert self.session is not None
        try:
            async with self.session.get(url + contract.METRICS_PATH, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def tick(self) -> None:
        now = self.clock.now()
        pods = {p.uid: p for p in self.fleet.pods}
        for uid in list(self.engine):
            if uid not in pods:
                del self.engine[uid]
        due: list[tuple[Any, str]] = []
        for key, url in [("router", self.router_url), *((p.uid, p.proc.url) for p in pods.values())]:
            at = self._next.setdefault(key, now + self.rng.uniform(0, SCRAPE_SECONDS))
            if now >= at:
                self._next[key] = at + SCRAPE_SECONDS * max(1, math.ceil((now - at) / SCRAPE_SECONDS))
                due.append((key, url))
        texts = await asyncio.gather(*(self._scrape(url) for key, url in due
                                       if key == "router" or now >= pods[key].loaded))
        scraped = [d for d in due if d[0] == "router" or now >= pods[d[0]].loaded]
        for (key, _), text in zip(scraped, texts, strict=True):
            if text is None:
                continue
            if key == "router":
                # What the chart's adapter rule sums from the routers: their queues and their burst.
                self.router_pending = (metric_sum(text, contract.ROUTER_METRIC_PENDING)
                                       + metric_sum(text, contract.ROUTER_METRIC_BURST))
            else:
                self.engine[key] = {name: metric_sum(text, name) for name in
                                    (contract.VLLM_METRIC_WAITING, contract.VLLM_METRIC_RUNNING,
                                     contract.VLLM_METRIC_KV_CACHE_USAGE)}

    async def run(self, stop: asyncio.Event) -> None:
        self.session = aiohttp.ClientSession()
        try:
            while not stop.is_set():
                await self.tick()
                await self.clock.sleep(0.5)
        finally:
            await self.session.close()


@dataclass
class Control:
    """The HPA and the operator's zero, on the simulated clock; what they decided and when."""

    clock: Clock
    fleet: Fleet
    prometheus: Prometheus
    signal: Signal
    spec: InferenceServiceSpec
    c: operator_harness.Cluster
    hpa_phase: float
    spec_replicas: int = 1
    idle: bool = False
    status: dict[str, Any] = field(default_factory=dict)
    scale_events: list[tuple[float, int, int]] = field(default_factory=list)  # (t, from, to) HPA writes
    zero_events: list[tuple[float, str]] = field(default_factory=list)
    metric_log: list[tuple[float, float | None, int | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.spec.autoscaling is not None
        self.hpa = Autoscaler.from_behavior(max(1, self.spec.autoscaling.min_replicas), self.spec.autoscaling.max_replicas,
                                            DEFAULT_SCALE_UP, DEFAULT_SCALE_DOWN)

    def proposal(self) -> tuple[int | None, float | None]:
        engines = self.prometheus.engine
        pods = self.fleet.pods
        try:
            if self.signal.kind == "object":
                value = (self.prometheus.router_pending or 0.0) + sum(
                    engines[p.uid][contract.VLLM_METRIC_WAITING] for p in pods if p.uid in engines)
                status_replicas = len(self.fleet.live())
                return object_average_replicas(status_replicas, self.signal.target, value, TOLERANCE)[0], value
            samples = [PodSample(str(p.uid), engines[p.uid][self.signal.metric] if p.uid in engines else None,
                                 deleting=p.terminating is not None) for p in pods]
            replicas, usage = pods_metric_replicas(self.spec_replicas, self.signal.target, samples, TOLERANCE)
            return replicas, usage / 1000
        except MetricError:
            return None, None

    def hpa_sync(self) -> None:
        now = self.clock.now()
        proposal, value = self.proposal()
        desired = self.hpa.sync(now, self.spec_replicas, proposal)
        self.metric_log.append((now, value, proposal))
        if desired != self.spec_replicas:
            self.scale_events.append((now, self.spec_replicas, desired))
            self.spec_replicas = desired

    async def operator_tick(self) -> None:
        async def read() -> Any:
            return self.c.emulator.find(*LEASES, NAMESPACE, LEASE)
        lease = await self.c.acall(read())
        renewed = parse_time(((lease or {}).get("spec") or {}).get("renewTime"))
        mapped = None
        if renewed is not None:  # the router stamps wall time; the operator's clock here is the simulated one
            sim = self.clock.sim_of_epoch(renewed.timestamp())
            mapped = {"spec": {"renewTime": self.clock.date(sim).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}
        now = self.clock.now()
        verdict = decide(self.spec, self.status, mapped, format_time(self.clock.date(0.0)), self.clock.date(now))
        if verdict.idle != self.idle:
            self.zero_events.append((now, "to-zero" if verdict.idle else "from-zero"))
        self.idle = verdict.idle
        self.status = {"idleSince": verdict.since} if verdict.since else {}

    async def run(self, stop: asyncio.Event) -> None:
        next_sync = self.hpa_phase
        while not stop.is_set():
            await self.operator_tick()
            if self.clock.now() >= next_sync:
                self.hpa_sync()
                next_sync += SYNC_SECONDS
            self.fleet.desired = 0 if self.idle else max(1, self.spec_replicas)
            await self.clock.sleep(1.0)
