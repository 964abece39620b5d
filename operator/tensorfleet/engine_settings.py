"""Every setting the operator hands an engine pod, in one table.

One row per setting: the env var the renderer writes (named in
`tensorfleet.contract`), the `Role` field the worker launcher parses it into,
the InferenceService field it comes from, and the flags that carry it to the
engine: one of `vllm serve` and one of `tensorfleet sim` (None where that
engine does not take it). Everything else is derived from this table:

  render/engine.py    the pod env: one variable per row, in the table's order
                      (the order matters: `$(VAR)` expands only variables
                      defined earlier in the list)
  worker/role.py      ENV_FIELDS, what the launcher reads, and the spec field
                      its errors name
  worker/command.py   the flags of the vLLM and simulator command lines (a few
                      open each line in a fixed order, the rest follow the table's)
  api/models.py       REFUSED_ENGINE_FLAGS, the flags `spec.engine.args` may
                      not pass: every vLLM flag a row carries (a second copy
                      would silently fight the plan) and its short aliases
  api/models.py, crd  WORKER_ENV_VARS, the variables `spec.engine.env` may not
                      override

tests/test_engine_settings.py checks that every row reaches each of them.
Imports nothing but the contract: the API models and the worker image (which
has pydantic and pyyaml but no kopf or Kubernetes client) both import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from tensorfleet import contract


@dataclass(frozen=True)
class Setting:
    env: str                            # contract.ENV_*: the pod env var
    field: str                          # the launcher's Role field
    source: str | None = None           # where the operator takes it from, named in errors
    vllm_flag: str | None = None        # the `vllm serve` flag that carries it
    sim_flag: str | None = None         # the `tensorfleet sim` flag that carries it
    vllm_aliases: tuple[str, ...] = ()  # vLLM's other spellings of vllm_flag
    # What a refused vllm_flag tells the user to set instead, when not `source`.
    instead: str | None = None

    @property
    def refused(self) -> bool:
        """Whether `spec.engine.args` may not pass this setting's vLLM flag: true of every one the operator sets."""
        return self.vllm_flag is not None


SETTINGS: Final[tuple[Setting, ...]] = (
    Setting(contract.ENV_ENGINE_KIND, "engine_kind", "spec.engine.kind"),
    Setting(contract.ENV_INFERENCE_SERVICE, "inference_service"),
    Setting(contract.ENV_NAMESPACE, "namespace"),
    Setting(contract.ENV_POD_NAME, "pod_name"),
    Setting(contract.ENV_GROUP_INDEX, "group_index"),
    Setting(contract.ENV_STAGE_INDEX, "stage_index"),
    Setting(contract.ENV_LEADER_ADDRESS, "leader_address"),
    Setting(contract.ENV_RAY_PORT, "ray_port"),
    Setting(contract.ENV_ENGINE_PORT, "engine_port", vllm_flag="--port", sim_flag="--port",
            instead="nothing: the engine port is fixed by the operator"),
    Setting(contract.ENV_TENSOR_PARALLEL, "tensor_parallel_size", "spec.parallelism.tensor",
            vllm_flag="--tensor-parallel-size", sim_flag="--tensor-parallel-size", vllm_aliases=("-tp",)),
    # The simulator stands for the whole group, whatever its stages.
    Setting(contract.ENV_PIPELINE_PARALLEL, "pipeline_parallel_size", "spec.parallelism.pipeline",
            vllm_flag="--pipeline-parallel-size", vllm_aliases=("-pp",)),
    # `vllm serve` takes the model as its positional argument, which is what --model sets.
    Setting(contract.ENV_MODEL, "model", "spec.model.name", vllm_flag="--model", sim_flag="--model"),
    Setting(contract.ENV_SERVED_MODEL_NAME, "served_model_name", "spec.model.servedName",
            vllm_flag="--served-model-name", sim_flag="--served-model-name"),
    Setting(contract.ENV_MODEL_REVISION, "model_revision", "spec.model.revision", vllm_flag="--revision"),
    Setting(contract.ENV_DTYPE, "dtype", "spec.model.dtype", vllm_flag="--dtype"),
    Setting(contract.ENV_QUANTIZATION, "quantization", "spec.model.quantization",
            vllm_flag="--quantization", vllm_aliases=("-q",)),
    Setting(contract.ENV_KV_CACHE_DTYPE, "kv_cache_dtype", "spec.engine.kvCacheDtype", vllm_flag="--kv-cache-dtype"),
    Setting(contract.ENV_MAX_MODEL_LEN, "max_model_len", "spec.model.maxModelLen",
            vllm_flag="--max-model-len", sim_flag="--max-model-len"),
    Setting(contract.ENV_GPU_MEMORY_UTILIZATION, "gpu_memory_utilization", "spec.engine.gpuMemoryUtilization",
            vllm_flag="--gpu-memory-utilization"),
    Setting(contract.ENV_MAX_NUM_SEQS, "max_num_seqs", "spec.engine.maxNumSeqs",
            vllm_flag="--max-num-seqs", sim_flag="--max-num-seqs"),
    # Appended to either command line as given, after the flags above.
    Setting(contract.ENV_EXTRA_ARGS, "extra_args", "spec.engine.args"),
    Setting(contract.ENV_ACCELERATOR, "accelerator", "spec.accelerator.type", sim_flag="--accelerator"),
    # The plan's KV-cache size: the simulator's capacity; vLLM measures its own.
    Setting(contract.ENV_KV_CACHE_TOKENS, "kv_cache_tokens", sim_flag="--kv-cache-tokens"),
    Setting(contract.ENV_GPU_METRICS_PORT, "gpu_metrics_port"),
)

BY_FIELD: Final = {setting.field: setting for setting in SETTINGS}

# Every variable the launcher reads; `spec.engine.env` may not set them.
WORKER_ENV_VARS: Final = tuple(setting.env for setting in SETTINGS)

# Engine flags the operator sets that carry no setting of their own; refused too.
EXECUTOR_FLAG: Final = "--distributed-executor-backend"   # vLLM: Ray, with pipeline > 1
HOST_FLAG: Final = "--host"                                # all addresses: vLLM's default, the simulator is told
_OPERATOR_FLAGS: Final = {
    EXECUTOR_FLAG: "spec.parallelism.pipeline (the operator picks Ray for pipeline > 1)",
    HOST_FLAG: "nothing: the engine listens on all addresses",
}


def _refused() -> dict[str, str]:
    refused: dict[str, str] = {}
    for setting in SETTINGS:
        if setting.vllm_flag is None:
            continue
        use = setting.instead or setting.source
        if use is None:
            raise ValueError(f"{setting.env}: its vLLM flag is refused in spec.engine.args, so it needs `source` or `instead`")
        for flag in (setting.vllm_flag, *setting.vllm_aliases):
            refused[flag] = use
    return {**refused, **_OPERATOR_FLAGS}


# Flag -> what to set instead. `spec.engine.args` may not pass any of them.
REFUSED_ENGINE_FLAGS: Final = _refused()
