"""Role -> the argv lists the launcher runs, in order. Pure: no I/O.

Every command is an argv list handed to the OS as is: no shell, so extra
engine args from the spec stay one item each, whatever characters they hold.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorfleet import contract
from tensorfleet.worker.role import Role, worker_hosts

VLLM = "vllm"
RAY = "ray"
REDACTED = "<redacted>"
# Whole words of a variable name (TF_KV_CACHE_TOKENS is a size, not a secret).
_SECRET_NAME = re.compile(
    r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY)(_|$)", re.IGNORECASE)

# Step names, as --print-command shows them.
STEP_RAY_HEAD = "ray-head"
STEP_WAIT_CLUSTER = "wait-for-ray-cluster"
STEP_WAIT_LEADER = "wait-for-leader"
STEP_RAY_WORKER = "ray-worker"
STEP_IDLE = "idle"
STEP_ENGINE = "engine"


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...] | None = None   # None: a wait the launcher does itself
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.name}
        if self.argv is not None:
            out["argv"] = list(self.argv)
        out.update(self.detail)
        return out


def _flag(argv: list[str], flag: str, value: object | None) -> None:
    if value is not None:
        argv += [flag, str(value)]


def vllm_argv(role: Role) -> list[str]:
    """`vllm serve MODEL ...`; flags the operator manages, then the user's extra args as given."""
    argv = [VLLM, "serve", role.model, "--port", str(role.engine_port),
            "--served-model-name", role.served_model_name,
            "--tensor-parallel-size", str(role.tensor_parallel_size)]
    if role.multi_node:
        argv += ["--pipeline-parallel-size", str(role.pipeline_parallel_size),
                 "--distributed-executor-backend", "ray"]
    _flag(argv, "--revision", role.model_revision)
    _flag(argv, "--dtype", role.dtype)
    _flag(argv, "--quantization", role.quantization)
    _flag(argv, "--kv-cache-dtype", role.kv_cache_dtype)
    _flag(argv, "--max-model-len", role.max_model_len)
    _flag(argv, "--gpu-memory-utilization", role.gpu_memory_utilization)
    _flag(argv, "--max-num-seqs", role.max_num_seqs)
    return argv + list(role.extra_args)


def simulator_argv(role: Role) -> list[str]:
    """`tensorfleet sim` with the same port, model name and sizing; extra vLLM flags pass through."""
    argv = [*contract.SIMULATOR_COMMAND, "--host", "0.0.0.0", "--port", str(role.engine_port),
            "--served-model-name", role.served_model_name, "--model", role.model]
    _flag(argv, "--accelerator", role.accelerator)
    argv += ["--tensor-parallel-size", str(role.tensor_parallel_size)]
    _flag(argv, "--max-model-len", role.max_model_len)
    _flag(argv, "--max-num-seqs", role.max_num_seqs)
    _flag(argv, "--kv-cache-tokens", role.kv_cache_tokens)
    return argv + list(role.extra_args)


def engine_argv(role: Role) -> list[str]:
    return simulator_argv(role) if role.simulator else vllm_argv(role)


def ray_head_argv(role: Role) -> list[str]:
    return [RAY, "start", "--head", f"--port={role.ray_port}", "--disable-usage-stats"]


def ray_status_argv() -> list[str]:
    # No --address: the head runs in this container and Ray finds it.
    return [RAY, "status"]


def ray_worker_argv(role: Role) -> list[str]:
    return [RAY, "start", f"--address={role.leader_address}:{role.ray_port}", "--block", "--disable-usage-stats"]


def ray_stop_argv() -> list[str]:
    return [RAY, "stop"]


def idle_argv() -> list[str]:
    """Stands in for a Ray worker in simulator mode: sleeps until signalled."""
    return [sys.executable, "-m", "tensorfleet.worker.idle"]


def steps(role: Role) -> list[Step]:
    """What this role runs, in order."""
    if not role.multi_node:
        return [Step(STEP_ENGINE, tuple(engine_argv(role)))]
    if role.leader:
        if role.simulator:
            return [Step(STEP_ENGINE, tuple(engine_argv(role)))]
        return [
            Step(STEP_RAY_HEAD, tuple(ray_head_argv(role))),
            Step(STEP_WAIT_CLUSTER, tuple(ray_status_argv()), {
                "untilNodes": role.pipeline_parallel_size,
                "untilGPUs": role.expected_gpus,
                "workers": [host for _, host in worker_hosts(role)],
            }),
            Step(STEP_ENGINE, tuple(engine_argv(role))),
        ]
    wait = Step(STEP_WAIT_LEADER, None, {"leader": role.leader_address, "port": role.leader_port})
    if role.simulator:
        return [wait, Step(STEP_IDLE, tuple(idle_argv()))]
    return [wait, Step(STEP_RAY_WORKER, tuple(ray_worker_argv(role)))]


def redact_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The env as passed to the engine, with secret-looking values replaced."""
    return {
        name: (REDACTED if value and (name == contract.ENV_HF_TOKEN or _SECRET_NAME.search(name)) else value)
        for name, value in sorted(environ.items())
    }


def print_document(role: Role, environ: Mapping[str, str]) -> dict[str, Any]:
    """What `--print-command` prints."""
    planned = steps(role)
    return {
        "role": role.name,
        "engine": role.engine_kind,
        "group": role.group_index,
        "stage": role.stage_index,
        "tensorParallelSize": role.tensor_parallel_size,
        "pipelineParallelSize": role.pipeline_parallel_size,
        "leaderAddress": role.leader_address,
        "steps": [step.to_json() for step in planned],
        "commands": [list(step.argv) for step in planned if step.argv is not None],
        # Run when the engine or the Ray worker has exited, best effort.
        "onExit": [ray_stop_argv()] if role.multi_node and not role.simulator else [],
        "env": redact_env(environ),
    }
