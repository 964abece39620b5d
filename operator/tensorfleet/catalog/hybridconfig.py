"""The config.json fields of hybrid models (attention layers beside Mamba or linear-attention state layers, and
Nemotron-H's MLP-only blocks), read as vLLM 0.19 reads them: which layer is which, the state's shape, and the state
layers' modules for the weights; a field it cannot read is refused by name. Used by `catalog/modelconfig.py`.
Design: docs/planner.md#hybrid-models-state-layers-beside-attention-plannerhybridpy."""

from __future__ import annotations

from typing import Any, Protocol

from tensorfleet.api.architecture import MambaArchitecture

# The hybrid families vLLM 0.19 runs and this reader sizes, by config.json model_type.
HYBRID_TYPES = {"qwen3_next", "granitemoehybrid", "jamba", "nemotron_h", "bamba"}
# Layer kinds: attention (a KV cache), state (Mamba / linear attention), mlp (neither: Nemotron-H's "-" blocks).
ATTENTION, STATE, MLP = "attention", "state", "mlp"
_NAMES = {"attention": ATTENTION, "full_attention": ATTENTION, "*": ATTENTION, "mamba": STATE, "linear_attention": STATE,
          "M": STATE, "mlp": MLP, "-": MLP}


class ConfigError(ValueError):
    """A hybrid config.json field the planner cannot read; the message names it."""


class Fields(Protocol):
    """What this reader needs of a config (modelconfig's _Config)."""

    model_type: str

    def get(self, key: str, default: Any = None) -> Any: ...

    def num(self, key: str, default: int | None = None) -> int: ...

    def nums(self, key: str) -> list[int] | None: ...


def layer_kinds(c: Fields, layers: int) -> list[str]:
    """Each layer's kind (ATTENTION, STATE, MLP), from the field the family states it in."""
    kinds = c.get("layer_types") or c.get("layers_block_type")
    pattern = c.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        kinds, field = list(pattern), "hybrid_override_pattern"
    else:
        field = "layer_types" if c.get("layer_types") else "layers_block_type"
    if isinstance(kinds, list) and kinds:
        unknown = sorted({str(k) for k in kinds if k not in _NAMES})
        if unknown:
            raise ConfigError(f"{field} has {', '.join(map(repr, unknown))}: only attention, Mamba / linear-attention "
                              "and MLP-only layers are sized here (not MoE-only blocks)")
        if len(kinds) != layers:
            raise ConfigError(f"{field} lists {len(kinds)} layers where num_hidden_layers is {layers}")
        return [_NAMES[k] for k in kinds]
    if c.model_type == "qwen3_next":
        interval = c.num("full_attention_interval", 4) or 1
        return [ATTENTION if (i + 1) % interval == 0 else STATE for i in range(layers)]
    if c.model_type == "jamba":
        period, offset = c.num("attn_layer_period", 8) or 1, c.num("attn_layer_offset", 4)
        return [ATTENTION if i % period == offset else STATE for i in range(layers)]
    indices = c.nums("attn_layer_indices")
    if indices is not None:
        return [ATTENTION if i in indices else STATE for i in range(layers)]
    raise ConfigError(f"model_type {c.model_type!r}: which layers are attention is not stated "
                      "(layer_types, layers_block_type, hybrid_override_pattern or attn_layer_indices is missing)")


def architecture(c: Fields, hidden: int, kinds: list[str]) -> MambaArchitecture:
    """The state layers' facts (ArchitectureSpec.mamba) from their config.json fields."""
    state, attention = kinds.count(STATE), kinds.count(ATTENTION)
    counts: dict[str, Any] = {"layers": state, "attention_layers": attention if MLP in kinds else None}
    if c.model_type == "qwen3_next":
        return MambaArchitecture(
            kind="gated-delta-net", conv_kernel=c.num("linear_conv_kernel_dim"), heads=c.num("linear_num_value_heads"),
            head_dim=c.num("linear_value_head_dim"), key_heads=c.num("linear_num_key_heads"),
            key_head_dim=c.num("linear_key_head_dim"), **counts)
    if c.model_type == "jamba":
        return MambaArchitecture(kind="mamba", conv_kernel=c.num("mamba_d_conv", 4), state_size=c.num("mamba_d_state", 16),
                                 intermediate_size=c.num("mamba_expand", 2) * hidden, **counts)
    if c.model_type == "nemotron_h":
        heads, head_dim = c.num("mamba_num_heads"), c.num("mamba_head_dim")
        # vLLM keeps Nemotron-H's SSM state in the type its config names; transformers' NemotronHConfig (which vLLM
        # 0.19 reads it with) defaults that to float32.
        dtype = str(c.get("mamba_ssm_cache_dtype") or "float32")
        return MambaArchitecture(
            kind="mamba2", conv_kernel=c.num("conv_kernel"), state_size=c.num("ssm_state_size"),
            intermediate_size=heads * head_dim, groups=c.num("n_groups"), heads=heads, head_dim=head_dim,
            state_dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "auto",
            chunk_size=c.num("chunk_size") if c.get("chunk_size") else None, **counts)
    return MambaArchitecture(   # Granite 4.0-H, Bamba
        kind="mamba2", conv_kernel=c.num("mamba_d_conv"), state_size=c.num("mamba_d_state"),
        intermediate_size=c.num("mamba_expand") * hidden, groups=c.num("mamba_n_groups"), heads=c.num("mamba_n_heads"),
        head_dim=c.num("mamba_d_head"),
        chunk_size=c.num("mamba_chunk_size") if c.get("mamba_chunk_size") else None, **counts)


