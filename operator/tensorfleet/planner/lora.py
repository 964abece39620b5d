"""GPU memory of LoRA adapters (spec.adapters, spec.engine.lora) and the spec checks they need: the max_loras slots
at max_lora_rank that vLLM preallocates for every LoRA-capable module whatever the adapters target, the shrink
buffers of the profiling pass, and the LoRA sizes the engines start with, which never follow the number of adapters
listed. Design: docs/planner.md#lora-adapters-slots."""

from __future__ import annotations

from dataclasses import dataclass

from tensorfleet.api.architecture import ArchitectureSpec
from tensorfleet.api.errors import SpecError
from tensorfleet.api.models import LORA_RANKS, InferenceServiceSpec
from tensorfleet.catalog.sizes import DEFAULT_VOCAB
from tensorfleet.planner.memory import stage_layers

DEFAULT_RANK = 16
# max_loras when spec.engine.lora sets no maxLoras: 8, lowered by memory alone. Never the number of adapters
# listed: the sizes are engine flags, and adding an adapter must not change them (it would restart the engines).
DEFAULT_MAX_LORAS = 8
# max_cpu_loras when not set: this many times max_loras (vLLM's own default is max_loras, which would read an
# adapter from disk again whenever one more than the slots is in use).
DEFAULT_CPU_LORAS_PER_SLOT = 2
# The default max_loras is lowered while its slots take more than this share of the KV cache.
SLOT_SHARE_OF_KV = 0.10
# LoRA weights are kept in the compute dtype, bfloat16 or float16.
LORA_ELEMENT_BYTES = 2
FP32_BYTES = 4
QKV_SLICES = 3
W13_SLICES = 2


@dataclass(frozen=True)
class LoraPlan:
    """LoRA as the engines start with it, and its GPU memory on one GPU of the largest stage."""

    max_loras: int               # --max-loras: adapters in GPU slots at once
    max_rank: int                # --max-lora-rank
    max_cpu_loras: int           # --max-cpu-loras
    weight_bytes_per_gpu: int    # the max_loras slots, preallocated at start
    working_bytes_per_gpu: int   # fp32 shrink buffers of the profiling pass
    rank_assumed: bool           # some adapter states no rank: its slots are sized at max_rank

    @property
    def bytes_per_gpu(self) -> int:
        return self.weight_bytes_per_gpu + self.working_bytes_per_gpu


@dataclass(frozen=True)
class LoraSettings:
    """What the spec fixes before any layout is sized."""

    max_rank: int
    rank_assumed: bool
    max_loras: int | None        # spec.engine.lora.maxLoras; None: the planner picks per layout
    default_max_loras: int       # the pick before the KV-cache share lowers it
    max_cpu_loras: int | None    # spec.engine.lora.maxCpuLoras
    adapters: int


def smallest_rank_holding(rank: int) -> int | None:
    """The smallest rank vLLM's --max-lora-rank takes that holds RANK (None: above them all)."""
    return next((supported for supported in LORA_RANKS if supported >= rank), None)


def settings(spec: InferenceServiceSpec) -> LoraSettings | None:
    """The spec's LoRA settings with their defaults, after its checks; None when LoRA is off.

    Raises SpecError for an adapter served under the base model's name, and for
    an adapter rank above an explicit spec.engine.lora.maxRank.
    """
    if not spec.lora_enabled:
        return None
    lora = spec.engine.lora
    served = spec.model.served_name or spec.model.name
    for i, adapter in enumerate(spec.adapters):
        if adapter.name == served:
            which = "spec.model.servedName" if spec.model.served_name else "spec.model.name, the default served name"
            raise SpecError(
                f"spec.adapters[{i}].name",
                f"{adapter.name!r} is the base model's served name ({which}), so clients could not reach one of "
                "them; give the adapter another name",
            )
    explicit_rank = lora.max_rank if lora is not None else None
    if explicit_rank is not None:
        for i, adapter in enumerate(spec.adapters):
            if adapter.rank is not None and adapter.rank > explicit_rank:
                needed = smallest_rank_holding(adapter.rank)
                raise SpecError(
                    f"spec.adapters[{i}].rank",
                    f"{adapter.rank} exceeds spec.engine.lora.maxRank {explicit_rank}, the largest rank the engines "
                    f"take; raise maxRank to {needed}, or leave it out to size it from the adapters",
                )
    ranks = [adapter.rank for adapter in spec.adapters if adapter.rank is not None]
    rank_assumed = any(adapter.rank is None for adapter in spec.adapters)
    if explicit_rank is not None:
        max_rank = explicit_rank
    else:
        # An adapter of unknown rank counts as DEFAULT_RANK, vLLM's own default: its load would fail on a
        # smaller maximum. AdapterSpec.rank is at most 512, the largest supported rank.
        sized = [*ranks, *([DEFAULT_RANK] if rank_assumed or not ranks else [])]
        max_rank = smallest_rank_holding(max(sized)) or LORA_RANKS[-1]
    max_cpu_loras = lora.max_cpu_loras if lora is not None else None
    default = DEFAULT_MAX_LORAS
    if max_cpu_loras is not None:
        default = min(default, max_cpu_loras)   # vLLM refuses max_cpu_loras < max_loras
    return LoraSettings(
        max_rank=max_rank,
        rank_assumed=rank_assumed,
        max_loras=lora.max_loras if lora is not None else None,
        default_max_loras=max(default, 1),
        max_cpu_loras=max_cpu_loras,
        adapters=len(spec.adapters),
    )


