"""Role -> the argv lists the launcher runs, in order, with the engine's flags from the rows of
`tensorfleet.engine_settings`. No shell: extra engine args stay one item each, and one that would override a flag
the operator sets is refused here too. Pure: no I/O. Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorfleet import contract
from tensorfleet.engine_settings import BY_FIELD, EXECUTOR_FLAG, HOST_FLAG, SETTINGS, Setting, refused_engine_arg
from tensorfleet.worker.errors import EXIT_CONFIG, WorkerError
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


# The flags each command line opens with, in this order (who and where, as `ps`
# shows it); every other row of the settings table that the command takes
# follows in the table's order, each flag left out while its value is unset.
_VLLM_FIRST = ("engine_port", "served_model_name", "tensor_parallel_size", "pipeline_parallel_size")
_SIM_FIRST = ("engine_port", "served_model_name", "model", "accelerator", "tensor_parallel_size")
_SIMULATOR_HOST = "0.0.0.0"
_RAY_EXECUTOR = "ray"


def _in_order(first: tuple[str, ...]) -> list[Setting]:
    return [BY_FIELD[name] for name in first] + [setting for setting in SETTINGS if setting.field not in first]


def _flag(argv: list[str], flag: str, value: object | None) -> None:
    """FLAG VALUE; a switch (a bool) is the flag alone when true; None and false add nothing."""
    if isinstance(value, bool):
        if value:
            argv.append(flag)
    elif value is not None:
        argv += [flag, str(value)]


def extra_args(role: Role) -> list[str]:
    """The user's extra args, refused when one would override a flag the operator sets."""
    for index, item in enumerate(role.extra_args):
        refused = refused_engine_arg(item)
        if refused is not None:
            raise WorkerError(f"{contract.ENV_EXTRA_ARGS}[{index}]: {refused.message()} "
                              "(spec.engine.args; the operator refuses it there too)", EXIT_CONFIG)
    return list(role.extra_args)


def vllm_argv(role: Role) -> list[str]:
    """`vllm serve MODEL ...`; flags the operator manages, then the user's extra args as given."""
    argv = [VLLM, "serve", role.model]
    for setting in _in_order(_VLLM_FIRST):
        if setting.vllm_flag is None or setting.field == "model":  # the model is the positional argument
            continue
        if setting.field == "pipeline_parallel_size":
            # One stage needs no flag; more run over Ray.
            if role.multi_node:
                argv += [setting.vllm_flag, str(role.pipeline_parallel_size), EXECUTOR_FLAG, _RAY_EXECUTOR]
            continue
        _flag(argv, setting.vllm_flag, getattr(role, setting.field))
    return argv + extra_args(role)


def simulator_argv(role: Role) -> list[str]:
    """`tensorfleet sim` with the same port, model name and sizing; extra vLLM flags pass through."""
    argv = [*contract.SIMULATOR_COMMAND, HOST_FLAG, _SIMULATOR_HOST]
    for setting in _in_order(_SIM_FIRST):
        if setting.sim_flag is not None:
            _flag(argv, setting.sim_flag, getattr(role, setting.field))
    return argv + extra_args(role)


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


def cpu_thread_binding(cpus: Collection[int], tensor: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for TENSOR workers on the CPUS this pod may use: contiguous, equal shares,
    one per worker, each written as vLLM reads it ("0-3|4-7"); cores left over go unused."""
    ordered = sorted(cpus)
    share = len(ordered) // tensor
    if share < 1:
        raise WorkerError(f"tensor parallel {tensor} on vLLM's CPU backend needs a core per worker; this pod may use "
                          f"{len(ordered)} ({contract.ENV_CPU_OMP_THREADS_BIND} can bind them by hand)", EXIT_CONFIG)
    groups = [ordered[rank * share:(rank + 1) * share] for rank in range(tensor)]
    return "|".join(",".join(_ranges(group)) for group in groups)


def _ranges(cpus: list[int]) -> list[str]:
    out: list[str] = []
    start = previous = cpus[0]
    for cpu in [*cpus[1:], None]:
        if cpu is not None and cpu == previous + 1:
            previous = cpu
            continue
        out.append(str(start) if start == previous else f"{start}-{previous}")
        if cpu is not None:
            start = previous = cpu
    return out


def engine_environ(role: Role, environ: Mapping[str, str], cpus: Collection[int]) -> dict[str, str]:
    """The env the engine runs with: ENVIRON, plus on vLLM's CPU backend with tensor parallel the workers'
    thread binding over CPUS, unless the pod's env sets one."""
    out = dict(environ)
    if role.cpu and role.tensor_parallel_size > 1 and not out.get(contract.ENV_CPU_OMP_THREADS_BIND):
        out[contract.ENV_CPU_OMP_THREADS_BIND] = cpu_thread_binding(cpus, role.tensor_parallel_size)
    return out


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
