"""The operator's work queue: a gate holds every key until the cache is whole; a burst is one reconcile."""

from __future__ import annotations

import asyncio

import pytest

from tensorfleet.controller.queue import WorkQueue

pytestmark = pytest.mark.asyncio


async def test_keys_added_before_the_gate_opens_wait_and_then_run_once() -> None:
    seen: list[str] = []

    async def handler(key: str) -> None:
        seen.append(key)

    gate = asyncio.Event()
    queue: WorkQueue[str] = WorkQueue(handler, workers=2, gate=gate)
    runner = asyncio.create_task(queue.run())
    try:
        for _ in range(3):
            queue.add("default/demo")
        queue.add("default/other")
        await asyncio.sleep(0.1)
        assert seen == [] and len(queue) == 2
        gate.set()
        await asyncio.wait_for(queue.wait_idle(), 5)
        assert sorted(seen) == ["default/demo", "default/other"]
    finally:
        runner.cancel()


async def test_a_failing_key_is_retried_with_backoff_without_blocking_others() -> None:
    attempts: dict[str, int] = {"bad": 0, "good": 0}

    async def handler(key: str) -> None:
        attempts[key] += 1
        if key == "bad" and attempts[key] < 3:
            raise RuntimeError("API server said no")

    queue: WorkQueue[str] = WorkQueue(handler, workers=1, base_backoff=0.01, max_backoff=0.05)
    runner = asyncio.create_task(queue.run())
    try:
        queue.add("bad")
        queue.add("good")
        await asyncio.wait_for(queue.wait_idle(), 5)
        assert attempts == {"bad": 3, "good": 1}
    finally:
        runner.cancel()
