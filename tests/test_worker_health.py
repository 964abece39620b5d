"""`tensorfleet-worker health` and the GPU gauges, against a fake NVML.

The fake replaces pynvml's functions one by one (the real nvidia-ml-py module
stays: its error classes and constants are the real ones), so the code under
test makes the same calls it makes on a GPU node. The no-NVML case uses the
real pynvml on this machine, which has no driver.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
from worker_helpers import FakeEngine, free_port, http_get

from tensorfleet import contract, promtext
from tensorfleet.worker import cli, metrics
from tensorfleet.worker import gpu as gpus
from tensorfleet.worker import state as statefile
from tensorfleet.worker.errors import EXIT_CONFIG, EXIT_NO_NVML, EXIT_OK, EXIT_UNHEALTHY

GiB = 1024**3
H100 = "NVIDIA H100 80GB HBM3"


@dataclass
class FakeGpu:
    name: str = H100
    temperature: int = 45
    slowdown: int | None = 87
    used: int = 70 * GiB
    total: int = 80 * GiB
    util: int = 93
    power_mw: int = 350_000
    limit_mw: int = 700_000
    ecc: int | None = 0                 # None: ECC not supported
    retired_pending: bool = False
    remap: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    lost: bool = False


class _Mem:
    def __init__(self, used: int, total: int) -> None:
        self.used, self.total, self.free = used, total, total - used


class _Util:
    def __init__(self, gpu: int) -> None:
        self.gpu, self.memory = gpu, 10


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def install_fake_nvml(monkeypatch: pytest.MonkeyPatch, devices: list[FakeGpu], *, xids: list[tuple[int, int]] | None = None) -> dict[str, int]:
    calls = {"init": 0, "shutdown": 0}

    def dev(handle: int) -> FakeGpu:
        gpu = devices[handle]
        if gpu.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def init() -> None:
        calls["init"] += 1

    def shutdown() -> None:
        calls["shutdown"] += 1

    def ecc(handle: int, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        value = dev(handle).ecc
        if value is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def remap(handle: int) -> tuple[int, int, int, int]:
        value = dev(handle).remap
        if value is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def threshold(handle: int, kind: int) -> int:
        assert kind == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        value = dev(handle).slowdown
        if value is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    pending = list(xids or [])

    class _Event:
        def __init__(self, device: int, data: int) -> None:
            self.device, self.eventData = device, data

    def wait(_events: object, _timeout_ms: int) -> _Event:
        if pending:
            device, xid = pending.pop(0)
            return _Event(device, xid)
        raise _err(pynvml.NVML_ERROR_TIMEOUT)

    fakes: dict[str, Any] = {
        "nvmlInit": init,
        "nvmlShutdown": shutdown,
        "nvmlSystemGetDriverVersion": lambda: "570.124.06",
        "nvmlDeviceGetCount": lambda: len(devices),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetIndex": lambda h: h,
        "nvmlDeviceGetName": lambda h: dev(h).name,
        "nvmlDeviceGetUUID": lambda h: f"GPU-0000000{h}-fake",
        "nvmlDeviceGetTemperature": lambda h, sensor: dev(h).temperature,
        "nvmlDeviceGetTemperatureThreshold": threshold,
        "nvmlDeviceGetMemoryInfo": lambda h: _Mem(dev(h).used, dev(h).total),
        "nvmlDeviceGetUtilizationRates": lambda h: _Util(dev(h).util),
        "nvmlDeviceGetPowerUsage": lambda h: dev(h).power_mw,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: dev(h).limit_mw,
        "nvmlDeviceGetTotalEccErrors": ecc,
        "nvmlDeviceGetRetiredPagesPendingStatus": lambda h: int(dev(h).retired_pending),
        "nvmlDeviceGetRemappedRows": remap,
        "nvmlEventSetCreate": lambda: object(),
        "nvmlDeviceRegisterEvents": lambda h, kinds, events: None,
        "nvmlEventSetWait": wait,
    }
    for name, fn in fakes.items():
        assert hasattr(pynvml, name), name    # only patch functions the real module has
        monkeypatch.setattr(pynvml, name, fn)
    return calls


@pytest.fixture
def run_health(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path):  # type: ignore[no-untyped-def]  # returns the test's own runner closure
    monkeypatch.setenv(contract.ENV_TENSOR_PARALLEL, "2")
    monkeypatch.setenv(contract.ENV_ENGINE_KIND, "vllm")

    def run(*args: str) -> tuple[int, str, str]:
        code = cli.main(["health", "--state-file", str(tmp_path / "absent.json"), *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_healthy(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    calls = install_fake_nvml(monkeypatch, [FakeGpu(), FakeGpu(temperature=51)])
    code, out, err = run_health()
    assert code == EXIT_OK, out
    assert err == ""
    lines = out.splitlines()
    assert lines[-1] == "healthy: 2 of 2 GPU(s) ok; tensor parallel needs 2"
    assert "driver 570.124.06, 2 GPU(s) visible" in out
    assert (f"GPU 0  {H100}  GPU-00000000-fake  45 C (limit 87 C)  memory 70.0/80.0 GiB (88%)  util 93%  "
            "power 350/700 W  ECC uncorrectable 0  ok") in lines
    assert calls["init"] == calls["shutdown"] == 1


def test_hot_gpu(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(), FakeGpu(temperature=91)])
    code, out, _ = run_health()
    assert code == EXIT_UNHEALTHY
    assert out.splitlines()[-1] == "unhealthy: GPU 1 is hot: 91 C >= 87 C"
    # The threshold is configurable.
    code, out, _ = run_health("--max-temperature", "95")
    assert code == EXIT_OK
    code, out, _ = run_health("--max-temperature", "40")
    assert code == EXIT_UNHEALTHY
    assert out.splitlines()[-1] == "unhealthy: GPU 0 is hot: 45 C >= 40 C; GPU 1 is hot: 91 C >= 40 C"


def test_temperature_limit_falls_back_when_nvml_has_none(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(slowdown=None, temperature=86), FakeGpu(slowdown=None)])
    code, out, _ = run_health()
    assert code == EXIT_UNHEALTHY and f"GPU 0 is hot: 86 C >= {gpus.FALLBACK_MAX_TEMPERATURE_C:.0f} C" in out


def test_ecc_errors(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(ecc=3), FakeGpu(ecc=None)])
    code, out, _ = run_health()
    assert code == EXIT_UNHEALTHY
    assert "GPU 0 has 3 uncorrectable ECC error(s) since the driver loaded (more than 0)" in out
    # ECC unsupported on GPU 1 is unknown, not a failure.
    assert "ECC uncorrectable n/a  ok" in out
    code, _, _ = run_health("--max-ecc-uncorrectable", "5")
    assert code == EXIT_OK


def test_row_remap_and_retired_pages(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(remap=(0, 1, 1, 0), retired_pending=True), FakeGpu(remap=None)])
    code, out, _ = run_health()
    assert code == EXIT_OK    # pending until reset: warnings
    assert "warning: GPU 0: a row remap is pending until the GPU is reset" in out
    assert "warning: GPU 0: retired pages pending until the GPU is reset" in out
    install_fake_nvml(monkeypatch, [FakeGpu(remap=(0, 1, 0, 1)), FakeGpu()])
    code, out, _ = run_health()
    assert code == EXIT_UNHEALTHY and "GPU 0: row remapping failed" in out


def test_missing_gpu(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu()])
    code, out, _ = run_health()
    assert code == EXIT_UNHEALTHY
    assert out.splitlines()[-1].startswith("unhealthy: 1 GPU(s) visible but tensor parallel needs 2")
    code, _, _ = run_health("--min-gpus", "1")
    assert code == EXIT_OK


def test_lost_gpu(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(), FakeGpu(lost=True)])
    code, out, _ = run_health()
    assert code == EXIT_UNHEALTHY
    assert "GPU 1 cannot be read: GPU is lost" in out


def test_memory_threshold_is_opt_in(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(used=79 * GiB), FakeGpu()])
    assert run_health()[0] == EXIT_OK
    code, out, _ = run_health("--max-memory-percent", "95")
    assert code == EXIT_UNHEALTHY and "GPU 0 memory 99% used > 95%" in out


def test_json_output(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(), FakeGpu(temperature=99)])
    code, out, _ = run_health("--json")
    doc = json.loads(out)
    assert code == EXIT_UNHEALTHY and doc["healthy"] is False
    assert [g["healthy"] for g in doc["gpus"]] == [True, False]
    assert doc["gpus"][1]["temperature_c"] == 99 and doc["gpus"][1]["temperatureLimitC"] == 87


def test_no_nvml(run_health: Any) -> None:
    """This machine has no NVIDIA driver: the real pynvml cannot load libnvidia-ml."""
    code, out, err = run_health()
    assert code == EXIT_NO_NVML
    assert "Traceback" not in out + err
    assert "cannot check GPU health: NVML did not start (NVML Shared Library Not Found)" in out
    assert "no NVIDIA driver or no GPU assigned" in out


def test_no_pynvml_module(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    code, out, _ = run_health()
    assert code == EXIT_NO_NVML and "the pynvml module is not installed" in out


def test_simulator_mode_needs_no_nvml(monkeypatch: pytest.MonkeyPatch, run_health: Any) -> None:
    monkeypatch.setenv(contract.ENV_ENGINE_KIND, "simulator")
    code, out, _ = run_health()
    assert code == EXIT_OK
    assert "simulator mode" in out and out.splitlines()[-1] == "healthy"


def test_launcher_state_gates_health(monkeypatch: pytest.MonkeyPatch, run_health: Any, tmp_path: Path) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(), FakeGpu()])
    path = tmp_path / "state.json"
    state = statefile.StateFile(path)
    state.phase(statefile.PHASE_WAITING_LEADER, "leader.svc:6379")
    code, out, _ = run_health("--state-file", str(path))
    assert code == EXIT_UNHEALTHY
    assert out.splitlines()[0].startswith("launcher: waiting-for-leader for ")
    state.phase(statefile.PHASE_RUNNING, "Ray worker joined")
    code, out, _ = run_health("--state-file", str(path))
    assert code == EXIT_OK and out.startswith("launcher: running")
    # A fatal XID the launcher saw makes the GPU unhealthy; a harmless one is a warning.
    state.add_xid(1, 31)
    code, out, _ = run_health("--state-file", str(path))
    assert code == EXIT_OK and "warning: GPU 1 reported XID 31" in out
    state.add_xid(1, 79)
    code, out, _ = run_health("--state-file", str(path))
    assert code == EXIT_UNHEALTHY and "GPU 1 reported XID 79 (fatal" in out
    code, out, _ = run_health("--state-file", str(path), "--fatal-xids", "48")
    assert code == EXIT_OK
    # A launcher that died leaves a stale file: unhealthy.
    data = json.loads(path.read_text())
    data["pid"] = 2**22 + 12345
    path.write_text(json.dumps(data))
    code, out, _ = run_health("--state-file", str(path))
    assert code == EXIT_UNHEALTHY and "launcher: not running" in out


def test_bad_health_flag(run_health: Any) -> None:
    with pytest.raises(SystemExit) as caught:
        run_health("--fatal-xids", "79,oops")
    assert caught.value.code == EXIT_CONFIG


def test_xid_watcher_records_events(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(), FakeGpu()], xids=[(1, 79), (0, 13)])
    state = statefile.StateFile(tmp_path / "s.json")
    stop = threading.Event()
    logs: list[str] = []
    seen: list[tuple[int, int]] = []

    def on_xid(gpu: int, xid: int) -> None:
        seen.append((gpu, xid))
        state.add_xid(gpu, xid)
        if len(seen) == 2:
            stop.set()

    watcher = gpus.XidWatcher(on_xid, stop, log=logs.append, timeout_ms=10)
    watcher.start()
    watcher.join(timeout=10)
    assert not watcher.is_alive()
    assert seen == [(1, 79), (0, 13)]
    written = statefile.read_state(tmp_path / "s.json")
    assert written is not None, "the watcher wrote its state file"
    assert [(x["gpu"], x["xid"]) for x in written["xids"]] == seen
    assert "GPU 1 reported XID 79" in logs


# --- Prometheus gauges -----------------------------------------------------------

def test_metrics_exposition(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(), FakeGpu(temperature=92, ecc=2)])
    collector = metrics.GpuCollector(gpus.Thresholds(min_gpus=2), xids=lambda: [{"gpu": 1, "xid": 79}, {"gpu": 1, "xid": 79}])
    parsed = promtext.samples(metrics.exposition(collector))

    def value(name: str, gpu: str | None = None) -> float:
        samples = promtext.select(parsed, name) if gpu is None else promtext.select(parsed, name, gpu=gpu)
        assert len(samples) == 1, (name, gpu, promtext.select(parsed, name))
        return samples[0].value

    assert value(contract.GPU_METRIC_NVML_UP) == 1
    assert value(contract.GPU_METRIC_VISIBLE) == 2 and value(contract.GPU_METRIC_EXPECTED) == 2
    assert value(contract.GPU_METRIC_ALL_HEALTHY) == 0
    assert value(contract.GPU_METRIC_HEALTHY, "0") == 1 and value(contract.GPU_METRIC_HEALTHY, "1") == 0
    assert value(contract.GPU_METRIC_TEMPERATURE, "1") == 92
    assert value(contract.GPU_METRIC_TEMPERATURE_LIMIT, "1") == 87
    assert value(contract.GPU_METRIC_MEMORY_USED, "0") == 70 * GiB
    assert value(contract.GPU_METRIC_MEMORY_TOTAL, "0") == 80 * GiB
    assert value(contract.GPU_METRIC_UTILIZATION, "0") == pytest.approx(0.93)
    assert value(contract.GPU_METRIC_POWER, "0") == 350 and value(contract.GPU_METRIC_POWER_LIMIT, "0") == 700
    assert value(contract.GPU_METRIC_ECC_UNCORRECTABLE, "1") == 2
    assert value(contract.GPU_METRIC_ROW_REMAP_FAILURE, "0") == 0
    xid = promtext.select(parsed, contract.GPU_METRIC_XID_ERRORS + "_total")
    assert [(s.labels, s.value) for s in xid] == [({"gpu": "1", "xid": "79"}, 2)]
    labels = promtext.select(parsed, contract.GPU_METRIC_TEMPERATURE)[0].labels
    assert labels == {"gpu": "0", "uuid": "GPU-00000000-fake", "device": H100}


def test_metrics_without_nvml() -> None:
    text = metrics.exposition(metrics.GpuCollector(gpus.Thresholds(min_gpus=8)))
    assert promtext.value(text, contract.GPU_METRIC_NVML_UP) == 0
    assert promtext.value(text, contract.GPU_METRIC_EXPECTED) == 8
    assert promtext.value(text, contract.GPU_METRIC_TEMPERATURE) is None


def test_metrics_served_over_http(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu()])
    port = free_port()
    server = metrics.serve(port, metrics.GpuCollector(gpus.Thresholds(min_gpus=1)), addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{contract.METRICS_PATH}", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
    assert promtext.value(text, contract.GPU_METRIC_ALL_HEALTHY) == 1
    assert promtext.value(text, contract.GPU_METRIC_TEMPERATURE) == 45


def test_metrics_command_prints_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu()])
    monkeypatch.setenv(contract.ENV_TENSOR_PARALLEL, "1")
    assert cli.main(["metrics"]) == 0
    assert promtext.value(capsys.readouterr().out, contract.GPU_METRIC_ALL_HEALTHY) == 1


def test_accelerator_mismatch_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu(name="NVIDIA A100-SXM4-80GB")])
    snapshot = gpus.sample()
    assert gpus.accelerator_mismatch(snapshot, "A100-80GB") is None
    message = gpus.accelerator_mismatch(snapshot, "H100-80GB")
    assert message and "plan was made for H100-80GB" in message and "NVIDIA A100-SXM4-80GB" in message


# --- the pod's /health (the GPU pods' readiness probe) -------------------------------

def _launcher(tmp_path: Path, **role: Any) -> Any:
    from tensorfleet.worker.launcher import Launcher, Options
    from tensorfleet.worker.role import Role

    logs: list[str] = []
    fields = {"model": "m", "served_model_name": "m", "tensor_parallel_size": 2,
              "gpu_metrics_port": free_port(), **role}
    launcher = Launcher(Role.model_validate(fields), {}, Options(state_path=str(tmp_path / "state.json")),
                        log=logs.append)
    return launcher, logs


def test_the_leaders_health_needs_its_gpus_and_its_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    devices = [FakeGpu(), FakeGpu()]
    install_fake_nvml(monkeypatch, devices)
    engine = FakeEngine()
    launcher, logs = _launcher(tmp_path, engine_port=engine.port, stage_index=0)
    port = launcher.role.gpu_metrics_port
    server = metrics.serve(port, metrics.GpuCollector(gpus.Thresholds(min_gpus=2)), addr="127.0.0.1",
                           health=launcher.pod_health)
    url = f"http://127.0.0.1:{port}{contract.HEALTH_PATH}"
    try:
        code, body = http_get(url)
        assert code == 503 and body.startswith("launcher: starting")
        launcher.state.phase(statefile.PHASE_RUNNING, "engine `vllm serve`")
        code, body = http_get(url)
        assert code == 200, body
        assert f"engine: http://127.0.0.1:{engine.port}/health answered 200" in body
        assert body.splitlines()[-1] == "healthy: 2 of 2 GPU(s) ok; tensor parallel needs 2"
        # vLLM up but a GPU unhealthy: the leader leaves the Service.
        devices[1].temperature = 95
        code, body = http_get(url)
        assert code == 503 and body.splitlines()[-1] == "unhealthy: GPU 1 is hot: 95 C >= 87 C"
        devices[1].temperature = 45
        # GPUs fine but vLLM not: not ready either.
        engine.status = 503
        code, body = http_get(url)
        assert code == 503 and "answered 503" in body.splitlines()[-1]
        engine.close()
        code, body = http_get(url)
        assert code == 503 and "did not answer" in body.splitlines()[-1]
        # A fatal XID the launcher saw.
        engine = FakeEngine()
        launcher.role = launcher.role.model_copy(update={"engine_port": engine.port})
        assert http_get(url)[0] == 200
        launcher.state.add_xid(0, 79)
        code, body = http_get(url)
        assert code == 503 and "GPU 0 reported XID 79 (fatal" in body
        # The gauges are still served beside it; other paths are not.
        code, text = http_get(f"http://127.0.0.1:{port}{contract.METRICS_PATH}")
        assert code == 200 and promtext.value(text, contract.GPU_METRIC_VISIBLE) == 2
        assert http_get(f"http://127.0.0.1:{port}/nothing")[0] == 404
    finally:
        server.shutdown()
        engine.close()
    # Each turn between healthy and unhealthy is logged once, with its reason; not every probe.
    verdicts = [line.removeprefix("pod health: ") for line in logs if line.startswith("pod health: ")]
    assert [v.split(":")[0] for v in verdicts] == ["unhealthy", "healthy", "unhealthy", "healthy", "unhealthy"], verdicts
    assert verdicts[2] == "unhealthy: GPU 1 is hot: 95 C >= 87 C"


def test_a_worker_stage_health_needs_its_gpus_and_ray_not_an_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install_fake_nvml(monkeypatch, [FakeGpu()])
    launcher, _ = _launcher(tmp_path, tensor_parallel_size=1, stage_index=1, pipeline_parallel_size=2,
                            engine_port=free_port())
    launcher.state.phase(statefile.PHASE_WAITING_LEADER, "leader.svc:6379")
    healthy, lines = launcher.pod_health()
    assert not healthy and lines[0].startswith("launcher: waiting-for-leader")
    launcher.state.phase(statefile.PHASE_RUNNING, "Ray worker joined")
    healthy, lines = launcher.pod_health()
    assert healthy, lines
    assert not any(line.startswith("engine:") for line in lines), "stage > 0 serves no HTTP"


def test_no_nvml_is_not_ready(tmp_path: Path) -> None:
    """This machine has no driver: a GPU pod that cannot read its GPUs is not ready."""
    engine = FakeEngine()
    try:
        launcher, _ = _launcher(tmp_path, engine_port=engine.port)
        launcher.state.phase(statefile.PHASE_RUNNING)
        healthy, lines = launcher.pod_health()
    finally:
        engine.close()
    assert not healthy and "cannot check GPU health" in lines[-1]


def test_the_launcher_stops_when_it_cannot_serve_its_health(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import socket

    from tensorfleet.worker.errors import EXIT_START_FAILED, WorkerError

    install_fake_nvml(monkeypatch, [FakeGpu(), FakeGpu()])
    launcher, _ = _launcher(tmp_path)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", launcher.role.gpu_metrics_port))
        taken.listen()
        with pytest.raises(WorkerError) as caught:
            launcher.prepare()
        launcher.close()
    assert caught.value.code == EXIT_START_FAILED
    assert f":{launcher.role.gpu_metrics_port}" in str(caught.value) and "readiness" in str(caught.value)


# --- CPU mode: vLLM's CPU backend (accelerator CPU) -------------------------------------


def _no_gpu_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if anything reads NVML or starts the XID watcher."""
    def refused(*_: Any, **__: Any) -> Any:
        raise AssertionError("CPU mode touched NVML")

    monkeypatch.setattr(gpus, "sample", refused)
    monkeypatch.setattr(gpus, "XidWatcher", refused)


