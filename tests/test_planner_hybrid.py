"""Hybrid models (Mamba or linear-attention state layers beside attention ones: Qwen3-Next, Granite 4.0-H, Jamba,
Nemotron-H) sized as vLLM 0.19 sizes them (planner/hybrid.py, planner/kvcache.py): the state's bytes, the attention
block size vLLM raises so a block of every layer takes the same page, the groups, the logged pool and the maximum
concurrency; held exactly to vLLM's own code run from the installed CPU build (tests/realvllm_hybrid_check.py), and
through the plan to the router's ceiling and the refusals vLLM would make."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import isvc_doc, require_real_vllm
from test_modelconfig import DATA, facts

from tensorfleet.api import load_inference_service
from tensorfleet.api.architecture import ArchitectureSpec
from tensorfleet.api.errors import SpecError
from tensorfleet.catalog.modelconfig import ModelConfigError, parse_model_config
from tensorfleet.catalog.sizes import kv_bytes_per_token_layer
from tensorfleet.planner import hybrid, kvcache, make_plan
from tensorfleet.planner.memory import GiB, stage_layers
from tensorfleet.sim.profile import read_layers
from tensorfleet.testing import realvllm

CHECK_SCRIPT = Path(__file__).with_name("realvllm_hybrid_check.py")
HYBRIDS = ("Qwen/Qwen3-Next-80B-A3B-Instruct", "ibm-granite/granite-4.0-h-small", "ibm-granite/granite-4.0-h-tiny",
           "ai21labs/AI21-Jamba-Mini-1.5", "nvidia/Nemotron-H-8B-Base-8K")


# --- what config.json says ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("repo", "attention", "state", "kind", "parameters"), [
    # Nemotron-H 8B: 24 Mamba2, 4 attention and 24 MLP-only blocks; 8,100,852,736 parameters, the total the
    # checkpoint's tensors add up to (https://huggingface.co/nvidia/Nemotron-H-8B-Base-8K, 8.1B).
    ("nvidia/Nemotron-H-8B-Base-8K", 4, 24, "mamba2", 8_100_852_736),
    # Qwen3-Next: every fourth layer full attention (full_attention_interval 4), the rest Gated DeltaNet; 80B
    # without the multi-token-prediction layer the checkpoint also carries.
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 12, 36, "gated-delta-net", 79_674_391_296),
    ("ibm-granite/granite-4.0-h-small", 4, 36, "mamba2", 32_207_337_984),   # 32B (model card)
    ("ibm-granite/granite-4.0-h-tiny", 4, 36, "mamba2", 6_939_037_248),     # 7B (model card), 6.94 B in llama.cpp
    ("ai21labs/AI21-Jamba-Mini-1.5", 4, 28, "mamba", 51_570_323_328),        # 52B total, 12B active (model card)
])
def test_hybrid_configs_are_read_layer_by_layer(repo: str, attention: int, state: int, kind: str, parameters: int) -> None:
    arch = facts(repo).arch
    assert arch.mamba is not None
    assert (arch.attention_layer_count, arch.mamba.layers, arch.mamba.kind, arch.parameters) == (
        attention, state, kind, parameters)
    layers = kvcache.model_layers(arch)
    assert sum(spec.kind == "full" for spec in layers) == attention
    assert sum(spec.kind == "mamba" for spec in layers) == state


def test_the_simulator_reads_kv_per_context_token_only_on_attention_layers() -> None:
    """A decode step reads a hybrid model's KV cache on its attention layers alone (the state layers keep a fixed
    state per sequence)."""
    arch = facts("Qwen/Qwen3-Next-80B-A3B-Instruct").arch
    assert arch.layers == 48
    assert read_layers(arch, 8192) == 12.0


def test_what_the_reader_cannot_size_is_refused_by_field() -> None:
    granite = facts_config("ibm-granite/granite-4.0-h-tiny")
    del granite["layer_types"]
    with pytest.raises(ModelConfigError, match="layer_types, layers_block_type, hybrid_override_pattern"):
        parse_model_config(granite, name="x")
    moe_blocks = facts_config("nvidia/Nemotron-H-8B-Base-8K")
    moe_blocks["hybrid_override_pattern"] = moe_blocks["hybrid_override_pattern"].replace("-", "E")
    with pytest.raises(ModelConfigError, match="hybrid_override_pattern has 'E'"):
        parse_model_config(moe_blocks, name="x")
    missing = facts_config("Qwen/Qwen3-Next-80B-A3B-Instruct")
    del missing["linear_num_value_heads"]
    with pytest.raises(ModelConfigError, match="linear_num_value_heads is missing"):
        parse_model_config(missing, name="x")
    with pytest.raises(ModelConfigError, match="falcon_h1"):
        parse_model_config({"model_type": "falcon_h1", "num_hidden_layers": 2}, name="x")


def facts_config(repo: str) -> dict[str, Any]:
    import json

    data: dict[str, Any] = json.loads((DATA / repo / "config.json").read_text())
    return data


def test_the_architecture_states_counts_as_for_sliding_windows() -> None:
    """spec.model.architecture.mamba: counts, like slidingWindowLayers; attentionLayers when some layers have
    neither; each kind's shape required."""
    base: dict[str, Any] = {"parameters": 8 * 10**9, "layers": 52, "hiddenSize": 4096, "attentionHeads": 32,
                            "kvHeads": 8}
    mamba = {"kind": "mamba2", "layers": 24, "attentionLayers": 4, "convKernel": 4, "stateSize": 128,
             "intermediateSize": 8192, "groups": 8, "heads": 128, "headDim": 64}
    arch = ArchitectureSpec.model_validate({**base, "mamba": mamba})
    assert arch.attention_layer_count == 4
    assert [spec.kind for spec in kvcache.model_layers(arch)].count("none") == 24
    with pytest.raises(ValueError, match="kind mamba2 needs heads"):
        ArchitectureSpec.model_validate({**base, "mamba": {**mamba, "heads": None}})
    with pytest.raises(ValueError, match="exceed layers 52"):
        ArchitectureSpec.model_validate({**base, "mamba": {**mamba, "attentionLayers": 30}})
    with pytest.raises(ValueError, match="needs attention layers"):
        ArchitectureSpec.model_validate({**base, "mamba": {**mamba, "layers": 52, "attentionLayers": None}})


