"""The launcher's multi-node flows against fake `ray` and `vllm` executables.

The fakes (tests/worker_helpers.py) are scripts on PATH that record their argv
and simulate what Ray does: a head whose `ray status` shows workers joining
late or never, a `ray start --block` that runs until signalled or loses its
GCS, and a vLLM that reports requests in flight. Pod envs come from the
rendered 405B multi-node example. Nothing asserts on wall-clock speed: the
launcher's intervals are shortened with its flags so the tests run quickly.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from worker_helpers import (
    WORKER,
    base_env,
    calls,
    example_docs,
    free_port,
    install_fakes,
    pod_env,
    read_log,
    run_worker,
    wait_until,
)

from tensorfleet import contract
from tensorfleet.worker import raywait
from tensorfleet.worker.errors import (
    EXIT_LEADER_LOST,
    EXIT_NOT_FOUND,
    EXIT_START_FAILED,
    EXIT_TIMEOUT,
)
from tensorfleet.worker.role import role_from_env

DOCS = dict(example_docs())
MULTINODE = DOCS["llama-3.1-405b-h100-multinode"]
SINGLE = DOCS["llama-3.1-8b-l4"]
FAST = ["--poll-interval", "0.05", "--log-interval", "0.2", "--watch-interval", "0.05", "--leader-lost-after", "0.3"]


class Fakes:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bin = install_fakes(tmp)
        self.log = tmp / "calls.jsonl"
        self.state = tmp / "state.json"
        self.stderr = tmp / "stderr.txt"

    def env(self, doc: dict[str, Any], stage: int, **extra: str) -> dict[str, str]:
        env = pod_env(doc, stage)
        env.pop(contract.ENV_GPU_METRICS_PORT, None)   # no exporter on a fixed port in tests
        env[contract.ENV_HF_HOME] = str(self.tmp / "hf")
        env.update({"FAKE_LOG": str(self.log), "FAKE_DIR": str(self.tmp)})
        env.update(extra)
        return base_env(env, path_first=self.bin)

    def args(self, *more: str) -> list[str]:
        return ["--state-file", str(self.state), *FAST, *more]

    def start(self, env: dict[str, str], *more: str) -> subprocess.Popen[str]:
        self.stderr.write_text("")
        return subprocess.Popen([WORKER, *self.args(*more)], env=env, stdout=subprocess.DEVNULL,
                                stderr=self.stderr.open("w"), text=True)

    def ray(self) -> list[dict[str, Any]]:
        return list(calls(self.log, "ray"))

    def events(self, cmd: str, event: str) -> list[dict[str, Any]]:
        return [e for e in calls(self.log, cmd) if e.get("event") == event]


@pytest.fixture
def fakes(tmp_path: Path) -> Fakes:
    return Fakes(tmp_path)


class FakeLeader:
    """A TCP listener standing in for the leader's Ray GCS port; accepts and drops connections."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))   # bound but not listening: connections are refused
        self._thread: threading.Thread | None = None

    def listen(self) -> None:
        self.sock.listen(64)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self._thread:
            self._thread.join(timeout=5)


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("tensorfleet-worker: error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


# --- leader -------------------------------------------------------------------

def test_leader_waits_for_slow_joins_then_serves(fakes: Fakes) -> None:
    env = fakes.env(MULTINODE, 0, FAKE_RAY_STATUS_FAIL_UNTIL="1", FAKE_RAY_JOIN_AFTER="4")
    # A progress line on every poll, so each state of the join is logged.
    done = run_worker(fakes.args("--cluster-timeout", "30", "--log-interval", "0.05"), env)
    assert done.returncode == 0, done.stderr

    log = read_log(fakes.log)
    argvs = [(e["cmd"], e["argv"]) for e in log if e.get("event") in (None, "started")]
    assert argvs[0] == ("ray", ["start", "--head", f"--port={contract.RAY_PORT}", "--disable-usage-stats"])
    statuses = [a for a in argvs if a == ("ray", ["status"])]
    assert len(statuses) >= 4
    engine = [a for c, a in argvs if c == "vllm"]
    assert len(engine) == 1
    assert engine[0][:2] == ["serve", "meta-llama/Llama-3.1-405B-Instruct"]
    assert engine[0][engine[0].index("--pipeline-parallel-size") + 1] == "2"
    assert engine[0][engine[0].index("--distributed-executor-backend") + 1] == "ray"
    # The engine starts only after the cluster is complete, and Ray is stopped last.
    assert argvs.index(("ray", ["status"])) < argvs.index(("vllm", engine[0]))
    assert argvs[-1] == ("ray", ["stop"])
    # The engine gets the pod's env unchanged.
    started = fakes.events("vllm", "started")[0]
    assert started["env"][contract.ENV_MODEL] == "meta-llama/Llama-3.1-405B-Instruct"

    worker = f"llama-405b-stage-1-0.{contract.workers_service_name('llama-405b')}.llm.svc"
    assert "`ray status` exited 1: ConnectionError" in done.stderr
    assert "waiting for the Ray cluster" in done.stderr
    assert f"1/2 nodes, 8/16 GPUs; no pod IP yet, pod not scheduled or not started: stage 1 ({worker})" in done.stderr
    assert "Ray cluster ready" in done.stderr and "2 nodes, 16 GPUs" in done.stderr


def test_leader_deadline_names_the_missing_worker(fakes: Fakes) -> None:
    env = fakes.env(MULTINODE, 0, FAKE_RAY_JOIN_AFTER="1000000")
    done = run_worker(fakes.args("--cluster-timeout", "0.5"), env)
    assert done.returncode == EXIT_TIMEOUT
    line = _one_error_line(done.stderr)
    worker = f"llama-405b-stage-1-0.{contract.workers_service_name('llama-405b')}.llm.svc"
    assert line == ("tensorfleet-worker: error: Ray cluster incomplete after 0.5s: 1/2 nodes, 8/16 GPUs; "
                    f"no pod IP yet, pod not scheduled or not started: stage 1 ({worker})")
    assert not list(calls(fakes.log, "vllm"))
    assert fakes.ray()[-1]["argv"] == ["stop"]


def test_leader_deadline_when_a_node_lacks_gpus(fakes: Fakes) -> None:
    env = fakes.env(MULTINODE, 0, FAKE_RAY_GPUS_PER_NODE="4")
    done = run_worker(fakes.args("--cluster-timeout", "0.3"), env)
    assert done.returncode == EXIT_TIMEOUT
    assert "2/2 nodes, 8/16 GPUs; every node joined but GPUs are short" in _one_error_line(done.stderr)


def test_ray_head_failure_is_one_line(fakes: Fakes) -> None:
    done = run_worker(fakes.args(), fakes.env(MULTINODE, 0, FAKE_RAY_HEAD_EXIT="1"))
    assert done.returncode == EXIT_START_FAILED
    assert "`ray start --head" in _one_error_line(done.stderr)


def test_missing_ray_is_one_line(tmp_path: Path) -> None:
    env = pod_env(MULTINODE, 0)
    env.pop(contract.ENV_GPU_METRICS_PORT)
    env[contract.ENV_HF_HOME] = str(tmp_path)
    done = run_worker(["--state-file", str(tmp_path / "s.json")], base_env(env))
    assert done.returncode == EXIT_NOT_FOUND
    assert "ray: command not found on PATH" in _one_error_line(done.stderr)


# --- worker (stage > 0) ---------------------------------------------------------

def test_worker_waits_for_leader_and_restarts_when_it_goes_away(fakes: Fakes) -> None:
    port = free_port()
    env = fakes.env(MULTINODE, 1, **{contract.ENV_LEADER_ADDRESS: "127.0.0.1", contract.ENV_RAY_PORT: str(port)})
    leader = FakeLeader(port)
    proc = fakes.start(env, "--leader-timeout", "30")
    try:
        # Slow leader: its name resolves, but the Ray head is not up yet.
        assert wait_until(lambda: "refuses connections (Ray head not started yet)" in fakes.stderr.read_text())
        assert not fakes.events("ray", "started")
        leader.listen()
        assert wait_until(lambda: bool(fakes.events("ray", "started")))
        joined = fakes.events("ray", "started")[0]
        assert joined["argv"] == ["start", f"--address=127.0.0.1:{port}", "--block", "--disable-usage-stats"]
        assert wait_until(lambda: '"phase": "running"' in fakes.state.read_text())

        # The leader restarts: its port stops answering.
        leader.close()
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == EXIT_LEADER_LOST
    line = _one_error_line(fakes.stderr.read_text())
    assert line == (f"tensorfleet-worker: error: leader 127.0.0.1:{port} unreachable for 0.3s: "
                    "it restarted or went away, so this worker must restart and rejoin")
    assert fakes.events("ray", "terminated"), "the Ray worker was not stopped"
    assert fakes.ray()[-1]["argv"] == ["stop"]
    assert '"phase": "exited"' in fakes.state.read_text()

    # The pod restarts and joins the new leader; asked to stop, it waits for the leader to finish first.
    leader = FakeLeader(port)
    leader.listen()
    proc = fakes.start(env, "--leader-timeout", "30")
    try:
        assert wait_until(lambda: len(fakes.events("ray", "started")) == 2)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: "keeps running until the leader finishes" in fakes.stderr.read_text())
        assert len(fakes.events("ray", "terminated")) == 1
        leader.close()
        code = proc.wait(timeout=30)
    finally:
        leader.close()
        if proc.poll() is None:
            proc.kill()
    assert code == 0, fakes.stderr.read_text()
    assert len(fakes.events("ray", "terminated")) == 2
    assert "has stopped; stopping this stage" in fakes.stderr.read_text()


