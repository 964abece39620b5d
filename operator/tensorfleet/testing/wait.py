"""Waiting in async tests for what another task or process does: the one `eventually` every harness uses."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def eventually(check: Callable[[], Any], timeout: float = 20.0, message: str = "",
                     interval: float = 0.05) -> Any:
    """Call `check` (sync, or returning an awaitable) until its result is truthy and return that result; fail
    after `timeout` seconds, naming `message` (or the check)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message or check}")
        await asyncio.sleep(interval)
