"""`spec.accelerator.type: CPU`: vLLM on its CPU backend, planned, rendered and launched without a GPU.

Planner: the engine container's memory request is the device. It must hold the weights, the activations,
vLLM's own processes and a KV cache of whole GiB, which is what the pod env hands vLLM
(VLLM_CPU_KVCACHE_SPACE); what vLLM's CPU backend cannot run (tensor or pipeline > 1, an fp8 KV cache, the
simulator, disaggregated pools) is refused naming its field, and a request too small is refused with the
request that would fit. Renderer: no nvidia.com/gpu, no GPU node affinity, no GPU toleration, no GPU gauges
port, vLLM's CPU image; the readiness probe is the launcher's /health. Launcher (a real
`tensorfleet-worker` process, fake `vllm` on PATH): in CPU mode that /health needs no NVML and follows
vLLM's own /health; the same pod on a GPU type, on this machine without a driver, stays unready.
The CPU example's `vllm serve` command line is checked by real vLLM in tests/test_vllm_argv_contract.py.
"""

from __future__ import annotations

import copy
import signal
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from conftest import isvc_doc
from pod_security import pod_templates, violations
from worker_helpers import WORKER, base_env, example_docs, free_port, http_get, install_fakes, pod_env, wait_until

from tensorfleet import contract, vllm_defaults
from tensorfleet.api import load_inference_service
from tensorfleet.api.base import quantity_bytes
from tensorfleet.api.errors import SpecError
from tensorfleet.catalog import gpu_names
from tensorfleet.planner import Plan, make_plan, memory
from tensorfleet.planner.memory import GiB
from tensorfleet.render import render
from tensorfleet.render.meta import Images
from tensorfleet.worker import command
from tensorfleet.worker.errors import WorkerError
from tensorfleet.worker.role import role_from_env

K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
EXAMPLE = dict(example_docs())["cpu-tiny"]
MEMORY = "32Gi"


def cpu_doc(memory: str | None = MEMORY, **spec: Any) -> dict[str, Any]:
    """Llama 3.1 8B (maxModelLen 8192) on accelerator CPU with MEMORY requested, SPEC merged over it."""
    engine: dict[str, Any] = {"resources": {"requests": {"cpu": "8", "memory": memory}}} if memory else {}
    return isvc_doc({"accelerator": {"type": contract.CPU_ACCELERATOR}, "engine": engine, **spec}, name="cpu")


def plan_of(doc: dict[str, Any]) -> Plan:
    return make_plan(load_inference_service(doc).spec)


def refusal(doc: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as caught:
        plan_of(doc)
    return caught.value


def engine_containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o["spec"]["template"]["spec"]["containers"][0] for o in objects if o["kind"] == "StatefulSet"]


# --- planning --------------------------------------------------------------------------------------------


def test_the_memory_request_sizes_a_kv_cache_of_whole_gib() -> None:
    plan = plan_of(cpu_doc())
    assert plan.cpu and plan.accelerator == contract.CPU_ACCELERATOR
    assert (plan.tensor, plan.pipeline, plan.gpus_per_replica) == (1, 1, 0)
    assert plan.gpu_memory_bytes == plan.budget_bytes_per_gpu == quantity_bytes(MEMORY)
    # What is left beside the weights, the activations and vLLM's processes, rounded down to whole GiB.
    left = plan.budget_bytes_per_gpu - plan.weight_bytes_per_gpu - plan.activation_bytes_per_gpu \
        - plan.non_torch_bytes_per_gpu
    assert plan.kv_bytes_per_gpu == left // GiB * GiB == plan.cpu_kv_cache_gib * GiB
    assert plan.cpu_kv_cache_gib >= 1
    # The tokens vLLM's CPU backend makes of it: whole blocks of 128.
    block = vllm_defaults.CPU_BLOCK_SIZE
    assert plan.kv_cache_tokens == plan.kv_bytes_per_gpu // (block * plan.kv_bytes_per_token_per_gpu) * block
    assert plan.fits and plan.max_num_seqs == vllm_defaults.CPU_MAX_NUM_SEQS
    assert any(contract.ENV_CPU_KVCACHE_SPACE in note for note in plan.notes)