def test_worker_exits_when_ray_loses_its_leader(fakes: Fakes) -> None:
    port = free_port()
    leader = FakeLeader(port)
    leader.listen()
    try:
        env = fakes.env(MULTINODE, 1, FAKE_RAY_BLOCK_EXIT_AFTER="0.2",
                        **{contract.ENV_LEADER_ADDRESS: "127.0.0.1", contract.ENV_RAY_PORT: str(port)})
        done = run_worker(fakes.args(), env)
    finally:
        leader.close()
    assert done.returncode == EXIT_LEADER_LOST
    assert "the Ray worker exited with code 1 while the group was up" in _one_error_line(done.stderr)
    assert fakes.events("ray", "lost-gcs")


def test_worker_deadline_when_the_leader_never_appears(fakes: Fakes) -> None:
    env = fakes.env(MULTINODE, 1, **{contract.ENV_LEADER_ADDRESS: "tf-missing-leader.invalid"})
    done = run_worker(fakes.args("--leader-timeout", "0.3"), env)
    assert done.returncode == EXIT_TIMEOUT
    assert _one_error_line(done.stderr) == (
        "tensorfleet-worker: error: leader tf-missing-leader.invalid not reachable after 0.3s: "
        "it has no DNS record yet (leader pod not scheduled or not started)")
    assert not fakes.events("ray", "started")


