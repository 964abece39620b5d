"""Every setting the operator hands an engine pod, in one table (`SETTINGS`): per setting the pod env var, the
launcher's Role field, the InferenceService field it comes from and the `vllm serve` and `tensorfleet sim` flags
that carry it. The pod env, the launcher's parsing, both command lines and the flags `spec.engine.args` may not pass
are derived from it. Imports nothing but the contract. Design:
docs/architecture.md#the-engine-pods-settings-one-table."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
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
    # What a refused vllm_flag tells the user to do, when not "set `source` instead".
    instead: str | None = None
    # False for a flag the operator sets only for some specs, which spec.engine.args may pass otherwise (the
    # planner refuses it where both would: --kv-transfer-config beside spec.prefill).
    always_refused: bool = True

    @property
    def refused(self) -> bool:
        """Whether `spec.engine.args` may never pass this setting's vLLM flag: true of every one the operator
        always owns."""
        return self.vllm_flag is not None and self.always_refused


# In the order the renderer writes the pod env: Kubernetes expands `$(VAR)` only for variables defined earlier.
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
            instead="leave it out: the operator fixes the engine port"),
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
    # LoRA: on when spec.adapters lists any (or spec.engine.lora is set); the adapters themselves are loaded
    # at runtime by the operator (controller/adapters.py), so changing them restarts nothing.
    Setting(contract.ENV_ENABLE_LORA, "enable_lora", vllm_flag="--enable-lora", sim_flag="--enable-lora",
            instead="list adapters in spec.adapters, or set spec.engine.lora"),
    Setting(contract.ENV_MAX_LORAS, "max_loras", "spec.engine.lora.maxLoras",
            vllm_flag="--max-loras", sim_flag="--max-loras"),
    Setting(contract.ENV_MAX_LORA_RANK, "max_lora_rank", "spec.engine.lora.maxRank",
            vllm_flag="--max-lora-rank", sim_flag="--max-lora-rank"),
    Setting(contract.ENV_MAX_CPU_LORAS, "max_cpu_loras", "spec.engine.lora.maxCpuLoras",
            vllm_flag="--max-cpu-loras", sim_flag="--max-cpu-loras"),
    # Prefill/decode disaggregation: the connector config, JSON, the same for both pools.
    # Colocated engines may still pass their own (say, LMCache's KV offloading) in spec.engine.args.
    Setting(contract.ENV_KV_TRANSFER_CONFIG, "kv_transfer_config", "spec.kvTransfer.connector",
            vllm_flag="--kv-transfer-config", sim_flag="--kv-transfer-config", always_refused=False),
    # KV-cache events for the router's index (router/kvindex.py), JSON: every vLLM engine publishes them, and
    # the simulator takes the same flag (sim/kvevents.py).
    Setting(contract.ENV_KV_EVENTS_CONFIG, "kv_events_config", vllm_flag="--kv-events-config",
            sim_flag="--kv-events-config",
            instead=f"leave it out: the operator has vLLM engines publish their KV events on port "
                    f"{contract.KV_EVENTS_PORT} ({contract.KV_EVENTS_PORT_NAME}) for the router, where the model's "
                    "layers all keep full attention (docs/routing.md)"),
    # Appended to either command line as given, after the flags above.
    Setting(contract.ENV_EXTRA_ARGS, "extra_args", "spec.engine.args"),
    Setting(contract.ENV_ACCELERATOR, "accelerator", "spec.accelerator.type", sim_flag="--accelerator"),
    # The plan's KV-cache size: the simulator's capacity; vLLM measures its own.
    Setting(contract.ENV_KV_CACHE_TOKENS, "kv_cache_tokens", sim_flag="--kv-cache-tokens"),
    Setting(contract.ENV_GPU_METRICS_PORT, "gpu_metrics_port"),
    # A simulator pod's simulated GPUs: the downward-API file of its annotation (worker/simgpu.py).
    Setting(contract.ENV_SIMULATED_GPU_STATE, "simulated_gpu_state"),
)

BY_FIELD: Final = {setting.field: setting for setting in SETTINGS}


def kv_events_config(port: int = contract.KV_EVENTS_PORT, replay_port: int = contract.KV_EVENTS_REPLAY_PORT) -> str:
    """vLLM's `--kv-events-config` as the operator writes it: ZeroMQ PUB and replay sockets bound on all
    addresses (vLLM binds an endpoint that names `*` and connects to any other), the router's topic."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "topic": contract.KV_EVENTS_TOPIC,
                       "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}",
                       "buffer_steps": contract.KV_EVENTS_BUFFER_STEPS}, separators=(",", ":"))