def test_cpu_mode_health_is_the_launcher_and_vllm_without_nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A CPU engine pod's readiness: the launcher runs its engine and vLLM's /health answers 200. No NVML, no
    XID watcher, no GPU gauges; the launcher serves /health on its port all the same."""
    _no_gpu_calls(monkeypatch)
    engine = FakeEngine()
    launcher, logs = _launcher(tmp_path, engine_port=engine.port, tensor_parallel_size=1,
                               accelerator=contract.CPU_ACCELERATOR)
    assert launcher.role.cpu
    port = launcher.role.gpu_metrics_port
    url = f"http://127.0.0.1:{port}{contract.HEALTH_PATH}"
    try:
        launcher.prepare()
        code, body = http_get(url)
        assert code == 503 and body.startswith("launcher: starting")
        launcher.state.phase(statefile.PHASE_RUNNING, "engine `vllm serve`")
        code, body = _until_ready(url)
        assert f"engine: http://127.0.0.1:{engine.port}/health answered 200" in body
        assert "engine: warmed up" in body
        assert "CPU mode" in body and body.splitlines()[-1] == "healthy"
        # vLLM not ready (loading, or broken): not ready either.
        engine.status = 503
        code, body = http_get(url)
        assert code == 503 and "answered 503" in body.splitlines()[-1]
        engine.close()
        code, body = http_get(url)
        assert code == 503 and "did not answer" in body.splitlines()[-1]
        # The launcher gone: its phase no longer counts.
        engine = FakeEngine()
        launcher.role = launcher.role.model_copy(update={"engine_port": engine.port})
        assert http_get(url)[0] == 200
        launcher.state.phase(statefile.PHASE_STOPPING)
        assert http_get(url)[0] == 503
        # No GPU gauges are served (nothing for a PodMonitor to find); /health alone.
        assert http_get(f"http://127.0.0.1:{port}{contract.METRICS_PATH}")[0] == 404
    finally:
        launcher.close()
        engine.close()
    assert any(line.startswith("CPU mode") for line in logs)
    assert not any("GPU metrics" in line for line in logs)


def _until_ready(url: str, bound: float = 10.0) -> tuple[int, str]:
    """The pod's /health once it answers 200 (the warm-up runs on a thread of its own)."""
    deadline = time.monotonic() + bound
    code, body = http_get(url)
    while code != 200 and time.monotonic() < deadline:
        time.sleep(0.02)
        code, body = http_get(url)
    assert code == 200, body
    return code, body


