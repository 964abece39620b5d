"""`tensorfleet-worker --print-command` for every role of every example, and the
env contract between the renderer and the launcher, both ways.

Pod envs are real: each example is rendered with `tensorfleet.render.render`,
and the engine container's env is resolved as the kubelet would (field refs,
secret refs, `$(VAR)` expansion) before the launcher reads it.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from worker_helpers import (
    SECRET_VALUE,
    base_env,
    example_docs,
    kubelet_env,
    pod_env,
    rendered_engine_containers,
    run_worker,
)

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.engine_settings import WORKER_ENV_VARS
from tensorfleet.planner import make_plan
from tensorfleet.worker import command
from tensorfleet.worker.errors import EXIT_CONFIG, WorkerError
from tensorfleet.worker.role import ENV_FIELDS, health_settings, role_from_env

SHELLS = {"sh", "bash", "/bin/sh", "/bin/bash", "dash", "zsh"}
WORKER_PACKAGE = Path(__file__).resolve().parent.parent / "operator" / "tensorfleet" / "worker"

# Every optional field set, and extra args a shell would mangle.
FULL: dict[str, Any] = {
    "apiVersion": contract.API_VERSION,
    "kind": contract.KIND,
    "metadata": {"name": "full", "namespace": "ml"},
    "spec": {
        "model": {"name": "mistralai/Mixtral-8x7B-Instruct-v0.1", "servedName": "mixtral", "revision": "v0.1-fix",
                  "dtype": "bfloat16", "quantization": "fp8", "maxModelLen": 8192},
        "engine": {
            "kvCacheDtype": "fp8", "gpuMemoryUtilization": 0.85, "maxNumSeqs": 128,
            "args": ["--enable-prefix-caching", "--override-generation-config", '{"temperature": 0.5, "top_p": 0.9}',
                     "--chat-template", "{{ messages }}; echo $(whoami) && rm -rf / `id` 'quoted' \"dq\"",
                     "--max-num-batched-tokens=4096"],
            "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        },
        "parallelism": {"tensor": 2, "pipeline": 2},
        "accelerator": {"type": "H100-80GB"},
        "replicas": 2,
        "hfTokenSecretRef": {"name": "hf", "key": "token"},
    },
}

CASES: list[tuple[str, dict[str, Any]]] = [*example_docs(), ("full", FULL)]


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _roles() -> list[tuple[str, dict[str, Any], int, int]]:
    """(case, doc, stage, group) for stage 0 and the last stage, groups 0 and 1 where there are two."""
    out = []
    for case, doc in CASES:
        isvc = load_inference_service(doc)
        plan = make_plan(isvc.spec)
        stages = sorted({0, plan.pipeline - 1})
        for stage in stages:
            for group in (0, 1):
                out.append((case, doc, stage, group))
    return out


ROLES = _roles()


def _print_command(env: dict[str, str]) -> dict[str, Any]:
    done = run_worker(["--print-command"], base_env(env))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return json.loads(done.stdout)


def _check_engine_argv(argv: list[str], doc: dict[str, Any], pipeline: int) -> None:
    isvc = load_inference_service(doc)
    spec, plan = isvc.spec, make_plan(isvc.spec)
    served = spec.model.served_name or spec.model.name
    assert argv[0] not in SHELLS and "-c" not in argv
    assert all(isinstance(item, str) for item in argv)
    if spec.engine.kind == "simulator":
        assert argv[:2] == list(contract.SIMULATOR_COMMAND)
        assert _flag(argv, "--port") == str(contract.ENGINE_PORT)
        assert _flag(argv, "--served-model-name") == served
        assert _flag(argv, "--model") == spec.model.name
        assert _flag(argv, "--accelerator") == plan.accelerator
        assert _flag(argv, "--tensor-parallel-size") == str(plan.tensor)
        assert _flag(argv, "--max-model-len") == str(plan.max_model_len)
        assert _flag(argv, "--max-num-seqs") == str(plan.max_num_seqs)
        assert _flag(argv, "--kv-cache-tokens") == str(plan.kv_cache_tokens)
    else:
        assert argv[:3] == ["vllm", "serve", spec.model.name]
        assert _flag(argv, "--port") == str(contract.ENGINE_PORT)
        assert _flag(argv, "--served-model-name") == served
        assert _flag(argv, "--tensor-parallel-size") == str(plan.tensor)
        assert _flag(argv, "--max-model-len") == str(plan.max_model_len)
        if plan.cpu:
            # vLLM's CPU backend allocates the KV cache the pod env names (VLLM_CPU_KVCACHE_SPACE) instead.
            assert "--gpu-memory-utilization" not in argv
        else:
            assert _flag(argv, "--gpu-memory-utilization") == str(spec.engine.gpu_memory_utilization)
        # The spec's dtype, `auto` included: vLLM then follows the checkpoint (an fp16 or AWQ one stays
        # float16). This used to be the planner's resolved dtype, so `auto` always ran as bfloat16.
        assert _flag(argv, "--dtype") == plan.engine_dtype == spec.model.dtype
        assert _flag(argv, "--kv-cache-dtype") == spec.engine.kv_cache_dtype
        assert _flag(argv, "--max-num-seqs") == str(plan.max_num_seqs)
        assert _flag(argv, "--revision") == spec.model.revision
        quantization = spec.model.quantization if spec.model.quantization != "none" else None
        assert _flag(argv, "--quantization") == quantization
        if pipeline > 1:
            assert _flag(argv, "--pipeline-parallel-size") == str(pipeline)
            assert _flag(argv, "--distributed-executor-backend") == "ray"
        else:
            assert "--pipeline-parallel-size" not in argv and "--distributed-executor-backend" not in argv
        # No flag the operator manages appears twice.
        for flag in ("--port", "--served-model-name", "--tensor-parallel-size", "--max-model-len"):
            assert argv.count(flag) == 1
    # The user's extra args come last, one argv item each, untouched.
    extra = list(spec.engine.args)
    assert argv[len(argv) - len(extra):] == extra


@pytest.mark.parametrize(("case", "doc", "stage", "group"), ROLES,
                         ids=[f"{c}-stage{s}-group{g}" for c, _, s, g in ROLES])
def test_print_command_for_every_role(case: str, doc: dict[str, Any], stage: int, group: int) -> None:
    isvc = load_inference_service(doc)
    plan = make_plan(isvc.spec)
    name, namespace = isvc.name, isvc.metadata.namespace or "default"
    env = pod_env(doc, stage, group)
    out = _print_command(env)
    leader = f"{contract.stage_name(name, 0)}-{group}.{contract.workers_service_name(name)}.{namespace}.svc"

    assert out["stage"] == stage and out["group"] == group
    assert out["tensorParallelSize"] == plan.tensor and out["pipelineParallelSize"] == plan.pipeline
    assert out["role"] == (contract.ROLE_LEADER if stage == 0 else contract.ROLE_WORKER)
    assert out["leaderAddress"] == leader
    steps = [s["step"] for s in out["steps"]]
    simulator = isvc.spec.engine.kind == "simulator"

    if plan.pipeline == 1 or (stage == 0 and simulator):
        assert steps == [command.STEP_ENGINE]
        _check_engine_argv(out["commands"][0], doc, plan.pipeline)
        assert out["onExit"] == []
    elif stage == 0:
        assert steps == [command.STEP_RAY_HEAD, command.STEP_WAIT_CLUSTER, command.STEP_ENGINE]
        head, status, engine = out["commands"]
        assert head == ["ray", "start", "--head", f"--port={contract.RAY_PORT}", "--disable-usage-stats"]
        assert status == ["ray", "status"]
        wait = out["steps"][1]
        assert wait["untilNodes"] == plan.pipeline and wait["untilGPUs"] == plan.tensor * plan.pipeline
        assert wait["workers"] == [
            f"{contract.stage_name(name, k)}-{group}.{contract.workers_service_name(name)}.{namespace}.svc"
            for k in range(1, plan.pipeline)
        ]
        _check_engine_argv(engine, doc, plan.pipeline)
        assert out["onExit"] == [["ray", "stop"]]
    else:
        wait = out["steps"][0]
        assert wait == {"step": command.STEP_WAIT_LEADER, "leader": leader,
                        "port": contract.ENGINE_PORT if simulator else contract.RAY_PORT}
        if simulator:
            assert steps == [command.STEP_WAIT_LEADER, command.STEP_IDLE]
            assert out["commands"][0][1:] == ["-m", "tensorfleet.worker.idle"]
        else:
            assert steps == [command.STEP_WAIT_LEADER, command.STEP_RAY_WORKER]
            assert out["commands"] == [["ray", "start", f"--address={leader}:{contract.RAY_PORT}", "--block",
                                        "--disable-usage-stats"]]

    # The env the engine gets is the pod's, with secrets redacted.
    shown = out["env"]
    for key, value in env.items():
        if key == contract.ENV_HF_TOKEN:
            assert shown[key] == command.REDACTED
        else:
            assert shown[key] == value
    assert SECRET_VALUE not in json.dumps(out)


def test_extra_args_survive_as_argv_items() -> None:
    role = role_from_env(pod_env(FULL, 0))
    argv = command.vllm_argv(role)
    assert argv[-6:] == FULL["spec"]["engine"]["args"]
    assert "{{ messages }}; echo $(whoami) && rm -rf / `id` 'quoted' \"dq\"" in argv


def test_pod_index_label_missing_falls_back_to_the_pod_ordinal() -> None:
    """Kubernetes < 1.28: the fieldRef to the pod-index label yields "" and the kubelet expands it so."""
    doc = FULL
    stage, container, _ = rendered_engine_containers(doc)[1]
    env = kubelet_env(container, namespace="ml", pod_name=f"{contract.stage_name('full', stage)}-3", pod_index=None)
    assert env[contract.ENV_GROUP_INDEX] == ""
    role = role_from_env(env)
    assert role.group_index == 3
    assert role.leader_address == f"{contract.stage_name('full', 0)}-3.{contract.workers_service_name('full')}.ml.svc"


def test_unexpanded_references_are_expanded_like_the_kubelet() -> None:
    """Env copied verbatim from the pod spec (to run by hand) still names the right leader."""
    env = {item["name"]: item["value"] for item in rendered_engine_containers(FULL)[1][1]["env"] if "value" in item}
    env.update({contract.ENV_GROUP_INDEX: "1", contract.ENV_NAMESPACE: "ml"})
    assert "$(" in env[contract.ENV_LEADER_ADDRESS]
    assert role_from_env(env).leader_address == f"full-stage-0-1.{contract.workers_service_name('full')}.ml.svc"


@pytest.mark.parametrize(("change", "message"), [
    ({contract.ENV_TENSOR_PARALLEL: "eight"}, f"{contract.ENV_TENSOR_PARALLEL}='eight'"),
    ({contract.ENV_PIPELINE_PARALLEL: "0"}, f"{contract.ENV_PIPELINE_PARALLEL}='0'"),
    ({contract.ENV_EXTRA_ARGS: "--enable-prefix-caching --swap-space 8"}, "must be a JSON list of strings"),
    ({contract.ENV_EXTRA_ARGS: '["--a", 3]'}, "must be a JSON list of strings"),
    ({contract.ENV_ENGINE_KIND: "tgi"}, f"{contract.ENV_ENGINE_KIND}='tgi'"),
    ({contract.ENV_STAGE_INDEX: "2"}, "must be below"),
    ({contract.ENV_MODEL: ""}, f"{contract.ENV_MODEL} is not set"),
    ({contract.ENV_LEADER_ADDRESS: ""}, f"{contract.ENV_LEADER_ADDRESS} is not set"),
    ({contract.ENV_GPU_MEMORY_UTILIZATION: "1.5"}, contract.ENV_GPU_MEMORY_UTILIZATION),
])
def test_bad_env_is_one_clear_line(change: dict[str, str], message: str) -> None:
    env = {**pod_env(FULL, 1), **change}
    with pytest.raises(WorkerError) as caught:
        role_from_env(env)
    assert message in str(caught.value) and caught.value.code == EXIT_CONFIG
    done = run_worker(["--print-command"], base_env(env))
    assert done.returncode == EXIT_CONFIG
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tensorfleet-worker: error: ") and message in lines[0]
    assert "Traceback" not in done.stderr


def test_bad_flag_is_one_line() -> None:
    done = run_worker(["--cluster-timeout", "soon", "--print-command"], base_env({contract.ENV_MODEL: "m"}))
    assert done.returncode == EXIT_CONFIG
    assert len(done.stderr.strip().splitlines()) == 1 and "--cluster-timeout" in done.stderr


def test_minimal_env_runs_by_hand() -> None:
    """On a single GPU box, TF_MODEL alone is enough."""
    out = _print_command({contract.ENV_MODEL: "Qwen/Qwen2.5-0.5B-Instruct"})
    assert out["commands"] == [["vllm", "serve", "Qwen/Qwen2.5-0.5B-Instruct", "--port", str(contract.ENGINE_PORT),
                                "--served-model-name", "Qwen/Qwen2.5-0.5B-Instruct", "--tensor-parallel-size", "1"]]


def test_secret_looking_env_is_redacted() -> None:
    shown = command.redact_env({"HF_TOKEN": "x", "AWS_SECRET_ACCESS_KEY": "y", "MY_API_KEY": "z",
                                "NCCL_DEBUG": "INFO", "HF_HOME": "/cache/huggingface", "EMPTY_TOKEN": ""})
    assert shown == {"AWS_SECRET_ACCESS_KEY": command.REDACTED, "EMPTY_TOKEN": "", "HF_HOME": "/cache/huggingface",
                     "HF_TOKEN": command.REDACTED, "MY_API_KEY": command.REDACTED, "NCCL_DEBUG": "INFO"}


# --- the env contract, both ways ----------------------------------------------

class RecordingEnv(dict[str, str]):
    """A mapping that remembers which names were looked up."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)


