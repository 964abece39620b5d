"""Simulated GPUs on simulator engine pods (worker/simgpu.py): their state from the pod's annotation, and the
launcher's /health and gauges over them, as on a GPU pod."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from worker_helpers import FakeEngine, free_port, http_get, wait_until

from tensorfleet import contract, promtext
from tensorfleet.worker import gpu as gpus
from tensorfleet.worker import simgpu
from tensorfleet.worker import state as statefile
from tensorfleet.worker.launcher import Launcher, Options
from tensorfleet.worker.role import Role


def test_simulated_gpus_are_healthy_gpus_of_the_planned_type_until_the_state_says_otherwise(tmp_path: Path) -> None:
    path = tmp_path / "state"
    sim = simgpu.SimulatedGpus(str(path), "L4", 2)
    snapshot = sim.sample()   # no file yet: the annotation is unset
    assert [(g.index, g.name, g.memory_total_bytes) for g in snapshot.gpus] == [
        (0, "NVIDIA L4", 23034 * 1024 * 1024), (1, "NVIDIA L4", 23034 * 1024 * 1024)]
    assert gpus.evaluate(snapshot, gpus.Thresholds(min_gpus=2)).healthy
    path.write_text("")       # the downward-API file of an annotation that is not there
    assert gpus.evaluate(sim.sample(), gpus.Thresholds(min_gpus=2)).healthy
    path.write_text(json.dumps({"gpus": [{"index": 1, "temperature_c": 97, "ecc_uncorrectable": 3}]}))
    report = gpus.evaluate(sim.sample(), gpus.Thresholds(min_gpus=2))
    assert report.gpu_healthy(0) and not report.gpu_healthy(1)
    assert {f.message for f in report.findings if f.level == gpus.UNHEALTHY} >= {"GPU 1 is hot: 97 C >= 85 C"}
    path.write_text(json.dumps({"gpus": [{"index": 0, "error": "GPU is lost"}], "xids": [{"gpu": 0, "xid": 79}]}))
    assert sim.sample().gpus[0].error == "GPU is lost" and sim.xids() == [(0, 79)]
    # A type the catalog does not know keeps its name; the count is the pod's tensor-parallel size.
    assert [g.name for g in simgpu.SimulatedGpus(None, "MI300X-ish", 3).sample().gpus] == ["MI300X-ish"] * 3


@pytest.mark.parametrize(("state", "said"), [
    ("{not json", "simulated GPU state is not JSON"),
    ('["xids"]', 'give one JSON object with "gpus" and/or "xids"'),
    ('{"gpu": []}', 'give one JSON object with "gpus" and/or "xids"'),
    ('{"gpus": [{"index": 2}]}', "needs an index from 0 to 1"),
    ('{"gpus": [{"index": 0, "temp": 90}]}', "unknown GPU field(s) ['temp']"),
    ('{"gpus": [{"index": 0, "temperature_c": "hot"}]}', "GPU 0 temperature_c='hot' is not a number"),
    ('{"gpus": [{"index": 0, "row_remap_failure": 1}]}', "GPU 0 row_remap_failure=1 is not a boolean"),
])
def test_a_state_that_cannot_be_read_fails_the_check_and_says_why(tmp_path: Path, state: str, said: str) -> None:
    path = tmp_path / "state"
    path.write_text(state)
    with pytest.raises(gpus.NvmlUnavailable) as caught:
        simgpu.SimulatedGpus(str(path), "L4", 2).sample()
    assert said in str(caught.value)


def test_xids_are_fed_once_each_in_order(tmp_path: Path) -> None:
    path = tmp_path / "state"
    seen: list[tuple[int, int]] = []
    stop = threading.Event()
    feed = simgpu.XidFeed(simgpu.SimulatedGpus(str(path), "L4", 2), lambda g, x: seen.append((g, x)), stop,
                          log=lambda _: None, every_s=0.01)
    feed.start()
    try:
        path.write_text(json.dumps({"xids": [{"gpu": 1, "xid": 13}]}))
        deadline = time.monotonic() + 5
        while len(seen) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        path.write_text(json.dumps({"xids": [{"gpu": 1, "xid": 13}, {"gpu": 0, "xid": 79}]}))
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
    finally:
        stop.set()
        feed.join(5)
    assert seen == [(1, 13), (0, 79)]


def test_a_simulator_pods_health_and_gauges_follow_its_simulated_gpus(tmp_path: Path) -> None:
    """The launcher of a simulator leader on L4s: Ready while its two simulated GPUs and its engine are; a hot GPU
    takes it out and back; an XID 79 takes it out for good, the annotation's removal notwithstanding."""
    engine, state = FakeEngine(), tmp_path / "simulated-gpu-state"
    role = Role.model_validate({"model": "m", "served_model_name": "m", "engine_kind": "simulator",
                                "accelerator": "L4", "tensor_parallel_size": 2, "stage_index": 0,
                                "engine_port": engine.port, "gpu_metrics_port": free_port(),
                                "simulated_gpu_state": str(state)})
    logs: list[str] = []
    launcher = Launcher(role, {},
                        Options(state_path=str(tmp_path / "launcher.json")), log=logs.append)
    launcher.prepare()
    url = f"http://127.0.0.1:{role.gpu_metrics_port}"
    try:
        launcher.state.phase(statefile.PHASE_RUNNING, "engine `python -m tensorfleet.sim`")
        code, body = http_get(url + contract.HEALTH_PATH)
        assert code == 200 and body.splitlines()[-1] == "healthy: 2 of 2 GPU(s) ok; tensor parallel needs 2", body
        code, text = http_get(url + contract.METRICS_PATH)
        assert code == 200 and promtext.value(text, contract.GPU_METRIC_VISIBLE) == 2
        assert promtext.value(text, contract.GPU_METRIC_ALL_HEALTHY) == 1
        state.write_text(json.dumps({"gpus": [{"index": 1, "temperature_c": 96}]}))
        code, body = http_get(url + contract.HEALTH_PATH)
        assert code == 503 and body.splitlines()[-1] == "unhealthy: GPU 1 is hot: 96 C >= 85 C", body
        state.write_text("")
        assert http_get(url + contract.HEALTH_PATH)[0] == 200
        state.write_text(json.dumps({"xids": [{"gpu": 0, "xid": 79}]}))
        assert wait_until(lambda: http_get(url + contract.HEALTH_PATH)[0] == 503, timeout=5), \
            "XID 79 fails the pod's health"
        state.write_text("")
        time.sleep(1.2)   # a feed period: the XID was taken once, and stays
        code, body = http_get(url + contract.HEALTH_PATH)
        assert code == 503 and "GPU 0 reported XID 79 (fatal" in body, body
        assert promtext.value(http_get(url + contract.METRICS_PATH)[1], contract.GPU_METRIC_ALL_HEALTHY) == 0
    finally:
        launcher.close()
        engine.server.shutdown()
    assert any("2 simulated NVIDIA L4 GPU(s)" in line for line in logs), logs
    assert "simulated GPU 0 reported XID 79" in logs


def test_the_gpu_checks_load_no_crd_model_and_no_planner() -> None:
    """The launcher's GPU checks (NVML's and the simulated ones) need the GPU table only: it is a leaf module, so
    they import neither pydantic's CRD models nor the catalog's model facts."""
    import subprocess
    import sys

    probe = ("import sys, tensorfleet.worker.gpu, tensorfleet.worker.simgpu\n"
             "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorfleet', 'pydantic'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            timeout=60).stdout.split()
    assert "tensorfleet.gpus" in loaded
    assert not [m for m in loaded if m.startswith(("tensorfleet.api", "tensorfleet.catalog", "tensorfleet.planner",
                                                   "pydantic"))], loaded
