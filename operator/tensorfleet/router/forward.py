"""A call's way through the engines: which engine next, retries before the first byte (each failure charged to its
engine as it deserves: FATAL, COUNTED, SUSPECT), a broken stream resumed as a continuation after it, and a
disaggregated request's prefill phase first (router/prefill.py). Design:
docs/routing.md#stream-resumption-and-token-accounting.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from tensorfleet.httpapi import error_response
from tensorfleet.router.adapters import REQUEST_ADAPTER, adapter_key
from tensorfleet.router.backends import Backend
from tensorfleet.router.budget import Body, BodyBudget
from tensorfleet.router.clients import RETRY_AFTER_SECONDS, reject, stream_error
from tensorfleet.router.config import RouterConfig
from tensorfleet.router.dispatch import NoBackend, QueueTimeout, ShuttingDown, Unavailable
from tensorfleet.router.fleet import Fleet
from tensorfleet.router.inflight import InFlight
from tensorfleet.router.metrics import CLIENT_CLOSED, RouterMetrics
from tensorfleet.router.prefill import KV_TRANSFER_PARAMS, PrefillStage
from tensorfleet.router.proxy import (
    COUNTED,
    FATAL,
    SHUTTING_DOWN,
    SUSPECT,
    Call,
    Failed,
    Proxy,
    Resume,
    Stopped,
    first_byte_bound,
)
from tensorfleet.router.waitqueue import QueueFull

log = logging.getLogger("tensorfleet.router")


class NoSuchModel(Exception):
    """The model a request names is in no healthy engine's list: 404."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model


async def finish(response: web.StreamResponse, data: bytes) -> None:
    """Write the last bytes of a stream and end it (a client gone by then is no matter)."""
    try:
        if data:
            await response.write(data)
        await response.write_eof()
    except (ConnectionError, aiohttp.ClientConnectionResetError):
        pass