# --- held to vLLM's own arithmetic --------------------------------------------------------------------------------


LAYOUTS = [
    # (repo, tensor, pipeline, prefix caching, KV-cache dtype, max_model_len, batched tokens)
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 1, 1, False, "auto", 32768, 8192),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 2, 1, False, "auto", 262144, 8192),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 4, 1, False, "auto", 131072, 2048),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 8, 1, False, "fp8", 65536, 8192),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 4, 2, False, "auto", 32768, 8192),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 2, 1, True, "auto", 32768, 8192),     # align: two states a request
    ("ibm-granite/granite-4.0-h-small", 1, 1, False, "auto", 131072, 8192),
    ("ibm-granite/granite-4.0-h-small", 2, 1, False, "fp8", 32768, 8192),
    ("ibm-granite/granite-4.0-h-small", 4, 1, True, "auto", 32768, 8192),      # all: a state per block, chunk 256
    ("ibm-granite/granite-4.0-h-small", 2, 3, False, "auto", 16384, 4096),
    ("ibm-granite/granite-4.0-h-tiny", 1, 1, False, "auto", 131072, 8192),
    ("ibm-granite/granite-4.0-h-tiny", 4, 1, False, "auto", 8192, 16384),
    ("ai21labs/AI21-Jamba-Mini-1.5", 1, 1, False, "auto", 262144, 8192),
    ("ai21labs/AI21-Jamba-Mini-1.5", 2, 1, False, "auto", 65536, 8192),
    ("ai21labs/AI21-Jamba-Mini-1.5", 8, 1, True, "auto", 32768, 8192),         # all, vLLM's default chunk 2048
    ("ai21labs/AI21-Jamba-Mini-1.5", 4, 2, False, "fp8", 100000, 8192),
    ("nvidia/Nemotron-H-8B-Base-8K", 1, 1, False, "auto", 8192, 8192),
    ("nvidia/Nemotron-H-8B-Base-8K", 2, 1, False, "auto", 4096, 2048),
    ("nvidia/Nemotron-H-8B-Base-8K", 4, 1, True, "auto", 8192, 8192),          # all, chunk 128
    ("nvidia/Nemotron-H-8B-Base-8K", 8, 2, False, "auto", 8192, 8192),
    ("nvidia/Nemotron-H-8B-Base-8K", 1, 1, False, "auto", 256, 8192),          # max_model_len under the block
]
LENGTHS = [1, 100, 1000, 3000, 8192, 20000, 131072]