# Every variable the launcher reads; `spec.engine.env` may not set them.
WORKER_ENV_VARS: Final = tuple(setting.env for setting in SETTINGS)

# Engine flags the operator sets that carry no setting of their own; refused too.
EXECUTOR_FLAG: Final = "--distributed-executor-backend"   # vLLM: Ray, with pipeline > 1
HOST_FLAG: Final = "--host"                                # all addresses: vLLM's default, the simulator is told
# `vllm serve --config FILE` reads flags from a YAML file, any of the above
# among them, where no check of spec.engine.args can see them.
CONFIG_FLAG: Final = "--config"
# Adapters the engine would serve from its start, which the operator would then unload as not listed.
LORA_MODULES_FLAG: Final = "--lora-modules"
_OPERATOR_FLAGS: Final = {
    EXECUTOR_FLAG: "set spec.parallelism.pipeline instead (the operator picks Ray for pipeline > 1)",
    HOST_FLAG: "leave it out: the engine listens on all addresses",
    CONFIG_FLAG: "put the flags themselves in spec.engine.args, one per item, where they are checked",
    LORA_MODULES_FLAG: "list the adapters in spec.adapters instead (the operator loads them without restarts)",
}


def _refused() -> dict[str, str]:
    refused: dict[str, str] = {}
    for setting in SETTINGS:
        if setting.vllm_flag is None or not setting.refused:
            continue
        if setting.instead is None and setting.source is None:
            raise ValueError(f"{setting.env}: its vLLM flag is refused in spec.engine.args, so it needs `source` or `instead`")
        advice = setting.instead or f"set {setting.source} instead"
        for flag in (setting.vllm_flag, *setting.vllm_aliases):
            refused[flag] = advice
    return {**refused, **_OPERATOR_FLAGS}


# Flag (as the table spells it) -> what to do instead. `spec.engine.args` may
# not pass any of them, in any spelling (see refused_engine_arg).
REFUSED_ENGINE_FLAGS: Final = _refused()

# --- reading an argv item as vLLM's parser does -------------------------------------
#
# `vllm serve` parses with vllm.utils.argparse_utils.FlexibleArgumentParser,
# an argparse.ArgumentParser that first rewrites each item:
#   --max_model_len        underscores become dashes in the name, which runs
#                          from `--` to the first `.` or `=`
#   --name=value           the value is split off at the first `=`
#   --json-arg.key value   a dotted key sets one key of a JSON (dict) argument;
#                          `--json-arg '{...}'` sets the whole of it
#   -O3, -O.level=3        the optimization level / compilation config
# then argparse itself takes any unambiguous prefix of a long flag
# (`--max-model` is --max-model-len: allow_abbrev is on), `-tp=4` for
# `-tp 4`, a one-letter flag glued to its value (`-qawq` is `-q awq`), and
# treats every item that starts with `-` and is not a negative number as a
# flag, wherever it stands. The last of repeated flags wins, so a second
# copy of a flag the operator sets would replace the plan's value.

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")   # argparse's own test


def vllm_flag_name(item: str) -> str | None:
    """The flag an argv item names, spelt as the table spells flags; None for a value.

    `--max_model_len=100000` -> `--max-model-len`, `--kv_transfer_config.kv_role`
    -> `--kv-transfer-config`, `-tp=4` -> `-tp`, `8192` -> None.
    """
    if not item.startswith("-") or item in ("-", "--") or _NEGATIVE_NUMBER.match(item):
        return None
    key = item.split("=", 1)[0].split(".", 1)[0]
    if key.startswith("--"):
        return "--" + key[2:].replace("_", "-")
    return key


def engine_arg_value(args: Sequence[str], flag: str) -> str | None:
    """The value the last FLAG in ARGS (spec.engine.args) gives, in either spelling vLLM reads (`--flag value`,
    `--flag=value`, underscores); "" for a flag without a value (a switch); None when ARGS do not set it."""
    value: str | None = None
    for i, arg in enumerate(args):
        if vllm_flag_name(arg) != flag:
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif i + 1 < len(args) and vllm_flag_name(args[i + 1]) is None:
            value = args[i + 1]
        else:
            value = ""
    return value


def _shown(item: str) -> str:
    """An item quoted in a one-line message, cut short when long."""
    return repr(item) if len(item) <= 60 else f"{item[:50]!r}... ({len(item)} characters)"