def state_modules(c: Fields, p: str, hidden: int, mamba: MambaArchitecture) -> list[tuple[str, int, str]]:
    """A state layer's mixer as (module path, parameters, kind): linear projections are `attn` (quantized like
    attention), the rest 16-bit."""
    if mamba.kind == "gated-delta-net":
        assert mamba.heads and mamba.head_dim and mamba.key_heads and mamba.key_head_dim
        keys, values = mamba.key_heads * mamba.key_head_dim, mamba.heads * mamba.head_dim
        a = f"{p}.linear_attn"
        return [(f"{a}.in_proj_qkvz", hidden * (2 * keys + 2 * values), "attn"),
                (f"{a}.in_proj_ba", hidden * 2 * mamba.heads, "attn"),
                (f"{a}.conv1d", (2 * keys + values) * mamba.conv_kernel, "norm"),
                (f"{a}.dt_bias", 2 * mamba.heads, "norm"),   # dt_bias and A_log
                (f"{a}.norm", mamba.head_dim, "norm"),
                (f"{a}.out_proj", values * hidden, "attn")]
    inner, state = mamba.intermediate_size or 0, mamba.state_size or 0
    m = f"{p}.mamba" if c.model_type in ("jamba", "granitemoehybrid", "bamba") else f"{p}.mixer"
    proj_bias = bool(c.get("mamba_proj_bias") if c.model_type != "nemotron_h" else c.get("use_bias"))
    conv_bias = bool(c.get("mamba_conv_bias", True) if c.model_type != "nemotron_h" else c.get("use_conv_bias", True))
    if mamba.kind == "mamba":
        rank = c.get("mamba_dt_rank")
        rank = -(-hidden // 16) if rank in (None, "auto") else c.num("mamba_dt_rank")
        out = [(f"{m}.in_proj", hidden * 2 * inner, "attn"),
               (f"{m}.conv1d", inner * mamba.conv_kernel + (inner if conv_bias else 0), "norm"),
               (f"{m}.x_proj", inner * (rank + 2 * state), "attn"),
               (f"{m}.dt_proj", rank * inner, "attn"), (f"{m}.dt_proj.bias", inner, "bias"),
               (f"{m}.A_log", inner * state + inner, "norm"),   # A_log and D
               (f"{m}.out_proj", inner * hidden, "attn")]
        if c.model_type == "jamba":
            out.append((f"{m}.dt_layernorm", rank + 2 * state, "norm"))   # dt, B and C layernorms
        return out + ([(f"{m}.proj_bias", 2 * inner + hidden, "bias")] if proj_bias else [])
    heads, groups = mamba.heads or 0, mamba.groups
    channels = inner + 2 * groups * state
    projected = 2 * inner + 2 * groups * state + heads
    return [(f"{m}.in_proj", hidden * projected, "attn"),
            (f"{m}.conv1d", channels * mamba.conv_kernel + (channels if conv_bias else 0), "norm"),
            (f"{m}.A_log", 3 * heads, "norm"),   # A_log, D, dt_bias
            (f"{m}.norm", inner, "norm"),
            (f"{m}.out_proj", inner * hidden, "attn")] + (
        [(f"{m}.proj_bias", projected + hidden, "bias")] if proj_bias else [])


def ffn_modules(c: Fields, i: int, p: str, hidden: int, kind: str) -> list[tuple[str, int, str]] | None:
    """A hybrid family's feed-forward modules where they differ from the standard decoder's (None: standard)."""
    if c.model_type == "nemotron_h":
        if kind != MLP:   # a Nemotron-H block is one mixer: attention, Mamba or MLP
            return []
        size = c.num("intermediate_size")
        return [(f"{p}.mixer.up_proj", hidden * size, "mlp"), (f"{p}.mixer.down_proj", size * hidden, "mlp")]
    if c.model_type == "granitemoehybrid":
        out: list[tuple[str, int, str]] = []
        experts = c.num("num_local_experts", 0)
        if experts:
            size, m = c.num("intermediate_size"), f"{p}.block_sparse_moe"
            out += [(f"{m}.router", experts * hidden, "router"),
                    (f"{m}.input_linear", experts * hidden * 2 * size, "expert"),
                    (f"{m}.output_linear", experts * size * hidden, "expert")]
        shared = c.num("shared_intermediate_size", 0)
        if shared:
            kind_ = "shared" if experts else "mlp"
            out += [(f"{p}.shared_mlp.input_linear", hidden * 2 * shared, kind_),
                    (f"{p}.shared_mlp.output_linear", shared * hidden, kind_)]
        return out
    if c.model_type == "jamba":
        experts = c.num("num_experts", 1)
        period, offset = c.num("expert_layer_period", 2) or 1, c.num("expert_layer_offset", 1)
        size, m = c.num("intermediate_size"), f"{p}.feed_forward"
        if experts > 1 and i % period == offset:
            return [(f"{m}.router", experts * hidden, "router"),
                    (f"{m}.experts.0.gate_proj", experts * hidden * size, "expert"),
                    (f"{m}.experts.0.up_proj", experts * hidden * size, "expert"),
                    (f"{m}.experts.0.down_proj", experts * size * hidden, "expert")]
        return [(f"{m}.gate_proj", hidden * size, "mlp"), (f"{m}.up_proj", hidden * size, "mlp"),
                (f"{m}.down_proj", size * hidden, "mlp")]
    return None


def norms(c: Fields) -> int:
    """Hidden-size norms per layer: Nemotron-H's blocks have one, the others two."""
    return 1 if c.model_type == "nemotron_h" else 2