# --- signals: the serving stage drains before the engine gets SIGTERM -----------

@contextmanager
def _serving_launcher(fakes: Fakes) -> Iterator[subprocess.Popen[str]]:
    """A single-stage launcher whose fake vLLM serves (with 2 requests in flight) on a free port; killed on exit."""
    port = free_port()
    proc = fakes.start(fakes.env(SINGLE, 0, FAKE_VLLM_SERVE="1", **{contract.ENV_ENGINE_PORT: str(port)}))
    try:
        assert wait_until(lambda: bool(fakes.events("vllm", "started")) and raywait.tcp_open("127.0.0.1", port))
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_waits_for_in_flight_requests(fakes: Fakes) -> None:
    with _serving_launcher(fakes) as proc:
        proc.send_signal(signal.SIGTERM)
        # The launcher keeps polling the engine's queue and holds SIGTERM while requests run.
        assert wait_until(lambda: len(fakes.events("vllm", "metrics")) >= 3)
        assert not fakes.events("vllm", "terminated")
        assert all(e["running"] == 2 for e in fakes.events("vllm", "metrics"))
        (fakes.tmp / "requests-done").write_text("")
        assert proc.wait(timeout=30) == 0
    assert fakes.events("vllm", "terminated")
    stderr = fakes.stderr.read_text()
    assert "draining: 2 request(s) in flight" in stderr and "stopping the engine" in stderr


