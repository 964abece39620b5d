"""One attempt of a call on one engine: send it, wait for the first byte, relay the answer whole or as a stream, and say
by what it raises how the attempt failed (Failed before any byte reached the client, Resume for a resumable stream
that broke after, Stopped, ClientGone); a stream that breaks and cannot be resumed ends here with an SSE error event.
Design: docs/routing.md#retries-before-the-first-byte.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import hdrs, web

from tensorfleet import contract
from tensorfleet.httpapi import SSE_CONTENT_TYPE, post_resending_once
from tensorfleet.router.backends import Backend, BackendPool
from tensorfleet.router.budget import Body
from tensorfleet.router.clients import GENERATION_PATHS, ClientGone, stream_error
from tensorfleet.router.config import RouterConfig
from tensorfleet.router.dispatch import Dispatcher
from tensorfleet.router.inflight import Attempt, InFlight, Interrupted
from tensorfleet.router.metrics import RouterMetrics
from tensorfleet.router.resume import StreamState, ask_usage, usage_asked
from tensorfleet.router.scheduling import RequestInfo
from tensorfleet.router.tenants import UsageMeter
from tensorfleet.router.tokencount import estimate_prompt_tokens, stated_max_tokens

log = logging.getLogger("tensorfleet.router")

_RELAYED_RESPONSE_HEADERS = ("Content-Type", "Content-Encoding", "X-Request-Id")
SHUTTING_DOWN = "the router is shutting down; retry the request"

# Failed.fault: how an attempt's failure counts against its engine.
FATAL = "fatal"      # ejects at once (a refused or reset connection)
COUNTED = "counted"  # towards the breaker's threshold
SUSPECT = "suspect"  # a 5xx: counted once another engine answers the same request without one


class Failed(Exception):
    """An attempt failed before any byte reached the client: try another engine.

    The message may reach the client: it never names an engine (the log does)."""

    def __init__(self, reason: str, message: str, *, fault: str | None, final: web.Response | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.fault = fault
        self.final = final


class Stopped(Exception):
    """The shutdown grace ended before the engine's first byte: answer 503."""


class Resume(Exception):
    """A resumable stream broke after bytes reached its client: continue it on another engine (forward.py).
    STATUS and MESSAGE make the error event that ends it if it cannot be."""

    def __init__(self, backend: Backend, reason: str, status: int, message: str) -> None:
        super().__init__(message)
        self.backend = backend
        self.reason = reason
        self.status = status
        self.message = message


@dataclass(eq=False)
class Call:
    """A parsed request, ready to send to any engine."""

    path: str
    body: Body
    headers: dict[str, str]
    info: RequestInfo
    first_byte_bound: float | None
    start: float
    suspects: list[Backend] = field(default_factory=list)  # engines that answered it 5xx, not yet charged
    tenant: str | None = None  # whose API key it came with
    meter: UsageMeter | None = None  # what it used, when tokens are limited
    resumable: bool = False  # a stream that may be continued elsewhere should it break (router/resume.py)
    adapter: str | None = None  # the LoRA adapter it asks for
    unresolved: str | None = None  # a model name no healthy engine's list has said anything of yet: maybe an adapter
    usage: tuple[bool, bool] = (False, False)  # a stream's usage its client asked for (resume.usage_asked)
    usage_added: bool = False  # the router asked the engine for usage on every event (resume.ask_usage)
    stream: StreamState | None = None  # once it streams (resumable or metered): what was sent; on continuations too
    response: web.StreamResponse | None = None  # the client's stream, for a continuation to write on

    def ask_usage(self, parsed: dict[str, Any]) -> None:
        """Have a stream the router tracks (resumable or metered) carry the engine's token counts on every event
        (router/resume.py), noting what usage its client asked for; the request goes as it came when its
        stream_options are not an object (the engine refuses it) or the body budget cannot take the bytes."""
        asked = usage_asked(parsed)
        if asked is None:
            return
        self.usage = asked
        rewritten = ask_usage(self.body.data, parsed)
        if rewritten is not None and self.body.replace(rewritten[0]):
            parsed["stream_options"] = rewritten[1]  # what a rewrite of the body from it (prefill) must keep
            self.usage_added = True


def first_byte_bound(config: RouterConfig, path: str, body: Mapping[str, Any]) -> float | None:
    """Seconds an engine may take to send the first byte of its answer to this request (None: no bound).

    A long prompt is a long prefill; an answer that is not streamed arrives whole, after its generation.
    """
    bound = config.first_byte_timeout + estimate_prompt_tokens(body) / config.prefill_tokens_per_second
    if path in GENERATION_PATHS and body.get("stream") is not True:
        limit = stated_max_tokens(body)
        if limit is None:
            return None  # the engine's default is the whole context: no useful bound
        bound += limit / config.decode_tokens_per_second
    return bound


