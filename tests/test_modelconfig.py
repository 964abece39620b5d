"""Model facts read from real config.json files (tests/data/models, see its README) against hand arithmetic.

Each expected figure is worked out from the config's fields in the comment
beside it, module by module, not by calling the code under test; where the
checkpoint's published parameter count is known, the hand total equals it.
Weights are bytes as vLLM holds them: quantized linear weights at their stored
bits (scales included), everything else 16-bit.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import ROOT, isvc_doc

from tensorfleet.api import load_inference_service
from tensorfleet.catalog import ModelConfigError, ModelFacts, catalog_facts, parse_model_config
from tensorfleet.catalog.formats import BITS
from tensorfleet.catalog.models import MODELS as CATALOG
from tensorfleet.catalog.models import find_model
from tensorfleet.planner import Plan, make_plan
from tensorfleet.planner.memory import facts_stages

DATA = ROOT / "tests" / "data" / "models"
GiB = 1024**3


def config(repo: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / repo / "config.json").read_text())
    return data


def facts(repo: str) -> ModelFacts:
    quant = DATA / repo / "hf_quant_config.json"
    return parse_model_config(config(repo), name=repo, source="file",
                              hf_quant_config=json.loads(quant.read_text()) if quant.is_file() else None)


def plan(repo: str, **spec: Any) -> Plan:
    doc = isvc_doc({"model": {"name": repo, "maxModelLen": 8192}, **spec})
    return make_plan(load_inference_service(doc).spec, facts(repo))


def test_at_least_fifteen_current_models_and_four_quantized_formats_are_stored() -> None:
    repos = sorted(str(p.parent.relative_to(DATA)) for p in DATA.glob("*/*/config.json"))
    assert len(repos) >= 19, repos
    formats = {facts(repo).weight_format.name for repo in repos}
    assert {"int4", "fp8", "awq", "gptq", "int8", "bnb-4bit", "mxfp4", "bf16"} <= formats
    readme = (DATA / "README.md").read_text()
    for repo in repos:
        assert f"hf.co/{repo}/blob/main/config.json" in readme, f"{repo} is not cited in tests/data/models/README.md"


# --- hand arithmetic, per layer -------------------------------------------------------------------

# Llama 3.1 8B: hidden 4096, 32 layers, 32 heads, 8 KV heads x 128, MLP 14336, vocab 128256.
L8_LINEAR = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336   # q, k, v, o, gate/up/down = 218,103,808
L8_NORMS = 2 * 4096                                                             # input + post-attention RMSNorm
L8_EMBED = 128256 * 4096                                                        # embed_tokens; lm_head the same
L8_PARAMS = 32 * (L8_LINEAR + L8_NORMS) + 2 * L8_EMBED + 4096                   # + final norm
L8_FIXED = 32 * L8_NORMS + 2 * L8_EMBED + 4096                                  # what stays 16-bit when quantized
# Llama 3.1/3.3 70B: hidden 8192, 80 layers, 64 heads, 8 KV heads x 128, MLP 28672.
L70_LINEAR = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672              # = 855,638,016
L70_FIXED = 80 * 2 * 8192 + 2 * 128256 * 8192 + 8192
L70_PARAMS = 80 * L70_LINEAR + L70_FIXED
# Qwen2.5: q/k/v carry biases. 7B: hidden 3584, 28 layers, 28 heads, 4 KV heads x 128, MLP 18944, vocab 152064.
Q7_LAYER = 2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944 + (3584 + 2 * 512) + 2 * 3584
Q7_PARAMS = 28 * Q7_LAYER + 2 * 152064 * 3584 + 3584
# 72B: hidden 8192, 80 layers, 64 heads, 8 KV heads; the GPTQ checkpoint pads the MLP to 29696 (29568 unquantized).
Q72_ATTN = 2 * 8192 * 8192 + 2 * 8192 * 1024
Q72_OTHER = (8192 + 2 * 1024) + 2 * 8192                                        # qkv biases + norms
Q72_PARAMS = 80 * (Q72_ATTN + 3 * 8192 * 29568 + Q72_OTHER) + 2 * 152064 * 8192 + 8192
Q72_GPTQ_LINEAR = Q72_ATTN + 3 * 8192 * 29696
Q72_GPTQ_FIXED = 80 * Q72_OTHER + 2 * 152064 * 8192 + 8192
# Qwen3: q/k norms of head_dim 128 each. 8B: hidden 4096, 36 layers, 32 heads, 8 KV heads, MLP 12288, vocab 151936.
Q3_8_PARAMS = 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 128 + 2 * 4096) + 2 * 151936 * 4096 + 4096
# Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads x 128 (q 4096 wide), 4 KV heads, 128 experts of 768, router 2048 x 128.
Q3_30_PARAMS = 48 * (2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 128 * 3 * 2048 * 768 + 2048 * 128 + 2 * 2048) \
    + 2 * 151936 * 2048 + 2048
# Qwen3-235B-A22B-2507: hidden 4096, 94 layers, 64 heads x 128 (q 8192 wide), 4 KV heads, 128 experts of 1536.
Q3_235_PARAMS = 94 * (2 * 4096 * 8192 + 2 * 4096 * 512 + 2 * 128 + 128 * 3 * 4096 * 1536 + 4096 * 128 + 2 * 4096) \
    + 2 * 151936 * 4096 + 4096
# Mistral 7B v0.3: Llama 8B's layers, vocab 32768.
M7_PARAMS = 32 * (L8_LINEAR + L8_NORMS) + 2 * 32768 * 4096 + 4096
# Mixtral 8x7B: 8 experts of Mistral's MLP, router 4096 x 8, vocab 32000.
MX_PARAMS = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096) + 2 * 32000 * 4096 + 4096
# Phi-4: fused qkv 5120 -> (40 + 2 x 10) x 128, fused gate_up 5120 -> 2 x 17920, vocab 100352.
PHI4_PARAMS = 40 * (5120 * 7680 + 5120 * 5120 + 5120 * 35840 + 17920 * 5120 + 2 * 5120) + 2 * 100352 * 5120 + 5120
# DeepSeek-V3 (MLA, first 3 layers dense, 58 MoE layers of 256 experts + 1 shared, noaux_tc router bias):
DS_ATTN = (7168 * 1536                  # q_a_proj
           + 1536 * 128 * (128 + 64)    # q_b_proj: heads x (nope + rope)
           + 7168 * (512 + 64)          # kv_a_proj_with_mqa: kv_lora_rank + rope
           + 512 * 128 * (128 + 128)    # kv_b_proj: heads x (nope + v)
           + 128 * 128 * 7168)          # o_proj
DS_ATTN_NORMS = 1536 + 512 + 2 * 7168   # q_a/kv_a layernorms, input/post-attention norms
DS_DENSE = 3 * 7168 * 18432
DS_MOE = 256 * 3 * 7168 * 2048 + 3 * 7168 * 2048   # routed + shared experts
DS_ROUTER = 256 * 7168 + 256                        # gate + e_score_correction_bias
DS_LINEAR = 61 * DS_ATTN + 3 * DS_DENSE + 58 * DS_MOE
DS_FIXED = 61 * DS_ATTN_NORMS + 58 * DS_ROUTER + 2 * 129280 * 7168 + 7168
DS_REPLICATED = 61 * (7168 * 1536 + 7168 * 576)     # q_a, kv_a: whole on every tensor rank in vLLM
# gpt-oss-120b: 36 layers; attention (q 2880 -> 64 x 64, k/v -> 8 x 64, o, all with biases, 64 sinks) stays bf16;
# 128 experts (gate_up 2880 -> 2 x 2880, down 2880 -> 2880, with biases) are MXFP4; router 2880 x 128 + bias.
GO_ATTN = 2880 * 4096 + 2 * 2880 * 512 + 4096 * 2880
GO_EXPERTS = 128 * 2880 * 5760 + 128 * 2880 * 2880
GO_OTHER = (4096 + 2 * 512 + 2880) + 64 + 2 * 2880 + (2880 * 128 + 128) + 128 * (5760 + 2880)
GO_PARAMS = 36 * (GO_ATTN + GO_EXPERTS + GO_OTHER) + 2 * 201088 * 2880 + 2880
# Gemma 3 27B (text_config lists only what differs from transformers' defaults: vocab 262208, tied embeddings,
# sliding-window pattern 6): hidden 5376, 62 layers, 32 heads x 128, 16 KV heads, MLP 21504, q/k norms, 4 norms.
G3_TEXT = 62 * (5376 * 4096 + 2 * 5376 * 2048 + 4096 * 5376 + 2 * 128 + 3 * 5376 * 21504 + 4 * 5376) \
    + 262208 * 5376 + 5376
# SigLIP (hidden 1152, MLP 4304, 27 layers, 896 px / 14 px patches), then Gemma's projector into 5376 and its norm.
G3_VISION = (3 * 14 * 14 * 1152 + 1152 + (896 // 14) ** 2 * 1152
             + 27 * (4 * (1152 * 1152 + 1152) + (1152 * 4304 + 4304) + (4304 * 1152 + 1152) + 4 * 1152)
             + 2 * 1152 + 1152 * 5376 + 1152)
# Llama 4 Scout: 48 MoE layers (16 experts of 8192 + 1 shared, top-1, router 5120 x 16), 40 heads x 128, 8 KV heads,
# vocab 202048; the vision encoder (1408 wide, 34 layers, 336 px / 14 px), its adapter and projector.
L4_TEXT = 48 * (2 * 5120 * 5120 + 2 * 5120 * 1024 + 16 * 3 * 5120 * 8192 + 3 * 5120 * 8192 + 5120 * 16 + 2 * 5120) \
    + 2 * 202048 * 5120 + 5120
L4_VISION = (3 * 14 * 14 * 1408 + 1408 + ((336 // 14) ** 2 + 1) * 1408 + 4 * 1408
             + 34 * (4 * (1408 * 1408 + 1408) + (1408 * 5632 + 5632) + (5632 * 1408 + 1408) + 4 * 1408)
             + 5632 * 4096 + 4096 * 4096 + 4096 * 5120)

BF16_MODELS: list[tuple[str, int, int]] = [
    # (repo, hand parameter count, the checkpoint's published count)
    ("meta-llama/Llama-3.1-8B-Instruct", L8_PARAMS, 8_030_261_248),
    ("meta-llama/Llama-3.1-70B-Instruct", L70_PARAMS, 70_553_706_496),
    ("meta-llama/Llama-3.3-70B-Instruct", L70_PARAMS, 70_553_706_496),
    ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", L70_PARAMS, 70_553_706_496),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", L4_TEXT + L4_VISION, 108_641_793_536),
    ("Qwen/Qwen2.5-7B-Instruct", Q7_PARAMS, 7_615_616_512),
    ("Qwen/Qwen2.5-72B-Instruct", Q72_PARAMS, 72_706_203_648),
    ("Qwen/Qwen3-8B", Q3_8_PARAMS, 8_190_735_360),
    ("Qwen/Qwen3-30B-A3B", Q3_30_PARAMS, 30_532_122_624),
    ("Qwen/Qwen3-235B-A22B-Instruct-2507", Q3_235_PARAMS, 235_093_634_560),
    ("mistralai/Mistral-7B-Instruct-v0.3", M7_PARAMS, 7_248_023_552),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", MX_PARAMS, 46_702_792_704),
    ("microsoft/phi-4", PHI4_PARAMS, 14_659_507_200),
    ("google/gemma-3-27b-it", G3_TEXT + G3_VISION, 27_432_406_640),
]


@pytest.mark.parametrize(("repo", "hand", "published"), BF16_MODELS, ids=[m[0] for m in BF16_MODELS])
def test_unquantized_parameters_and_weight_bytes(repo: str, hand: int, published: int) -> None:
    assert hand == published, "the hand arithmetic must reproduce the published count"
    got = facts(repo)
    assert got.parameters == hand
    assert got.weight_bytes() == 2 * hand           # bf16: two bytes a parameter
    assert got.weight_format.name == "bf16" and not got.weight_format.quantized


QUANTIZED: list[tuple[str, str, float]] = [
    # (repo, format, hand weight bytes)
    # compressed-tensors W4A16, group 128, symmetric, lm_head ignored: 4 bits + a 16-bit scale per 128.
    ("RedHatAI/Meta-Llama-3.1-70B-Instruct-quantized.w4a16", "int4", 80 * L70_LINEAR * (4 + 16 / 128) / 8 + L70_FIXED * 2),
    # compressed-tensors FP8, per-channel weights (scales negligible), lm_head ignored.
    ("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", "fp8", 80 * L70_LINEAR * 1 + L70_FIXED * 2),
    # compressed-tensors W8A8 INT8, per channel.
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8", "int8", 32 * L8_LINEAR * 1 + L8_FIXED * 2),
    # AWQ 4-bit, group 128, zero point: 4 bits + (16-bit scale + 4-bit zero) per 128.
    ("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "awq", 80 * L70_LINEAR * (4 + 20 / 128) / 8 + L70_FIXED * 2),
    # GPTQ 4-bit, group 128 (scale + packed zero per group), MLP padded to 29696.
    ("Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4", "gptq", 80 * Q72_GPTQ_LINEAR * (4 + 20 / 128) / 8 + Q72_GPTQ_FIXED * 2),
    # bitsandbytes NF4, blocks of 64, double-quantized absmax (8-bit per block + fp32 per 256 blocks).
    ("unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit", "bnb-4bit",
     32 * L8_LINEAR * (4 + 8 / 64 + 32 / (64 * 256)) / 8 + L8_FIXED * 2),
    # NVIDIA ModelOpt FP8 from hf_quant_config.json (config.json itself says nothing), lm_head excluded.
    ("nvidia/Llama-3.1-8B-Instruct-FP8", "fp8", 32 * L8_LINEAR * 1 + L8_FIXED * 2),
    # DeepSeek-V3 ships FP8 with one fp32 scale per 128 x 128 block; router, norms and embeddings bf16.
    ("deepseek-ai/DeepSeek-V3", "fp8", DS_LINEAR * (8 + 32 / (128 * 128)) / 8 + DS_FIXED * 2),
    # gpt-oss: MXFP4 experts (4 bits + an 8-bit scale per 32), everything else bf16.
    ("openai/gpt-oss-120b", "mxfp4", 36 * GO_EXPERTS * (4 + 8 / 32) / 8 + (36 * (GO_ATTN + GO_OTHER) + 2 * 201088 * 2880 + 2880) * 2),
]


@pytest.mark.parametrize(("repo", "fmt", "hand"), QUANTIZED, ids=[m[0] for m in QUANTIZED])
def test_quantized_weight_bytes(repo: str, fmt: str, hand: float) -> None:
    got = facts(repo)
    assert got.weight_format.name == fmt and got.weight_format.quantized
    assert abs(got.weight_bytes() - hand) <= 8, f"{got.weight_bytes()} != {hand:.0f}"


def test_quantized_parameter_counts() -> None:
    # Quantization changes bytes, not parameters: the hand totals of the base models hold.
    assert facts("RedHatAI/Meta-Llama-3.1-70B-Instruct-quantized.w4a16").parameters == L70_PARAMS
    assert facts("deepseek-ai/DeepSeek-V3").parameters == DS_LINEAR + DS_FIXED == 671_026_419_200
    assert facts("openai/gpt-oss-120b").parameters == GO_PARAMS == 116_829_156_672
    assert facts("Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4").parameters == 80 * Q72_GPTQ_LINEAR + Q72_GPTQ_FIXED


def test_layers_left_unquantized_are_named() -> None:
    assert "attention" in facts("openai/gpt-oss-120b").weight_format.detail
    detail = facts("RedHatAI/Meta-Llama-3.1-70B-Instruct-quantized.w4a16").weight_format.detail
    assert "group 128" in detail and "lm_head" in detail and "embeddings" in detail


# --- KV cache, context length, windows ------------------------------------------------------------

KV: list[tuple[str, int, int]] = [
    # (repo, max_model_len the config implies as vLLM derives it, KV bytes per token at tensor 1, bf16, every
    # attention layer counted as vLLM's logged pool counts them: sliding and chunked ones too)
    ("meta-llama/Llama-3.1-8B-Instruct", 131072, 2 * 32 * 8 * 128 * 2),        # llama3 RoPE does not scale
    ("meta-llama/Llama-3.3-70B-Instruct", 131072, 2 * 80 * 8 * 128 * 2),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 10485760, 2 * 48 * 8 * 128 * 2),
    ("Qwen/Qwen2.5-7B-Instruct", 32768, 2 * 28 * 4 * 128 * 2),                  # use_sliding_window false
    ("Qwen/Qwen2.5-72B-Instruct", 32768, 2 * 80 * 8 * 128 * 2),
    ("Qwen/Qwen3-8B", 40960, 2 * 36 * 8 * 128 * 2),
    ("Qwen/Qwen3-30B-A3B", 40960, 2 * 48 * 4 * 128 * 2),
    ("Qwen/Qwen3-235B-A22B-Instruct-2507", 262144, 2 * 94 * 4 * 128 * 2),
    ("mistralai/Mistral-7B-Instruct-v0.3", 32768, 2 * 32 * 8 * 128 * 2),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", 32768, 2 * 32 * 8 * 128 * 2),
    ("microsoft/phi-4", 16384, 2 * 40 * 10 * 128 * 2),
    ("deepseek-ai/DeepSeek-V3", 4096 * 40, 61 * (512 + 64) * 2),              # yarn: original x factor; MLA latent
    # gpt-oss: yarn 4096 x 32; 18 full layers and 18 windows of 128 tokens.
    ("openai/gpt-oss-120b", 4096 * 32, 36 * 2 * 8 * 64 * 2),
    # Gemma 3: 10 global layers and 52 of 1024-token windows (pattern 6); its linear RoPE factor is not applied.
    ("google/gemma-3-27b-it", 131072, 62 * 2 * 16 * 128 * 2),
]


@pytest.mark.parametrize(("repo", "context", "kv"), KV, ids=[m[0] for m in KV])
def test_kv_bytes_per_token_and_context(repo: str, context: int, kv: int) -> None:
    got = facts(repo)
    assert got.arch.max_context_length == context
    (stage,) = facts_stages(got, tensor=1, pipeline=1, kv_element_bytes=2)
    assert stage.kv_bytes_per_token_per_gpu == kv


def test_moe_mla_and_window_facts() -> None:
    ds = facts("deepseek-ai/DeepSeek-V3").arch
    assert ds.mla is not None and (ds.mla.kv_lora_rank, ds.mla.qk_rope_head_dim) == (512, 64)
    assert ds.moe is not None and (ds.moe.experts, ds.moe.experts_per_token, ds.moe.shared_experts) == (256, 8, 1)
    assert ds.intermediate_size == 2048                       # the per-expert width sizes the activation reserve
    scout = facts("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    assert scout.arch.moe is not None and scout.arch.moe.shared_experts == 1
    assert scout.encoder == L4_VISION
    assert (scout.arch.attention_chunk_size, scout.arch.chunked_attention_layers) == (8192, 36)
    oss = facts("openai/gpt-oss-120b").arch
    assert (oss.sliding_window, oss.sliding_window_layers) == (128, 18)
    gemma = facts("google/gemma-3-27b-it").arch
    assert (gemma.sliding_window, gemma.sliding_window_layers, gemma.tied_embeddings) == (1024, 52, True)
    assert facts("google/gemma-3-27b-it").encoder == G3_VISION
    # Mixtral's active parameters: all but 6 of 8 experts' MLPs per layer.
    mx = facts("mistralai/Mixtral-8x7B-Instruct-v0.1").arch.moe
    assert mx is not None and mx.active_parameters == MX_PARAMS - 32 * 6 * 3 * 4096 * 14336
    assert any("multi-token-prediction" in n for n in facts("deepseek-ai/DeepSeek-V3").notes)


def test_catalog_agrees_with_the_stored_configs() -> None:
    """The catalog (the offline fallback) holds the same facts the configs give."""
    for repo in ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                 "Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen3-8B", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B-Instruct-2507",
                 "mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mixtral-8x7B-Instruct-v0.1", "deepseek-ai/DeepSeek-V3",
                 "openai/gpt-oss-120b", "microsoft/phi-4", "google/gemma-3-27b-it",
                 "meta-llama/Llama-4-Scout-17B-16E-Instruct", "deepseek-ai/DeepSeek-R1-Distill-Llama-70B"):
        read, known = facts(repo), catalog_facts(repo)
        assert known is not None, repo
        a, b = read.arch, known.arch
        assert (a.layers, a.hidden_size, a.attention_heads, a.kv_heads, a.head_dim, a.vocab_size) == \
               (b.layers, b.hidden_size, b.attention_heads, b.kv_heads, b.head_dim, b.vocab_size), repo
        assert (a.max_context_length, a.sliding_window, a.sliding_window_layers, a.tied_embeddings) == \
               (b.max_context_length, b.sliding_window, b.sliding_window_layers, b.tied_embeddings), repo
        assert read.parameters == b.parameters, repo
        assert (a.moe is None) == (b.moe is None) and (a.mla is None) == (b.mla is None), repo
    assert {entry.key for entry in CATALOG} >= {"gemma-3-27b", "phi-4", "llama-4-scout-17b-16e"}


# --- the planner on these facts ---------------------------------------------------------------------


def test_w4a16_70b_fits_on_fewer_gpus_than_bf16() -> None:
    for gpu in ("H100-80GB", "A100-80GB"):
        bf16 = plan("meta-llama/Llama-3.1-70B-Instruct", accelerator={"type": gpu})
        w4a16 = plan("RedHatAI/Meta-Llama-3.1-70B-Instruct-quantized.w4a16", accelerator={"type": gpu})
        assert w4a16.gpus_per_replica < bf16.gpus_per_replica, gpu
        assert w4a16.gpus_per_replica == 1 and w4a16.weight_format == "int4"
        # 36.8 GiB of weights on one GPU: 80 x 855,638,016 x 4.125 / 8 + 16-bit embeddings, head and norms.
        assert abs(w4a16.weight_bytes_per_gpu - (80 * L70_LINEAR * 4.125 / 8 + L70_FIXED * 2)) <= 8


def test_mla_down_projections_are_whole_on_every_rank() -> None:
    p = plan("deepseek-ai/DeepSeek-V3", accelerator={"type": "H200-141GB"}, parallelism={"tensor": 8, "pipeline": 1})
    bits = 8 + 32 / (128 * 128)
    expected = ((DS_LINEAR - DS_REPLICATED) * bits / 8 + DS_FIXED * 2) / 8 + DS_REPLICATED * bits / 8
    assert abs(p.weight_bytes_per_gpu - expected) <= 8
    assert p.model_source == "file" and p.kv_bytes_per_token_per_gpu == 61 * (512 + 64) * 2


def test_pipeline_stages_take_their_own_layers() -> None:
    # DeepSeek-V3 over 4 stages: [15, 15, 16, 15] layers; the first stage holds the 3 dense layers (smaller).
    p = plan("deepseek-ai/DeepSeek-V3", accelerator={"type": "H200-141GB"}, parallelism={"tensor": 8, "pipeline": 4})
    moe_layer = (DS_ATTN + DS_MOE) * (8 + 32 / 16384) / 8 + (DS_ATTN_NORMS + DS_ROUTER) * 2
    replicated = (7168 * 1536 + 7168 * 576) * (8 + 32 / 16384) / 8
    # The largest stage is the third: 16 MoE layers, no embedding, no head.
    expected = 16 * ((moe_layer - replicated) / 8 + replicated)
    assert abs(p.weight_bytes_per_gpu - expected) <= 16


def test_fp8_at_load_time_requantizes_the_linear_layers_only() -> None:
    p = plan("meta-llama/Llama-3.1-70B-Instruct", model={"name": "meta-llama/Llama-3.1-70B-Instruct",
                                                         "maxModelLen": 8192, "quantization": "fp8"},
             parallelism={"tensor": 2})
    assert p.weight_format == "fp8" and "load time" in p.weight_detail
    assert abs(p.weight_bytes_total - (80 * L70_LINEAR * 1 + L70_FIXED * 2)) <= 8


def test_awq_checkpoint_refuses_other_quantization() -> None:
    from tensorfleet.api import SpecError
    with pytest.raises(SpecError) as err:
        plan("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4",
             model={"name": "hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "quantization": "gptq"})
    assert err.value.field == "spec.model.quantization"
    assert plan("Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4",
                model={"name": "Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4", "quantization": "gptq"}).weight_format == "gptq"


def test_float16_checkpoints_compute_in_float16() -> None:
    # The AWQ config says torch_dtype float16, as vLLM's auto dtype follows.
    assert plan("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4").dtype == "float16"
    assert plan("meta-llama/Llama-3.1-8B-Instruct").dtype == "bfloat16"


def test_facts_win_over_the_catalog_and_the_spec_wins_over_facts() -> None:
    spec = load_inference_service(isvc_doc({"model": {"name": "Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4",
                                                      "maxModelLen": 8192}})).spec
    read = make_plan(spec, facts("Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4"))
    fallback = make_plan(spec)
    assert (read.model_source, fallback.model_source) == ("file", "catalog+id-markers")
    assert read.weight_bytes_total > fallback.weight_bytes_total       # the padded MLP the catalog cannot know
    assert read.to_status().model_source == "file"
    arch = {"parameters": 13_000_000_000, "layers": 40, "hiddenSize": 5120, "attentionHeads": 40, "kvHeads": 40,
            "vocabSize": 32000, "maxContextLength": 4096}
    own = load_inference_service(isvc_doc({"model": {"name": "Qwen/Qwen3-8B", "maxModelLen": 4096,
                                                     "architecture": arch}})).spec
    assert make_plan(own, facts("Qwen/Qwen3-8B")).model_source == "spec"


# --- reading configs: the rules and the refusals ----------------------------------------------------


def test_compressed_tensors_ignore_patterns_keep_modules_16_bit() -> None:
    # Llama 4 W4A16 checkpoints ignore attention and routers by regex and class name.
    cfg = config("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}},
        "ignore": ["re:.*lm_head", "re:.*self_attn", "re:.*router", "re:vision_model.*", "Llama4TextAttention"],
    }
    got = parse_model_config(cfg, name="w4a16-scout")
    attn = 2 * 5120 * 5120 + 2 * 5120 * 1024
    experts = 16 * 3 * 5120 * 8192 + 3 * 5120 * 8192
    other = 5120 * 16 + 2 * 5120
    layer = experts * (4 + 16 / 128) / 8 + (attn + other) * 2
    hand = 48 * layer + (2 * 202048 * 5120 + 5120 + L4_VISION) * 2
    assert abs(got.weight_bytes() - hand) <= 8
    assert "attention" in got.weight_format.detail


def test_gptq_modules_in_block_and_quantized_head() -> None:
    cfg = config("Qwen/Qwen2.5-7B-Instruct")
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": 128, "lm_head": True,
                                  "modules_in_block_to_quantize": [["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]}
    got = parse_model_config(cfg, name="gptq-8")
    bits = 8 + (16 + 8) / 128
    mlp, attn = 3 * 3584 * 18944, 2 * 3584 * 3584 + 2 * 3584 * 512
    other = (3584 + 2 * 512) + 2 * 3584
    hand = 28 * (mlp * bits / 8 + (attn + other) * 2) + 152064 * 3584 * 2 + 152064 * 3584 * bits / 8 + 3584 * 2
    assert got.weight_format.name == "gptq-int8"
    assert abs(got.weight_bytes() - hand) <= 8


@pytest.mark.parametrize(("change", "phrase"), [
    ({"quantization_config": {"quant_method": "gguf"}}, "quant_method 'gguf'"),
    ({"hidden_size": None}, "hidden_size is missing"),
    ({"model_type": "falcon_h1"}, "not an attention decoder nor a hybrid the planner reads"),
    ({"model_type": "jamba", "attn_layer_offset": 99}, "a hybrid model needs attention layers too"),
    ({"layer_types": ["linear_attention"] * 32}, "layer_types has 'linear_attention'"),
    ({"num_key_value_heads": 7}, "kvHeads 7 must divide"),
    ({"num_hidden_layers": "32"}, "num_hidden_layers must be a whole number"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "config_groups is missing"),
])
def test_configs_the_planner_cannot_size_say_why(change: dict[str, Any], phrase: str) -> None:
    cfg = {**config("meta-llama/Llama-3.1-8B-Instruct"), **change}
    with pytest.raises(ModelConfigError) as err:
        parse_model_config(cfg, name="x")
    assert phrase in str(err.value)


def test_context_length_follows_vllm() -> None:
    base = config("meta-llama/Llama-3.1-8B-Instruct")
    linear = {**base, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert parse_model_config(linear, name="x").arch.max_context_length == 4096 * 4
    yarn = {**base, "max_position_embeddings": 32768,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert parse_model_config(yarn, name="x").arch.max_context_length == 131072
    several = {**base, "rope_scaling": None, "max_position_embeddings": 8192, "seq_length": 4096}
    assert parse_model_config(several, name="x").arch.max_context_length == 4096


def test_qwen_sliding_window_from_max_window_layers() -> None:
    cfg = {**config("Qwen/Qwen2.5-7B-Instruct"), "use_sliding_window": True, "sliding_window": 4096,
           "max_window_layers": 20}
    arch = parse_model_config(cfg, name="x").arch
    assert (arch.sliding_window, arch.sliding_window_layers) == (4096, 8)


def test_an_unknown_model_type_is_sized_as_a_standard_decoder() -> None:
    cfg = {**config("meta-llama/Llama-3.1-8B-Instruct"), "model_type": "acme_llm", "architectures": ["AcmeForCausalLM"]}
    got = parse_model_config(cfg, name="acme/llm")
    assert got.parameters == L8_PARAMS
    assert any("acme_llm" in n for n in got.notes)


# --- the catalog fallback reads quantization markers in the model id -----------------------------------

MARKERS = [
    ("RedHatAI/Meta-Llama-3.1-70B-Instruct-quantized.w4a16", "llama-3.1-70b", "int4"),
    ("neuralmagic/Meta-Llama-3.1-70B-Instruct-W4A16", "llama-3.1-70b", "int4"),
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8", "llama-3.1-8b", "int8"),
    ("acme/Llama-3.1-8B-Instruct-W8A8", "llama-3.1-8b", "int8"),
    ("acme/Llama-3.1-8B-Instruct-INT8", "llama-3.1-8b", "int8"),
    ("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", "llama-3.1-70b", "fp8"),
    ("Qwen/Qwen2.5-72B-Instruct-AWQ", "qwen2.5-72b", "awq"),
    ("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "llama-3.1-70b", "awq"),
    ("Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4", "qwen2.5-72b", "gptq"),
    ("Qwen/Qwen2.5-72B-Instruct-GPTQ-Int8", "qwen2.5-72b", "gptq-int8"),
    ("unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit", "llama-3.1-8b", "bnb-4bit"),
    ("unsloth/Llama-3.3-70B-Instruct-unsloth-bnb-4bit", "llama-3.1-70b", "bnb-4bit"),
    ("nvidia/Llama-3.3-70B-Instruct-FP4", "llama-3.1-70b", "nvfp4"),
    ("RedHatAI/Mixtral-8x7B-Instruct-v0.1-W4A16", "mixtral-8x7b", "int4"),
    ("Qwen/Qwen3-235B-A22B-Instruct-2507", "qwen3-235b-a22b-2507", None),
    ("Qwen/Qwen3-235B-A22B-Instruct-2507-FP8", "qwen3-235b-a22b-2507", "fp8"),
    ("Qwen/Qwen3-235B-A22B", "qwen3-235b-a22b", None),
    ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", "llama-3.1-70b", None),
]


@pytest.mark.parametrize(("name", "key", "fmt"), MARKERS, ids=[m[0] for m in MARKERS])
def test_id_markers_on_a_known_base(name: str, key: str, fmt: str | None) -> None:
    entry, implied = find_model(name)
    assert entry is not None and entry.key == key
    assert implied == fmt
    found = catalog_facts(name)
    assert found is not None and found.source == ("catalog+id-markers" if fmt else "catalog")
    if fmt:
        assert found.weight_format.bits == BITS[fmt]


def test_w4a16_id_offline_is_planned_at_4_bits_on_fewer_gpus() -> None:
    # No config.json (offline): the catalog's Llama 3.1 70B, at the bits the id names. It used to be 16-bit, 4 GPUs.
    def offline(name: str) -> Plan:
        return make_plan(load_inference_service(isvc_doc({"model": {"name": name, "maxModelLen": 32768}})).spec)

    bf16 = offline("meta-llama/Llama-3.1-70B-Instruct")
    w4a16 = offline("RedHatAI/Meta-Llama-3.1-70B-Instruct-quantized.w4a16")
    w8a8 = offline("RedHatAI/Meta-Llama-3.1-70B-Instruct-quantized.w8a8")
    assert (bf16.gpus_per_replica, w8a8.gpus_per_replica, w4a16.gpus_per_replica) == (4, 2, 1)
    assert (w4a16.weight_format, w4a16.model_source) == ("int4", "catalog+id-markers")
    # Catalog totals: 2 x 128256 x 8192 embedding parameters at 2 bytes, the rest at 4.125 bits.
    embeddings = 2 * 128256 * 8192
    assert abs(w4a16.weight_bytes_total - (embeddings * 2 + (70_553_706_496 - embeddings) * 4.125 / 8)) <= 8


def test_readme_sources_are_exact_paths() -> None:
    readme = (DATA / "README.md").read_text()
    for line in readme.splitlines():
        if "hf.co/" in line:
            repo = line.split("hf.co/", 1)[1].split("/blob/", 1)[0]
            assert (DATA / repo / "config.json").is_file(), line


def test_the_status_names_every_source_the_facts_know() -> None:
    from typing import get_args

    from tensorfleet.api.architecture import ArchitectureSpec
    from tensorfleet.api.status import PlanStatus
    from tensorfleet.catalog.facts import MODEL_SOURCES, ModelSource

    status_sources = get_args(get_args(PlanStatus.model_fields["model_source"].annotation)[0])
    assert set(status_sources) == set(MODEL_SOURCES) == set(get_args(ModelSource))
    # Every format the planner knows can be written in spec.model.architecture.weightFormat.
    assert set(get_args(ArchitectureSpec.model_fields["weight_format"].annotation)) == set(BITS)
