"""The router's queue of requests waiting for an engine slot: each tenant's waiters in arrival order, the tenant
served least recently first, and a full queue made fair by displacing the newest waiter of the tenant with the most.
Design: docs/routing.md#admission-and-the-queue.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from tensorfleet.router.backends import Backend
from tensorfleet.router.scheduling import RequestInfo


class QueueFull(Exception):
    """The router's queue is at its bound: answer 429. `displaced`: the request had queued, and a tenant with
    fewer waiters took its place."""

    def __init__(self, displaced: bool = False) -> None:
        super().__init__("displaced" if displaced else "full")
        self.displaced = displaced


@dataclass(eq=False)
class Waiter:
    info: RequestInfo
    exclude: frozenset[str]   # engines the request already failed on
    future: asyncio.Future[Backend]
    tenant: str | None = None
    timer: asyncio.TimerHandle | None = None
    since: float = 0.0   # loop time it began to wait


class TenantQueues:
    """Waiters by tenant (None: requests without an API key), each tenant's in arrival order; a tenant has an entry
    only while it has waiters."""

    def __init__(self) -> None:
        self._queues: dict[str | None, OrderedDict[Waiter, None]] = {}
        self._served: dict[str | None, int] = {}  # tenant -> the turn it last got a slot
        self._turn = 0

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def by_tenant(self) -> dict[str | None, int]:
        return {tenant: len(queue) for tenant, queue in self._queues.items()}

    def waiters(self) -> list[Waiter]:
        return [waiter for queue in self._queues.values() for waiter in queue]

    def in_turn(self) -> Iterator[list[Waiter]]:
        """Each tenant's waiters (oldest first), the tenant served least recently first."""
        for tenant in sorted(self._queues, key=lambda t: self._served.get(t, 0)):
            yield list(self._queues[tenant])

    def add(self, waiter: Waiter) -> None:
        self._queues.setdefault(waiter.tenant, OrderedDict())[waiter] = None

    def remove(self, waiter: Waiter) -> None:
        queue = self._queues.get(waiter.tenant)
        if queue is None:
            return
        queue.pop(waiter, None)
        if not queue:
            del self._queues[waiter.tenant]

    def granted(self, tenant: str | None) -> None:
        """TENANT got a slot: it goes last in the order of turns."""
        self._turn += 1
        self._served[tenant] = self._turn

    def forget(self, keep: frozenset[str]) -> None:
        """Forget the turns of tenants that are gone (and have nothing queued)."""
        for tenant in [t for t in self._served if t is not None and t not in keep and t not in self._queues]:
            del self._served[tenant]

    def displace(self, tenant: str | None) -> None:
        """The queue is full: make room for TENANT's request by refusing the newest waiter of the tenant with the
        most, if that tenant has at least two more than TENANT; else QueueFull."""
        mine = len(self._queues.get(tenant, ()))
        most = max(self._queues, key=lambda t: len(self._queues[t]), default=None)
        if most is None or most == tenant or len(self._queues[most]) < mine + 2:
            raise QueueFull()
        waiter = next(reversed(self._queues[most]))
        self.remove(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(QueueFull(displaced=True))
