"""What the engines serve, from their /v1/models: the union GET /v1/models answers, and the LoRA adapters, learnt when a
request names a model the router does not know and refreshed while any are known; which engines list an adapter
steers its requests there. Owned by router/fleet.py. Design: docs/routing.md#lora-adapters.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from typing import Any

from aiohttp import ClientTimeout, web

from tensorfleet.router.backends import Backend, BackendPool
from tensorfleet.router.config import RouterConfig
from tensorfleet.router.inflight import InFlight

ADAPTERS_ASK_AGAIN_SECONDS = 1.0   # an unknown model name asks the engines for their adapters at most this often
ADAPTERS_REFRESH_SECONDS = 10.0    # once some are known, they are asked this often, so one unloaded is forgotten
REQUEST_ADAPTER = web.RequestKey("adapter", str)  # the request's LoRA adapter, for its metrics


def adapter_key(name: str) -> int:
    """An adapter's name as the cache-aware strategy hashes it: the same in every router replica."""
    return zlib.crc32(name.encode()) | (1 << 32)  # never equal to a conversation's opening hash (32 bits)


class Adapters:
    """The adapters the healthy engines list, which engine lists which, and the rounds of asking them; and the
    engines' whole lists, for GET /v1/models."""

    def __init__(self, config: RouterConfig, pool: BackendPool, in_flight: InFlight) -> None:
        self.config = config
        self.pool = pool
        self.in_flight = in_flight
        # LoRA adapters the engines serve (their /v1/models entries with a parent), and when that was last asked.
        self.names: frozenset[str] = frozenset()
        self._hosts: dict[str, frozenset[str]] = {}  # engine URL -> the adapters it listed
        self._asked = -math.inf
        self._asked_from: frozenset[str] = frozenset()  # the engines that answered then
        self.refreshing: asyncio.Task[None] | None = None  # a round of asking them, in flight
        self._round_started = -math.inf   # when the round in flight (or the last one) began
        self._round_answered = -math.inf  # when the last round to end began

    def hosts(self, name: str) -> frozenset[str]:
        """The engines (URLs) that listed adapter NAME."""
        return frozenset(url for url, names in self._hosts.items() if name in names)

    def listed_by(self, url: str) -> bool:
        """Whether the router holds the list of the engine at URL."""
        return url in self._hosts

    def known(self) -> bool:
        """Whether the router holds the model list of an engine that is healthy now: a name no such list has is
        no adapter of the fleet's (404). Without one (a cold start, every engine ejected, the router just
        started) a name may be an adapter the router has not heard of yet."""
        return any(b.healthy and b.url in self._hosts for b in self.pool)

    def due(self) -> bool:
        """Whether the health loop should ask again: on schedule, or an engine joined or left (an adapter may be
        gone). Never while none is known: an unknown name asks for itself."""
        return bool(self.names) and (self.in_flight.now() - self._asked >= ADAPTERS_REFRESH_SECONDS
                                     or self._asked_from != frozenset(b.url for b in self.pool if b.healthy))

    async def models(self) -> dict[str, dict[str, Any]]:
        """The union of the engines' model lists (the healthy ones', else all), each model once."""
        session = self.in_flight.session
        backends = [b for b in self.pool if b.healthy] or list(self.pool)

        async def one(backend: Backend) -> list[dict[str, Any]]:
            """One engine's models ([] unless it answers 200)."""
            timeout = ClientTimeout(total=self.config.health_timeout)
            async with session.get(backend.url + "/v1/models", timeout=timeout) as resp:
                if resp.status != 200:
                    return []
                body = await resp.json(content_type=None)
                return [m for m in body.get("data", []) if isinstance(m, dict) and "id" in m]

        results = await asyncio.gather(*(one(b) for b in backends), return_exceptions=True)
        models: dict[str, dict[str, Any]] = {}
        for result in results:
            if isinstance(result, list):
                for model in result:
                    models.setdefault(model["id"], model)
        return models

    async def lookup(self, model: Any, arrived: float) -> str | None:
        """MODEL when it names a LoRA adapter the engines serve. A name not known yet waits for the engines' lists
        as asked after the request ARRIVED (rounds start at most once a second, shared by every request waiting),
        so an adapter loaded a moment ago is found, never refused."""
        if not isinstance(model, str) or model == self.config.model:
            return None
        if model not in self.names:
            if self.known():
                await self.refresh(since=arrived)
            elif self.in_flight.now() - self._round_started >= ADAPTERS_ASK_AGAIN_SECONDS:
                # No healthy engine's list to refuse it by: the request waits for an engine (unresolved), and
                # asks once more now in case one has just come up.
                await self.refresh()
        return model if model in self.names else None

    async def refresh(self, since: float | None = None) -> None:
        """Learn the adapters the healthy engines list in /v1/models (entries with a parent); callers at the same
        time share one round of asking. SINCE: return once a round begun at or after it has ended (a new one
        begins at most every ADAPTERS_ASK_AGAIN_SECONDS); None: once the round in flight, or a new one, ends."""
        now = self.in_flight.now
        while since is None or self._round_answered < since:
            task = self.refreshing
            if task is None or task.done():
                wait = self._round_started + ADAPTERS_ASK_AGAIN_SECONDS - now()
                if since is not None and wait > 0:
                    await asyncio.sleep(wait)
                    continue  # another waiter may have begun the round meanwhile
                self._round_started = now()
                task = self.refreshing = asyncio.create_task(self._ask(self._round_started), name="router-adapters")
            await asyncio.shield(task)
            if since is None:
                return

    async def _ask(self, started: float) -> None:
        try:
            await self._ask_engines()
        finally:
            self._round_answered = max(self._round_answered, started)

    async def _ask_engines(self) -> None:
        session = self.in_flight.session
        timeout = ClientTimeout(total=self.config.health_timeout)
        healthy = [b for b in self.pool if b.healthy]

        async def listed(backend: Backend) -> set[str]:
            async with session.get(backend.url + "/v1/models", timeout=timeout) as resp:
                data = (await resp.json(content_type=None)).get("data", []) if resp.status == 200 else []
            return {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent")}

        results = await asyncio.gather(*(listed(b) for b in healthy), return_exceptions=True)
        answers = [r for r in results if isinstance(r, set)]
        if answers:  # else ask again at the next chance: no engine could say
            self.names = frozenset().union(*answers)
            self._hosts = {b.url: frozenset(r) for b, r in zip(healthy, results, strict=True) if isinstance(r, set)}
            self._asked = self.in_flight.now()
            self._asked_from = frozenset(b.url for b in healthy)
