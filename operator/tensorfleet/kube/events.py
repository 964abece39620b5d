"""Kubernetes Events for the decisions a user wants to see in `kubectl describe`: the same reason and message for the
same object at most once per window, and a failure to post is logged, never fatal.
Design: docs/architecture.md#the-kubernetes-layer.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import time
from typing import Any

from tensorfleet import contract
from tensorfleet.kube.client import ApiError, Kube
from tensorfleet.kube.resources import EVENT

log = logging.getLogger(__name__)
COMPONENT = contract.OPERATOR_COMPONENT
REPEAT_WINDOW_SECONDS = 600.0
MAX_MESSAGE = 1024


class EventRecorder:
    """Posts Events about InferenceServices, each distinct one at most once per REPEAT_WINDOW_SECONDS."""

    def __init__(self, kube: Kube, instance: str = "") -> None:
        self.kube = kube
        self.instance = instance
        self._posted: dict[tuple[str, str, str], float] = {}

    async def normal(self, obj: dict[str, Any], reason: str, message: str) -> None:
        """Post a Normal event about `obj`."""
        await self.post(obj, "Normal", reason, message)

    async def warning(self, obj: dict[str, Any], reason: str, message: str) -> None:
        """Post a Warning event about `obj` (something a person should look at)."""
        await self.post(obj, "Warning", reason, message)

    async def post(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Post one event unless the same one was posted within the window; failures are logged only."""
        meta = obj.get("metadata", {})
        key = (meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}", reason, message)
        now = time.monotonic()
        if now - self._posted.get(key, -REPEAT_WINDOW_SECONDS) < REPEAT_WINDOW_SECONDS:
            return
        self._posted[key] = now
        self._forget_old(now)
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        digest = hashlib.sha1(f"{key}{time.time_ns()}".encode()).hexdigest()[:10]
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta.get('name')}.{digest}", "namespace": meta.get("namespace")},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion", contract.API_VERSION),
                "kind": obj.get("kind", contract.KIND),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                **({"uid": meta["uid"]} if meta.get("uid") else {}),
            },
            "type": type_,
            "reason": reason,
            "message": message[:MAX_MESSAGE],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance or COMPONENT,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            await self.kube.create(EVENT, meta.get("namespace"), event)
        except ApiError as exc:
            log.warning("could not post event %s for %s/%s: %s", reason, meta.get("namespace"), meta.get("name"), exc)

    def _forget_old(self, now: float) -> None:
        if len(self._posted) > 10_000:
            self._posted = {k: t for k, t in self._posted.items() if now - t < REPEAT_WINDOW_SECONDS}
