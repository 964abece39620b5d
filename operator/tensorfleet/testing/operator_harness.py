"""Running the real operator against the emulator, and waiting on what it does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from kmock import Server

from tensorfleet import contract
from tensorfleet.controller.operator import Operator, OperatorConfig
from tensorfleet.kube.connection import Connection
from tensorfleet.testing.fake_workloads import FakeWorkloads
from tensorfleet.testing.kube_emulator import ClusterEmulator

ISVC_API = contract.API_VERSION
ISVC_PATH = f"/apis/{contract.API_VERSION}"


class Cluster:
    """The emulated API server, running on its own thread and event loop.

    kopf, at shutdown, cancels and waits for every task on its loop that it
    did not start; an API server living on the same loop would be caught in
    that (in a cluster it is another process). So the emulator, and the
    stand-in controllers that write to it, get a loop of their own, and tests
    reach them through `call` (sync) and `acall` (async).
    """

    def __init__(self, emulator: ClusterEmulator, url: str, loop: asyncio.AbstractEventLoop) -> None:
        self.emulator = emulator
        self.url = url
        self.loop = loop

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a plain function on the emulator's loop and return its result."""
        async def run() -> Any:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    async def acall(self, coroutine: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    # What a user (kubectl) does.
    async def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.url + path, data=None if body is None else json.dumps(body),
                            headers={"Content-Type": content_type}) as response,
        ):
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

    # What other controllers (or a person with kubectl edit) do, bypassing faults.
    async def upsert(self, api_version: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.acall(self.emulator.upsert(api_version, plural, obj))

    async def remove(self, api_version: str, plural: str, namespace: str | None, name: str) -> None:
        await self.acall(self.emulator.remove(api_version, plural, namespace, name))

    @contextlib.asynccontextmanager
    async def workloads(self, ready: Callable[[dict[str, Any]], bool] | None = None) -> AsyncIterator[FakeWorkloads]:
        """The StatefulSet/Deployment controllers and kubelet stand-ins, on the emulator's loop."""
        workloads = FakeWorkloads(self.emulator, ready)
        await self.acall(workloads.__aenter__())
        try:
            yield workloads
        finally:
            await self.acall(workloads.__aexit__(None, None, None))

    # What tests look at.
    def all(self, api_version: str, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.call(self.emulator.all, api_version, plural, namespace)

    def requests(self) -> list[Any]:
        return self.call(lambda: list(self.emulator))

    def isvc(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self.call(self.emulator.find, ISVC_API, contract.PLURAL, namespace, name)

    def get(self, api_version: str, plural: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self.call(self.emulator.find, api_version, plural, namespace, name)

    def condition(self, name: str, type_: str, namespace: str = "default") -> dict[str, Any] | None:
        status = (self.isvc(name, namespace) or {}).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)

    def events(self, name: str, namespace: str = "default") -> list[dict[str, Any]]:
        return [e for e in self.all("v1", "events", namespace) if e["involvedObject"]["name"] == name]

    def children(self, name: str, namespace: str = "default") -> dict[tuple[str, str], dict[str, Any]]:
        """Every object labelled as part of `name` (pods excluded), keyed by (kind, name)."""
        from tensorfleet.kube.resources import CHILD_KINDS

        out = {}
        for kind in CHILD_KINDS:
            for obj in self.all(kind.api_version, kind.plural, namespace):
                if (obj["metadata"].get("labels") or {}).get(contract.LABEL_INSTANCE) == name:
                    out[(kind.kind, obj["metadata"]["name"])] = obj
        return out


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[Cluster]:
    started = threading.Event()
    holder: dict[str, Any] = {}

    def serve() -> None:
        async def main() -> None:
            async with ClusterEmulator() as emulator, Server(emulator) as server:
                holder.update(emulator=emulator, url=str(server.url).rstrip("/"), loop=asyncio.get_running_loop(),
                              stop=asyncio.Event())
                started.set()
                await holder["stop"].wait()
        asyncio.run(main())

    thread = threading.Thread(target=serve, name="api-server", daemon=True)
    thread.start()
    await asyncio.to_thread(started.wait, 30)
    try:
        yield Cluster(holder["emulator"], holder["url"], holder["loop"])
    finally:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        await asyncio.to_thread(thread.join, 30)


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