def _all_rendered_envs() -> list[tuple[str, dict[str, str], set[str]]]:
    """(case, kubelet env, names of the user's own env vars) for every stage of every case."""
    out = []
    for case, doc in CASES:
        user = {item["name"] for item in doc["spec"].get("engine", {}).get("env", [])}
        isvc = load_inference_service(doc)
        for stage in range(make_plan(isvc.spec).pipeline):
            out.append((f"{case}/stage{stage}", pod_env(doc, stage), user))
    return out


def test_launcher_reads_exactly_the_contract() -> None:
    # Every TF_ variable the contract names is a row of the settings table the launcher reads from.
    named = {value for key, value in vars(contract).items() if key.startswith("ENV_") and value.startswith("TF_")}
    assert set(ENV_FIELDS) == named
    assert list(ENV_FIELDS) == list(WORKER_ENV_VARS)


def test_every_var_the_renderer_sets_is_read_by_the_launcher() -> None:
    # Set by the renderer for vLLM and huggingface_hub themselves (HOME and USER: GPU engines
    # run as a uid stock vLLM images have no passwd entry for); the launcher passes them through.
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: vLLM's (and the simulator's) own switch, with LoRA.
    # VLLM_NIXL_SIDE_CHANNEL_*: vLLM's, with spec.prefill. VLLM_CPU_KVCACHE_SPACE: vLLM's, on accelerator CPU.
    passed_through = {contract.ENV_HF_HOME, contract.ENV_HF_TOKEN, contract.ENV_HOME, contract.ENV_USER,
                      contract.ENV_RUNTIME_LORA_UPDATING, contract.ENV_NIXL_SIDE_CHANNEL_HOST,
                      contract.ENV_NIXL_SIDE_CHANNEL_PORT, contract.ENV_CPU_KVCACHE_SPACE}
    for case, env, user in _all_rendered_envs():
        recording = RecordingEnv(env)
        role_from_env(recording)
        health_settings(recording)
        ours = set(env) - user - passed_through
        assert ours <= recording.read, f"{case}: rendered but never read: {sorted(ours - recording.read)}"
        assert set(env) - user <= set(WORKER_ENV_VARS) | passed_through


