"""List, then watch, one kind of object for as long as a process runs: the loop the router's engine discovery and the
gateway's model table share. A watch that ends resumes from the last resourceVersion seen, a 410 Gone (history
compacted) relists, and any other failure backs off exponentially and relists; API trouble never raises out of it.
Design: docs/architecture.md#the-kubernetes-layer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tensorfleet.kube.client import Gone, Kube, Observer
from tensorfleet.kube.connection import Connection
from tensorfleet.kube.resources import Kind

log = logging.getLogger("tensorfleet.kube.follow")

WATCH_TIMEOUT_SECONDS = 290  # the API server ends watches after 5-10 min anyway
BACKOFF_START, BACKOFF_MAX = 0.5, 30.0


async def follow(connection: Connection, kind: Kind, namespace: str | None, selector: dict[str, str], *,
                 component: str, on_list: Callable[[Iterable[Mapping[str, Any]]], None],
                 on_event: Callable[[Mapping[str, Any]], None], on_failure: Callable[[], None],
                 what: str, observe: Observer | None = None) -> None:
    """Follow KIND in NAMESPACE (None: all) matching SELECTOR until cancelled: ON_LIST gets each list's items (the
    whole truth, replacing what came before), ON_EVENT each watch event (BOOKMARKs included), ON_FAILURE is called
    when a list or watch failed (before the backoff). WHAT names the objects in the log; OBSERVE counts the API
    calls (kube/client.py)."""
    backoff = BACKOFF_START
    version: str | None = None
    async with Kube(connection, component=component, observe=observe) as kube:
        while True:
            try:
                if version is None:
                    items, version = await kube.list_versioned(kind, namespace, selector)
                    on_list(items)
                async for event in kube.watch(kind, namespace, selector, resource_version=version,
                                              timeout_seconds=WATCH_TIMEOUT_SECONDS):
                    seen = ((event.get("object") or {}).get("metadata") or {}).get("resourceVersion")
                    if seen:
                        version = seen
                    on_event(event)
                backoff = BACKOFF_START
            except asyncio.CancelledError:
                raise
            except Gone:
                version = None
            except Exception as exc:  # noqa: BLE001 - any failure: back off and relist
                log.warning("watching %s failed: %s; retrying in %.1fs", what, exc, backoff)
                version = None
                on_failure()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
