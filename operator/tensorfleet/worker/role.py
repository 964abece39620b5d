"""The launcher's role, parsed from the env the renderer writes (the rows of `tensorfleet.engine_settings`) and
checked here, so that a bad value stops the pod with one line naming the variable instead of a vLLM traceback
later. Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tensorfleet import contract, vllm_defaults
from tensorfleet.engine_settings import SETTINGS
from tensorfleet.worker.errors import EXIT_CONFIG, WorkerError

# env var -> Role field: everything the launcher reads from its env. A test checks it against what the renderer
# sets, both ways.
ENV_FIELDS: dict[str, str] = {setting.env: setting.field for setting in SETTINGS}
FIELD_ENV = {field: env for env, field in ENV_FIELDS.items()}

# Where each value comes from, for error messages.
_SOURCE: dict[str, str] = {setting.env: setting.source for setting in SETTINGS if setting.source}

_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_ORDINAL = re.compile(r"-(\d+)$")


class Role(BaseModel):
    """What this pod runs: its place in the group and the engine's settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_kind: Literal["vllm", "simulator"] = "vllm"
    inference_service: str | None = None
    namespace: str | None = None
    pod_name: str | None = None
    group_index: int = Field(default=0, ge=0)
    stage_index: int = Field(default=0, ge=0)
    leader_address: str | None = None
    ray_port: int = Field(default=contract.RAY_PORT, ge=1, le=65535)
    engine_port: int = Field(default=contract.ENGINE_PORT, ge=1, le=65535)
    tensor_parallel_size: int = Field(default=vllm_defaults.TENSOR_PARALLEL_SIZE, ge=1, le=64)
    pipeline_parallel_size: int = Field(default=vllm_defaults.PIPELINE_PARALLEL_SIZE, ge=1, le=64)
    model: str = Field(min_length=1)
    served_model_name: str = Field(min_length=1)
    model_revision: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    max_model_len: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    enable_lora: bool = False
    max_loras: int | None = Field(default=None, ge=1)
    max_lora_rank: int | None = Field(default=None, ge=1)
    max_cpu_loras: int | None = Field(default=None, ge=1)
    kv_transfer_config: str | None = None
    kv_events_config: str | None = None
    extra_args: tuple[str, ...] = ()
    accelerator: str | None = None
    kv_cache_tokens: int | None = Field(default=None, ge=0)
    gpu_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    simulated_gpu_state: str | None = None

    @property
    def simulator(self) -> bool:
        return self.engine_kind == "simulator"

    @property
    def cpu(self) -> bool:
        """vLLM on its CPU backend: the plan's accelerator (TF_ACCELERATOR) is CPU. No GPUs, so no NVML."""
        return not self.simulator and is_cpu_accelerator(self.accelerator)

    @property
    def multi_node(self) -> bool:
        return self.pipeline_parallel_size > 1

    @property
    def leader(self) -> bool:
        return self.stage_index == 0

    @property
    def name(self) -> str:
        """leader / worker, as the pods are labelled."""
        return contract.ROLE_LEADER if self.leader else contract.ROLE_WORKER

    @property
    def expected_gpus(self) -> int:
        """GPUs the whole group holds: tensor x pipeline."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def leader_port(self) -> int:
        """The leader's port a worker joins and watches: Ray's GCS, or the simulator's HTTP port."""
        return self.engine_port if self.simulator else self.ray_port

    def describe(self) -> str:
        where = f"{self.name}, group {self.group_index}, stage {self.stage_index} of {self.pipeline_parallel_size}"
        return f"{where}, tensor {self.tensor_parallel_size}, engine {self.engine_kind}"