def test_every_var_the_launcher_reads_is_set_by_the_renderer() -> None:
    rendered: set[str] = set()
    read: set[str] = set()
    for _, env, _ in _all_rendered_envs():
        rendered |= set(env)
        recording = RecordingEnv(env)
        role_from_env(recording)
        health_settings(recording)
        read |= recording.read
    assert read <= rendered, f"read but never rendered: {sorted(read - rendered)}"
    assert set(WORKER_ENV_VARS) <= rendered


def test_no_env_name_is_spelled_outside_the_contract() -> None:
    """Worker code names variables through tensorfleet.contract only."""
    for path in WORKER_PACKAGE.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"[\"']TF_[A-Z_]+[\"']", text), f"{path.name} spells a TF_ variable"
        for value in (str(contract.ENGINE_PORT), str(contract.RAY_PORT), str(contract.WORKER_METRICS_PORT)):
            assert not re.search(rf"\b{value}\b", text), f"{path.name} spells port {value}"


def test_gpu_metrics_port_is_rendered_for_gpu_engines_and_simulators_of_a_gpu_type() -> None:
    gpu = pod_env(FULL, 0)
    assert gpu[contract.ENV_GPU_METRICS_PORT] == str(contract.WORKER_METRICS_PORT)
    assert contract.ENV_SIMULATED_GPU_STATE not in gpu, "a GPU engine's GPUs are real"
    sim = copy.deepcopy(FULL)
    sim["spec"]["engine"]["kind"] = "simulator"
    # A simulator standing in for a GPU pod serves the same port, from simulated GPUs (worker/simgpu.py).
    assert pod_env(sim, 0)[contract.ENV_GPU_METRICS_PORT] == str(contract.WORKER_METRICS_PORT)
    assert pod_env(sim, 0)[contract.ENV_SIMULATED_GPU_STATE] == contract.SIMULATED_GPU_STATE_PATH
    assert role_from_env(pod_env(sim, 1)).simulated_gpu_state == contract.SIMULATED_GPU_STATE_PATH
    assert role_from_env(gpu).gpu_metrics_port == contract.WORKER_METRICS_PORT
