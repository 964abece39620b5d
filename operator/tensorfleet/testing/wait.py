"""Waiting in tests for what another task, process or cluster does: one polling loop, blocking (`poll`,
`wait_for`) or awaited (`eventually`), that every harness uses."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def _timed_out(timeout: float, what: object, last: Any) -> AssertionError:
    seen = f"; last: {last!r}" if last is not None else ""
    return AssertionError(f"timed out after {timeout:g}s waiting for {what}{seen}")


def poll(check: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05,
         tolerate: tuple[type[BaseException], ...] = ()) -> tuple[bool, Any]:
    """Call `check` until its result is truthy or `timeout` seconds pass: (whether it came, the last result).
    An exception of TOLERATE counts as "not yet" (and is the last result)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            last = check()
        except tolerate as exc:
            last = exc
        else:
            if last:
                return True, last
        if time.monotonic() > deadline:
            return False, last
        time.sleep(interval)


def wait_for(check: Callable[[], Any], timeout: float = 20.0, message: str = "", interval: float = 0.05,
             tolerate: tuple[type[BaseException], ...] = ()) -> Any:
    """`poll` for a truthy result and return it; fail with an AssertionError naming `message` (or the check) and
    the last result."""
    came, last = poll(check, timeout, interval, tolerate)
    if not came:
        raise _timed_out(timeout, message or check, last)
    return last


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
            raise _timed_out(timeout, message or check, None)
        await asyncio.sleep(interval)
