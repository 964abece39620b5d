"""LoRA in the plan: the adapters' GPU slots against hand calculations, the KV cache they leave, the defaults,
and the specs refused. Each expected figure is worked out from the model's config.json facts in the comment
beside it (vLLM's LoRA layer shapes: planner/lora.py), not by calling the planner's helpers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import isvc_doc

from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.cli import main
from tensorfleet.planner import LoraPlan, Plan, make_plan

GiB = 1024**3
MiB = 1024**2
BLOCK = 16


def plan_for(spec: dict[str, Any]) -> Plan:
    return make_plan(load_inference_service(isvc_doc(spec)).spec)


def lora_of(plan: Plan) -> LoraPlan:
    assert plan.lora is not None
    return plan.lora


def adapters(count: int, rank: int | None = 16) -> list[dict[str, Any]]:
    return [{"name": f"adapter-{i}", "source": f"org/adapter-{i}", **({"rank": rank} if rank else {})}
            for i in range(count)]


# Llama 3.1 8B (config.json): hidden 4096, 32 heads x 128, 8 KV heads, intermediate 14336, 32 layers, vocab 128256.
def llama_8b_slot_elements(rank: int, tensor: int) -> int:
    """One slot, one GPU: lora_a (r x input) whole and lora_b split for column-parallel projections,
    lora_a split and lora_b (output x r) whole for row-parallel ones; embedding and head whole."""
    hidden, q, kv, inter, vocab = 4096, 32 * 128, 8 * 128, 14336, 128256
    qkv = 3 * rank * hidden + (q + 2 * kv) // tensor * rank
    o_proj = rank * q // tensor + hidden * rank
    gate_up = 2 * rank * hidden + 2 * inter // tensor * rank
    down = rank * inter // tensor + hidden * rank
    embedding_and_head = 2 * (vocab * rank + hidden * rank)
    return 32 * (qkv + o_proj + gate_up + down) + embedding_and_head


def test_llama_8b_slots_at_tensor_1_by_hand() -> None:
    plan = plan_for({"parallelism": {"tensor": 1}, "engine": {"lora": {"maxLoras": 4, "maxRank": 16}}})
    lora = lora_of(plan)
    # qkv 196608 + 98304, o 65536 + 65536, gate_up 131072 + 458752, down 229376 + 65536 = 1310720 per layer;
    # x 32 layers + 2 x (128256 + 4096) x 16 = 46178304 elements, 2 bytes each: 88.1 MiB a slot.
    assert llama_8b_slot_elements(16, 1) == 46_178_304
    assert lora.weight_bytes_per_gpu == 4 * 46_178_304 * 2 == 369_426_432
    # One fp32 shrink buffer of qkv's 3 slices for the 8192 tokens of the profiling pass.
    assert lora.working_bytes_per_gpu == 8192 * 16 * 3 * 4
    # maxCpuLoras defaults to twice the 4 GPU slots.
    assert (lora.max_loras, lora.max_rank, lora.max_cpu_loras, lora.rank_assumed) == (4, 16, 2 * 4, False)
    assert plan.lora_bytes_per_gpu == lora.weight_bytes_per_gpu + lora.working_bytes_per_gpu
    assert 0.34 * GiB < plan.lora_bytes_per_gpu < 0.35 * GiB


def test_llama_8b_slots_at_tensor_2_by_hand() -> None:
    # Column-parallel lora_b and row-parallel lora_a halve; the embedding, head and the other halves stay whole.
    plan = plan_for({"parallelism": {"tensor": 2}, "engine": {"lora": {"maxLoras": 4, "maxRank": 16}}})
    per_layer = (3 * 16 * 4096 + (4096 + 2 * 1024) // 2 * 16) + (16 * 2048 + 4096 * 16) \
        + (2 * 16 * 4096 + 2 * 7168 * 16) + (16 * 7168 + 4096 * 16)
    assert llama_8b_slot_elements(16, 2) == 32 * per_layer + 2 * (128256 + 4096) * 16
    assert lora_of(plan).weight_bytes_per_gpu == 4 * llama_8b_slot_elements(16, 2) * 2 == 260_374_528


def test_replicated_kv_heads_keep_one_head_per_gpu() -> None:
    # Tensor 8 > 8 KV heads / 8 = 1: each rank's k and v slices hold one head (128 wide); q holds 4 heads.
    plan = plan_for({"parallelism": {"tensor": 8}, "engine": {"lora": {"maxLoras": 1, "maxRank": 8}}})
    assert lora_of(plan).weight_bytes_per_gpu == llama_8b_slot_elements(8, 8) * 2


def test_pipeline_takes_the_largest_stage_and_its_embedding() -> None:
    # Pipeline 2: 16 layers a stage, the first with the embedding, the last with the head.
    plan = plan_for({"parallelism": {"tensor": 1, "pipeline": 2}, "engine": {"lora": {"maxLoras": 2, "maxRank": 16}}})
    whole = llama_8b_slot_elements(16, 1)
    vocab_term = (128256 + 4096) * 16
    assert lora_of(plan).weight_bytes_per_gpu == 2 * ((whole - 2 * vocab_term) // 2 + vocab_term) * 2


def test_kv_cache_shrinks_by_exactly_the_lora_bytes() -> None:
    base = plan_for({"parallelism": {"tensor": 1}})
    with_lora = plan_for({"parallelism": {"tensor": 1}, "adapters": adapters(4)})
    lora_bytes = with_lora.lora_bytes_per_gpu
    assert lora_bytes > 0
    assert with_lora.kv_bytes_per_gpu == base.kv_bytes_per_gpu - lora_bytes
    per_block = BLOCK * base.kv_bytes_per_token_per_gpu
    assert base.kv_cache_tokens == base.kv_bytes_per_gpu // per_block * BLOCK
    assert with_lora.kv_cache_tokens == (base.kv_bytes_per_gpu - lora_bytes) // per_block * BLOCK
    # The default 8 slots at rank 16 on an H100, whatever the 4 adapters: 8 x 46178304 x 2 = 738852864 bytes
    # (704.6 MiB, a small share of the KV cache, so not lowered) and 8192 x 16 x 3 x 4 = 1572864 of buffers.
    assert lora_of(with_lora).max_loras == 8
    assert lora_bytes == 8 * 46_178_304 * 2 + 8192 * 16 * 3 * 4 == 740_425_728
    # That is 353 blocks of 16 x 128 KiB = 2 MiB, and 131072 bytes over. The KV cache without LoRA,
    # 81047 MiB x 0.9 - 16060522496 - 2157969408 - 0.27 GiB = 57977142968 bytes, is 27645 blocks and
    # 1375928 bytes over, which covers those 131072: 353 blocks go, 353 x 16 = 5648 tokens.
    assert base.kv_cache_tokens - with_lora.kv_cache_tokens == 353 * 16 == 5648
    assert (with_lora.weight_bytes_per_gpu, with_lora.activation_bytes_per_gpu) == \
        (base.weight_bytes_per_gpu, base.activation_bytes_per_gpu)


def test_without_lora_the_plan_is_unchanged() -> None:
    # Llama 3.1 8B on one H100, as tests/test_planner.py works it out by hand.
    budget = (81559 - 512) * MiB * 0.9
    weights = 8_030_261_248 * 2
    activation = 8192 * 3 * 14336 * 2 + 8192 * 6 * 4096 * 2 + 1024 * 128256 * 4 * 2
    tokens = int((budget - weights - activation - 0.27 * GiB) // (16 * 131072)) * 16
    plan = plan_for({"parallelism": {"tensor": 1}})
    assert plan.lora is None and plan.lora_bytes_per_gpu == 0
    assert abs(plan.kv_cache_tokens - tokens) <= 16
    status = plan.to_status().model_dump(by_alias=True)
    assert not {"maxLoras", "maxLoraRank", "maxCpuLoras", "loraMemoryPerGpu"} & set(status)
    assert not any("LoRA" in note for note in plan.notes)


def test_status_carries_the_lora_figures() -> None:
    # Rank 32 so that the three figures differ: the default 8 slots (8 x 176 MiB is far below a tenth of an
    # H100's KV cache), rank 32, and twice 8 in host memory.
    plan = plan_for({"parallelism": {"tensor": 1}, "adapters": adapters(3, rank=32)})
    status = plan.to_status().model_dump(by_alias=True)
    assert (status["maxLoras"], status["maxLoraRank"], status["maxCpuLoras"]) == (8, 32, 16)
    assert status["loraMemoryPerGpu"] == f"{plan.lora_bytes_per_gpu / GiB:.1f}Gi"


# --- defaults -------------------------------------------------------------------


@pytest.mark.parametrize("ranks,expected", [
    ([8], 8), ([8, 24], 32), ([16, 64], 64), ([300], 320), ([512], 512), ([1], 1),
])
def test_max_rank_is_the_smallest_supported_rank_holding_every_adapter(ranks: list[int], expected: int) -> None:
    spec = [{"name": f"a{i}", "source": "org/a", "rank": rank} for i, rank in enumerate(ranks)]
    lora = lora_of(plan_for({"parallelism": {"tensor": 1}, "adapters": spec}))
    assert (lora.max_rank, lora.rank_assumed) == (expected, False)


def test_max_rank_is_16_without_ranks_and_says_so() -> None:
    plan = plan_for({"parallelism": {"tensor": 1}, "adapters": adapters(2, rank=None)})
    lora = lora_of(plan)
    assert (lora.max_rank, lora.rank_assumed) == (16, True)
    assert any("rank 16" in note and "q/k/v/o/gate/up/down" in note for note in plan.notes)
    # One adapter without a rank is enough; the others' ranks still size the slots.
    mixed = lora_of(plan_for({"adapters": [{"name": "a", "source": "org/a", "rank": 64},
                                           {"name": "b", "source": "org/b"}]}))
    assert (mixed.max_rank, mixed.rank_assumed) == (64, True)


def test_an_explicit_max_rank_wins() -> None:
    lora = lora_of(plan_for({"adapters": adapters(1, rank=8), "engine": {"lora": {"maxRank": 64}}}))
    assert lora.max_rank == 64


def test_engine_lora_alone_switches_lora_on_with_the_defaults() -> None:
    # No adapter listed: 8 slots at rank 16 (8 x 88 MiB = 705 MiB, about 1% of an H100's 54 GiB of KV cache,
    # so not lowered), twice 8 in host memory.
    plan = plan_for({"parallelism": {"tensor": 1}, "engine": {"lora": {}}})
    lora = lora_of(plan)
    assert (lora.max_loras, lora.max_rank, lora.max_cpu_loras, lora.rank_assumed) == (8, 16, 16, False)
    assert lora.weight_bytes_per_gpu == 8 * llama_8b_slot_elements(16, 1) * 2
    assert not any("lowered" in note for note in plan.notes)


@pytest.mark.parametrize("listed", [1, 3, 8, 20])
def test_max_loras_default_is_8_whatever_the_adapters_listed(listed: int) -> None:
    # 8 GPU slots and 16 in host memory for 1 adapter as for 20: fewer host slots than adapters is allowed
    # (vLLM evicts from its host cache), and more slots than adapters only cost memory.
    lora = lora_of(plan_for({"parallelism": {"tensor": 1}, "adapters": adapters(listed)}))
    assert (lora.max_loras, lora.max_cpu_loras) == (8, 2 * 8)
    assert lora.weight_bytes_per_gpu == 8 * llama_8b_slot_elements(16, 1) * 2


@pytest.mark.parametrize("rank", [16, None], ids=["rank-16", "no-rank"])
@pytest.mark.parametrize("accelerator", ["H100-80GB", "L4"])
def test_adding_an_adapter_changes_no_engine_flag(accelerator: str, rank: int | None) -> None:
    # max_loras, max_rank and max_cpu_loras become engine flags: adding adapters (1 listed, then 5, of the same
    # rank or none) must not change them (it would restart the engines), nor the slots' bytes or the KV cache
    # they leave. On the L4 the default 8 is lowered by memory alone, to 4, as worked out below.
    spec: dict[str, Any] = {"accelerator": {"type": accelerator}, "parallelism": {"tensor": 1}}
    one = plan_for({**spec, "adapters": adapters(1, rank)})
    five = plan_for({**spec, "adapters": adapters(5, rank)})
    assert lora_of(one) == lora_of(five)
    assert (lora_of(one).max_loras, lora_of(one).max_cpu_loras) == ((8, 16) if accelerator == "H100-80GB" else (4, 8))
    assert lora_of(one).max_rank == 16
    assert (one.lora_bytes_per_gpu, one.kv_bytes_per_gpu, one.kv_cache_tokens) == \
        (five.lora_bytes_per_gpu, five.kv_bytes_per_gpu, five.kv_cache_tokens)


def test_an_adapter_of_a_higher_rank_raises_max_rank() -> None:
    # The one exception: an adapter whose rank the current max_rank does not hold raises it (and the engines
    # restart with larger slots). One of a rank it holds changes nothing.
    spec: dict[str, Any] = {"parallelism": {"tensor": 1}}
    before = plan_for({**spec, "adapters": adapters(1, rank=16)})
    smaller = plan_for({**spec, "adapters": [*adapters(1, rank=16), {"name": "small", "source": "org/s", "rank": 8}]})
    assert lora_of(smaller) == lora_of(before) and smaller.kv_cache_tokens == before.kv_cache_tokens
    higher = plan_for({**spec, "adapters": [*adapters(1, rank=16), {"name": "big", "source": "org/b", "rank": 40}]})
    lora = lora_of(higher)
    # 40 needs rank 64. The slot's elements are linear in the rank: 4 x 46178304 a slot; 8 slots of 352 MiB
    # (2.75 GiB) are still within a tenth of the H100's 54 GiB of KV cache, so max_loras stays 8.
    assert llama_8b_slot_elements(64, 1) == 4 * 46_178_304
    assert (lora.max_loras, lora.max_rank, lora.max_cpu_loras) == (8, 64, 16)
    assert lora.weight_bytes_per_gpu == 8 * 4 * 46_178_304 * 2
    assert lora.working_bytes_per_gpu == 8192 * 64 * 3 * 4
    assert higher.kv_cache_tokens < before.kv_cache_tokens


def test_max_loras_default_lowered_to_a_tenth_of_the_kv_cache_on_a_small_gpu() -> None:
    # On one L4 Llama 3.1 8B leaves about 4.1 GiB of KV cache: (23034 - 512) MiB x 0.9, less the weights, the
    # activation peak at vLLM's small-GPU defaults (2048 batched tokens, 256 sequences) and 0.27 GiB. A tenth
    # is 416 MiB; the default 8 slots of 88 MiB would take a sixth. 4 slots (352 MiB) fit in the tenth,
    # 5 (440 MiB) do not. One adapter listed: the lowered figure does not depend on it.
    spec: dict[str, Any] = {"accelerator": {"type": "L4"}, "parallelism": {"tensor": 1}}
    kv_without = plan_for(spec).kv_bytes_per_gpu
    activation = 2048 * 3 * 14336 * 2 + 2048 * 6 * 4096 * 2 + 256 * 128256 * 4 * 2
    assert abs(kv_without - ((23034 - 512) * MiB * 0.9 - 8_030_261_248 * 2 - activation - 0.27 * GiB)) <= 1
    assert 4 * 46_178_304 * 2 <= 0.1 * kv_without < 5 * 46_178_304 * 2
    plan = plan_for({**spec, "adapters": adapters(1)})
    lora = lora_of(plan)
    slot = llama_8b_slot_elements(16, 1) * 2
    assert lora.max_loras * slot <= 0.1 * kv_without < (lora.max_loras + 1) * slot
    assert lora.max_loras == 4
    assert lora.max_cpu_loras == 2 * 4   # twice the lowered max_loras
    assert any(f"maxLoras lowered to {lora.max_loras} from 8" in note for note in plan.notes)
    # A fixed maxLoras is kept, and the plan says nothing about it.
    fixed = plan_for({**spec, "adapters": adapters(8), "engine": {"lora": {"maxLoras": 8}}})
    assert lora_of(fixed).max_loras == 8 and not any("lowered" in note for note in fixed.notes)


def test_max_loras_default_never_below_one() -> None:
    # Rank 512 on one L4: one slot is 2.8 GiB, most of the KV cache; still one slot, and the plan fits.
    plan = plan_for({"accelerator": {"type": "L4"}, "parallelism": {"tensor": 1},
                     "adapters": adapters(4, rank=512)})
    assert lora_of(plan).max_loras == 1 and plan.fits


def test_max_cpu_loras() -> None:
    # Below the adapters listed is allowed: vLLM evicts from its host cache.
    lora = lora_of(plan_for({"adapters": adapters(6), "engine": {"lora": {"maxCpuLoras": 2}}}))
    assert (lora.max_cpu_loras, lora.max_loras) == (2, 2)   # the default maxLoras stays within it
    # Above 8 it leaves the default 8 as it is.
    lora = lora_of(plan_for({"adapters": adapters(6), "engine": {"lora": {"maxCpuLoras": 20}}}))
    assert (lora.max_cpu_loras, lora.max_loras) == (20, 8)
    # Not set: twice max_loras, an explicit one included; fewer than the adapters listed is allowed.
    assert lora_of(plan_for({"adapters": adapters(2), "engine": {"lora": {"maxLoras": 5}}})).max_cpu_loras == 2 * 5
    lora = lora_of(plan_for({"adapters": adapters(20), "engine": {"lora": {"maxLoras": 3}}}))
    assert (lora.max_loras, lora.max_cpu_loras) == (3, 6)


def test_layout_search_makes_room_for_the_slots() -> None:
    # 64 slots at rank 64 (22 GiB) do not fit beside Llama 3.1 8B on one L4; the planner spreads it.
    base = plan_for({"accelerator": {"type": "L4"}})
    plan = plan_for({"accelerator": {"type": "L4"}, "engine": {"lora": {"maxLoras": 64, "maxRank": 64}}})
    assert base.tensor == 1 and plan.tensor > 1 and plan.fits
    assert lora_of(plan).max_loras == 64


def test_moe_slots_count_every_routed_expert() -> None:
    # Qwen3-30B-A3B: hidden 2048, 32 heads x 128, 4 KV heads, 128 experts of width 768, 48 layers, vocab 151936.
    plan = plan_for({"model": {"name": "Qwen/Qwen3-30B-A3B", "maxModelLen": 32768}, "parallelism": {"tensor": 1},
                     "engine": {"lora": {"maxLoras": 1, "maxRank": 16}}})
    r, hidden = 16, 2048
    attention = 3 * r * hidden + (4096 + 2 * 512) * r + r * 4096 + hidden * r
    expert = 2 * r * hidden + 2 * 768 * r + r * 768 + hidden * r
    router = r * hidden + 128 * r
    per_layer = attention + 128 * expert + router
    expected = (48 * per_layer + 2 * (151936 + 2048) * r) * 2
    lora = lora_of(plan)
    assert lora.weight_bytes_per_gpu == expected
    # The fused-MoE buffer: w13's 2 slices for each of the 8 experts a token goes to.
    assert lora.working_bytes_per_gpu == 8192 * 16 * 2 * 8 * 4
    assert any("128 routed experts" in note for note in plan.notes)


def test_mla_is_sized_and_noted() -> None:
    plan = plan_for({"model": {"name": "deepseek-ai/DeepSeek-V3", "maxModelLen": 32768},
                     "accelerator": {"type": "H200-141GB"}, "adapters": adapters(1)})
    assert plan.fits and lora_of(plan).weight_bytes_per_gpu > 0
    assert any("latent attention" in note for note in plan.notes)
    assert any("shared experts" in note for note in plan.notes)


# --- refusals ---------------------------------------------------------------------


def refusal(spec: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as caught:
        plan_for(spec)
    assert "\n" not in str(caught.value)
    return caught.value


def test_adapter_named_like_the_base_model_is_refused() -> None:
    error = refusal({"adapters": [{"name": "sql", "source": "org/sql"},
                                  {"name": "meta-llama/Llama-3.1-8B-Instruct", "source": "org/x"}]})
    assert error.field == "spec.adapters[1].name"
    assert "served name" in error.message and "spec.model.name" in error.message
    error = refusal({"model": {"servedName": "llama"}, "adapters": [{"name": "llama", "source": "/models/llama-lora"}]})
    assert error.field == "spec.adapters[0].name" and "spec.model.servedName" in error.message
    # With a served name set, the model's id is free for an adapter.
    plan_for({"model": {"servedName": "llama"}, "adapters": [{"name": "meta-llama/Llama-3.1-8B-Instruct", "source": "org/x"}]})


@pytest.mark.parametrize("rank,needed", [(32, 32), (24, 32), (17, 32), (200, 256)])
def test_adapter_rank_over_max_rank_is_refused(rank: int, needed: int) -> None:
    error = refusal({"adapters": [{"name": "a", "source": "org/a", "rank": 8},
                                  {"name": "b", "source": "org/b", "rank": rank}],
                     "engine": {"lora": {"maxRank": 16}}})
    assert error.field == "spec.adapters[1].rank"
    assert f"{rank} exceeds spec.engine.lora.maxRank 16" in error.message
    assert f"raise maxRank to {needed}" in error.message


def test_fixed_max_loras_that_leaves_no_kv_cache_is_refused_with_what_fits() -> None:
    spec: dict[str, Any] = {"accelerator": {"type": "L4"}, "parallelism": {"tensor": 1, "pipeline": 1}}
    error = refusal({**spec, "engine": {"lora": {"maxLoras": 64, "maxRank": 64}}})
    assert error.field == "spec.engine.lora.maxLoras"
    assert "64 LoRA slots at rank 64" in error.message and "fewer than one sequence of maxModelLen 8192" in error.message
    fits = int(error.message.split("set maxLoras <= ")[1].split()[0])
    assert plan_for({**spec, "engine": {"lora": {"maxLoras": fits, "maxRank": 64}}}).fits
    assert "maxRank" in error.message and "tensor" in error.message
    with pytest.raises(SpecError):
        plan_for({**spec, "engine": {"lora": {"maxLoras": fits + 1, "maxRank": 64}}})


def test_not_one_slot_fitting_says_so() -> None:
    # maxModelLen just below what one L4 holds without LoRA: no slot of rank 512 leaves room for it.
    spec: dict[str, Any] = {"accelerator": {"type": "L4"}, "parallelism": {"tensor": 1, "pipeline": 1}}
    room = plan_for(spec).kv_cache_tokens
    spec["model"] = {"maxModelLen": room - 16}
    error = refusal({**spec, "engine": {"lora": {"maxLoras": 2, "maxRank": 512}}})
    assert error.field == "spec.engine.lora.maxLoras" and "not one slot fits there" in error.message
    # Without a fixed maxLoras the rank is what to change.
    error = refusal({**spec, "adapters": adapters(1, rank=512)})
    assert error.field == "spec.engine.lora.maxRank" and "1 LoRA slot at rank 512" in error.message


def test_fewer_host_slots_than_adapters_is_not_refused() -> None:
    assert plan_for({"adapters": adapters(10), "engine": {"lora": {"maxLoras": 2, "maxCpuLoras": 2}}}).fits


def test_webhook_refuses_what_plan_refuses() -> None:
    pytest.importorskip("aiohttp")
    from tensorfleet.controller.webhook import validate_document

    doc = isvc_doc({"adapters": [{"name": "a", "source": "org/a", "rank": 64}], "engine": {"lora": {"maxRank": 32}}})
    with pytest.raises(SpecError) as caught:
        validate_document(doc)
    assert caught.value.field == "spec.adapters[0].rank"


# --- tensorfleet plan ---------------------------------------------------------------


def _write(tmp_path: Path, spec: dict[str, Any]) -> Path:
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(isvc_doc(spec)))
    return path


def test_cli_plan_shows_the_lora_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"parallelism": {"tensor": 1}, "engine": {"lora": {"maxLoras": 4}},
                             "adapters": [{"name": "sql", "source": "org/sql", "rank": 16},
                                          {"name": "chat", "source": "/models/adapters/chat"}]})
    assert main(["plan", "-f", str(path), "--offline"]) == 0
    out = capsys.readouterr().out
    lines = {re.split(r"\s{2,}", line.strip())[0]: line for line in out.splitlines()}
    assert "352 MiB per GPU (4 x rank 16; host memory holds 8)" in lines["LoRA slots"]
    assert "1.5 MiB per GPU" in lines["LoRA working"]
    assert "(what the LoRA slots leave)" in lines["KV cache"]
    assert "439,488 tokens per replica" in out
    assert "note" in out and "since some adapter gives no rank" in out


def test_cli_plan_json_has_the_lora_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    path = _write(tmp_path, {"parallelism": {"tensor": 1}, "adapters": adapters(2)})
    assert main(["plan", "-f", str(path), "--offline", "-o", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    # The default 8 slots, not the 2 adapters listed.
    assert (summary["maxLoras"], summary["maxLoraRank"], summary["loraRankAssumed"]) == (8, 16, False)
    assert summary["loraSlotBytesPerGPU"] == 8 * llama_8b_slot_elements(16, 1) * 2


def test_cli_plan_without_lora_has_no_lora_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"parallelism": {"tensor": 1}})
    assert main(["plan", "-f", str(path), "--offline"]) == 0
    assert "LoRA" not in capsys.readouterr().out


@pytest.mark.parametrize("spec,field,phrase", [
    ({"adapters": [{"name": "meta-llama/Llama-3.1-8B-Instruct", "source": "org/a"}]}, "spec.adapters[0].name", "served name"),
    ({"adapters": [{"name": "a", "source": "org/a", "rank": 64}], "engine": {"lora": {"maxRank": 16}}},
     "spec.adapters[0].rank", "raise maxRank to 64"),
    ({"accelerator": {"type": "L4"}, "parallelism": {"tensor": 1, "pipeline": 1}, "engine": {"lora": {"maxLoras": 64, "maxRank": 64}}},
     "spec.engine.lora.maxLoras", "set maxLoras <="),
    ({"adapters": [{"name": "a", "source": "org/a"}, {"name": "a", "source": "org/b"}]}, "spec.adapters[1]", "duplicate"),
    ({"engine": {"lora": {"maxRank": 24}}}, "spec.engine.lora.maxRank", "use 32"),
    ({"engine": {"lora": {"maxLoras": 4, "maxCpuLoras": 2}}}, "spec.engine.lora", "maxCpuLoras 2 is less than maxLoras 4"),
], ids=["served-name", "rank-over-max", "slots-over-memory", "duplicate-name", "unsupported-rank", "cpu-below-gpu"])
def test_cli_bad_lora_spec_is_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: dict[str, Any], field: str, phrase: str,
) -> None:
    path = _write(tmp_path, spec)
    assert main(["plan", "-f", str(path), "--offline"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"error: {path}: {field}:"), lines[0]
    assert phrase in lines[0], lines[0]