def _case(index: int, layout: tuple[str, int, int, bool, str, int, int]) -> dict[str, Any]:
    repo, tensor, pipeline, prefix, kv_dtype, max_model_len, batched = layout
    arch = facts(repo).arch
    assert arch.mamba is not None
    mode = hybrid.cache_mode(arch.mamba, prefix)
    kinds = {"full": "attention", "mamba": "mamba", "none": "none"}
    bounds, first = [], 0
    for count in stage_layers(arch.layers, pipeline):
        bounds.append((first, first + count))
        first += count
    return {
        "name": f"{repo.split('/')[1]}-tp{tensor}pp{pipeline}-{mode}-{kv_dtype}-{max_model_len}",
        "repo": repo, "config_dir": str(DATA / repo), "tensor": tensor, "mode": mode,
        "kinds": [kinds[spec.kind] for spec in kvcache.model_layers(arch, mode)], "stages": bounds,
        "free": [int((31.5 - 2.75 * stage - 1.5 * (index % 3)) * GiB) for stage in range(pipeline)],
        "max_model_len": max_model_len, "batched_tokens": batched, "prefix_caching": prefix,
        "kv_cache_dtype": kv_dtype, "lengths": LENGTHS,
    }


CASES = [_case(index, layout) for index, layout in enumerate(LAYOUTS)]


@pytest.fixture(scope="module")
def vllm_answers() -> dict[str, Any]:
    python = require_real_vllm()
    payload = {"cases": [{key: value for key, value in case.items() if key not in ("repo", "mode")} for case in CASES]}
    found = realvllm.run_script(CHECK_SCRIPT.read_text(), payload, timeout=600, python=python)
    assert isinstance(found, dict)
    return {result["name"]: result for result in found["results"]}


def planned(case: dict[str, Any]) -> tuple[hybrid.HybridBlock, kvcache.Grouping, kvcache.KVPool]:
    """The planner's block, groups and pool for one case (what plan.size_layout does for a hybrid model)."""
    arch = facts(case["repo"]).arch
    assert arch.mamba is not None
    conv, ssm = hybrid.state_element_bytes(arch.mamba, 2)
    token_bytes = kv_bytes_per_token_layer(arch, case["tensor"], 1 if case["kv_cache_dtype"] == "fp8" else 2)
    block = hybrid.block_size(hybrid.state_bytes(arch.mamba, case["tensor"], conv, ssm), token_bytes, 16,
                              case["mode"], arch.mamba.chunk_size)
    grouping = kvcache.group_layers(kvcache.model_layers(arch, case["mode"]), hybrid=True)
    logged = min(block.block_size, case["max_model_len"]) if case["mode"] == "none" else block.block_size
    pool, _ = kvcache.pool(grouping, [(range(first, end), free) for (first, end), free in
                                      zip(case["stages"], case["free"], strict=True)],
                           block.page_bytes, block.block_size, case["batched_tokens"], logged)
    return block, grouping, pool


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_block_state_pool_and_concurrency_are_vllms(vllm_answers: dict[str, Any], case: dict[str, Any]) -> None:
    vllm = vllm_answers[case["name"]]
    block, grouping, pool = planned(case)
    assert (block.block_size, block.state_bytes, block.page_bytes) == (
        vllm["block_size"], vllm["state_bytes"], vllm["page_bytes"])
    assert (pool.num_blocks, len(grouping.groups)) == (vllm["num_blocks"], vllm["groups"])
    assert pool.tokens == vllm["logged_tokens"]
    for length in case["lengths"]:
        assert pool.concurrency(length) == pytest.approx(vllm["concurrency"][str(length)], rel=1e-12), length