class Proxy:
    """Attempts of calls on engines, each on the engine it is given (router/forward.py picks and retries)."""

    def __init__(self, config: RouterConfig, pool: BackendPool, dispatcher: Dispatcher, in_flight: InFlight,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.pool = pool
        self.dispatcher = dispatcher
        self.in_flight = in_flight
        self.metrics = metrics

    async def attempt(self, request: web.Request, backend: Backend, call: Call) -> web.StreamResponse:
        """The call on one engine: its whole answer, or its stream relayed."""
        attempt = Attempt(backend, self.in_flight.loop)
        self.in_flight.attempts.add(attempt)
        try:
            try:
                async with asyncio.timeout(call.first_byte_bound) as timer:
                    attempt.timer = timer
                    first, payload = await self._exchange(backend, call, attempt)
            except TimeoutError:
                if attempt.reason == "shutdown":
                    raise Stopped() from None
                if attempt.reason == "unresponsive":
                    raise Failed("unresponsive", "its engine stopped answering health checks", fault=None) from None
                raise Failed("timeout", f"no answer within {call.first_byte_bound or 0:g}s", fault=None) from None
            finally:
                attempt.timer = None
                self.dispatcher.discharge(backend, call.info)
            # This engine answered without a 5xx: those that answered this same request with one were at fault.
            for suspect in call.suspects:
                self.pool.record_failure(suspect)
            call.suspects.clear()
            upstream = attempt.upstream
            assert upstream is not None
            if payload is not None:
                if call.response is not None:  # a continuation answered whole: an error (a stream was asked for)
                    raise Failed("status", f"an engine answered HTTP {upstream.status}: {payload[:300]!r}", fault=None,
                                 final=web.Response(body=payload, status=upstream.status))
                if upstream.status >= 400:
                    self.pool.record_neutral(backend)  # the client's doing, not the engine's
                else:
                    self.pool.record_success(backend)
                if call.meter is not None:
                    call.meter.answer(upstream.status, payload)
                return web.Response(body=payload, status=upstream.status, headers=self._relay_headers(upstream, backend))
            assert first is not None
            return await self._relay_stream(request, attempt, upstream, first, call)
        finally:
            self.in_flight.attempts.discard(attempt)
            upstream = attempt.upstream
            if upstream is not None:
                # close(), not release(): an unfinished answer must drop the
                # connection, which is what tells the engine to abort.
                if not upstream.closed and not upstream.content.is_eof():
                    upstream.close()
                else:
                    upstream.release()

    async def _exchange(self, backend: Backend, call: Call, attempt: Attempt) -> tuple[bytes | None, bytes | None]:
        """Send the call and wait for the answer's first byte: (first chunk, None) for a stream, (None, whole
        answer) otherwise. An engine failure raises Failed."""
        try:
            upstream = await self._post(backend, call)
        except (aiohttp.ClientConnectorError, ConnectionError) as exc:
            raise Failed("connect", f"could not connect to an engine ({exc.__class__.__name__})", fault=FATAL) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise Failed("upstream", f"an engine failed before answering ({exc.__class__.__name__})",
                         fault=COUNTED) from None
        attempt.upstream = upstream
        try:
            if upstream.status >= 500:
                payload = await upstream.read()
                final = web.Response(body=payload, status=upstream.status, headers=self._relay_headers(upstream, backend))
                raise Failed("status", f"an engine answered HTTP {upstream.status}", fault=SUSPECT, final=final)
            if upstream.status == 200 and upstream.headers.get(hdrs.CONTENT_TYPE, "").startswith(SSE_CONTENT_TYPE):
                first = await upstream.content.readany()
                if not first:
                    raise Failed("upstream", "an engine ended the stream before sending anything", fault=COUNTED)
                return first, None
            return None, await upstream.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise Failed("upstream", f"an engine failed mid-answer ({exc.__class__.__name__})", fault=FATAL) from None

    async def _post(self, backend: Backend, call: Call) -> aiohttp.ClientResponse:
        """POST the call; once more on a new connection if the engine hung up before answering anything (a
        pooled connection it closed: no engine fault; httpapi.post_resending_once)."""

        def resend(exc: BaseException) -> None:
            log.debug("engine %s: %s on a pooled connection; sending again", backend.url, exc.__class__.__name__)
            self.metrics.retry("closed_idle")

        return await post_resending_once(self.in_flight.session, backend.url + call.path, on_resend=resend,
                                         data=call.body.data, headers=call.headers)

    def _relay_headers(self, upstream: aiohttp.ClientResponse, backend: Backend) -> dict[str, str]:
        out = {name: upstream.headers[name] for name in _RELAYED_RESPONSE_HEADERS if name in upstream.headers}
        if self.config.backend_header:
            out[contract.BACKEND_HEADER] = backend.url
        return out

    async def _relay_stream(self, request: web.Request, attempt: Attempt, upstream: aiohttp.ClientResponse,
                            first: bytes, call: Call) -> web.StreamResponse:
        """Relay the engine's stream to the client as it comes (a continuation's onto the client's stream, its
        events rewritten). An interruption ends it with an error event, or raises Resume for a resumable one."""
        backend = attempt.backend
        stream = call.stream
        continuing = call.response is not None
        if call.response is None:
            if call.resumable or call.meter is not None:
                # Tracked for a continuation, or for its token charge; a resumable one's body stays for a
                # continuation (resume.MAX_BODY_BYTES at most).
                stream = call.stream = StreamState.start(call.path, call.body.data if call.resumable else b"",
                                                         resumable=call.resumable, usage=call.usage,
                                                         added=call.usage_added)
            call.body.release()  # no retry can need it from here on
            response = call.response = web.StreamResponse(status=upstream.status, headers={
                **self._relay_headers(upstream, backend), "Cache-Control": "no-cache"})
            if self.in_flight.draining:
                response.force_close()
        else:
            response = call.response
        content = upstream.content
        loop_time = self.in_flight.now
        resumes = stream is not None and stream.resumable
        attempt.client = request.transport
        attempt.streaming = attempt.writing = True
        attempt.last = loop_time()
        try:
            if not continuing:
                await response.prepare(request)
            out = first if stream is None else stream.feed(first)
            if out:
                await response.write(out)
            attempt.writing = False
            if not continuing:
                self.metrics.adapter_first_byte(loop_time() - call.start, call.adapter)
            tail = out[-2:]
            while True:
                attempt.last = loop_time()
                try:
                    chunk = await content.readany()
                except Interrupted as exc:
                    if resumes and exc.reason != "shutdown":
                        status, message = self._breakage(backend, exc.reason)
                        raise Resume(backend, exc.reason, status, message) from None
                    await self._end_interrupted(response, tail, backend, exc.reason)
                    return response
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self.pool.record_failure(backend, fatal=True)
                    status, message = self._breakage(backend, "failed", exc)
                    if resumes:
                        raise Resume(backend, "failed", status, message) from None
                    self.metrics.stream_error(backend)
                    await stream_error(response, tail, status, message)
                    return response
                if not chunk:
                    break
                out = chunk if stream is None else stream.feed(chunk)
                if not out:
                    continue
                attempt.writing = True
                attempt.last = loop_time()
                await response.write(out)
                attempt.writing = False
                tail = out[-2:] if len(out) >= 2 else tail[-1:] + out
            self.pool.record_success(backend)
            if stream is not None and (rest := stream.leftover()):
                await response.write(rest)
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            # The client went away between two chunks (a write failed rather
            # than the handler being cancelled); the engine is fine.
            raise ClientGone(response) from None
        finally:
            attempt.streaming = False
        return response

    def _breakage(self, backend: Backend, reason: str, exc: BaseException | None = None) -> tuple[int, str]:
        """Log how an engine's stream broke (`unresponsive`, `stalled` or `failed` with EXC); the status and
        message of the error event that ends the client's stream if it cannot go on."""
        if reason == "unresponsive":
            log.warning("engine %s stopped answering health checks mid-stream", backend.url)
            return 504, "the engine serving this request stopped responding mid-stream; the answer is incomplete"
        if reason == "stalled":
            log.warning("engine %s sent nothing for %gs mid-stream", backend.url, self.config.stream_idle_timeout)
            return 504, (f"the engine serving this request sent nothing for {self.config.stream_idle_timeout:g}s "
                         "mid-stream; the answer is incomplete")
        log.warning("engine %s failed mid-stream: %r", backend.url, exc)
        name = exc.__class__.__name__ if exc is not None else "error"
        return 502, f"the engine serving this request failed mid-stream ({name}); the answer is incomplete"

    async def _end_interrupted(self, response: web.StreamResponse, tail: bytes, backend: Backend, reason: str) -> None:
        if reason == "shutdown":
            await stream_error(response, tail, 503, "the router is shutting down; the answer is incomplete, "
                                                    "retry the request", type_="ServiceUnavailableError")
            return
        self.metrics.stream_error(backend)
        status, message = self._breakage(backend, reason)
        await stream_error(response, tail, status, message)
