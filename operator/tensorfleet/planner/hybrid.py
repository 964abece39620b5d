"""Hybrid models' state layers as vLLM 0.19 sizes them: the bytes of one request's Mamba or linear-attention state
on one GPU, and the attention block size that makes a block of every layer the same bytes. Pure functions, no
policy; held to vLLM's own code by tests/test_planner_hybrid.py. Design:
docs/planner.md#hybrid-models-state-layers-beside-attention-plannerhybridpy."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tensorfleet.api.architecture import MambaArchitecture
from tensorfleet.planner.kvcache import StateCacheMode

# vLLM's attention kernels take blocks of a multiple of 16 tokens (its default block size too).
KERNEL_BLOCK_ALIGNMENT = 16
# The scan chunk vLLM assumes when a model's config names none (ModelConfig.get_mamba_chunk_size).
DEFAULT_CHUNK = 2048
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Kinds whose models vLLM can cache a state per block for (its SupportsMambaPrefixCaching models: Jamba, Bamba,
# Granite 4.0-H, Nemotron-H, Falcon-H1); Qwen3-Next's Gated DeltaNet keeps an aligned copy instead.
PER_BLOCK_STATE_KINDS = ("mamba", "mamba2")


def _shard(value: int, tensor: int, what: str) -> int:
    if value % tensor:
        raise ValueError(f"{what} {value} is not divisible by tensor {tensor}")
    return value // tensor


def state_bytes(mamba: MambaArchitecture, tensor: int, conv_bytes: int, ssm_bytes: int) -> int:
    """One request's state in one state layer on one GPU, as vllm/model_executor/layers/mamba/mamba_utils.py shapes
    it: a convolution state of (kernel - 1) x its channels in CONV_BYTES per element, and a temporal (SSM) state in
    SSM_BYTES (Mamba1 width x state size, Mamba2 heads x head size x state size, Gated DeltaNet value heads x value
    head size x key head size), channels and heads split over the tensor ranks. Raises ValueError when tensor does
    not divide what vLLM splits."""
    taps = mamba.conv_kernel - 1
    if mamba.kind == "gated-delta-net":
        assert mamba.heads and mamba.head_dim and mamba.key_heads and mamba.key_head_dim
        channels = 2 * mamba.key_heads * mamba.key_head_dim + mamba.heads * mamba.head_dim
        conv = taps * _shard(channels, tensor, "the linear-attention convolution's channels")
        temporal = _shard(mamba.heads, tensor, "linear_num_value_heads") * mamba.head_dim * mamba.key_head_dim
    elif mamba.kind == "mamba2":
        assert mamba.intermediate_size and mamba.state_size and mamba.heads and mamba.head_dim
        # Groups that tensor does not divide are replicated so every rank holds its heads' groups.
        groups = mamba.groups if mamba.groups % tensor == 0 else tensor
        channels = mamba.intermediate_size + 2 * groups * mamba.state_size
        conv = taps * _shard(channels, tensor, "the Mamba convolution's channels")
        temporal = _shard(mamba.heads, tensor, "the Mamba heads") * mamba.head_dim * mamba.state_size
    else:
        assert mamba.intermediate_size and mamba.state_size
        width = _shard(mamba.intermediate_size, tensor, "the Mamba width")
        conv, temporal = taps * width, width * mamba.state_size
    return conv * conv_bytes + temporal * ssm_bytes


def tensor_problem(mamba: MambaArchitecture, tensor: int) -> str | None:
    """Why vLLM cannot split the state layers over TENSOR ranks, or None."""
    try:
        state_bytes(mamba, tensor, 1, 1)
    except ValueError as error:
        return str(error)
    if mamba.kind == "gated-delta-net" and mamba.key_heads and mamba.key_heads % tensor:
        return f"linear_num_key_heads {mamba.key_heads} is not divisible by tensor {tensor}"
    return None


def cache_mode(mamba: MambaArchitecture, prefix_caching: bool, asked: str | None = None) -> StateCacheMode:
    """How vLLM keeps the state pages: none without prefix caching (hybrid models' default); with it, an aligned
    copy where ASKED (--mamba-cache-mode) says align or the model has no per-block states, else a state per block
    (asking for all on such a model gets align)."""
    if not prefix_caching:
        return "none"
    return "all" if asked != "align" and mamba.kind in PER_BLOCK_STATE_KINDS else "align"


@dataclass(frozen=True)
class HybridBlock:
    """The attention block vLLM chooses for a hybrid model, and what the state pages come to."""

    block_size: int      # attention tokens per block, every group's page being block_size x token_bytes
    state_bytes: int     # one state layer's state on one GPU, before padding
    page_bytes: int      # every layer's page on one GPU

    @property
    def padding(self) -> float:
        """How much larger a state page is than the state (vLLM logs "Padding mamba page size by P%")."""
        return self.page_bytes / self.state_bytes - 1


def block_size(state: int, token_bytes: int, base_block: int, mode: StateCacheMode = "none",
               chunk: int | None = None) -> HybridBlock:
    """The attention block for a state of STATE bytes beside attention layers of TOKEN_BYTES per token on one GPU,
    BASE_BLOCK the engine's block otherwise: the smallest multiple of 16 tokens whose page holds the state (with a
    state per block, of the scan CHUNK too), never below BASE_BLOCK; the state page is padded to it
    (vllm/model_executor/models/config.py)."""
    if mode == "all":
        step = math.lcm(chunk or DEFAULT_CHUNK, KERNEL_BLOCK_ALIGNMENT)
        needed = step * math.ceil(math.ceil(state / token_bytes) / step)
    else:
        needed = KERNEL_BLOCK_ALIGNMENT * math.ceil(state / (KERNEL_BLOCK_ALIGNMENT * token_bytes))
    block = max(base_block, needed)
    return HybridBlock(block, state, block * token_bytes)


def state_element_bytes(mamba: MambaArchitecture, model_bytes: int, engine_conv: str | None = None,
                        engine_ssm: str | None = None) -> tuple[int, int]:
    """(convolution, temporal) state element bytes: the model's dtype unless --mamba-cache-dtype (ENGINE_CONV)
    says otherwise; the temporal state follows the convolution's unless the model or --mamba-ssm-cache-dtype
    (ENGINE_SSM, which wins) names its own."""
    conv = DTYPE_BYTES.get(engine_conv or "", model_bytes)
    ssm_name = engine_ssm if engine_ssm not in (None, "auto") else (
        mamba.state_dtype if mamba.state_dtype != "auto" else None)
    return conv, DTYPE_BYTES.get(ssm_name or "", conv)
