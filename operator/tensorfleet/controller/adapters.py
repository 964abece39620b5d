"""LoRA adapters in running engines: each reconcile of an InferenceService with LoRA asks every ready leader pod for
its `/v1/models`, loads the adapters of spec.adapters it lacks and unloads those no longer listed (vLLM's runtime
LoRA endpoints), so adapters come and go without restarting an engine; what the engines answered becomes
status.adapters (`adapter_status`, pure). Design: docs/lora.md#who-loads-them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tensorfleet import contract
from tensorfleet.api.errors import one_line
from tensorfleet.api.models import AdapterSpec

LIST_TIMEOUT_SECONDS = 5.0
# vLLM answers a load once the adapter is read (from the cache volume, or downloaded from the Hub): a large one
# takes a while. An answer that does not come in time is asked again at the next reconcile, when the engine
# says the adapter is loaded, or loads it then.
LOAD_TIMEOUT_SECONDS = 30.0
RETRY_SECONDS = 15.0      # some ready engine lacks an adapter: come back this soon
MAX_MESSAGE = 300


class EngineError(Exception):
    """An engine's answer that is not what vLLM's API gives."""


@dataclass(frozen=True)
class Engine:
    """One ready group's OpenAI server: its leader pod."""

    pod: str
    url: str


@dataclass
class EngineResult:
    """What one engine serves after a sync, and the adapters it refused (name -> its message)."""

    served: set[str] | None = None          # None: the engine did not answer /v1/models
    failures: dict[str, str] = field(default_factory=dict)
    error: str | None = None                # why /v1/models failed


def ready_engines(pods: Iterable[dict[str, Any]], ready: Any) -> list[Engine]:
    """The ready leader pods (stage 0) with an address, as engines to load adapters into."""
    out: list[Engine] = []
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        address = (pod.get("status") or {}).get("podIP")
        if labels.get(contract.LABEL_ROLE) != contract.ROLE_LEADER or not address or not ready(pod):
            continue
        host = f"[{address}]" if ":" in address else address
        out.append(Engine(pod["metadata"]["name"], f"http://{host}:{contract.ENGINE_PORT}"))
    return sorted(out, key=lambda engine: engine.pod)


async def _answer(response: aiohttp.ClientResponse) -> tuple[int, str]:
    """The status and the message of an engine's answer (OpenAI error JSON, or text)."""
    text = await response.text()
    try:
        body = json.loads(text)
    except ValueError:
        return response.status, one_line(text.strip(), MAX_MESSAGE)
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else (body.get("message") if isinstance(body, dict) else None)
    return response.status, one_line(str(message if message is not None else text).strip(), MAX_MESSAGE)


class EngineClient:
    """vLLM's model-listing and runtime LoRA endpoints, over one HTTP session."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def adapters(self, engine: Engine) -> set[str]:
        """The adapters ENGINE serves: its /v1/models entries that have a parent (the base model)."""
        timeout = aiohttp.ClientTimeout(total=LIST_TIMEOUT_SECONDS)
        async with self.session.get(f"{engine.url}/v1/models", timeout=timeout) as response:
            if response.status != 200:
                status, message = await _answer(response)
                raise EngineError(f"/v1/models answered {status}: {message}")
            body = await response.json(content_type=None)
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise EngineError("/v1/models answered without a `data` list")
        return {str(entry["id"]) for entry in data
                if isinstance(entry, dict) and entry.get("parent") and isinstance(entry.get("id"), str)}

    async def load(self, engine: Engine, adapter: AdapterSpec) -> str | None:
        """Load ADAPTER into ENGINE; None when it serves it now, else the engine's reason."""
        timeout = aiohttp.ClientTimeout(total=LOAD_TIMEOUT_SECONDS)
        body = {"lora_name": adapter.name, "lora_path": adapter.source}
        async with self.session.post(f"{engine.url}{contract.LORA_LOAD_PATH}", json=body, timeout=timeout) as response:
            if response.status == 200:
                return None
            status, message = await _answer(response)
        if status == 400 and "already" in message.lower():
            return None  # another reconcile (or a load that timed out) got there first
        return f"{status}: {message}"

    async def unload(self, engine: Engine, name: str) -> str | None:
        """Unload NAME from ENGINE; None when it no longer serves it."""
        timeout = aiohttp.ClientTimeout(total=LOAD_TIMEOUT_SECONDS)
        body = {"lora_name": name}
        async with self.session.post(f"{engine.url}{contract.LORA_UNLOAD_PATH}", json=body, timeout=timeout) as response:
            if response.status == 200:
                return None
            status, message = await _answer(response)
        return None if status == 404 else f"{status}: {message}"


