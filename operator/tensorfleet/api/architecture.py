"""spec.model.architecture: a model's shape for the planner when its config.json cannot be read (dense, MoE,
MLA, and hybrid Mamba / linear-attention layers). Part of the API models (models.py); see docs/api.md."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic.alias_generators import to_camel

from tensorfleet.api.base import ApiModel


class MoEArchitecture(ApiModel):
    experts: int = Field(ge=1, le=4096, description="Routed experts per MoE layer.")
    experts_per_token: int = Field(ge=1, le=256, description="Experts activated per token (top-k).")
    shared_experts: int = Field(default=0, ge=0, le=64, description="Always-active shared experts per MoE layer. Default: 0.")
    active_parameters: int | None = Field(
        default=None, ge=1, description="Parameters used per token, for reporting. Optional."
    )


class MLAArchitecture(ApiModel):
    kv_lora_rank: int = Field(ge=1, le=65536, description="Rank of the compressed KV latent (DeepSeek `kv_lora_rank`).")
    qk_rope_head_dim: int = Field(ge=0, le=4096, description="Decoupled rotary key dimension (DeepSeek `qk_rope_head_dim`).")


class MambaArchitecture(ApiModel):
    """Layers that keep a fixed-size state per request (Mamba, Mamba2, Gated DeltaNet) beside attention ones."""

    kind: Literal["mamba", "mamba2", "gated-delta-net"] = Field(
        description=(
            "The state layers' kind: mamba (Mamba1: Jamba), mamba2 (Granite 4.0-H, Nemotron-H, Bamba), "
            "gated-delta-net (linear attention: Qwen3-Next)."
        ),
    )
    layers: int = Field(ge=1, le=1024, description="How many layers are state layers (no attention KV cache).")
    attention_layers: int | None = Field(
        default=None, ge=1, le=1024,
        description=(
            "How many layers have attention (a KV cache). Default: every layer that is not a state layer; state it "
            "when some layers have neither (Nemotron-H's MLP-only layers)."
        ),
    )
    conv_kernel: int = Field(ge=1, le=64, description="Causal convolution width (`mamba_d_conv`, `conv_kernel`, `linear_conv_kernel_dim`).")
    state_size: int | None = Field(
        default=None, ge=1, le=65536,
        description="SSM state size (`mamba_d_state`, `ssm_state_size`); mamba and mamba2.",
    )
    intermediate_size: int | None = Field(
        default=None, ge=1, le=1048576,
        description="Mixer width: `mamba_expand` x hiddenSize, or Nemotron-H's `mamba_num_heads` x `mamba_head_dim`; mamba and mamba2.",
    )
    groups: int = Field(default=1, ge=1, le=1024, description="B/C groups (`mamba_n_groups`, `n_groups`); mamba2. Default: 1.")
    heads: int | None = Field(
        default=None, ge=1, le=4096,
        description="State heads: mamba2's (`mamba_n_heads`, `mamba_num_heads`), or gated-delta-net's value heads (`linear_num_value_heads`).",
    )
    head_dim: int | None = Field(
        default=None, ge=1, le=4096,
        description="Per-head size: mamba2's (`mamba_d_head`, `mamba_head_dim`), or gated-delta-net's value head size (`linear_value_head_dim`).",
    )
    key_heads: int | None = Field(default=None, ge=1, le=4096, description="Gated-delta-net key heads (`linear_num_key_heads`).")
    key_head_dim: int | None = Field(default=None, ge=1, le=4096, description="Gated-delta-net key head size (`linear_key_head_dim`).")
    state_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description=(
            "Element type vLLM keeps the SSM (temporal) state in; the convolution state follows the model's dtype. "
            "auto: the model's dtype (Nemotron-H keeps it in float32 unless its config names another). Default: auto."
        ),
    )
    chunk_size: int | None = Field(
        default=None, ge=1, le=65536,
        description="Mamba2 scan chunk (`mamba_chunk_size`, `chunk_size`): the attention block size is a multiple of it under prefix caching. Default: 2048, vLLM's.",
    )

    @model_validator(mode="after")
    def _shape_complete(self) -> MambaArchitecture:
        needs = {"mamba": ("state_size", "intermediate_size"),
                 "mamba2": ("state_size", "intermediate_size", "heads", "head_dim"),
                 "gated-delta-net": ("heads", "head_dim", "key_heads", "key_head_dim")}[self.kind]
        missing = [to_camel(name) for name in needs if getattr(self, name) is None]
        if missing:
            raise ValueError(f"kind {self.kind} needs {', '.join(missing)}")
        return self


class ArchitectureSpec(ApiModel):
    """Facts about a model the catalog does not know. Values come from the model's config.json."""

    parameters: int = Field(ge=1_000_000, le=100_000_000_000_000, description="Total parameter count (all experts included), e.g. 70553706496.")
    layers: int = Field(ge=1, le=1024, description="Transformer layers (`num_hidden_layers`).")
    hidden_size: int = Field(ge=64, le=262144, description="Model width (`hidden_size`).")
    attention_heads: int = Field(ge=1, le=1024, description="Query heads (`num_attention_heads`).")
    kv_heads: int | None = Field(
        default=None, ge=1, le=1024, description="Key/value heads (`num_key_value_heads`). Default: attentionHeads (no GQA)."
    )
    head_dim: int | None = Field(default=None, ge=8, le=4096, description="Per-head dimension. Default: hiddenSize / attentionHeads.")
    intermediate_size: int | None = Field(
        default=None, ge=1, le=1048576, description="MLP width (`intermediate_size`; for MoE models the per-expert `moe_intermediate_size`); sizes the activation reserve. Default: 4 x hiddenSize."
    )
    vocab_size: int | None = Field(default=None, ge=1, le=4_000_000, description="Vocabulary size; embeddings stay unquantized. Default: 32000.")
    tied_embeddings: bool = Field(default=False, description="Input and output embeddings share weights (`tie_word_embeddings`). Default: false.")
    max_context_length: int | None = Field(
        default=None, ge=128, le=100_000_000, description="Longest context the model supports (`max_position_embeddings`); the default for maxModelLen."
    )
    sliding_window: int | None = Field(
        default=None, ge=1, le=100_000_000,
        description="Sliding-window attention span in tokens (`sliding_window`), when the model uses one.",
    )
    sliding_window_layers: int | None = Field(
        default=None, ge=0, le=1024,
        description="How many layers use the sliding window (gpt-oss: every other one). Default: all (attention) layers, when slidingWindow is set.",
    )
    attention_chunk_size: int | None = Field(
        default=None, ge=1, le=100_000_000,
        description="Chunked local attention span in tokens (Llama 4's `attention_chunk_size`), when the model uses one.",
    )
    chunked_attention_layers: int | None = Field(
        default=None, ge=0, le=1024,
        description="How many layers use chunked local attention (Llama 4: three of every four). Default: all (attention) layers, when attentionChunkSize is set.",
    )
    weight_format: Literal[
        "bf16", "fp16", "fp8", "int8", "int4", "awq", "gptq", "gptq-int8", "mxfp4", "nvfp4", "bnb-4bit", "bnb-8bit"
    ] = Field(
        default="bf16",
        description=(
            "Precision the checkpoint's weights ship in: int8 = W8A8/W8A16, int4 = W4A16 (group 128), awq/gptq = "
            "4-bit group 128, gptq-int8, mxfp4 (gpt-oss), nvfp4, bnb-4bit/bnb-8bit (bitsandbytes). Default: bf16."
        ),
    )
    moe: MoEArchitecture | None = Field(default=None, description="Mixture-of-experts facts, for MoE models.")
    mla: MLAArchitecture | None = Field(default=None, description="Multi-head latent attention facts (DeepSeek-V2/V3): KV cache stores a latent, not per-head keys and values.")
    mamba: MambaArchitecture | None = Field(
        default=None,
        description=(
            "Hybrid models: the layers that keep a Mamba or linear-attention state per request instead of an attention "
            "KV cache (Qwen3-Next, Granite 4.0-H, Jamba, Nemotron-H). vLLM sizes one state per request for each and "
            "raises the attention block size so a block of every layer takes the same bytes."
        ),
    )

    @model_validator(mode="after")
    def _heads_consistent(self) -> ArchitectureSpec:
        if self.kv_heads is not None and self.attention_heads % self.kv_heads:
            raise ValueError(
                f"kvHeads {self.kv_heads} must divide attentionHeads {self.attention_heads} (grouped-query attention)"
            )
        if self.sliding_window_layers is not None and self.sliding_window_layers > self.layers:
            raise ValueError(f"slidingWindowLayers {self.sliding_window_layers} exceeds layers {self.layers}")
        if self.chunked_attention_layers is not None and self.chunked_attention_layers > self.layers:
            raise ValueError(f"chunkedAttentionLayers {self.chunked_attention_layers} exceeds layers {self.layers}")
        attention = self.attention_layer_count
        if self.mamba is not None and self.mamba.layers + attention > self.layers:
            raise ValueError(f"mamba.layers {self.mamba.layers} and {attention} attention layers exceed layers "
                             f"{self.layers}")
        if attention < 1:
            raise ValueError(f"mamba.layers {self.mamba.layers if self.mamba else 0}: every layer is a state layer; a hybrid model needs "
                             "attention layers too (pure state-space models are not sized)")
        windowed = ((self.sliding_window_layers if self.sliding_window_layers is not None else attention)
                    if self.sliding_window else 0)
        chunked = ((self.chunked_attention_layers if self.chunked_attention_layers is not None else attention)
                   if self.attention_chunk_size else 0)
        if windowed + chunked > attention:
            raise ValueError(f"{windowed} sliding-window and {chunked} chunked-attention layers exceed the {attention} "
                             "attention layers: a layer has one kind of attention")
        if self.head_dim is None and self.hidden_size % self.attention_heads:
            raise ValueError("headDim is required when hiddenSize is not a multiple of attentionHeads")
        return self

    @property
    def attention_layer_count(self) -> int:
        """Layers with an attention KV cache: all of them, or for a hybrid model those that are not state layers
        (mamba.attentionLayers when some layers have neither)."""
        if self.mamba is None:
            return self.layers
        if self.mamba.attention_layers is not None:
            return self.mamba.attention_layers
        return self.layers - self.mamba.layers