# --- bytes -------------------------------------------------------------------------


def _column(rank: int, inputs: int, outputs: list[int], tensor: int) -> int:
    """Elements of one slot of a column-parallel projection, one slice per output: A whole, B split."""
    return sum(rank * inputs + out // tensor * rank for out in outputs)


def _row(rank: int, inputs: int, output: int, tensor: int) -> int:
    """Elements of one slot of a row-parallel projection: A split, B whole."""
    return rank * (inputs // tensor) + output * rank


def _replicated(rank: int, inputs: int, output: int) -> int:
    return rank * inputs + output * rank


def layer_slot_elements(arch: ArchitectureSpec, tensor: int, rank: int) -> int:
    """Elements of one LoRA slot in one transformer layer on one tensor rank, as vLLM's
    BaseLinearLayerWithLoRA.create_lora_weights allocates it. Column-parallel projections keep lora_a whole
    (r x input) and split lora_b (output / t x r): qkv_proj's 3 slices, gate_up_proj's 2; row-parallel ones split
    lora_a (r x input / t) and keep lora_b whole (output x r): o_proj, down_proj. MoE layers (FusedMoEWithLoRA)
    hold the MLP's slots once per routed expert, shared experts as one MLP of shared x the width, the router as a
    replicated hidden -> experts projection; every layer counts as MoE (DeepSeek-V3's few dense ones are smaller).
    MLA: q as hidden -> heads x head_dim, kv_a as hidden -> kvLoraRank + qkRopeHeadDim (replicated), kv_b as
    kvLoraRank -> heads x 2 x (head_dim - qkRopeHeadDim), o from heads x (head_dim - qkRopeHeadDim); DeepSeek's
    q_a/q_b pair is smaller than that q."""
    hidden = arch.hidden_size
    heads = arch.attention_heads
    head_dim = arch.head_dim or hidden // heads
    if arch.mla is None:
        kv_heads = arch.kv_heads or heads
        kv_per_rank = max(1, kv_heads // tensor) * head_dim   # replicated KV heads when tensor > kv_heads
        q_per_rank = heads // tensor * head_dim
        attention = (
            QKV_SLICES * rank * hidden + (q_per_rank + 2 * kv_per_rank) * rank   # qkv_proj: A whole, B split
            + _row(rank, heads * head_dim, hidden, tensor)
        )
    else:
        latent = arch.mla.kv_lora_rank
        value_dim = max(head_dim - arch.mla.qk_rope_head_dim, 1)
        attention = (
            _column(rank, hidden, [heads * head_dim], tensor)
            + _replicated(rank, hidden, latent + arch.mla.qk_rope_head_dim)
            + _column(rank, latent, [heads * 2 * value_dim], tensor)
            + _row(rank, heads * value_dim, hidden, tensor)
        )
    intermediate = arch.intermediate_size or 4 * hidden
    mlp = _column(rank, hidden, [intermediate, intermediate], tensor) + _row(rank, intermediate, hidden, tensor)
    if arch.moe is not None:
        moe = arch.moe
        mlp *= moe.experts
        if moe.shared_experts:
            shared = moe.shared_experts * intermediate
            mlp += _column(rank, hidden, [shared, shared], tensor) + _row(rank, shared, hidden, tensor)
        mlp += _replicated(rank, hidden, moe.experts)   # the router
    return attention + mlp


def slot_bytes(arch: ArchitectureSpec, tensor: int, pipeline: int, rank: int) -> int:
    """Bytes of one LoRA slot on one GPU of the stage that needs the most, in the compute dtype (LoRAConfig's
    lora_dtype `auto` follows --dtype even for quantized weights). Models that declare embedding modules (Llama,
    Mistral, most decoder-only families) also hold the input embedding on the first stage (A vocab x r, B hidden
    x r) and the output head on the last, neither split by tensor parallelism; for the others this overstates a
    slot by about a tenth, on the safe side."""
    per_layer = layer_slot_elements(arch, tensor, rank)
    vocab_term = (arch.vocab_size or DEFAULT_VOCAB) * rank + arch.hidden_size * rank   # embedding or head, whole
    parts = stage_layers(arch.layers, pipeline)
    worst = 0
    for index, layers in enumerate(parts):
        ends = (index == 0) + (index == pipeline - 1)   # the embedding on the first stage, the head on the last
        worst = max(worst, layers * per_layer + ends * vocab_term)
    return worst * LORA_ELEMENT_BYTES


def working_bytes(arch: ArchitectureSpec, batched_tokens: int, rank: int) -> int:
    """The largest fp32 shrink buffer of one profiling pass. Each LoRA linear call allocates (slices, tokens,
    max_lora_rank) in fp32 for the shrink result (punica_gpu.py add_lora_linear) and frees it when the layer is
    done, so the pass peaks at one buffer for the widest merged projection: qkv's 3 slices, or a fused MoE layer's
    w13, 2 slices x top-k copies of each token. Each token uses one adapter: it does not grow with max_loras."""
    copies = QKV_SLICES
    if arch.moe is not None:
        copies = max(copies, W13_SLICES * arch.moe.experts_per_token)
    return batched_tokens * rank * copies * FP32_BYTES


def size(
    lora: LoraSettings, arch: ArchitectureSpec, tensor: int, pipeline: int, batched_tokens: int,
    kv_bytes_without_lora: int, max_loras: int | None = None,
) -> LoraPlan:
    """LoRA at one layout. KV_BYTES_WITHOUT_LORA is the KV cache per GPU the layout has without it, for the
    default max_loras; MAX_LORAS, when given, overrides both the spec's and the default (for what-ifs)."""
    one = slot_bytes(arch, tensor, pipeline, lora.max_rank)
    count = max_loras or lora.max_loras
    if count is None:
        count = lora.default_max_loras
        while count > 1 and count * one > SLOT_SHARE_OF_KV * kv_bytes_without_lora:
            count -= 1
    cpu = lora.max_cpu_loras if lora.max_cpu_loras is not None else DEFAULT_CPU_LORAS_PER_SLOT * count
    return LoraPlan(
        max_loras=count,
        max_rank=lora.max_rank,
        max_cpu_loras=cpu,
        weight_bytes_per_gpu=count * one,
        working_bytes_per_gpu=working_bytes(arch, batched_tokens, lora.max_rank),
        rank_assumed=lora.rank_assumed,
    )


def notes(lora: LoraSettings, plan: LoraPlan, arch: ArchitectureSpec) -> list[str]:
    """What the plan assumed about LoRA, for Plan.notes."""
    out: list[str] = []
    if plan.rank_assumed:
        out.append(
            f"LoRA slots sized at rank {plan.max_rank} over q/k/v/o/gate/up/down of every layer, since some adapter "
            "gives no rank (spec.adapters[].rank); the reservation is the same whatever the adapter targets"
        )
    if lora.max_loras is None and plan.max_loras < lora.default_max_loras:
        out.append(
            f"maxLoras lowered to {plan.max_loras} from {lora.default_max_loras}: more slots would take over "
            f"{SLOT_SHARE_OF_KV:.0%} of the KV cache (set spec.engine.lora.maxLoras to choose)"
        )
    if arch.moe is not None:
        out.append(
            f"LoRA on the MoE layers counts the MLP slots of all {arch.moe.experts} routed experts"
            + (" and the shared experts" if arch.moe.shared_experts else "")
            + ", as vLLM allocates them for fused MoE"
        )
    if arch.mla is not None:
        out.append("LoRA slots of the latent attention are approximated from hiddenSize, headDim, kvLoraRank and "
                   "qkRopeHeadDim (q taken as one projection)")
    return out