def _failure(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "no answer in time; asking again"
    return one_line(str(exc) or type(exc).__name__, MAX_MESSAGE)


async def sync_engine(client: EngineClient, engine: Engine, wanted: Sequence[AdapterSpec]) -> EngineResult:
    """Bring one engine's adapters in line with WANTED: load the missing, unload the ones not listed."""
    result = EngineResult()
    try:
        served = await client.adapters(engine)
    except (aiohttp.ClientError, EngineError, ValueError, TimeoutError) as exc:
        result.error = _failure(exc)
        return result
    names = {adapter.name for adapter in wanted}
    for name in sorted(served - names):
        try:
            problem = await client.unload(engine, name)
        except (aiohttp.ClientError, TimeoutError) as exc:
            problem = _failure(exc)
        if problem is None:
            served.discard(name)
    for adapter in wanted:
        if adapter.name in served:
            continue
        try:
            problem = await client.load(engine, adapter)
        except (aiohttp.ClientError, TimeoutError) as exc:
            problem = _failure(exc)
        if problem is None:
            served.add(adapter.name)
        else:
            result.failures[adapter.name] = problem
    result.served = served
    return result


async def sync(engines: Sequence[Engine], wanted: Sequence[AdapterSpec],
               client: EngineClient | None = None) -> dict[str, EngineResult]:
    """Sync every engine at once; pod name -> what it serves and refused."""
    if not engines:
        return {}
    if client is None:
        async with aiohttp.ClientSession() as session:
            return await sync(engines, wanted, EngineClient(session))
    results = await asyncio.gather(*(sync_engine(client, engine, wanted) for engine in engines))
    return {engine.pod: result for engine, result in zip(engines, results, strict=True)}


# How the reconciler reaches the engines: `sync`, or a test's stand-in.
Sync = Callable[[Sequence[Engine], Sequence[AdapterSpec]], Awaitable[dict[str, EngineResult]]]


@dataclass(frozen=True)
class Outcome:
    """status.adapters, the events to post, and when to come back (None: not for adapters' sake)."""

    status: list[dict[str, Any]]
    warnings: list[tuple[str, str]]
    requeue: float | None


def adapter_status(wanted: Sequence[AdapterSpec], results: dict[str, EngineResult]) -> Outcome:
    """Each adapter's state over the ready engines: Loaded on all, Loading on some, Failed, or Pending."""
    answered = {pod: r for pod, r in results.items() if r.served is not None}
    warnings: list[tuple[str, str]] = []
    for pod, result in sorted(results.items()):
        if result.error is not None:
            warnings.append(("AdapterSyncFailed", f"engine pod {pod} did not list its adapters: {result.error}"))
    status: list[dict[str, Any]] = []
    settled = True
    for adapter in wanted:
        serving = sum(1 for r in answered.values() if r.served is not None and adapter.name in r.served)
        refused = {pod: r.failures[adapter.name] for pod, r in sorted(answered.items()) if adapter.name in r.failures}
        entry: dict[str, Any] = {"name": adapter.name, "engines": serving, "readyEngines": len(results)}
        if refused:
            pod, message = next(iter(refused.items()))
            entry["state"] = "Failed"
            entry["message"] = f"engine pod {pod}: {message}"
            for pod, message in refused.items():
                warnings.append(("AdapterLoadFailed", f"adapter {adapter.name} ({adapter.source}) on engine pod {pod}: {message}"))
        elif not results:
            entry["state"] = "Pending"
        elif serving == len(results):
            entry["state"] = "Loaded"
        else:
            entry["state"] = "Loading"
        settled = settled and entry["state"] in ("Loaded", "Pending")
        status.append(entry)
    if any(r.error is not None for r in results.values()):
        settled = False
    return Outcome(status=status, warnings=warnings, requeue=None if settled else RETRY_SECONDS)