def test_second_sigterm_stops_at_once(fakes: Fakes) -> None:
    with _serving_launcher(fakes) as proc:
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: bool(fakes.events("vllm", "metrics")))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert fakes.events("vllm", "terminated")
    assert not (fakes.tmp / "requests-done").exists()


# --- units ----------------------------------------------------------------------

RAY_STATUS_V1 = """\
======== Autoscaler status: 2020-12-28 01:02:03 ========
Node status
--------------------------------------------------------
Active:
 2 p3.2xlarge
 20 m4.4xlarge
Idle:
 (no idle nodes)
Pending:
 m4.4xlarge, 2 launching
 1.2.3.4: m4.4xlarge, waiting-for-ssh
Recent failures:
 p3.2xlarge: NodeTerminated (ip: 1.2.3.6)

Resources
--------------------------------------------------------
Usage:
 0/2 AcceleratorType:V100
 530.0/544.0 CPU
 2/2 GPU
 2.00GiB/8.00GiB memory
"""

RAY_STATUS_V2 = """\
======== Autoscaler status: 2026-01-21 02:05:25.227901 ========
Node status
---------------------------------------------------------------
Active:
 1 node_5f1bb2d4
Idle:
 1 node_9c0a7e11
Pending:
 (no pending nodes)
Recent failures:
 (no failures)

Resources
---------------------------------------------------------------
Total Usage:
 0.0/32.0 CPU
 8.0/16.0 GPU
 0B/9.31GiB memory

Total Demands:
 (no resource demands)
"""


@pytest.mark.parametrize(("text", "nodes", "gpus"), [
    (RAY_STATUS_V1, 22, 2.0),
    (RAY_STATUS_V2, 2, 16.0),
    ("Node status\n----\nActive:\n (no active nodes)\nPending:\n (no pending nodes)\n", 0, 0.0),
    ("", 0, 0.0),
])
def test_parse_ray_status(text: str, nodes: int, gpus: float) -> None:
    assert raywait.parse_ray_status(text) == (nodes, gpus)


def test_leader_watch_notices_a_recreated_leader() -> None:
    now = [0.0]
    answers: dict[str, Any] = {"ip": ["10.0.0.5"], "open": True}
    logs: list[str] = []
    watch = raywait.LeaderWatch("leader.svc", 6379, ["10.0.0.5"], lost_after=30, interval=5, log=logs.append,
                                resolver=lambda host: answers["ip"], connect=lambda h, p: bool(answers["open"]),
                                clock=lambda: now[0])
    assert watch() is None
    # Blips shorter than lost_after are tolerated.
    answers["open"] = False
    now[0] = 10
    assert watch() is None
    now[0] = 12          # within the check interval: not even looked at
    assert watch() is None
    now[0] = 20
    answers["open"] = True
    assert watch() is None
    assert "reachable again" in logs[-1]
    # Unreachable for lost_after: restart.
    answers["open"] = False
    now[0] = 30
    assert watch() is None
    now[0] = 60
    assert "unreachable for 30s" in (watch() or "")
    # A recreated leader pod has a new IP: restart at once, even though it answers.
    watch = raywait.LeaderWatch("leader.svc", 6379, ["10.0.0.5"], lost_after=30, interval=0, log=logs.append,
                                resolver=lambda host: ["10.0.0.9"], connect=lambda h, p: True, clock=lambda: 0.0)
    assert "moved from 10.0.0.5 to 10.0.0.9" in (watch() or "")


def test_describe_missing_tells_up_from_unscheduled() -> None:
    env = pod_env(DOCS["simulator-cpu"], 0)
    env[contract.ENV_PIPELINE_PARALLEL] = "3"
    role = role_from_env(env)
    hosts = {h: ["10.1.2.3"] if "stage-1" in h else None for h in
             (f"sim-llama-stage-{k}-0.{contract.workers_service_name('sim-llama')}.default.svc" for k in (1, 2))}
    text = raywait.describe_missing(role, raywait.ClusterStatus(1, 1.0), resolver=lambda h: hosts.get(h))
    assert "1/3 nodes, 1/3 GPUs" in text
    assert "pod not scheduled or not started: stage 2 (sim-llama-stage-2-0." in text
    assert "pod up, Ray worker not joined yet" in text and "stage 1 (sim-llama-stage-1-0." in text and "10.1.2.3" in text