class Forwarder:
    """Engines for calls, until one answers: the retries, the resumptions and the prefill phase."""

    def __init__(self, config: RouterConfig, fleet: Fleet, proxy: Proxy, in_flight: InFlight,
                 metrics: RouterMetrics, body_budget: BodyBudget) -> None:
        self.config = config
        self.fleet = fleet
        self.proxy = proxy
        self.in_flight = in_flight
        self.metrics = metrics
        self.body_budget = body_budget

    async def prefill(self, stage: PrefillStage, call: Call, parsed: dict[str, Any]) -> None:
        """The first of a disaggregated request's two phases (router/prefill.py): on success the call carries the
        prefill engine's kv_transfer_params to the decode engine; otherwise it goes as it came (the decode engine
        computes the prompt)."""
        # The prefill half answers after its prompt and one token: bounded as a stream's first byte is.
        bound = first_byte_bound(self.config, call.path, {**parsed, "stream": True})
        # The prompt hashed once where the decode side hashed it alike (an adapter's info routes by the adapter).
        strategy = self.fleet.strategy
        same = (strategy.needs_prefix and strategy.block_chars == stage.strategy.block_chars
                and call.info.adapter is None)
        info = call.info if same else stage.info(parsed)
        outcome, params = await stage.run(self.in_flight.session, call.path, parsed, info, call.headers, bound)
        if params is not None:
            data = json.dumps({**parsed, KV_TRANSFER_PARAMS: params}, separators=(",", ":")).encode()
            if call.body.replace(data):
                call.info.queues_prompt = False  # the decode engine computes none of it: nothing for it to queue
            else:
                outcome = "failed"  # no room in the body budget for the rewritten request: it goes as it came
        self.metrics.prefill(outcome)

    async def forward(self, request: web.Request, call: Call) -> web.StreamResponse:
        """Send the call to engines until one answers (or the retries are spent); the answer, or the router's.
        Raises NoSuchModel for a name that turned out to be no adapter of the fleet's."""
        fleet, pool, dispatcher = self.fleet, self.fleet.pool, self.fleet.dispatcher
        tried: set[str] = set()
        failures: list[Failed] = []
        retry_after: dict[str, str] = {}
        # A request that finds no engine to serve it during a cold start (the fleet waking from zero, its
        # engines loading) waits up to --cold-start-timeout, not --queue-timeout.
        waiting = self.config.queue_timeout
        if not pool.routable():
            if fleet.demand is not None:
                fleet.demand.touch(urgent=True)
            if fleet.cold_start() is not None:
                waiting = max(waiting, self.config.cold_start_timeout)
        elif fleet.demand is not None:
            fleet.demand.touch()
        for attempt in range(self.config.retries + 1):
            try:
                backend = await dispatcher.acquire(call.info, frozenset(tried), tenant=call.tenant, timeout=waiting)
                if call.unresolved is not None:
                    backend = await self._resolve_model(request, call, backend, frozenset(tried), waiting)
            except QueueFull as exc:
                if call.tenant is not None:
                    self.metrics.tenant_rejected(call.tenant, "queue")
                if exc.displaced:
                    message = ("the router's queue is full, and a request of an API key with fewer requests waiting "
                               "took this one's place; retry later")
                else:
                    message = (f"the router's queue is full ({dispatcher.max_queue} requests waiting for an "
                               "engine); retry later")
                return reject(self.metrics, 429, message, headers={"Retry-After": RETRY_AFTER_SECONDS})
            except QueueTimeout:
                healthy = sum(1 for b in pool if b.healthy)
                return reject(self.metrics, 503, f"no engine could take the request within {waiting:g}s "
                                                 f"({len(pool)} engines, {healthy} healthy); the service is "
                                                 "overloaded or starting, retry later",
                              headers={"Retry-After": RETRY_AFTER_SECONDS})
            except ShuttingDown:
                return reject(self.metrics, 503, SHUTTING_DOWN, headers={"Retry-After": RETRY_AFTER_SECONDS},
                              close=True)
            except Unavailable as exc:
                retry_after = {"Retry-After": str(exc.retry_after)}
                if failures:
                    break  # it failed where it was tried: say how, below
                return reject(self.metrics, 503, str(exc), headers=retry_after)
            except NoBackend:
                break
            tried.add(backend.url)
            code = CLIENT_CLOSED
            broken: Resume | None = None
            try:
                response = await self.proxy.attempt(request, backend, call)
                code = str(response.status)
                return response
            except Resume as exc:
                code = "200"  # its answer began as one; the rest comes from elsewhere
                broken = exc
            except Failed as exc:
                failures.append(exc)
                code = str(exc.final.status) if exc.final is not None else "502"
                if exc.fault == FATAL:
                    pool.record_failure(backend, fatal=True)
                elif exc.fault == COUNTED:
                    pool.record_failure(backend)
                else:
                    if exc.fault == SUSPECT:
                        call.suspects.append(backend)
                    pool.record_neutral(backend)
                if attempt < self.config.retries:
                    self.metrics.retry(exc.reason)
                    log.info("engine %s: %s before the first byte; retrying elsewhere", backend.url, exc)
                else:
                    log.info("engine %s: %s before the first byte", backend.url, exc)
            except Stopped:
                code = "503"  # counted against this attempt's engine label below, like any answer on its behalf
                response = error_response(503, SHUTTING_DOWN, headers={"Retry-After": RETRY_AFTER_SECONDS})
                response.force_close()
                return response
            finally:
                dispatcher.release(backend, call.info)
                self.metrics.attempt_done(backend.url, code)
            if broken is not None:
                return await self._resume(request, call, broken)
        final = next((f.final for f in reversed(failures) if f.final is not None), None)
        if final is not None:
            return final
        reasons = "; ".join(dict.fromkeys(str(f) for f in failures)) or "no engine"
        status = 504 if failures and all(f.reason in ("timeout", "unresponsive") for f in failures) else 502
        return reject(self.metrics, status, f"no engine could serve the request ({len(failures)} tried: {reasons})",
                      headers=retry_after)

    async def _resolve_model(self, request: web.Request, call: Call, backend: Backend, exclude: frozenset[str],
                             waiting: float) -> Backend:
        """A request naming a model no healthy engine had listed when it came (call.unresolved), now that it has
        an engine: learn the lists (BACKEND is up). An adapter goes on as one, to an engine that lists it; a name
        no list has is refused (NoSuchModel: 404, the slot given back); with still no list to be had (BACKEND
        did not answer /v1/models) it goes to BACKEND, which decides."""
        adapters, dispatcher = self.fleet.adapters, self.fleet.dispatcher
        name = call.unresolved
        assert name is not None
        call.unresolved = None
        if name not in adapters.names:
            # BACKEND's list is one the router lacks: a round from now on; else one begun since the request came
            await adapters.refresh(since=self.in_flight.now() if not adapters.listed_by(backend.url) else call.start)
        if name in adapters.names:
            call.adapter = request[REQUEST_ADAPTER] = name
            call.info.adapter = adapter_key(name)
            call.info.hosts = adapters.hosts(name)
            if backend.url in call.info.hosts:
                return backend
            dispatcher.release(backend, call.info)  # picked without the adapter's placement: pick again
            return await dispatcher.acquire(call.info, exclude, tenant=call.tenant, timeout=waiting)
        if adapters.known():
            dispatcher.release(backend, call.info)
            raise NoSuchModel(name)
        return backend

    async def _resume(self, request: web.Request, call: Call, broken: Resume) -> web.StreamResponse:
        """Continue a stream that broke mid-way as a continuation on another engine (never one it broke on), at
        most --stream-resumptions times; a stream that cannot be continued ends with its error event."""
        pool, dispatcher = self.fleet.pool, self.fleet.dispatcher
        stream, response = call.stream, call.response
        assert stream is not None and response is not None
        while True:
            stream.failed.add(broken.backend.url)
            body = stream.continuation_body() if not stream.complete and stream.blocked is None else None
            if stream.complete or (stream.blocked is None and body is None):
                # All of the answer was sent (the engine broke before its last events): end the stream.
                await finish(response, stream.ending())
                return response
            why = stream.blocked
            if why is None and stream.resumptions >= self.config.stream_resumptions:
                why = f"it was resumed {stream.resumptions} times already"
            backend = None
            if why is None:
                try:
                    backend = await dispatcher.acquire(call.info, frozenset(stream.failed), tenant=call.tenant)
                except (QueueFull, QueueTimeout, ShuttingDown, Unavailable, NoBackend) as exc:
                    why = f"no other engine could take it ({exc.__class__.__name__})"
            if why is not None or backend is None or body is None:
                log.warning("a stream broken on engine %s ends with an error event: %s", broken.backend.url, why)
                self.metrics.stream_error(broken.backend)
                await stream_error(response, b"\n\n", broken.status, broken.message)
                return response
            stream.resumptions += 1
            self.metrics.stream_resumed(broken.reason)
            log.info("resuming a stream broken on engine %s on engine %s (%d token(s) sent; resumption %d of %d)",
                     broken.backend.url, backend.url, stream.tokens, stream.resumptions, self.config.stream_resumptions)
            data = Body(self.body_budget)
            data.data = bytearray(json.dumps(body, ensure_ascii=False).encode())  # not charged: the stream's own
            continuation = Call(call.path, data, call.headers, call.info, first_byte_bound(self.config, call.path, body),
                                self.in_flight.now(), tenant=call.tenant, meter=call.meter, stream=stream,
                                response=response)
            stream.begin_continuation()
            code = CLIENT_CLOSED
            try:
                await self.proxy.attempt(request, backend, continuation)
                code = "200"
                return response
            except Resume as exc:
                code = "200"
                broken = exc
            except Failed as exc:
                code = str(exc.final.status) if exc.final is not None else "502"
                if exc.fault == FATAL:
                    pool.record_failure(backend, fatal=True)
                elif exc.fault == COUNTED:
                    pool.record_failure(backend)
                else:
                    pool.record_neutral(backend)
                log.info("engine %s: %s before the continuation's first byte", backend.url, exc)
                if exc.final is not None and exc.final.status < 500:
                    # Refused (4xx): any engine would refuse it. The stream ends as it would have without it.
                    self.metrics.stream_error(broken.backend)
                    await stream_error(response, b"\n\n", broken.status, broken.message)
                    return response
                broken = Resume(backend, exc.reason, broken.status, broken.message)
            except Stopped:
                code = "503"
                await stream_error(response, b"\n\n", 503, "the router is shutting down; the answer is "
                                   "incomplete, retry the request", type_="ServiceUnavailableError")
                return response
            finally:
                dispatcher.release(backend, call.info)
                self.metrics.attempt_done(backend.url, code)