def test_more_memory_means_more_kv_cache_and_nothing_else() -> None:
    small, large = plan_of(cpu_doc("24Gi")), plan_of(cpu_doc("40Gi"))
    assert large.cpu_kv_cache_gib - small.cpu_kv_cache_gib == 16
    assert large.weight_bytes_per_gpu == small.weight_bytes_per_gpu
    assert large.kv_cache_tokens > small.kv_cache_tokens


def test_lora_comes_out_of_the_same_memory() -> None:
    adapters = [{"name": "sql", "source": "org/sql-lora", "rank": 16}]
    plain, lora = plan_of(cpu_doc()), plan_of(cpu_doc(adapters=adapters))
    assert lora.lora is not None and lora.lora_bytes_per_gpu > 0
    assert lora.kv_bytes_per_gpu <= plain.kv_bytes_per_gpu


@pytest.mark.parametrize(("change", "field", "says"), [
    ({"engine": {}}, "spec.engine.resources.requests.memory", "required with spec.accelerator.type CPU"),
    ({"engine": {"resources": {"requests": {"cpu": "8"}}}}, "spec.engine.resources.requests.memory", "e.g. 24Gi"),
    ({"parallelism": {"tensor": 3}}, "spec.parallelism.tensor", "does not divide the model's 32 attention heads"),
    ({"parallelism": {"pipeline": 2}}, "spec.parallelism.pipeline", "cannot span pods"),
    ({"engine": {"kvCacheDtype": "fp8", "resources": {"requests": {"memory": MEMORY}}}}, "spec.engine.kvCacheDtype",
     "use auto"),
    ({"engine": {"gpuMemoryUtilization": 0.9, "resources": {"requests": {"memory": MEMORY}}}},
     "spec.engine.gpuMemoryUtilization", "spec.engine.resources.requests.memory"),
    ({"engine": {"kind": "simulator", "resources": {"requests": {"memory": MEMORY}}}}, "spec.accelerator.type",
     "spec.engine.kind vllm"),
    ({"accelerator": {"type": "CPU", "gpusPerNode": 8}}, "spec.accelerator.gpusPerNode", "applies to GPU types"),
    ({"prefill": {"replicas": 1, "accelerator": {"type": "H100-80GB"}}}, "spec.accelerator.type", "colocated"),
], ids=["no-resources", "no-memory", "tensor-3", "pipeline-2", "fp8-kv-cache", "gpu-memory-utilization",
        "simulator", "gpus-per-node", "prefill"])
def test_what_the_cpu_backend_cannot_run_is_refused_naming_the_field(change: dict[str, Any], field: str,
                                                                     says: str) -> None:
    doc = cpu_doc()
    for key, value in change.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value} if key == "accelerator" else value
    error = refusal(doc)
    assert error.field == field, error
    assert says in error.message, error


def test_tensor_parallel_workers_share_the_request_each_with_its_own_kv_cache() -> None:
    one, two = plan_of(cpu_doc()), plan_of(cpu_doc(parallelism={"tensor": 2}))
    assert (one.tensor, two.tensor) == (1, 2) and two.gpus_per_replica == 0
    # Each worker: half the request, half the weights, its own vLLM process, a KV cache of whole GiB.
    assert two.budget_bytes_per_gpu == one.budget_bytes_per_gpu // 2
    assert two.weight_bytes_per_gpu < one.weight_bytes_per_gpu
    assert two.kv_bytes_per_gpu % GiB == 0 and two.kv_bytes_per_gpu > 0
    # Workers x (weights + activations + runtime + KV cache) stays within the request.
    used = two.tensor * (two.weight_bytes_per_gpu + two.activation_bytes_per_gpu + two.kv_bytes_per_gpu)
    assert used + memory.cpu_runtime_bytes(2) <= quantity_bytes(MEMORY)
    assert two.non_torch_bytes_per_gpu * 2 == memory.cpu_runtime_bytes(2)
    assert any("per tensor-parallel worker" in note for note in two.notes)


