"""Leader election on a coordination.k8s.io Lease, client-go's protocol, so two replicas never both reconcile: every
write carries the resourceVersion it read, and a leader that cannot renew within the lease duration stops rather
than act beside a new one. Design: docs/architecture.md#the-kubernetes-layer.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable
from typing import Any

from tensorfleet.kube.client import ApiError, Kube
from tensorfleet.kube.resources import LEASE

log = logging.getLogger(__name__)


class LostLease(Exception):
    pass


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _format(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    return datetime.datetime.fromisoformat(value)


class LeaderElector:
    """One candidate for one Lease; `on_leading(True/False)` hears when it wins and loses it."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, *,
                 lease_seconds: int = 15, renew_seconds: float = 5.0,
                 on_leading: Callable[[bool], None] | None = None) -> None:
        self.kube = kube
        self.on_leading = on_leading or (lambda _: None)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds

    def _spec(self, lease: dict[str, Any] | None, *, acquire: bool) -> dict[str, Any]:
        spec = dict((lease or {}).get("spec") or {})
        now = _format(_now())
        if acquire:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if lease else 0)
        spec.update({"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_seconds, "renewTime": now})
        return spec

    async def try_acquire(self) -> bool:
        """One attempt: create the Lease, renew our own, or take over an expired one. True when we hold it."""
        lease = await self.kube.get(LEASE, self.namespace, self.name)
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(None, acquire=True)}
            try:
                await self.kube.create(LEASE, self.namespace, body)
                return True
            except ApiError as exc:
                if exc.conflict:
                    return False
                raise
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        renewed = _parse(spec.get("renewTime"))
        duration = int(spec.get("leaseDurationSeconds") or self.lease_seconds)
        expired = renewed is None or _now() > renewed + datetime.timedelta(seconds=duration)
        if holder and holder != self.identity and not expired:
            return False
        return await self._write(lease, acquire=holder != self.identity)

    async def _write(self, lease: dict[str, Any], *, acquire: bool) -> bool:
        """Write our holder record with the resourceVersion read; False when another candidate wrote first."""
        body = {**lease, "spec": self._spec(lease, acquire=acquire)}
        try:
            await self.kube.replace(LEASE, self.namespace, body)
            return True
        except ApiError as exc:
            if exc.conflict:  # someone else wrote first
                return False
            raise

    async def acquire(self) -> None:
        """Wait until this candidate holds the Lease."""
        announced = False
        while True:
            try:
                if await self.try_acquire():
                    log.info("acquired leader lease %s/%s as %s", self.namespace, self.name, self.identity)
                    self.on_leading(True)
                    return
            except ApiError as exc:
                log.warning("leader election: %s", exc)
            if not announced:
                log.info("waiting for leader lease %s/%s (standby)", self.namespace, self.name)
                announced = True
            await asyncio.sleep(self.renew_seconds)

    async def hold(self) -> None:
        """Renew until the Lease is lost; then raise LostLease."""
        last_renewal = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.renew_seconds)
            try:
                lease = await self.kube.get(LEASE, self.namespace, self.name)
                ours = lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.identity
                if lease is not None and ours and await self._write(lease, acquire=False):
                    last_renewal = asyncio.get_running_loop().time()
                    continue
                if not ours:
                    self.on_leading(False)
                    raise LostLease(f"lease {self.namespace}/{self.name} is held by someone else now")
            except ApiError as exc:
                log.warning("could not renew leader lease: %s", exc)
            if asyncio.get_running_loop().time() - last_renewal > self.lease_seconds:
                self.on_leading(False)
                raise LostLease(f"could not renew lease {self.namespace}/{self.name} for {self.lease_seconds}s")

    async def release(self) -> None:
        """Give the Lease up on a clean shutdown so a standby takes over at once."""
        try:
            lease = await self.kube.get(LEASE, self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = {**lease["spec"], "holderIdentity": None, "renewTime": None}
                await self.kube.replace(LEASE, self.namespace, {**lease, "spec": {k: v for k, v in spec.items() if v is not None}})
        except ApiError as exc:
            log.warning("could not release leader lease: %s", exc)
        self.on_leading(False)