@dataclass(frozen=True)
class RefusedArg:
    """An item of `spec.engine.args` that vLLM would read as a flag the operator sets."""

    item: str
    flags: tuple[str, ...]   # the operator's flags vLLM may read it as (several: an ambiguous prefix)
    abbreviation: bool       # a prefix of the flag, not the flag itself
    advice: str              # what to do instead

    def message(self) -> str:
        shown = _shown(self.item)
        if len(self.flags) > 1:
            return (f"{shown} abbreviates {' or '.join(self.flags)}, flags the operator sets (vLLM reads any "
                    "unambiguous prefix of a flag as the flag); spell out the flag you mean")
        flag = self.flags[0]
        if flag == CONFIG_FLAG:
            return f"{shown} makes vLLM read flags from a file, where flags the operator sets would escape this check; {self.advice}"
        if self.abbreviation:
            how = f"abbreviates {flag} (vLLM reads any unambiguous prefix of a flag as the flag)"
        elif self.item.split("=", 1)[0] != flag:
            how = f"is {flag} as vLLM reads it"
        else:
            how = f"sets {flag}"
        return f"{shown} {how}, which the operator sets; {self.advice}"


_LONG_FLAGS: Final = tuple(flag for flag in REFUSED_ENGINE_FLAGS if flag.startswith("--"))
_SHORT_FLAGS: Final = tuple(flag for flag in REFUSED_ENGINE_FLAGS if not flag.startswith("--"))
# Short aliases -> the long flag of their row, to say which flag an alias is.
_LONG_OF: Final = {
    alias: setting.vllm_flag for setting in SETTINGS if setting.vllm_flag for alias in setting.vllm_aliases
}


def refused_engine_arg(item: str) -> RefusedArg | None:
    """Whether vLLM would read this argv item as a flag the operator sets, in any spelling."""
    name = vllm_flag_name(item)
    if name is None:
        return None
    abbreviation = False
    if name in REFUSED_ENGINE_FLAGS:
        matches: tuple[str, ...] = (_LONG_OF.get(name, name),)
    elif name.startswith("--"):
        # argparse's abbreviations; a prefix that also matches other vLLM flags fails there anyway.
        matches = tuple(flag for flag in _LONG_FLAGS if len(name) > 2 and flag.startswith(name))
        abbreviation = True
    else:
        # -t (a prefix of -tp), or a one-letter flag glued to its value (-qawq).
        aliases = [alias for alias in _SHORT_FLAGS
                   if alias.startswith(name) or (len(alias) == 2 and name.startswith(alias))]
        matches = tuple(dict.fromkeys(_LONG_OF.get(alias, alias) for alias in aliases))
        abbreviation = not any(len(alias) == 2 for alias in aliases)
    if not matches:
        return None
    return RefusedArg(item, matches, abbreviation, REFUSED_ENGINE_FLAGS[matches[0]])


_QUOTES = ("'", '"')


def _shell_quoted(value: str) -> bool:
    return len(value) >= 2 and value[0] in _QUOTES and value[-1] == value[0]


def engine_arg_problem(item: str) -> str | None:
    """What is wrong with one item of `spec.engine.args`, or None.

    The items reach vLLM as argv, never through a shell, so besides the flags
    the operator sets (refused_engine_arg) two shell habits are refused: a
    flag and its value in one item (argparse reads it as an unknown flag), and
    shell quotes around a value, as in `--kv-transfer-config='{...}'` copied
    from a command line: the quotes would reach vLLM as part of the JSON.
    """
    together = item.startswith("-") and "=" not in item and re.search(r"\s", item) is not None
    refused = refused_engine_arg(item.split()[0] if together else item)
    if refused is not None:
        return refused.message()
    if together:
        return f"{_shown(item)} holds a flag and its value in one string; split it into separate items"
    name = vllm_flag_name(item)
    value = item.split("=", 1)[1] if name is not None and "=" in item else (None if name is not None else item)
    json_like = value is not None and value[1:2] in ("{", "[") and value[-2:-1] in ("}", "]")
    if value is not None and _shell_quoted(value) and (name is not None or json_like):
        unquoted = f"{item.split('=', 1)[0]}={value[1:-1]}" if name is not None else value[1:-1]
        return (f"{_shown(item)} wraps its value in shell quotes, which would reach vLLM as part of it "
                f"(the args are not run through a shell); write {_shown(unquoted)}")
    return None