def _until_healthy(launcher: Any, bound: float = 10.0) -> tuple[bool, list[str]]:
    """The launcher's verdict once healthy, or its last one after BOUND seconds."""
    deadline = time.monotonic() + bound
    healthy, lines = launcher.pod_health()
    while not healthy and time.monotonic() < deadline:
        time.sleep(0.02)
        healthy, lines = launcher.pod_health()
    return healthy, lines


def _cpu_launcher(tmp_path: Path, engine: FakeEngine) -> Any:
    launcher, logs = _launcher(tmp_path, engine_port=engine.port, tensor_parallel_size=1,
                               accelerator=contract.CPU_ACCELERATOR, served_model_name="served-name")
    launcher.state.phase(statefile.PHASE_RUNNING, "engine `vllm serve`")
    return launcher, logs


def test_a_cpu_engine_turns_ready_only_once_warmed_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """vLLM's CPU backend compiles on its first generations (20-35 s on 2 cores): the pod stays out of its
    Service, saying so, until one sampled and one greedy generation of the served model have answered."""
    _no_gpu_calls(monkeypatch)
    engine = FakeEngine()
    engine.generate.clear()   # the first generation "compiles" until released
    try:
        launcher, logs = _cpu_launcher(tmp_path, engine)
        healthy, lines = launcher.pod_health()
        assert not healthy and lines[-1].startswith("unhealthy: engine: warming up ("), lines
        # The warm-up's request is sent from a thread of its own: it reaches the engine soon, not at once.
        deadline = time.monotonic() + 10
        while not engine.generations and time.monotonic() < deadline:
            time.sleep(0.02)
        for _ in range(3):
            healthy, lines = launcher.pod_health()
            assert not healthy and lines[-1].startswith("unhealthy: engine: warming up ("), lines
        time.sleep(0.2)
        assert len(engine.generations) == 1, "one warm-up at a time, started once"
        engine.generate.set()
        healthy, lines = _until_healthy(launcher)
        assert healthy and "engine: warmed up" in lines, lines
    finally:
        engine.close()
    assert [g["model"] for g in engine.generations] == ["served-name", "served-name"]
    assert sorted(g["temperature"] for g in engine.generations) == [0.0, 1.0]
    assert any(line.startswith("engine warmed up in ") for line in logs), logs
    # Warmed up once: an engine that restarts its /health later is judged on /health alone.
    engine_again = FakeEngine()
    try:
        launcher.role = launcher.role.model_copy(update={"engine_port": engine_again.port})
        assert launcher.pod_health()[0] and not engine_again.generations
    finally:
        engine_again.close()


