"""The engine's warm-up on vLLM's CPU backend, before the pod turns Ready: one sampled and one greedy generation the
launcher sends itself, so the first real request does not pay the compile. A warm-up that fails or runs past its
bound is logged and the pod turns Ready all the same. Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

# One request a kind: sampled (temperature 1: the sampler's top-k/top-p path) and greedy.
REQUESTS: tuple[dict[str, Any], ...] = (
    {"prompt": "Warm-up: the first generation compiles the model.", "max_tokens": 4, "temperature": 1.0},
    {"prompt": "Warm-up: and the greedy path.", "max_tokens": 4, "temperature": 0.0},
)
# Seconds for the whole warm-up; the CPU backend's compile on a small node with a cold cache takes minutes.
TIMEOUT_SECONDS = 600.0

PENDING, RUNNING, DONE = "pending", "running", "done"


class Warmup:
    """Sends the warm-up generations once, on a thread of its own, the first time `check` sees the engine
    healthy; `check` says whether the pod may turn Ready and why not."""

    def __init__(self, port: int, model: str, *, log: Callable[[str], None],
                 requests: Sequence[dict[str, Any]] = REQUESTS, timeout: float = TIMEOUT_SECONDS) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.model, self.log, self.requests, self.timeout = model, log, tuple(requests), timeout
        self.phase = PENDING
        self.started: float | None = None
        self._lock = threading.Lock()

    def check(self) -> tuple[bool, str]:
        """(done, line); starts the warm-up when it is pending. Call it only once the engine answers healthy."""
        with self._lock:
            if self.phase == PENDING:
                self.phase, self.started = RUNNING, time.monotonic()
                threading.Thread(target=self._run, name="engine-warmup", daemon=True).start()
            if self.phase == DONE:
                return True, "engine: warmed up"
            waited = time.monotonic() - (self.started or time.monotonic())
        return False, (f"engine: warming up ({waited:.0f}s; the first generations compile on vLLM's CPU backend, "
                       f"bounded at {self.timeout:.0f}s)")

    def _run(self) -> None:
        started = time.monotonic()
        try:
            for body in self.requests:
                left = self.timeout - (time.monotonic() - started)
                if left <= 0:
                    self.log(f"warning: the engine's warm-up passed its bound ({self.timeout:.0f}s); turning Ready "
                             "without it (the first requests pay the compile)")
                    return
                problem = self._send(body, left)
                if problem:
                    self.log(f"warning: the engine's warm-up failed ({problem}); turning Ready without it "
                             "(the first requests pay the compile)")
                    return
            self.log(f"engine warmed up in {time.monotonic() - started:.1f}s ({len(self.requests)} generations)")
        finally:
            with self._lock:
                self.phase = DONE

    def _send(self, body: dict[str, Any], timeout: float) -> str | None:
        """None when the engine answered 200; else what went wrong, in a few words."""
        data = json.dumps({"model": self.model, **body}).encode()
        request = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                answer.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode("utf-8", "replace")
            return f"POST {self.url} answered {exc.code}: {detail}"
        except (OSError, ValueError) as exc:
            return f"POST {self.url}: {getattr(exc, 'reason', exc)}"
        return None
