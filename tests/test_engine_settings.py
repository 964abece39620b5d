"""Every row of the engine settings table reaches every place derived from it.

A row (`tensorfleet.engine_settings.SETTINGS`) is one value the operator hands
an engine pod. For every example, the FULL spec of test_worker_command and
that spec as a simulator, each row must be: rendered into the pod env, parsed
by the launcher into its Role field unchanged, carried by its vLLM and
simulator flags onto the command line (and understood by `tensorfleet sim`),
and its vLLM flag refused in `spec.engine.args`. Adding a row and forgetting
any of these fails here.
"""

from __future__ import annotations

import copy
import functools
import json
import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from test_worker_command import FULL
from worker_helpers import example_docs, pod_env

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.api.models import EngineSpec, InferenceServiceSpec
from tensorfleet.cli import build_parser
from tensorfleet.engine_settings import (
    CONFIG_FLAG,
    EXECUTOR_FLAG,
    HOST_FLAG,
    LORA_MODULES_FLAG,
    REFUSED_ENGINE_FLAGS,
    SETTINGS,
    WORKER_ENV_VARS,
    Setting,
    refused_engine_arg,
)
from tensorfleet.planner import make_plan
from tensorfleet.worker import command
from tensorfleet.worker.errors import WorkerError
from tensorfleet.worker.role import ENV_FIELDS, Role, role_from_env


def _simulator(doc: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out["spec"]["engine"]["kind"] = "simulator"
    return out


CASES = [*example_docs(), ("full", FULL), ("full-simulator", _simulator(FULL))]


@functools.cache
def _pods() -> list[tuple[str, dict[str, str], Role]]:
    """(case/stage, kubelet env, parsed Role) of every stage of every case."""
    out = []
    for case, doc in CASES:
        for stage in range(make_plan(load_inference_service(doc).spec).pipeline):
            env = pod_env(doc, stage)
            out.append((f"{case}/stage{stage}", env, role_from_env(env)))
    return out


def _as_env(value: object) -> str:
    """A Role value written back the way the renderer writes it."""
    if isinstance(value, bool):
        return json.dumps(value)  # a switch: "true"
    return json.dumps(list(value)) if isinstance(value, tuple) else str(value)


def _engine_pods(kind: str) -> list[tuple[str, Role, list[str]]]:
    """(pod, role, the operator's part of its engine argv: the user's extra args cut off) of each leader."""
    out = []
    for pod, _, role in _pods():
        if role.leader and role.engine_kind == kind:
            argv = command.engine_argv(role)
            out.append((pod, role, argv[:len(argv) - len(role.extra_args)]))
    assert out, f"no {kind} case"
    return out


def _value_after(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


# --- the table itself ----------------------------------------------------------------------------


def test_rows_are_the_contracts_variables_and_the_roles_fields() -> None:
    named = {value for key, value in vars(contract).items() if key.startswith("ENV_") and value.startswith("TF_")}
    assert [s.env for s in SETTINGS] == list(WORKER_ENV_VARS) == list(ENV_FIELDS)
    assert set(WORKER_ENV_VARS) == named and len(WORKER_ENV_VARS) == len(named)
    assert [s.field for s in SETTINGS] == list(Role.model_fields)


def _spec_field(path: str) -> None:
    """Walk `spec.a.b` through the API models by wire name; KeyError if a step does not exist."""
    model: type[BaseModel] = InferenceServiceSpec
    for part in path.removeprefix("spec.").split("."):
        fields = {field.alias or name: field for name, field in model.model_fields.items()}
        annotation = fields[part].annotation
        nested = [arg for arg in (typing.get_args(annotation) if isinstance(annotation, types.UnionType)
                                  else (annotation,)) if isinstance(arg, type) and issubclass(arg, BaseModel)]
        if nested:
            model = nested[0]


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.source], ids=lambda s: s.env)
def test_every_source_is_a_spec_field(setting: Setting) -> None:
    assert setting.source is not None and setting.source.startswith("spec.")
    _spec_field(setting.source)


# --- render -> launcher ------------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.env)
def test_every_row_is_rendered_and_parsed_unchanged(setting: Setting) -> None:
    rendered = [(pod, env, role) for pod, env, role in _pods() if setting.env in env]
    assert rendered, f"{setting.env} is rendered for no case"
    for pod, env, role in rendered:
        assert _as_env(getattr(role, setting.field)) == env[setting.env], pod


