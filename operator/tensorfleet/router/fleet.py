"""The router's engines: which there are (`--backend`, EndpointSlice discovery), which are healthy (a health check and
load scrape each interval, ejections), and whether a request can wait for one (`unavailable`, `cold_start`); it keeps
the engines' adapters, the demand Lease, the peers and the KV events in step with the pool, and knows nothing of HTTP
clients. Design: docs/routing.md#engine-health.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from tensorfleet import contract
from tensorfleet.kube.connection import Connection, in_cluster_namespace
from tensorfleet.router import NO_ENGINE_RETRY_SECONDS
from tensorfleet.router.adapters import Adapters
from tensorfleet.router.backends import (
    CLOSED,
    HALF_OPEN,
    JOINING,
    OPEN,
    Backend,
    BackendPool,
    Load,
    parse_engine_metrics,
)
from tensorfleet.router.config import RouterConfig
from tensorfleet.router.demand import REFRESH_SECONDS as DEMAND_REFRESH_SECONDS
from tensorfleet.router.demand import DemandLease
from tensorfleet.router.discovery import EndpointSliceWatcher
from tensorfleet.router.dispatch import Dispatcher, Unavailable
from tensorfleet.router.inflight import InFlight
from tensorfleet.router.kvfleet import KVEventFleet
from tensorfleet.router.peers import Loads, Peers, Placement
from tensorfleet.router.prefill import PrefillStage
from tensorfleet.router.scheduling import RequestInfo, make_profile
from tensorfleet.router.tokencount import CHARS_PER_TOKEN
from tensorfleet.router.tokens import fetch_tokens, tokenize_request

log = logging.getLogger("tensorfleet.router")


class Fleet:
    """The engine pool, its dispatcher and everything that keeps them current."""

    def __init__(self, config: RouterConfig, in_flight: InFlight) -> None:
        self.config = config
        self.in_flight = in_flight
        # Engines join the pool without traffic until a health check passes (backends.py).
        self.pool = BackendPool(config.breaker, check_first=True)
        self.strategy = make_profile(config.strategy)
        self.dispatcher = Dispatcher(self.pool, self.strategy, ceiling=config.max_concurrency_per_backend,
                                     burst=config.burst_concurrency_per_backend,
                                     max_queue=config.max_queue, queue_timeout=config.queue_timeout,
                                     prompt_queue_chars=config.prompt_queue_tokens * CHARS_PER_TOKEN,
                                     unavailable=self.unavailable)
        self.pool.on_removed.append(self.strategy.forget)
        self.kv = KVEventFleet(config.kv_event_endpoints) if config.kv_events else None
        if self.kv is not None:
            self.strategy.use_kv_index(self.kv.index)
        self.pool.on_ejected.append(self._on_ejected)
        self.prefill: PrefillStage | None = None
        if config.prefill_backends or config.prefill_service:
            self.prefill = PrefillStage(ceiling=config.prefill_max_concurrency_per_backend
                                        or config.max_concurrency_per_backend,
                                        policy=config.breaker, static=config.prefill_backends)
        self.adapters = Adapters(config, self.pool, in_flight)
        self.peers: Peers | None = None
        self.watcher: EndpointSliceWatcher | None = None
        self.demand: DemandLease | None = None
        self._static: list[str] = list(config.static_backends)
        self._static_urls = {url.rstrip("/") for url in self._static}
        self._discovered: list[str] = []
        self._health_wake = asyncio.Event()  # set when engines join: check them now, not an interval later
        self._tasks: list[asyncio.Task[None]] = []

    def share_placements(self, on_outcome: Callable[[str, int], None]) -> Peers:
        """Tell the other router replicas where this one sends prompts, and take theirs (router/peers.py);
        ON_OUTCOME(outcome, count) counts the placements sent, failed, dropped and received."""
        peers = self.peers = Peers(static=self.config.peers, own_address=self.config.own_address,
                                   on_outcome=on_outcome)
        # The dispatcher's hooks are single slots (dispatch.py): the peers are their only listener.
        self.dispatcher.on_placed = self._placed
        self.dispatcher.on_load = peers.nudge
        self.dispatcher.yielding.peer_queue = self._peer_queue
        peers.queue_heads_source = self.dispatcher.queue_heads
        return peers

    def _peer_queue(self) -> dict[str, float]:
        assert self.peers is not None
        return self.peers.queue_heads(self.in_flight.now())

    def _placed(self, backend: Backend, info: RequestInfo) -> None:
        assert self.peers is not None
        self.peers.share(backend.url, info.prefix_hashes, info.opening)

    def learn_placements(self, placements: list[Placement]) -> None:
        """A peer's placements, taken into the strategy's index as if this replica had made them."""
        backends = self.pool.backends
        for url, opening, hashes in placements:
            backend = backends.get(url)
            if backend is not None:
                self.strategy.learn(backend, hashes, opening)
        self._peer_load()

    def _peer_load(self) -> None:
        """The other replicas' load, as they last told it, replaces what the last scrape said of it; a peer
        not heard from within PEER_STALE counts no more."""
        if self.peers is None or not self.peers.heard:
            return
        load = self.peers.load(self.in_flight.now())
        freed = False
        for backend in self.pool:
            told = load.get(backend.url) or Load()
            if told.requests > backend.peers.requests:
                self.dispatcher.yielding.end(backend.url, "taken")
            freed = (freed or told.requests < backend.peers.requests
                     or told.queued_prompt_chars < backend.peers.queued_prompt_chars)
            backend.peers, backend.others = told, told.requests
        if freed:
            self.dispatcher.drain()  # the peers freed slots or prompt room on an engine: waiters here may take them

    def _own_load(self) -> Loads:
        """This replica's load on each engine, as the peers are told it."""
        return {b.url: b.own for b in self.pool}

    def _block_chars(self) -> int:
        return self.strategy.block_chars

    # --- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        """Take the static engines, and start the health loop, the peers and discovery (as the app starts)."""
        cfg = self.config
        self._update_pool()
        tasks = self._tasks
        tasks.append(asyncio.create_task(self._health_loop(), name="router-health"))
        if self.peers is not None:
            tasks.append(asyncio.create_task(
                self.peers.run(self.in_flight.session, self._block_chars, self._own_load, self.in_flight.now),
                name="router-peers"))
        if cfg.service or cfg.prefill_service or (self.peers and cfg.peer_service):
            namespace = cfg.namespace or in_cluster_namespace() or "default"
            connection = cfg.kube or Connection.from_environment()
        if cfg.service:
            watcher = EndpointSliceWatcher(cfg.service, namespace, self._on_discovered, connection=connection,
                                           on_update=self.dispatcher.reevaluate)
            self.watcher = watcher
            tasks.append(asyncio.create_task(watcher.run(), name="router-discovery"))
            if cfg.demand_lease:
                self.demand = DemandLease(cfg.demand_lease, namespace, connection)
                tasks.append(asyncio.create_task(self._demand_loop(self.demand), name="router-demand"))
        if self.peers is not None and cfg.peer_service:
            # The router's own Service: its ready endpoints are this replica and its peers.
            replicas = EndpointSliceWatcher(cfg.peer_service, namespace, self.peers.set_discovered,
                                            connection=connection)
            tasks.append(asyncio.create_task(replicas.run(), name="router-peer-discovery"))
        if cfg.prefill_service:
            prefill = EndpointSliceWatcher(cfg.prefill_service, namespace, self._on_prefill_discovered,
                                           connection=connection)
            tasks.append(asyncio.create_task(prefill.run(), name="router-prefill-discovery"))

    async def stop(self) -> None:
        tasks = self._tasks
        if self.adapters.refreshing is not None:
            tasks.append(self.adapters.refreshing)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.demand is not None:
            await self.demand.close()
        if self.kv is not None:
            await self.kv.close()

    async def _demand_loop(self, demand: DemandLease) -> None:
        """Keep renewing the demand Lease while requests are being handled (a long stream is demand too)."""
        while True:
            await asyncio.sleep(DEMAND_REFRESH_SECONDS)
            if self.in_flight.requests:
                demand.touch()

    # --- discovery ---------------------------------------------------------------
    def _on_discovered(self, urls: list[str]) -> None:
        self._discovered = urls
        self._update_pool()

    def _on_prefill_discovered(self, urls: list[str]) -> None:
        if self.prefill is not None and self.prefill.set_discovered(urls):
            self._health_wake.set()

    def _update_pool(self) -> None:
        if self.pool.set_urls([*self._static, *self._discovered]):
            self._health_wake.set()
        if self.kv is not None:
            self.kv.sync(backend.url for backend in self.pool)
        self.dispatcher.reevaluate()

    # --- health and load ----------------------------------------------------------
    async def _health_loop(self) -> None:
        """Check every engine each health interval (and scrape its load), and at once when engines join, until
        cancelled."""
        while True:
            self._health_wake.clear()
            checks = [self.check(b) for b in self.pool]
            if self.prefill is not None:
                checks += [self.check(b, self.prefill.pool, self.prefill.dispatcher) for b in self.prefill.pool]
            if checks:
                await asyncio.gather(*checks, return_exceptions=True)
            self.pool.tick()
            self._peer_load()
            self.strategy.align(b.engine.kv_block_size for b in self.pool)
            if self.prefill is not None:
                self.prefill.strategy.align(b.engine.kv_block_size for b in self.prefill.pool)
            if self.adapters.due():
                await self.adapters.refresh()  # on schedule, or an engine joined or left: an adapter may be gone
            self.dispatcher.reevaluate()  # a joining engine's first check may have ended a cold start
            try:
                await asyncio.wait_for(self._health_wake.wait(), self.config.health_interval)
            except TimeoutError:
                pass

    async def check(self, backend: Backend, pool: BackendPool | None = None,
                    dispatcher: Dispatcher | None = None) -> None:
        """One health check of BACKEND in POOL (the decode engines', unless the prefill engines'): unanswered
        within the timeout ejects as unresponsive, refused ejects, else counts. A joining engine is checked every
        time, and joins on its first 200."""
        pool = pool or self.pool
        if backend.state in (OPEN, HALF_OPEN):
            if not backend.breaker.probe_due(pool.clock()):
                return  # ejected, or a probe is already out: nothing to learn yet
            # Past its ejection time: this check is the half-open probe.
            pool.begin_probe(backend)
        try:
            await self._check(backend, pool, dispatcher or self.dispatcher)
        finally:
            backend.breaker.checked = True

    async def _check(self, backend: Backend, pool: BackendPool, dispatcher: Dispatcher) -> None:
        session = self.in_flight.session
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        ok: bool | None = None  # None: no answer in time
        refused = False
        try:
            async with session.get(backend.url + contract.HEALTH_PATH, timeout=timeout) as resp:
                ok = resp.status == 200
                await resp.read()
        except TimeoutError:
            ok = None
        except (aiohttp.ClientConnectorError, ConnectionError):
            refused = True
        except Exception:  # noqa: BLE001 - a check that fails in any way has failed
            ok = False
        if refused and not backend.breaker.unreachable and backend.state == JOINING and backend.url in self._static_urls:
            log.warning("engine %s refuses connections: not taken as starting, requests get 503 until it answers",
                        backend.url)
        backend.breaker.unreachable = refused
        if refused:
            pool.record_failure(backend, fatal=True)
            return
        if ok is None:
            if backend.state == CLOSED:
                log.warning("engine %s did not answer its health check within %gs", backend.url,
                            self.config.health_timeout)
            pool.record_failure(backend, unresponsive=True)
            return
        if ok:
            try:
                async with session.get(backend.url + contract.METRICS_PATH, timeout=timeout) as resp:
                    if resp.status == 200:
                        backend.scraped(parse_engine_metrics(await resp.text()))
                        dispatcher.adapt(backend)
            except Exception:  # noqa: BLE001 - a scrape that fails in any way has failed
                ok = False
        if not ok:
            pool.record_failure(backend)
        elif backend.state != CLOSED:
            if backend.state == JOINING:
                log.info("engine %s is up: taking requests", backend.url)
            pool.record_success(backend)

    def _on_ejected(self, backend: Backend) -> None:
        log.warning("ejected engine %s%s for %.1fs", backend.url, " (unresponsive)" if backend.breaker.unresponsive else "",
                    backend.breaker.open_until - self.pool.clock())
        self.dispatcher.reevaluate()  # the last healthy engine gone: the queued requests have nothing to wait for
        if backend.breaker.unresponsive:
            self.in_flight.engine_unresponsive(backend)

    # --- availability ---------------------------------------------------------------------
    async def token_ids(self, path: str, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids, for placement by the KV index: given in the body, or asked of the least loaded
        engine's /tokenize. None where they cannot change the placement (fewer than two engines to choose from),
        where there is no one prompt, or where the engine did not answer in time."""
        request = tokenize_request(path, body, self.config.model)
        if request is None or isinstance(request, list):
            return request
        routable = self.pool.routable()
        if len(routable) < 2:
            return None
        engine = min(routable, key=Backend.estimated_load)
        return await fetch_tokens(self.in_flight.session, engine.url, request)

    def cold_start(self) -> str | None:
        """What makes a cold start underway, in words; None when none is. One is while discovery has not listed
        the engines yet (and has not failed to), while an engine pod is starting (listed, neither ready nor
        terminating), while a fleet scaled to zero has no engine, or while an engine is joining: a static one
        never yet up that does not refuse connections, or a discovered one before its first check completes (it
        joined Ready, so failing then is a fault, not a start)."""
        watcher = self.watcher
        if watcher is not None:
            if not watcher.listed and not watcher.failing:
                return "the router is listing its engines"
            starting = watcher.starting()
            if starting:
                return f"{len(starting)} engine pod(s) starting"
            if self.demand is not None and not watcher.failing and not len(self.pool):
                return "the fleet is scaled to zero; waking it"
        joining = sum(1 for b in self.pool if b.state == JOINING
                      and (b.url in self._static_urls and not b.breaker.unreachable or not b.breaker.checked))
        if joining:
            return f"{joining} engine(s) not up yet"
        return None

    def unavailable(self, exclude: frozenset[str]) -> Unavailable | None:
        """Why a request (that already failed on `exclude`) cannot wait for an engine: none healthy or about to
        be probed, no cold start underway. None when it may queue. Its Retry-After is when the soonest engine may
        serve again (Breaker.back_in), at least 1 s; NO_ENGINE_RETRY_SECONDS with no engine at all."""
        now = self.pool.clock()
        candidates = [b for b in self.pool if b.url not in exclude]
        if any(b.state == CLOSED or b.routable(now) for b in candidates):
            return None
        if self.cold_start() is not None:
            return None
        if candidates:
            seconds = min(b.breaker.back_in(now, self.config.health_interval) for b in candidates)
            ejected = sum(1 for b in candidates if b.state in (OPEN, HALF_OPEN))
            parts = [f"{ejected} ejected after failures"] if ejected else []
            unreachable = sum(1 for b in candidates
                              if b.state == JOINING and b.breaker.unreachable and b.url in self._static_urls)
            if unreachable:
                parts.append(f"{unreachable} not accepting connections (down, or a wrong --backend address)")
            if len(candidates) > ejected + unreachable:
                parts.append(f"{len(candidates) - ejected - unreachable} ready but not answering the router's "
                             "health checks")
            detail = ", ".join(parts)
        else:
            seconds = NO_ENGINE_RETRY_SECONDS
            if self.watcher is not None and self.watcher.failing:
                detail = "the router cannot list its engines; its log says why"
            else:
                detail = "none is ready and none is starting"
        retry = max(1, math.ceil(seconds))
        return Unavailable(f"no engine is available ({detail}); retry in {retry}s", retry)