def test_the_block_is_the_smallest_that_holds_the_state() -> None:
    """Qwen3-Next at tensor 2: one Gated DeltaNet state is 3 x 4096 convolution channels and 16 x 128 x 128
    temporal elements in bfloat16, 548,864 bytes; an attention token 1 KV head x 256 x 2 x 2 = 1,024 bytes; 536
    tokens hold it, rounded up to 544 (vLLM logs "Setting attention block size to 544 tokens" and pads the state
    page by 1.49%)."""
    arch = facts("Qwen/Qwen3-Next-80B-A3B-Instruct").arch
    assert arch.mamba is not None
    block = hybrid.block_size(hybrid.state_bytes(arch.mamba, 2, 2, 2), 1024, 16)
    assert (block.state_bytes, block.block_size, round(100 * block.padding, 2)) == (548_864, 544, 1.49)


def test_nemotron_nano_9b_v2_block_is_the_published_672_tokens() -> None:
    """vLLM's own words (https://github.com/vllm-project/vllm/issues/24280): hybrid Mamba models "might cause large
    attention page sizes (672 tokens for nvidia/NVIDIA-Nemotron-Nano-9B-v2)". Its config: 128 Mamba heads of 80, 8
    groups, state 128, kernel 4; 8 KV heads of 128; the SSM state in float16, as the vLLM of that report kept it
    (vLLM 0.19 reads Nemotron-H's config with transformers 5, whose default is float32: 1,312 tokens)."""
    arch = ArchitectureSpec.model_validate({
        "parameters": 8_888_000_000, "layers": 56, "hiddenSize": 4480, "attentionHeads": 40, "kvHeads": 8,
        "headDim": 128, "mamba": {"kind": "mamba2", "layers": 27, "attentionLayers": 4, "convKernel": 4,
                                  "stateSize": 128, "intermediateSize": 10240, "groups": 8, "heads": 128,
                                  "headDim": 80, "stateDtype": "float16"}})
    assert arch.mamba is not None
    conv, ssm = hybrid.state_element_bytes(arch.mamba, 2)
    block = hybrid.block_size(hybrid.state_bytes(arch.mamba, 1, conv, ssm), kv_bytes_per_token_layer(arch, 1, 2), 16)
    assert block.block_size == 672
    wide = arch.mamba.model_copy(update={"state_dtype": "float32"})
    state = hybrid.state_bytes(wide, 1, *hybrid.state_element_bytes(wide, 2))
    assert hybrid.block_size(state, kv_bytes_per_token_layer(arch, 1, 2), 16).block_size == 1312


# --- through the plan ---------------------------------------------------------------------------------------------


def _plan(repo: str, **spec: Any) -> Any:
    model = {"name": repo, "maxModelLen": 65536, **spec.pop("model", {})}
    doc = isvc_doc({"model": model, "accelerator": {"type": "H100-80GB"}, **spec})
    return make_plan(load_inference_service(doc).spec, facts(repo))