def _get(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def expand_references(value: str, environ: Mapping[str, str], overrides: Mapping[str, str] | None = None) -> str:
    """Expand `$(VAR)` as the kubelet does (for env copied from a pod spec and run by hand)."""
    overrides = overrides or {}

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in overrides:
            return overrides[name]
        found = environ.get(name)
        return found if found is not None else match.group(0)

    return _VAR_REF.sub(sub, value.replace("$$", "\0")).replace("\0", "$")


def _extra_args(raw: str | None) -> tuple[str, ...]:
    if raw is None:
        return ()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise WorkerError(
            f"{contract.ENV_EXTRA_ARGS}={raw!r}: must be a JSON list of strings, one flag or value per item "
            f"(e.g. [\"--enable-prefix-caching\"]); the operator writes it from spec.engine.args",
            EXIT_CONFIG,
        )
    return tuple(value)


def _group_index(environ: Mapping[str, str], pod_name: str | None) -> tuple[str | None, bool]:
    """(group index, derived-from-pod-name)."""
    raw = _get(environ, contract.ENV_GROUP_INDEX)
    if raw is not None:
        return raw, False
    # Kubernetes < 1.28 has no pod-index label, so the fieldRef yields "":
    # a StatefulSet pod's name ends with its ordinal, which is the same number.
    if pod_name and (match := _ORDINAL.search(pod_name)):
        return match.group(1), True
    return None, False


def _leader_address(raw: str | None, environ: Mapping[str, str], group: str | None, isvc: str | None, derived: bool) -> str | None:
    if raw is None:
        return None
    overrides = {contract.ENV_GROUP_INDEX: group} if group is not None else {}
    address = expand_references(raw, environ, overrides)
    if derived and isvc and group is not None:
        # The kubelet expanded an empty pod-index label: `NAME-stage-0-.NAME-workers...`.
        broken = f"{contract.stage_name(isvc, 0)}-."
        if address.startswith(broken):
            address = f"{contract.stage_name(isvc, 0)}-{group}.{address[len(broken):]}"
    return address


def role_from_env(environ: Mapping[str, str]) -> Role:
    """Parse and check the launcher's env; raise WorkerError naming the variable."""
    raw = {field: _get(environ, env) for env, field in ENV_FIELDS.items()}
    if raw["model"] is None:
        raise WorkerError(
            f"{contract.ENV_MODEL} is not set: the operator sets it from spec.model.name; "
            "to run the launcher by hand, set it to a Hugging Face model id or a path",
        )
    group, derived = _group_index(environ, raw["pod_name"])
    raw["group_index"] = group
    if environ.get(contract.ENV_GROUP_INDEX) is not None and group is None:
        raise WorkerError(
            f"{contract.ENV_GROUP_INDEX} is empty and {contract.ENV_POD_NAME} has no ordinal: the pod lacks the "
            f"{contract.LABEL_POD_INDEX} label (Kubernetes >= 1.28 sets it on StatefulSet pods)",
        )
    raw["leader_address"] = _leader_address(raw["leader_address"], environ, group, raw["inference_service"], derived)
    extra_args = _extra_args(raw["extra_args"])
    raw["served_model_name"] = raw["served_model_name"] or raw["model"]
    values: dict[str, str | tuple[str, ...]] = {field: value for field, value in raw.items() if value is not None}
    values["extra_args"] = extra_args
    try:
        role = Role.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        env = FIELD_ENV.get(field, field)
        source = f" (the operator sets it from {_SOURCE[env]})" if env in _SOURCE else ""
        given = environ.get(env)
        raise WorkerError(f"{env}={given!r}: {error['msg'].lower()}{source}") from None
    if role.stage_index >= role.pipeline_parallel_size:
        raise WorkerError(
            f"{contract.ENV_STAGE_INDEX}={role.stage_index}: must be below "
            f"{contract.ENV_PIPELINE_PARALLEL}={role.pipeline_parallel_size}",
        )
    if role.multi_node and not role.leader_address:
        raise WorkerError(
            f"{contract.ENV_LEADER_ADDRESS} is not set: pipeline {role.pipeline_parallel_size} needs the "
            "group leader's DNS name (the operator sets it from the NAME-workers Service)",
        )
    if role.leader_address and "$(" in role.leader_address:
        raise WorkerError(
            f"{contract.ENV_LEADER_ADDRESS}={role.leader_address!r}: holds an unexpanded $(VAR) reference; "
            f"set the variables it names ({', '.join(_VAR_REF.findall(role.leader_address))})",
        )
    return role


def is_cpu_accelerator(accelerator: str | None) -> bool:
    """Whether TF_ACCELERATOR names vLLM's CPU backend (the renderer writes the plan's `CPU`; by hand, any case)."""
    return accelerator is not None and accelerator.strip().upper() == contract.CPU_ACCELERATOR


def cpu_backend(environ: Mapping[str, str]) -> bool:
    """`health`'s CPU mode: a vLLM pod whose plan is for the CPU backend (never guessed from NVML failing)."""
    kind = _get(environ, contract.ENV_ENGINE_KIND) or "vllm"
    return kind == "vllm" and is_cpu_accelerator(_get(environ, contract.ENV_ACCELERATOR))


def health_settings(environ: Mapping[str, str]) -> tuple[str, int | None]:
    """(engine kind, tensor size) for `health`, leniently: it also runs by hand on any GPU box."""
    kind = _get(environ, contract.ENV_ENGINE_KIND) or "vllm"
    tensor_raw = _get(environ, contract.ENV_TENSOR_PARALLEL)
    tensor = int(tensor_raw) if tensor_raw and tensor_raw.isdigit() and int(tensor_raw) > 0 else None
    return kind, tensor


def worker_hosts(role: Role) -> list[tuple[int, str]]:
    """(stage, DNS name) of the other stages' pods in this group, derived like the leader's name."""
    if not role.inference_service:
        return []
    leader_host = f"{contract.stage_name(role.inference_service, 0)}-{role.group_index}"
    rest = ""
    if role.leader_address and role.leader_address.startswith(leader_host + "."):
        rest = role.leader_address[len(leader_host):]
    return [
        (stage, f"{contract.stage_name(role.inference_service, stage)}-{role.group_index}{rest}")
        for stage in range(1, role.pipeline_parallel_size)
    ]