def test_a_request_too_small_for_tensor_parallel_workers_says_the_request_that_fits() -> None:
    error = refusal(cpu_doc("10Gi", parallelism={"tensor": 2}))
    assert error.field == "spec.engine.resources.requests.memory" and "2 tensor-parallel workers" in error.message
    needed = error.message.split("request at least ")[1].split("Gi")[0]
    assert plan_of(cpu_doc(f"{needed}Gi", parallelism={"tensor": 2})).fits
    assert refusal(cpu_doc(f"{int(needed) - 1}Gi", parallelism={"tensor": 2}))


def test_a_cpu_prefill_pool_is_refused() -> None:
    doc = isvc_doc({"prefill": {"replicas": 1, "accelerator": {"type": "CPU"}}})
    error = refusal(doc)
    assert error.field == "spec.prefill.accelerator.type" and "colocated" in error.message


def test_a_request_too_small_is_refused_with_the_request_that_fits() -> None:
    error = refusal(cpu_doc("12Gi"))
    assert error.field == "spec.engine.resources.requests.memory"
    assert "needs 15.0Gi of weights" in error.message and "choose a GPU type" in error.message
    wanted = int(error.message.split("request at least ")[1].split("Gi")[0])
    # The request it names serves one sequence of maxModelLen; one GiB less does not.
    assert plan_of(cpu_doc(f"{wanted}Gi")).fits
    assert "request at least" in refusal(cpu_doc(f"{wanted - 1}Gi")).message


def test_a_context_too_long_for_the_kv_cache_says_what_fits() -> None:
    doc = cpu_doc()
    doc["spec"]["model"]["maxModelLen"] = 131072
    error = refusal(doc)
    assert error.field == "spec.engine.resources.requests.memory"
    assert "fewer than one sequence of maxModelLen 131072" in error.message
    shorter = int(error.message.split("spec.model.maxModelLen <= ")[1].split(",")[0])
    doc["spec"]["model"]["maxModelLen"] = shorter
    assert plan_of(doc).fits


def test_the_accelerator_name_is_case_insensitive_and_listed_among_the_known_types() -> None:
    doc = cpu_doc()
    doc["spec"]["accelerator"]["type"] = "cpu"
    assert plan_of(doc).accelerator == contract.CPU_ACCELERATOR
    unknown = refusal(isvc_doc({"accelerator": {"type": "TPU-v5"}})).message
    assert unknown.endswith(f"known types: {', '.join([*gpu_names(), contract.CPU_ACCELERATOR])}")


def test_engine_env_may_not_set_the_kv_cache_space() -> None:
    doc = cpu_doc()
    doc["spec"]["engine"]["env"] = [{"name": contract.ENV_CPU_KVCACHE_SPACE, "value": "64"}]
    with pytest.raises(SpecError, match=r"^spec\.engine\.env.*set by the operator for accelerator CPU"):
        load_inference_service(doc)


