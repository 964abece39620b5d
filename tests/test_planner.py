"""Planner figures against hand calculations. Each expected value is worked out
from the model's config.json facts in the comment beside it, not by calling
the planner's own helpers."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import isvc_doc

from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.planner import Plan, make_plan
from tensorfleet.planner.memory import stage_layers

GiB = 1024**3
MiB = 1024**2


def plan_for(spec: dict[str, Any]) -> Plan:
    return make_plan(load_inference_service(isvc_doc(spec)).spec)


def test_kv_bytes_per_token_gqa_single_gpu() -> None:
    # Llama 3.1 8B: 32 layers x 8 KV heads x 128 head dim x 2 (K,V) x 2 bytes (bf16)
    plan = plan_for({"parallelism": {"tensor": 1, "pipeline": 1}})
    assert plan.kv_bytes_per_token_per_gpu == 32 * 8 * 128 * 2 * 2 == 131072


def test_kv_bytes_per_token_split_by_tensor() -> None:
    # Llama 3.1 70B at tensor 4: 80 layers x (8/4) heads x 128 x 2 x 2 bytes
    plan = plan_for({"model": {"name": "meta-llama/Llama-3.1-70B-Instruct"}, "parallelism": {"tensor": 4}})
    assert plan.kv_bytes_per_token_per_gpu == 80 * 2 * 128 * 2 * 2 == 81920


def test_kv_heads_replicated_when_tensor_exceeds_them() -> None:
    # Qwen3-30B-A3B has 4 KV heads; at tensor 8 every GPU still holds one whole head.
    plan = plan_for({"model": {"name": "Qwen/Qwen3-30B-A3B", "maxModelLen": 32768}, "parallelism": {"tensor": 8}})
    assert plan.kv_bytes_per_token_per_gpu == 48 * 1 * 128 * 2 * 2
    assert any("replicated" in note for note in plan.notes)


def test_mla_kv_is_latent_and_not_split_by_tensor() -> None:
    # DeepSeek-V3: 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes, on every rank.
    plan = plan_for({"model": {"name": "deepseek-ai/DeepSeek-V3", "maxModelLen": 32768},
                     "accelerator": {"type": "H200-141GB"}, "parallelism": {"tensor": 8}})
    assert plan.kv_bytes_per_token_per_gpu == 61 * (512 + 64) * 2 == 70272


def test_fp8_kv_cache_halves_bytes_per_token() -> None:
    plan = plan_for({"engine": {"kvCacheDtype": "fp8"}, "parallelism": {"tensor": 1}})
    assert plan.kv_bytes_per_token_per_gpu == 32 * 8 * 128 * 2 * 1


def test_bf16_weights_per_gpu() -> None:
    # Llama 3.1 70B: 70,553,706,496 parameters x 2 bytes / 4 GPUs
    plan = plan_for({"model": {"name": "meta-llama/Llama-3.1-70B-Instruct"}, "parallelism": {"tensor": 4}})
    assert plan.weight_bytes_total == 70_553_706_496 * 2
    assert abs(plan.weight_bytes_per_gpu - 70_553_706_496 * 2 / 4) <= 4


def test_fp8_keeps_embeddings_16_bit() -> None:
    # Two untied 128256 x 8192 embedding matrices stay bf16; the other parameters take 1 byte.
    embeddings = 2 * 128256 * 8192
    expected = embeddings * 2 + (70_553_706_496 - embeddings) * 1
    plan = plan_for({"model": {"name": "meta-llama/Llama-3.1-70B-Instruct", "quantization": "fp8"},
                     "parallelism": {"tensor": 2}})
    assert abs(plan.weight_bytes_total - expected) <= 8
    assert plan.weight_format == "fp8"


def test_int4_checkpoint_found_by_name() -> None:
    # An AWQ checkpoint: 4-bit body plus one fp16 scale and a 4-bit zero per 128 weights.
    embeddings = 2 * 128256 * 8192
    expected = embeddings * 2 + (70_553_706_496 - embeddings) * (0.5 + 2.5 / 128)
    plan = plan_for({"model": {"name": "hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4"},
                     "accelerator": {"type": "A100-80GB"}, "parallelism": {"tensor": 1}})
    assert plan.weight_format == "awq"
    assert abs(plan.weight_bytes_total - expected) / expected < 1e-6
    assert 36 * GiB < plan.weight_bytes_per_gpu < 40 * GiB


def test_pipeline_stages_split_like_vllm() -> None:
    # vLLM's get_pp_indices: even shares; the remainder goes one layer each to the
    # stages counted backwards from the second-to-last.
    assert stage_layers(80, 3) == [27, 27, 26]
    assert stage_layers(61, 4) == [15, 15, 16, 15]  # the example in vLLM's docs
    assert stage_layers(126, 2) == [63, 63]
    assert stage_layers(32, 1) == [32]


def test_pipeline_weights_take_the_largest_stage() -> None:
    # Llama 3.1 405B, tensor 8 x pipeline 2: each stage holds 63 layers and one
    # embedding matrix (input on the first, output head on the last).
    embedding = 128256 * 16384
    per_layer = (405_853_388_800 - 2 * embedding) * 2 / 126
    expected = (63 * per_layer + embedding * 2) / 8
    plan = plan_for({"model": {"name": "meta-llama/Llama-3.1-405B-Instruct"},
                     "parallelism": {"tensor": 8, "pipeline": 2}})
    assert abs(plan.weight_bytes_per_gpu - expected) <= 8
    assert plan.gpus_per_replica == 16
    assert plan.kv_bytes_per_token_per_gpu == 63 * 1 * 128 * 2 * 2


def test_kv_tokens_hand_calculation_single_gpu() -> None:
    # Llama 3.1 8B on one H100 at utilization 0.9; vLLM 0.19 defaults on >= 70 GiB
    # GPUs: 8192 batched tokens, 1024 sequences.
    budget = (81559 - 512) * MiB * 0.9                      # NVML total less driver reserve
    weights = 8_030_261_248 * 2
    activation = 8192 * 3 * 14336 * 2 + 8192 * 6 * 4096 * 2 + 1024 * 128256 * 4 * 2
    non_torch = 0.27 * GiB
    per_token = 131072
    tokens = int((budget - weights - activation - non_torch) // (16 * per_token)) * 16
    plan = plan_for({"parallelism": {"tensor": 1}})
    assert abs(plan.kv_cache_tokens - tokens) <= 16
    assert plan.max_concurrent_sequences == plan.kv_cache_tokens // 8192
    assert plan.max_num_seqs == 1024


def test_a100_uses_vllm_small_gpu_defaults() -> None:
    plan = plan_for({"accelerator": {"type": "A100-80GB"}, "parallelism": {"tensor": 1}})
    assert plan.max_num_seqs == 256
    assert plan_for({"accelerator": {"type": "A100-80GB"}, "engine": {"maxNumSeqs": 64}}).max_num_seqs == 64


def test_pipeline_takes_the_smallest_stage_capacity() -> None:
    # 80 layers over 3 stages: the 27-layer stages hold fewer tokens than the 26-layer one.
    plan = plan_for({"model": {"name": "meta-llama/Llama-3.1-70B-Instruct"}, "parallelism": {"tensor": 4, "pipeline": 3}})
    assert plan.kv_bytes_per_token_per_gpu == 27 * 2 * 128 * 2 * 2
    four = plan_for({"model": {"name": "meta-llama/Llama-3.1-70B-Instruct"}, "parallelism": {"tensor": 4, "pipeline": 4}})
    assert four.kv_cache_tokens > plan.kv_cache_tokens


@pytest.mark.parametrize(
    "spec,layout",
    [
        # 70B bf16 needs 131 GiB: two A100-80GB hold it with room for an 8k sequence.
        ({"model": {"name": "meta-llama/Llama-3.1-70B-Instruct"}, "accelerator": {"type": "A100-80GB"}}, (2, 1)),
        # 8B at its full 128k context does not fit one L4 (24 GB), two do.
        ({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": None}, "accelerator": {"type": "L4"}}, (2, 1)),
        # 405B bf16 (756 GiB) exceeds one 8 x H100 node: tensor 8, two pipeline stages.
        ({"model": {"name": "meta-llama/Llama-3.1-405B-Instruct"}}, (8, 2)),
        # A 7B fits on one GPU.
        ({"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "accelerator": {"type": "A10G"}}, (1, 1)),
        # gpt-oss-120b (mxfp4, alternating 128-token windows) serves its full context on one H100.
        ({"model": {"name": "openai/gpt-oss-120b", "maxModelLen": None}}, (1, 1)),
    ],
)
def test_auto_layout_is_the_smallest_that_fits(spec: dict[str, Any], layout: tuple[int, int]) -> None:
    if spec["model"].get("maxModelLen", 0) is None:
        document = isvc_doc(spec)
        del document["spec"]["model"]["maxModelLen"]
        plan = make_plan(load_inference_service(document).spec)
    else:
        plan = plan_for(spec)
    assert (plan.tensor, plan.pipeline) == layout
    assert plan.auto_layout and plan.fits


def test_tensor_given_pipeline_chosen() -> None:
    plan = plan_for({"model": {"name": "meta-llama/Llama-3.1-405B-Instruct"}, "parallelism": {"tensor": 8}})
    assert (plan.tensor, plan.pipeline) == (8, 2)


def test_gpus_per_node_override_bounds_tensor() -> None:
    with pytest.raises(SpecError) as err:
        plan_for({"accelerator": {"type": "L4", "gpusPerNode": 4}, "parallelism": {"tensor": 8}})
    assert err.value.field == "spec.parallelism.tensor"
    assert "4 GPUs" in err.value.message


def test_too_large_names_a_layout_that_fits() -> None:
    with pytest.raises(SpecError) as err:
        plan_for({"model": {"name": "meta-llama/Llama-3.1-70B-Instruct"}, "accelerator": {"type": "A100-80GB"},
                  "parallelism": {"tensor": 1, "pipeline": 1}})
    assert err.value.field == "spec.parallelism"
    assert "needs tensor >= 2 on A100-80GB" in err.value.message
    assert "quantization: fp8" in err.value.message


def test_kv_shortfall_suggests_max_model_len() -> None:
    with pytest.raises(SpecError) as err:
        plan_for({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 131072},
                  "accelerator": {"type": "L4"}, "parallelism": {"tensor": 1, "pipeline": 1}})
    message = err.value.message
    assert "fewer than one sequence of maxModelLen 131072" in message
    assert "spec.model.maxModelLen <=" in message
    allowed = int(message.split("spec.model.maxModelLen <= ")[1].split(",")[0].split(";")[0])
    plan_for({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": allowed},
              "accelerator": {"type": "L4"}, "parallelism": {"tensor": 1, "pipeline": 1}})


def test_architecture_in_spec_serves_unknown_model() -> None:
    arch = {"parameters": 13_000_000_000, "layers": 40, "hiddenSize": 5120, "attentionHeads": 40, "kvHeads": 40,
            "vocabSize": 32000, "maxContextLength": 4096}
    plan = plan_for({"model": {"name": "acme/internal-13b", "maxModelLen": 4096, "architecture": arch},
                     "parallelism": {"tensor": 1}})
    # 40 layers x 40 heads x (5120/40 = 128) x 2 x 2 bytes
    assert plan.kv_bytes_per_token_per_gpu == 40 * 40 * 128 * 2 * 2
    assert plan.weight_bytes_total == 13_000_000_000 * 2


def test_plan_status_shape() -> None:
    status = plan_for({"parallelism": {"tensor": 1}}).to_status().model_dump(by_alias=True)
    assert set(status) == {"accelerator", "tensor", "pipeline", "gpusPerReplica", "maxModelLen", "weightsPerGpu",
                           "kvCacheBytesPerToken", "kvCacheTokens", "maxConcurrentSequences", "loadSeconds", "modelSource"}
    assert status["weightsPerGpu"].endswith("Gi")
    assert status["modelSource"] == "catalog"


@pytest.mark.parametrize(("accelerator", "args", "runs"), [
    ("H100-80GB", [], True),                                   # SXM boards: NVLink
    ("H100-80GB", ["--disable-custom-all-reduce"], False),
    ("L40S", [], False),                                       # PCIe cards without peer-to-peer access
    ("A10G", [], False),
])
def test_the_communication_reserve_follows_custom_all_reduce(accelerator: str, args: list[str], runs: bool) -> None:
    """Under tensor parallelism vLLM's custom all-reduce buffers come beside NCCL's only where it runs (NVLink,
    a supported size, not turned off): without it the reserve is about 1.4 GiB smaller and the plan says why."""
    from tensorfleet.planner import memory

    doc = isvc_doc({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
                    "accelerator": {"type": accelerator}, "parallelism": {"tensor": 2, "pipeline": 1},
                    "engine": {"args": args}})
    plan = make_plan(load_inference_service(doc).spec)
    assert plan.non_torch_bytes_per_gpu == (memory.NON_TORCH_TENSOR_PARALLEL if runs else memory.NON_TORCH_NCCL_ONLY)
    said = [note for note in plan.notes if "custom all-reduce does not run" in note]
    assert bool(said) != runs, plan.notes
    if args:
        assert "--disable-custom-all-reduce in spec.engine.args" in said[0]
