"""A work queue of InferenceService keys, the shape controller-runtime uses: a burst of events for one key is one
reconcile, no key runs on two workers at once (an event mid-reconcile runs it once more afterwards), and a failing
key is retried with capped exponential backoff without blocking the others.
Design: docs/architecture.md#the-reconcile-loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from tensorfleet.controller import metrics

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
# Reconciles one key; returns seconds until it should run again, or None.
Handler = Callable[[K], Awaitable[float | None]]


class WorkQueue(Generic[K]):
    def __init__(self, handler: Handler[K], *, workers: int = 4, base_backoff: float = 0.5, max_backoff: float = 300.0,
                 gate: asyncio.Event | None = None) -> None:
        self._handler = handler
        self._gate = gate  # workers take no key until it is set (keys added before wait)
        self._workers = workers
        self._base = base_backoff
        self._max = max_backoff
        self._heap: list[tuple[float, int, K]] = []
        self._due: dict[K, float] = {}
        self._active: set[K] = set()
        self._again: dict[K, float] = {}
        self._failures: dict[K, int] = {}
        self._seq = itertools.count()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def add(self, key: K, delay: float = 0.0) -> None:
        """Reconcile `key` after `delay` seconds (sooner if it is already due sooner)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + max(delay, 0.0)
        if key in self._active:
            self._again[key] = min(due, self._again.get(key, due))
            return
        if key in self._due and self._due[key] <= due:
            return
        self._due[key] = due
        heapq.heappush(self._heap, (due, next(self._seq), key))
        self._idle.clear()
        metrics.QUEUE_DEPTH.set(len(self._due))
        self._wakeup.set()

    def __len__(self) -> int:
        return len(self._due) + len(self._active)

    async def wait_idle(self) -> None:
        """Until nothing is queued or running (tests and benchmarks)."""
        await self._idle.wait()

    async def run(self) -> None:
        """Run the workers until cancelled (after the gate opens, when there is one)."""
        if self._gate is not None:
            await self._gate.wait()
        await asyncio.gather(*(self._worker() for _ in range(self._workers)))

    async def _next(self) -> K:
        loop = asyncio.get_running_loop()
        while True:
            while self._heap:
                due, _, key = self._heap[0]
                if self._due.get(key) != due:  # superseded by an earlier add
                    heapq.heappop(self._heap)
                    continue
                wait = due - loop.time()
                if wait <= 0:
                    heapq.heappop(self._heap)
                    del self._due[key]
                    metrics.QUEUE_DEPTH.set(len(self._due))
                    return key
                break
            self._wakeup.clear()
            timeout = (self._heap[0][0] - loop.time()) if self._heap else None
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                pass

    async def _worker(self) -> None:
        while True:
            key = await self._next()
            self._active.add(key)
            requeue: float | None = None
            try:
                requeue = await self._handler(key)
                self._failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any reconcile failure is retried with backoff, never fatal
                failures = self._failures.get(key, 0) + 1
                self._failures[key] = failures
                requeue = min(self._max, self._base * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)
                log.warning("reconcile of %s failed (attempt %d), retrying in %.1fs: %s", key, failures, requeue, exc)
            finally:
                self._active.discard(key)
            again = self._again.pop(key, None)
            if again is not None:
                self.add(key, max(again - asyncio.get_running_loop().time(), 0.0))
            if requeue is not None:
                self.add(key, requeue)
            if not self._due and not self._active:
                self._idle.set()
