"""The simulator path serves: `tensorfleet-worker` in simulator mode, on loopback,
with the env the renderer writes for the simulator example (pipeline 2).

Stage 0 runs `tensorfleet sim` and answers a chat completion; stage 1 waits
for the leader, stands in for a Ray worker, reports healthy without NVML (its
GPU simulated, and made to fail from its pod's state), and exits non-zero once
the leader has gone, as a Ray worker would.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from worker_helpers import WORKER, base_env, example_docs, free_port, pod_env, run_worker, wait_until

from tensorfleet import contract
from tensorfleet.worker.errors import EXIT_LEADER_LOST

SIM = dict(example_docs())["simulator-cpu"]
TENSORFLEET = Path(sys.executable).with_name(contract.SIMULATOR_COMMAND[0])


def _sim_available() -> bool:
    if not TENSORFLEET.exists() and shutil.which(contract.SIMULATOR_COMMAND[0]) is None:
        return False
    done = subprocess.run([str(TENSORFLEET), *contract.SIMULATOR_COMMAND[1:], "--help"],
                          capture_output=True, text=True, timeout=60, check=False)
    return done.returncode == 0


pytestmark = pytest.mark.skipif(not _sim_available(), reason="`tensorfleet sim` (the engine simulator) is not installed")


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(response.status), json.loads(response.read())


def test_simulator_group_serves_a_chat_completion(tmp_path: Path) -> None:
    port = free_port()
    served = SIM["spec"]["model"]["servedName"]
    leader_env = pod_env(SIM, 0)
    assert leader_env[contract.ENV_ENGINE_KIND] == "simulator"
    leader_env[contract.ENV_ENGINE_PORT] = str(port)
    worker_env = pod_env(SIM, 1)
    worker_env.update({contract.ENV_ENGINE_PORT: str(port), contract.ENV_LEADER_ADDRESS: "127.0.0.1"})
    # Two pods on one loopback: each launcher's /health and gauges on a port of its own.
    leader_env[contract.ENV_GPU_METRICS_PORT], worker_env[contract.ENV_GPU_METRICS_PORT] = str(free_port()), str(free_port())
    state = tmp_path / "simulated-gpu-state"
    worker_env[contract.ENV_SIMULATED_GPU_STATE] = str(state)   # the pod's annotation, as its downward-API file
    fast = ["--poll-interval", "0.1", "--watch-interval", "0.1", "--leader-lost-after", "0.5"]
    leader_state, worker_state = tmp_path / "leader.json", tmp_path / "worker.json"

    # The launcher's own --print-command names the simulator for stage 0.
    shown = json.loads(run_worker(["--print-command"], base_env(leader_env)).stdout)
    assert shown["commands"][0][:2] == list(contract.SIMULATOR_COMMAND)

    leader_log, worker_log = (tmp_path / "leader.log").open("w"), (tmp_path / "worker.log").open("w")
    leader = subprocess.Popen([WORKER, "--state-file", str(leader_state), *fast], env=base_env(leader_env),
                              stdout=leader_log, stderr=subprocess.STDOUT)
    worker = subprocess.Popen([WORKER, "--state-file", str(worker_state), *fast], env=base_env(worker_env),
                              stdout=worker_log, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: leader.poll() is not None
                          or _get(f"http://127.0.0.1:{port}{contract.HEALTH_PATH}") == 200, timeout=60)
        assert leader.poll() is None, (tmp_path / "leader.log").read_text()
        status, body = _post(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "model": served, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
        })
        assert status == 200
        assert body["model"] == served
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["message"]["content"]

        # Stage 1 joined its leader and is healthy without any GPU or NVML: its GPU is simulated, its readiness
        # the launcher's /health as a GPU pod's; `tensorfleet-worker health` gives the same verdict.
        assert wait_until(lambda: worker_state.exists() and '"phase": "running"' in worker_state.read_text(), timeout=30)
        ready = f"http://127.0.0.1:{worker_env[contract.ENV_GPU_METRICS_PORT]}{contract.HEALTH_PATH}"
        assert wait_until(lambda: _get(ready) == 200, timeout=30)
        assert _get(f"http://127.0.0.1:{leader_env[contract.ENV_GPU_METRICS_PORT]}{contract.HEALTH_PATH}") == 200
        health = run_worker(["health", "--state-file", str(worker_state)], base_env(worker_env))
        assert health.returncode == 0, health.stdout
        assert health.stdout.splitlines()[-1] == "healthy: 1 of 1 GPU(s) ok; tensor parallel needs 1", health.stdout
        # A GPU fault set on the pod: its readiness drops, and the command says why.
        state.write_text(json.dumps({"gpus": [{"index": 0, "error": "GPU is lost"}]}))
        assert _get(ready) == 503
        health = run_worker(["health", "--state-file", str(worker_state)], base_env(worker_env))
        assert health.returncode == 1 and "GPU is lost" in health.stdout.splitlines()[-1], health.stdout

        # SIGTERM: nothing in flight, so the leader stops the simulator and exits cleanly...
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=30) == 0, (tmp_path / "leader.log").read_text()
        # ...and stage 1, like a Ray worker whose head is gone, exits so its pod restarts.
        assert worker.wait(timeout=30) == EXIT_LEADER_LOST, (tmp_path / "worker.log").read_text()
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    text = (tmp_path / "leader.log").read_text()
    assert "no request in flight" in text and "forwarding SIGTERM" in text
    assert "unreachable for 0.5s" in (tmp_path / "worker.log").read_text()
