"""Running the real operator against the emulator, and waiting on what it does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from kmock import Server

from kube_emulator import ClusterEmulator
from tensorfleet import contract
from tensorfleet.controller.kube import Connection
from tensorfleet.controller.operator import Operator, OperatorConfig

ISVC_API = contract.API_VERSION
ISVC_PATH = f"/apis/{contract.API_VERSION}"


class Cluster:
    def __init__(self, emulator: ClusterEmulator, url: str) -> None:
        self.emulator = emulator
        self.url = url

    # What a user (kubectl) does.
    async def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        async with aiohttp.ClientSession() as session:
            async with session.request(method, self.url + path, data=None if body is None else json.dumps(body),
                                       headers={"Content-Type": content_type}) as response:
                payload = await response.json()
                if response.status >= 400:
                    raise AssertionError(f"{method} {path}: {response.status} {payload}")
                return payload

    async def create(self, doc: dict[str, Any]) -> dict[str, Any]:
        namespace = doc["metadata"].setdefault("namespace", "default")
        return await self.request("POST", f"{ISVC_PATH}/namespaces/{namespace}/{contract.PLURAL}", doc)

    async def patch(self, name: str, patch: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
        return await self.request("PATCH", f"{ISVC_PATH}/namespaces/{namespace}/{contract.PLURAL}/{name}", patch,
                                  "application/merge-patch+json")

    async def scale(self, name: str, replicas: int, namespace: str = "default") -> dict[str, Any]:
        return await self.request("PATCH", f"{ISVC_PATH}/namespaces/{namespace}/{contract.PLURAL}/{name}/scale",
                                  {"spec": {"replicas": replicas}}, "application/merge-patch+json")

    async def delete(self, name: str, namespace: str = "default") -> None:
        await self.request("DELETE", f"{ISVC_PATH}/namespaces/{namespace}/{contract.PLURAL}/{name}")

    # What tests look at.
    def isvc(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self.emulator.find(ISVC_API, contract.PLURAL, namespace, name)

    def get(self, api_version: str, plural: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self.emulator.find(api_version, plural, namespace, name)

    def condition(self, name: str, type_: str, namespace: str = "default") -> dict[str, Any] | None:
        status = (self.isvc(name, namespace) or {}).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)

    def events(self, name: str, namespace: str = "default") -> list[dict[str, Any]]:
        return [e for e in self.emulator.all("v1", "events", namespace) if e["involvedObject"]["name"] == name]

    def children(self, name: str, namespace: str = "default") -> dict[tuple[str, str], dict[str, Any]]:
        """Every object labelled as part of `name` (pods excluded), keyed by (kind, name)."""
        from tensorfleet.controller.resources import CHILD_KINDS

        out = {}
        for kind in CHILD_KINDS:
            for obj in self.emulator.all(kind.api_version, kind.plural, namespace):
                if (obj["metadata"].get("labels") or {}).get(contract.LABEL_INSTANCE) == name:
                    out[(kind.kind, obj["metadata"]["name"])] = obj
        return out


async def eventually(check: Callable[[], Any], timeout: float = 20.0, message: str = "") -> Any:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message or check}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[Cluster]:
    async with ClusterEmulator() as emulator, Server(emulator) as server:
        yield Cluster(emulator, str(server.url).rstrip("/"))


@contextlib.asynccontextmanager
async def running_operator(target: Cluster, **overrides: Any) -> AsyncIterator[Operator]:
    config = OperatorConfig(**{"leader_election": False, "health_port": None, "workers": 2,
                               "child_debounce_seconds": 0.05, "api_timeout_seconds": 5.0, **overrides})
    operator = Operator(config, Connection(server=target.url))
    task = asyncio.create_task(operator.run())
    stop = asyncio.create_task(operator.stop_flag.wait())
    await asyncio.wait({task, asyncio.create_task(operator.ready_flag.wait()), stop},
                       return_when=asyncio.FIRST_COMPLETED, timeout=30)
    if task.done():
        task.result()
    try:
        yield operator
    finally:
        operator.stop()
        await asyncio.wait_for(task, 40)
        stop.cancel()