@pytest.mark.parametrize(("text", "expected"), [
    ("24Gi", 24 * GiB), ("16G", 16 * 10**9), ("1.5Ti", 3 * 2**39), ("512000000", 512000000), ("0.5Gi", GiB // 2),
    ("100Mi", 100 * 2**20), ("2k", 2000),
])
def test_quantities(text: str, expected: int) -> None:
    assert quantity_bytes(text) == expected


# --- rendering -------------------------------------------------------------------------------------------


def test_a_cpu_pod_asks_for_no_gpu_in_any_way() -> None:
    isvc = load_inference_service(EXAMPLE)
    plan = make_plan(isvc.spec)
    objects = render(isvc, plan)
    text = repr(objects)
    assert contract.GPU_RESOURCE not in text and contract.GPU_PRODUCT_LABEL not in text
    for sts in (o for o in objects if o["kind"] == "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        assert "affinity" not in pod and "tolerations" not in pod
        [engine] = pod["containers"]
        assert engine["image"] == contract.VLLM_CPU_IMAGE
        assert engine["resources"] == EXAMPLE["spec"]["engine"]["resources"], "the user's, and nothing added"
        env = {item["name"]: item.get("value") for item in engine["env"]}
        assert env[contract.ENV_CPU_KVCACHE_SPACE] == str(plan.cpu_kv_cache_gib)
        assert env[contract.ENV_ACCELERATOR] == contract.CPU_ACCELERATOR
        assert contract.ENV_GPU_MEMORY_UTILIZATION not in env
        # The launcher's port is the pod's /health alone: no `gpu-metrics` for the PodMonitor to scrape.
        ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
        assert ports[contract.PORT_NAME_POD_HEALTH] == int(env[contract.ENV_GPU_METRICS_PORT])
        assert contract.PORT_NAME_GPU_METRICS not in ports
        assert engine["readinessProbe"]["httpGet"] == {"path": contract.HEALTH_PATH, "port": contract.PORT_NAME_POD_HEALTH}
        for probe in ("startupProbe", "livenessProbe"):
            assert engine[probe]["httpGet"] == {"path": contract.HEALTH_PATH, "port": contract.PORT_NAME_HTTP}
        # The launcher comes from the init container, as on GPU pods.
        assert engine["command"] == list(contract.LAUNCHER_COMMAND)
        assert [c["name"] for c in pod["initContainers"]] == [contract.LAUNCHER_INIT_CONTAINER]


def test_the_users_placement_is_kept_and_nothing_gpu_is_added() -> None:
    placement = {"type": "CPU", "nodeSelector": {"pool": "cpu"},
                 "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}]}
    doc = cpu_doc(accelerator=placement)
    [sts] = [o for o in render(load_inference_service(doc), plan_of(doc)) if o["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == placement["tolerations"]
    assert "affinity" not in pod


def test_the_cpu_image_follows_the_spec_then_the_operators_default() -> None:
    isvc = load_inference_service(EXAMPLE)
    plan = make_plan(isvc.spec)
    mirrored = Images(cpu_worker="mirror.example/vllm-cpu:1")
    assert {c["image"] for c in engine_containers(render(isvc, plan, images=mirrored))} == {"mirror.example/vllm-cpu:1"}
    own = copy.deepcopy(EXAMPLE)
    own["spec"]["engine"]["image"] = "own/vllm-cpu:2"
    isvc = load_inference_service(own)
    assert {c["image"] for c in engine_containers(render(isvc, plan, images=mirrored))} == {"own/vllm-cpu:2"}


CPU_CASES = {
    "example": EXAMPLE,
    "lora-placement": cpu_doc(adapters=[{"name": "sql", "source": "/cache/adapters/sql", "rank": 8}],
                              accelerator={"type": "CPU", "nodeSelector": {"pool": "cpu"}},
                              autoscaling={"minReplicas": 1, "maxReplicas": 4}),
}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_cpu_objects_validate_strictly_and_meet_restricted(case: str, version: str) -> None:
    doc = CPU_CASES[case]
    objects = render(load_inference_service(doc), plan_of(doc))
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    for name, pod, pod_annotations in pod_templates(objects):
        assert violations(pod, pod_annotations) == [], name


# --- the launcher: CPU mode ------------------------------------------------------------------------------


def test_the_launcher_reads_cpu_mode_from_the_plan() -> None:
    assert role_from_env(pod_env(EXAMPLE, 0)).cpu
    gpu = copy.deepcopy(EXAMPLE)
    gpu["spec"]["accelerator"] = {"type": "L4"}
    del gpu["spec"]["engine"]
    assert not role_from_env(pod_env(gpu, 0)).cpu


def _get(url: str) -> tuple[int, str]:
    """`http_get`, with a connection refused (or timed out) as status 0."""
    try:
        return http_get(url)
    except OSError as exc:
        return 0, str(exc)


def _launch(tmp_path: Path, doc: dict[str, Any]) -> tuple[subprocess.Popen[str], str, Path]:
    """`tensorfleet-worker` with DOC's stage-0 pod env (ports moved to free ones) and a fake vLLM that serves."""
    bin_dir = install_fakes(tmp_path)
    env = pod_env(doc, 0)
    health_port = free_port()
    env.update({contract.ENV_ENGINE_PORT: str(free_port()), contract.ENV_GPU_METRICS_PORT: str(health_port),
                contract.ENV_HF_HOME: str(tmp_path / "hf"), "FAKE_LOG": str(tmp_path / "calls.jsonl"),
                "FAKE_DIR": str(tmp_path), "FAKE_VLLM_SERVE": "1"})
    (tmp_path / "requests-done").write_text("")   # the fake engine reports nothing in flight: a quick drain
    stderr = tmp_path / "stderr.txt"
    proc = subprocess.Popen([WORKER, "--state-file", str(tmp_path / "state.json"), "--poll-interval", "0.05"],
                            env=base_env(env, path_first=bin_dir), stdout=subprocess.DEVNULL,
                            stderr=stderr.open("w"), text=True)
    return proc, f"http://127.0.0.1:{health_port}", stderr


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def test_a_cpu_engine_pod_becomes_ready_without_nvml(tmp_path: Path) -> None:
    proc, url, stderr = _launch(tmp_path, EXAMPLE)
    try:
        assert wait_until(lambda: _get(url + contract.HEALTH_PATH)[0] == 200, timeout=30), stderr.read_text()
        code, body = _get(url + contract.HEALTH_PATH)
        assert "launcher: running" in body and "answered 200" in body and "CPU mode" in body
        assert _get(url + contract.METRICS_PATH)[0] == 404, "no GPU gauges in CPU mode"
    finally:
        code = _stop(proc)
    assert code == 0, stderr.read_text()
    log = stderr.read_text()
    assert "CPU mode" in log and "GPUs cannot be checked" not in log and "Traceback" not in log


def test_the_same_pod_on_a_gpu_type_without_nvml_is_never_ready(tmp_path: Path) -> None:
    gpu = copy.deepcopy(EXAMPLE)
    gpu["spec"]["accelerator"] = {"type": "L4"}
    del gpu["spec"]["engine"]
    proc, url, stderr = _launch(tmp_path, gpu)
    try:
        # The launcher runs its engine, and vLLM answers; NVML cannot: unready, every time asked.
        assert wait_until(lambda: "answered 200" in _get(url + contract.HEALTH_PATH)[1], timeout=30), \
            stderr.read_text()
        for _ in range(3):
            code, body = _get(url + contract.HEALTH_PATH)
            assert code == 503 and "cannot check GPU health" in body
    finally:
        _stop(proc)
    assert "warning: GPUs cannot be checked" in stderr.read_text()


@pytest.mark.parametrize(("cpus", "tensor", "binding"), [
    ([0, 1], 2, "0|1"),
    (range(8), 2, "0-3|4-7"),
    (range(8), 4, "0-1|2-3|4-5|6-7"),
    ([0, 2, 3, 5, 6, 7], 2, "0,2-3|5-7"),
    (range(7), 2, "0-2|3-5"),  # the odd core goes unused: equal shares
    ([3], 1, "3"),
])
def test_tensor_parallel_workers_get_equal_shares_of_the_pods_cores(cpus: Any, tensor: int, binding: str) -> None:
    assert command.cpu_thread_binding(cpus, tensor) == binding


def test_more_workers_than_cores_is_one_clear_error() -> None:
    with pytest.raises(WorkerError) as caught:
        command.cpu_thread_binding([0, 1], 4)
    assert contract.ENV_CPU_OMP_THREADS_BIND in str(caught.value) and "2" in str(caught.value)


def test_the_engine_env_binds_cpu_workers_unless_the_pod_says_how() -> None:
    def role(accelerator: str, tensor: int) -> Any:
        doc = cpu_doc(parallelism={"tensor": tensor})
        doc["spec"]["accelerator"]["type"] = accelerator
        if accelerator != contract.CPU_ACCELERATOR:
            doc["spec"]["engine"] = {}
        return role_from_env(pod_env(doc, 0))

    cpu2, cpu1, gpu2 = role(contract.CPU_ACCELERATOR, 2), role(contract.CPU_ACCELERATOR, 1), role("H100-80GB", 2)
    assert command.engine_environ(cpu2, {}, [0, 1, 2, 3])[contract.ENV_CPU_OMP_THREADS_BIND] == "0-1|2-3"
    assert command.engine_environ(cpu2, {contract.ENV_CPU_OMP_THREADS_BIND: "0|2"}, [0, 1, 2, 3]) == {
        contract.ENV_CPU_OMP_THREADS_BIND: "0|2"}
    assert contract.ENV_CPU_OMP_THREADS_BIND not in command.engine_environ(cpu1, {}, [0, 1])
    assert contract.ENV_CPU_OMP_THREADS_BIND not in command.engine_environ(gpu2, {}, [0, 1])