# --- launcher -> engine ------------------------------------------------------------------------


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.vllm_flag], ids=lambda s: s.env)
def test_every_vllm_flag_carries_its_value(setting: Setting) -> None:
    assert setting.vllm_flag is not None
    carried = 0
    for pod, role, argv in _engine_pods("vllm"):
        value = getattr(role, setting.field)
        if setting.field == "model":
            assert argv[:3] == [command.VLLM, "serve", value], pod  # vLLM's positional form of --model
            carried += 1
        elif setting.field == "pipeline_parallel_size" and not role.multi_node:
            assert setting.vllm_flag not in argv, pod
        elif isinstance(value, bool):  # a switch: the flag alone, once, when on
            assert argv.count(setting.vllm_flag) == (1 if value else 0), pod
            carried += value
        elif value is not None:
            assert _value_after(argv, setting.vllm_flag) == _as_env(value) and argv.count(setting.vllm_flag) == 1, pod
            carried += 1
        else:
            assert setting.vllm_flag not in argv, pod
    assert carried, f"{setting.vllm_flag} reaches no vLLM command line"


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.sim_flag], ids=lambda s: s.env)
def test_every_simulator_flag_carries_its_value(setting: Setting) -> None:
    assert setting.sim_flag is not None
    carried = 0
    for pod, role, argv in _engine_pods("simulator"):
        value = getattr(role, setting.field)
        if value is None or value is False:
            assert setting.sim_flag not in argv, pod
            continue
        if value is True:  # a switch: the flag alone
            assert argv.count(setting.sim_flag) == 1, pod
            carried += 1
            continue
        assert _value_after(argv, setting.sim_flag) == _as_env(value) and argv.count(setting.sim_flag) == 1, pod
        carried += 1
    assert carried, f"{setting.sim_flag} reaches no simulator command line"


@pytest.mark.parametrize("kind", ["vllm", "simulator"])
def test_the_operator_sets_no_flag_outside_the_table(kind: str) -> None:
    rows = {s.vllm_flag if kind == "vllm" else s.sim_flag for s in SETTINGS} - {None}
    fixed = {EXECUTOR_FLAG} if kind == "vllm" else {HOST_FLAG}
    for pod, _, argv in _engine_pods(kind):
        flags = {item for item in argv if item.startswith("-")}
        assert flags <= rows | fixed, f"{pod}: {sorted(flags - rows - fixed)} set outside tensorfleet.engine_settings"


def test_the_simulator_understands_every_flag_it_is_given() -> None:
    for pod, role, argv in _engine_pods("simulator"):
        assert argv[:len(contract.SIMULATOR_COMMAND)] == list(contract.SIMULATOR_COMMAND)
        args = build_parser().parse_args(argv[1:])
        assert args.ignored_args == [], pod
        for setting in SETTINGS:
            if setting.sim_flag is not None and setting.sim_flag in argv:
                parsed = getattr(args, setting.sim_flag.lstrip("-").replace("-", "_"))
                assert parsed == getattr(role, setting.field), f"{pod}: {setting.sim_flag}"


# --- spec.engine.args --------------------------------------------------------------------------


def test_refused_flags_are_every_vllm_flag_the_operator_sets() -> None:
    from_rows = {flag for s in SETTINGS if s.refused for flag in (s.vllm_flag, *s.vllm_aliases) if flag}
    assert set(REFUSED_ENGINE_FLAGS) == from_rows | {EXECUTOR_FLAG, HOST_FLAG, CONFIG_FLAG, LORA_MODULES_FLAG}
    assert all(s.refused == (s.vllm_flag is not None and s.always_refused) for s in SETTINGS)
    # The one flag the operator sets only for some specs (spec.prefill), which the planner refuses beside it.
    assert [s.vllm_flag for s in SETTINGS if s.vllm_flag and not s.refused] == ["--kv-transfer-config"]
    sometimes = {s.vllm_flag for s in SETTINGS if s.vllm_flag and not s.refused}
    for _, _, argv in _engine_pods("vllm"):
        assert {item for item in argv if item.startswith("-")} <= set(REFUSED_ENGINE_FLAGS) | sometimes


@pytest.mark.parametrize("flag", sorted(REFUSED_ENGINE_FLAGS))
def test_a_refused_flag_names_what_to_set_instead(flag: str) -> None:
    setting = next((s for s in SETTINGS if flag in (s.vllm_flag, *s.vllm_aliases)), None)
    for args in ([flag, "1"], [f"{flag}=1"]):
        with pytest.raises(ValidationError) as caught:
            EngineSpec.model_validate({"args": ["--enable-prefix-caching", *args]})
        (error,) = caught.value.errors()
        assert error["loc"] == ("args", 1)   # the item: spec.engine.args[1]
        assert REFUSED_ENGINE_FLAGS[flag] in error["msg"]
        if setting is not None and setting.instead is None:
            assert f"set {setting.source} instead" in error["msg"]


def _long(flag: str) -> str:
    return next((s.vllm_flag for s in SETTINGS if flag in s.vllm_aliases), flag) or flag