def test_the_plan_sizes_a_hybrid_as_vllm_and_the_router_uses_its_concurrency() -> None:
    plan = _plan("Qwen/Qwen3-Next-80B-A3B-Instruct", parallelism={"tensor": 4, "pipeline": 1},
                 engine={"maxNumSeqs": 1024})
    pool = plan.kv_pool
    assert pool.block_size == 272 and len(pool.specs) == 4   # 1 attention group of 12 layers, 3 state groups
    assert plan.kv_cache_tokens == pool.num_blocks // 4 * 272
    # A request of L tokens takes ceil(L / 272) attention blocks and one state block in each state group.
    assert plan.max_concurrency == pool.num_blocks / (-(-65536 // 272) + 3)
    assert plan.engine_concurrency(4096) == min(1024, int(pool.num_blocks / (-(-4096 // 272) + 3)))
    # Only the 12 attention layers hold KV per token.
    assert plan.kv_bytes_per_token_per_gpu == 12 * 1024


@pytest.mark.parametrize(("spec", "field", "words"), [
    ({"engine": {"args": ["--disable-hybrid-kv-cache-manager"]}}, "spec.engine.args",
     "--disable-hybrid-kv-cache-manager"),
    ({"prefill": {"parallelism": {"tensor": 4}}}, "spec.prefill", "--no-disable-hybrid-kv-cache-manager"),
    ({"accelerator": {"type": "CPU"}, "engine": {"resources": {"requests": {"memory": "512Gi"}}}},
     "spec.accelerator.type", "CPU backend runs none"),
])
def test_what_vllm_refuses_for_a_hybrid_model_is_refused(spec: dict[str, Any], field: str, words: str) -> None:
    """vLLM 0.19 cannot group state layers with attention ones without its hybrid KV-cache manager ("Hybrid KV
    cache manager is disabled but failed to convert the KV cache specs to one unified type"), which the flag and a
    KV connector turn off (KV events do too, so the operator renders none for these models, and spec.engine.args
    may not pass them: tests/test_kvindex.py); its CPU backend has no kernels for the state layers."""
    base: dict[str, Any] = {"parallelism": {"tensor": 4, "pipeline": 1}}
    with pytest.raises(SpecError) as refused:
        _plan("ibm-granite/granite-4.0-h-small", **{**base, **spec})
    assert refused.value.field == field and words in str(refused.value)
    # A KV connector beside the hybrid manager (NixlConnector supports it) is planned.
    split = _plan("ibm-granite/granite-4.0-h-small", parallelism={"tensor": 2}, prefill={"parallelism": {"tensor": 2}},
                  engine={"args": ["--no-disable-hybrid-kv-cache-manager"]})
    assert split.prefill is not None and len(split.kv_pool.specs) == 10


def test_prefix_caching_and_tensor_sizes_follow_vllm() -> None:
    off = _plan("ibm-granite/granite-4.0-h-small", parallelism={"tensor": 2, "pipeline": 1})
    on = _plan("ibm-granite/granite-4.0-h-small", parallelism={"tensor": 2, "pipeline": 1},
               engine={"args": ["--enable-prefix-caching"]})
    assert on.kv_pool.block_size % 256 == 0 and on.kv_pool.block_size >= off.kv_pool.block_size
    assert on.max_concurrency < off.max_concurrency   # a state per block of every request
    with pytest.raises(SpecError, match="linear_num_value_heads 32 is not divisible by tensor 3|divide"):
        _plan("Qwen/Qwen3-Next-80B-A3B-Instruct", parallelism={"tensor": 3, "pipeline": 1})


@pytest.mark.parametrize("repo", HYBRIDS)
def test_every_stored_hybrid_plans(repo: str) -> None:
    arch = facts(repo).arch
    plan = _plan(repo, model={"maxModelLen": min(arch.max_context_length or 8192, 32768)})
    assert plan.fits and plan.kv_pool.block_size > 16 and plan.engine_concurrency(2048) >= 1