def test_a_failed_warm_up_does_not_keep_a_cpu_engine_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A warm-up the engine refuses (a model that cannot generate, say) is logged and the pod turns Ready."""
    _no_gpu_calls(monkeypatch)
    engine = FakeEngine()
    engine.generate_status = 400
    try:
        launcher, logs = _cpu_launcher(tmp_path, engine)
        assert _until_healthy(launcher)[0]
    finally:
        engine.close()
    assert len(engine.generations) == 1
    warning = next(line for line in logs if "warm-up failed" in line)
    assert "answered 400" in warning and "turning Ready without it" in warning


def test_gpu_pods_do_not_warm_up(tmp_path: Path) -> None:
    """The GPU backend captures its graphs at start-up: no warm-up generation before Ready."""
    launcher, _ = _launcher(tmp_path, accelerator="H100-80GB")
    assert launcher.warmup is None


def test_a_gpu_pod_without_nvml_stays_unhealthy_whatever_its_engine_says(tmp_path: Path) -> None:
    """CPU mode comes from the plan (TF_ACCELERATOR), never from NVML failing: a GPU pod on this machine (no
    driver) with vLLM answering 200 and its launcher running is not ready."""
    engine = FakeEngine()
    try:
        launcher, _ = _launcher(tmp_path, engine_port=engine.port, accelerator="H100-80GB")
        assert not launcher.role.cpu
        launcher.state.phase(statefile.PHASE_RUNNING)
        healthy, lines = launcher.pod_health()
    finally:
        engine.close()
    assert not healthy
    assert f"engine: http://127.0.0.1:{engine.port}/health answered 200" in lines
    assert "cannot check GPU health" in lines[-1]


def test_the_health_command_in_cpu_mode(monkeypatch: pytest.MonkeyPatch, run_health: Any, tmp_path: Path) -> None:
    """`tensorfleet-worker health` reads CPU mode from the pod env: exit 0 without NVML once the launcher runs
    its engine; the same env with a GPU type still exits 3 (no NVML here)."""
    monkeypatch.setenv(contract.ENV_TENSOR_PARALLEL, "1")
    monkeypatch.setenv(contract.ENV_ACCELERATOR, "L4")
    assert run_health()[0] == EXIT_NO_NVML
    monkeypatch.setenv(contract.ENV_ACCELERATOR, contract.CPU_ACCELERATOR)
    _no_gpu_calls(monkeypatch)
    path = tmp_path / "state.json"
    state = statefile.StateFile(path)
    state.phase(statefile.PHASE_STARTING)
    code, out, _ = run_health("--state-file", str(path))
    assert code == EXIT_UNHEALTHY and out.startswith("launcher: starting")
    state.phase(statefile.PHASE_RUNNING, "engine `vllm serve`")
    code, out, _ = run_health("--state-file", str(path), "--json")
    doc = json.loads(out)
    assert code == EXIT_OK and doc["healthy"] is True and doc["cpu"] is True
    # A simulator never is in CPU mode, whatever its accelerator says.
    monkeypatch.setenv(contract.ENV_ENGINE_KIND, "simulator")
    code, out, _ = run_health("--state-file", str(path))
    assert code == EXIT_OK and "simulator mode" in out