def _spellings(flag: str) -> list[list[str]]:
    """Ways vLLM's parser (FlexibleArgumentParser over argparse) reads `flag` with a value."""
    if not flag.startswith("--"):   # a short alias: -tp 4, -tp=4
        return [[flag, "4"], [f"{flag}=4"]]
    name = flag[2:]
    under = "--" + name.replace("-", "_")
    out = [[flag, "4"], [f"{flag}=4"], [under, "4"], [f"{under}=4"], [f"{flag}.key", "4"], [f"{under}.key=4"]]
    if len(name) > 4:
        out.append([flag[:-1], "4"])   # argparse takes an unambiguous prefix (allow_abbrev)
    return out


@pytest.mark.parametrize("flag", sorted(REFUSED_ENGINE_FLAGS))
def test_every_spelling_of_a_refused_flag_is_refused(flag: str) -> None:
    for args in _spellings(flag):
        refused = refused_engine_arg(args[0])
        assert refused is not None, args
        assert _long(flag) in refused.flags, args
        with pytest.raises(ValidationError) as caught:
            EngineSpec.model_validate({"args": args})
        assert caught.value.errors()[0]["loc"] == ("args", 0)


@pytest.mark.parametrize(("item", "flag"), [
    ("--max_model_len=100000", "--max-model-len"),
    ("--tensor_parallel_size=4", "--tensor-parallel-size"),
    ("-tp", "--tensor-parallel-size"),
    ("-tp=4", "--tensor-parallel-size"),
    ("-t", "--tensor-parallel-size"),          # a prefix of -tp
    ("-pp", "--pipeline-parallel-size"),
    ("-qawq", "--quantization"),              # argparse glues a one-letter flag to its value
    ("-q=fp8", "--quantization"),
    ("--max-model-len=1", "--max-model-len"),
    ("--max-model", "--max-model-len"),
    ("--gpu_memory_util=0.95", "--gpu-memory-utilization"),
    ("--served_model_name", "--served-model-name"),
    ("--max_model_len.value=1", "--max-model-len"),
    ("--port=9000", "--port"),
    ("--host=127.0.0.1", "--host"),
    ("--distributed_executor_backend=mp", "--distributed-executor-backend"),
    ("--config", "--config"),
    ("--model=other/model", "--model"),
])
def test_refused_spellings(item: str, flag: str) -> None:
    refused = refused_engine_arg(item)
    assert refused is not None and refused.flags == (flag,)
    assert repr(item) in refused.message()


@pytest.mark.parametrize("item", [
    "--enable-prefix-caching", "--max-num-batched-tokens=4096", "--max_num_batched_tokens", "--swap-space",
    '--kv-transfer-config={"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
    '--kv_transfer_config={"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}',
    "--kv-transfer-config.kv_connector", "--compilation-config.level=3", '--compilation_config={"level": 3}',
    "-O3", "-O.level=3", "--config-format", "--model-impl", "--tokenizer", "--seed", "-1", "-0.5", "8192",
    "{{ messages }}", "--chat-template", "--",
])
def test_other_flags_and_values_pass(item: str) -> None:
    assert refused_engine_arg(item) is None
    assert EngineSpec.model_validate({"args": [item]}).args == [item]


def test_an_ambiguous_prefix_names_every_flag_it_could_be() -> None:
    refused = refused_engine_arg("--max")
    assert refused is not None and set(refused.flags) == {"--max-model-len", "--max-num-seqs", "--max-loras",
                                                          "--max-lora-rank", "--max-cpu-loras"}


def test_a_flag_and_value_in_one_item_is_checked_by_its_flag() -> None:
    with pytest.raises(ValidationError, match="spec.engine.maxNumSeqs"):
        EngineSpec.model_validate({"args": ["--max-num-seqs 64"]})
    with pytest.raises(ValidationError, match="separate items"):
        EngineSpec.model_validate({"args": ["--max-num-batched-tokens 4096"]})


@pytest.mark.parametrize(("extra", "index"), [(["--max_model_len=100000"], 0), (["--enable-prefix-caching", "-tp", "4"], 1)])
def test_the_launcher_refuses_an_operator_flag_in_its_env_too(extra: list[str], index: int) -> None:
    """A hand-edited TF_EXTRA_ARGS cannot override the plan: the launcher stops, naming the item."""
    _, env, _ = next(p for p in _pods() if p[2].leader and p[2].engine_kind == "vllm")
    role = role_from_env({**env, contract.ENV_EXTRA_ARGS: json.dumps(extra)})
    with pytest.raises(WorkerError, match=rf"^{contract.ENV_EXTRA_ARGS}\[{index}\]: "):
        command.engine_argv(role)
