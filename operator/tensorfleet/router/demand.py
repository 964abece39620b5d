"""Demand, told to the operator through the Lease `NAME-demand` of a fleet that scales to zero: a router renews it as
requests arrive, at most every REFRESH_SECONDS, and within URGENT_SECONDS when a request finds no engine, in the
background, so no request waits for the write. Design: docs/autoscaling.md#scale-to-zero-and-back.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
from collections.abc import Callable

from tensorfleet import contract
from tensorfleet.kube.client import ApiError, Kube
from tensorfleet.kube.connection import Connection
from tensorfleet.kube.resources import LEASE

log = logging.getLogger("tensorfleet.router.demand")

REFRESH_SECONDS = 10.0  # a busy router renews this often at most: the idle period is minutes
URGENT_SECONDS = 1.0    # a request that finds no engine renews within this, to wake the fleet
FAILURE_LOG_SECONDS = 60.0


def micro_time(now: float) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC) for the epoch seconds NOW."""
    stamp = datetime.datetime.fromtimestamp(now, datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class DemandLease:
    """Renews one Lease on demand; `touch()` is called for every arriving request and never blocks."""

    def __init__(self, name: str, namespace: str, connection: Connection, *, identity: str | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.name = name
        self.namespace = namespace
        self.connection = connection
        self.identity = identity or os.environ.get("HOSTNAME") or "tensorfleet-router"
        self.clock = clock
        self.wall = wall
        self.writes = 0
        self.failures = 0
        self._last: float | None = None  # when the last write started (clock)
        self._task: asyncio.Task[None] | None = None
        self._kube: Kube | None = None
        self._logged_failure = -FAILURE_LOG_SECONDS

    def touch(self, *, urgent: bool = False) -> None:
        """Requests arrived (URGENT: one found no engine): renew the Lease unless it was renewed just now."""
        if self._task is not None and not self._task.done():
            return
        now = self.clock()
        if self._last is not None and now - self._last < (URGENT_SECONDS if urgent else REFRESH_SECONDS):
            return
        self._last = now
        self._task = asyncio.get_running_loop().create_task(self._write(), name="router-demand-lease")

    async def _write(self) -> None:
        """One server-side apply of `spec.renewTime` and `spec.holderIdentity` (the pod's name) under the router's own
        field manager: the operator owns the Lease's metadata, the routers its renewal, and neither overwrites the
        other. Failures are logged (at most once a FAILURE_LOG_SECONDS), never raised, and retried at the next
        request."""
        if self._kube is None:
            self._kube = Kube(self.connection, component=contract.ROUTER_COMPONENT,
                              field_manager=contract.ROUTER_COMPONENT)
            await self._kube.__aenter__()
        lease = {
            "apiVersion": LEASE.api_version,
            "kind": LEASE.kind,
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {"holderIdentity": self.identity, "renewTime": micro_time(self.wall())},
        }
        try:
            await self._kube.apply(lease, force=True)
            self.writes += 1
        except ApiError as exc:
            self.failures += 1
            self._last = None  # try again at the next request
            now = self.clock()
            if now - self._logged_failure >= FAILURE_LOG_SECONDS:
                self._logged_failure = now
                log.warning("could not renew the demand Lease %s/%s (the operator wakes the fleet from it): %s",
                            self.namespace, self.name, exc)

    async def close(self) -> None:
        """Wait for a write in progress, then close the client."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._kube is not None:
            await self._kube.close()
