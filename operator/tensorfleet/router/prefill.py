"""The prefill half of a disaggregated request, the first of the router's two phases: the client's request, with
`max_tokens` 1 and `do_remote_decode`, to a prefill engine chosen by prefix affinity within the load bound, whose
`kv_transfer_params` then go with it to a decode engine. It never makes a request fail or wait: whatever goes wrong,
the decode engine computes the prompt itself (each outcome counted). Design:
docs/routing.md#prefilldecode-disaggregation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from tensorfleet.prompts import opening_chars, prompt_text
from tensorfleet.router.backends import Backend, BackendPool, BreakerPolicy
from tensorfleet.router.dispatch import Dispatcher
from tensorfleet.router.scheduling import CacheAware, RequestInfo, hash_prompt

log = logging.getLogger("tensorfleet.router")

# What the prefill half asks of its engine (vLLM's proxy sends these nulls too).
PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
KV_TRANSFER_PARAMS = "kv_transfer_params"
REMOTE = "remote"
OUTCOMES = (REMOTE, "saturated", "unavailable", "failed", "no-params", "unsupported")


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The prefill half of BODY (a chat or completion request), or None when it cannot be split: several choices
    (each would need its own prefill), an echoed prompt, prompt logprobs (a decode engine that skips the prompt
    has none to give), or params of the client's own."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return None
    if body.get("echo") or body.get("prompt_logprobs") is not None or body.get(KV_TRANSFER_PARAMS) is not None:
        return None
    half = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    half["max_tokens"] = 1
    if "max_completion_tokens" in half:
        half["max_completion_tokens"] = 1
    half["stream"] = False
    half[KV_TRANSFER_PARAMS] = PREFILL_PARAMS
    return half


class PrefillStage:
    """The prefill engines (their own pool, breaker and per-engine ceiling) and the first phase on them."""

    def __init__(self, *, ceiling: int, policy: BreakerPolicy | None = None, static: tuple[str, ...] = ()) -> None:
        self.pool = BackendPool(policy, check_first=True)
        self.strategy = CacheAware()
        # Never queued: a request that finds no prefill slot free goes to a decode engine whole instead.
        self.dispatcher = Dispatcher(self.pool, self.strategy, ceiling=ceiling)
        self.static = list(static)
        self.discovered: list[str] = []
        self.pool.set_urls(self.static)

    def set_discovered(self, urls: list[str]) -> bool:
        """The prefill Service's ready endpoints changed; whether an engine joined (it wants a health check)."""
        self.discovered = urls
        return self.pool.set_urls([*self.static, *urls])

    def info(self, body: Mapping[str, Any]) -> RequestInfo:
        """What the cache-aware choice of a prefill engine needs of BODY: its prompt's block hashes."""
        info = RequestInfo()
        info.prefix_hashes, info.opening, info.opening_blocks = hash_prompt(
            prompt_text(body), opening_chars(body), self.strategy.block_chars)
        return info

    async def run(self, session: aiohttp.ClientSession, path: str, body: Mapping[str, Any], info: RequestInfo,
                  headers: Mapping[str, str], timeout: float | None) -> tuple[str, dict[str, Any] | None]:
        """The first phase: (outcome, the kv_transfer_params for the decode half, or None to send it whole)."""
        half = prefill_body(body)
        if half is None:
            return "unsupported", None
        if not any(b.healthy for b in self.pool):
            return "unavailable", None
        backend = self.dispatcher.try_acquire(info)
        if backend is None:
            return "saturated", None
        try:
            return await self._exchange(session, backend, path, half, headers, timeout)
        finally:
            self.dispatcher.release(backend, info)

    async def _exchange(self, session: aiohttp.ClientSession, backend: Backend, path: str, half: dict[str, Any],
                        headers: Mapping[str, str], timeout: float | None) -> tuple[str, dict[str, Any] | None]:
        data = json.dumps(half, separators=(",", ":")).encode()
        try:
            async with asyncio.timeout(timeout):
                async with session.post(backend.url + path, data=data, headers=headers) as resp:
                    status = resp.status
                    payload = await resp.read()
        except (aiohttp.ClientConnectorError, ConnectionError) as exc:
            self.pool.record_failure(backend, fatal=True)
            log.info("prefill engine %s: %s; the decode engine computes the prompt", backend.url,
                     exc.__class__.__name__)
            return "failed", None
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.pool.record_failure(backend)
            log.info("prefill engine %s: %s; the decode engine computes the prompt", backend.url,
                     exc.__class__.__name__ or "timeout")
            return "failed", None
        if status >= 500:
            self.pool.record_failure(backend)
            return "failed", None
        if status >= 400:
            # The request's own doing: the decode engine will answer it the same way, to the client.
            self.pool.record_neutral(backend)
            return "failed", None
        self.pool.record_success(backend)
        try:
            params = json.loads(payload).get(KV_TRANSFER_PARAMS)
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return "no-params", None
        return REMOTE, params
