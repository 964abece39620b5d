"""A model's config.json (and its quantization config) -> ModelFacts. Pure, dicts in and facts out
(`tensorfleet.modelinfo` fetches the files): the architecture from the config's fields, with transformers' defaults
for its model type, and the weights module by module, each linear module at the bits its quantization stores it
with, as vLLM loads it. Design: docs/planner.md#reading-the-models-own-config."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from pydantic import ValidationError

from tensorfleet.api.architecture import ArchitectureSpec, MambaArchitecture, MLAArchitecture, MoEArchitecture
from tensorfleet.catalog import hybridconfig
from tensorfleet.catalog.facts import LayerWeights, ModelFacts, ModelSource
from tensorfleet.catalog.formats import BITS, WeightFormat


class ModelConfigError(ValueError):
    """A config.json the planner cannot size; the message names the field and why."""


# Defaults transformers' config classes give fields a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131_072, "sliding_window": 4096, "sliding_window_pattern": 6,
                    "tie_word_embeddings": True},
    "gemma2": {"tie_word_embeddings": True, "sliding_window_pattern": 2},
    "gemma": {"tie_word_embeddings": True},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_channels": 3, "image_size": 224, "patch_size": 16},
    "llama4_vision_model": {"num_channels": 3},
}
# Model types whose q/k/v projections always carry a bias (no attention_bias field).
_QKV_BIAS = {"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"}
# Model types with per-head RMS norms on queries and keys (weights of head_dim each).
_QK_NORM = {"qwen3", "qwen3_moe", "gemma3_text", "gemma3", "olmo2", "olmoe", "qwen3_next"}
# Model types with four norms per layer (before and after attention and MLP).
_FOUR_NORMS = {"gemma2", "gemma3_text", "gemma3"}
# Families sized by their own rules; anything else is read as a standard decoder, with a note.
_KNOWN = {
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "gemma", "gemma2",
    "gemma3_text", "deepseek_v2", "deepseek_v3", "kimi_k2", "llama4_text", "gpt_oss", "granite", "olmo2",
    *hybridconfig.HYBRID_TYPES,
}
# Models whose cache is not sized here: other state-space or linear-attention designs, encoder-decoders. Falcon-H1
# runs attention and a Mamba mixer side by side in every layer.
_UNSUPPORTED = {"falcon_h1", "minimax", "minimax_text_01", "mamba", "mamba2", "rwkv", "t5", "bart", "whisper",
                "zamba", "zamba2", "lfm2"}
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_sequence_length", "max_seq_length", "seq_len")
_LINEAR = {"attn", "mlp", "expert", "shared"}


@dataclass(frozen=True)
class _Module:
    path: str      # the checkpoint's module name, e.g. model.layers.3.self_attn.q_proj
    params: int
    kind: str      # attn, mlp, expert, shared (linear); router, norm, bias, sink (16-bit)
    replicated: bool = False


class _Config:
    """Field lookup: the text config, then the wrapper's top level, then transformers' defaults."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        nested = config.get("text_config")
        self.top = config
        self.text: Mapping[str, Any] = nested if isinstance(nested, Mapping) else config
        self.nested = isinstance(nested, Mapping)
        self.model_type = str(self.text.get("model_type") or config.get("model_type") or "")
        top_type = str(config.get("model_type") or "")
        if self.nested and self.model_type in ("", top_type):
            # Older wrappers omit the text model_type: Gemma 3's is gemma3_text.
            self.model_type = {"gemma3": "gemma3_text", "llama4": "llama4_text"}.get(top_type, self.model_type or top_type)
        self.defaults = _DEFAULTS.get(self.model_type, {})

    def get(self, key: str, default: Any = None) -> Any:
        for source in (self.text, self.top, self.defaults):
            if key in source and source[key] is not None:
                return source[key]
        return default

    def num(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            where = "text_config." if self.nested else ""
            raise ModelConfigError(f"{where}{key} is missing")
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < 0:
            raise ModelConfigError(f"{key} must be a whole number, not {value!r}")
        return int(value)

    def nums(self, key: str) -> list[int] | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ModelConfigError(f"{key} must be a list of whole numbers")
        return list(value)


def parse_model_config(
    config: Mapping[str, Any],
    *,
    name: str,
    source: ModelSource = "file",
    hf_quant_config: Mapping[str, Any] | None = None,
    revision: str | None = None,
) -> ModelFacts:
    """The planner's facts for the model whose config.json is CONFIG.

    `hf_quant_config` is the checkpoint's hf_quant_config.json, when it has one
    (NVIDIA ModelOpt); a `quantization_config` inside config.json wins over it.
    Raises ModelConfigError when a field is missing or the model is of a kind the
    planner cannot size (state-space hybrids, unknown quantization methods).
    """
    if not isinstance(config, Mapping):
        raise ModelConfigError("config.json must be a JSON object")
    c = _Config(config)
    if c.model_type in _UNSUPPORTED:
        raise ModelConfigError(
            f"model_type {c.model_type!r} is not an attention decoder nor a hybrid the planner reads (Qwen3-Next, "
            "Granite 4.0-H, Jamba, Nemotron-H, Bamba); its cache cannot be sized from config.json here (give "
            "spec.model.architecture, with `mamba` for its state layers)"
        )
    notes: list[str] = []
    if c.model_type not in _KNOWN:
        notes.append(f"model_type {c.model_type or '(none)'!r} is not one the planner knows by name; "
                     "sized as a standard decoder from its config.json")
    scheme = _scheme(config.get("quantization_config") or c.text.get("quantization_config"), hf_quant_config)
    layers_n = c.num("num_hidden_layers")
    prefix = "language_model.model" if c.nested else "model"
    try:
        kinds = hybridconfig.layer_kinds(c, layers_n) if c.model_type in hybridconfig.HYBRID_TYPES else None
        state = hybridconfig.architecture(c, c.num("hidden_size"), kinds) if kinds else None
    except (hybridconfig.ConfigError, ValidationError) as exc:
        raise ModelConfigError(_first_problem(exc)) from None
    modules = [_layer_modules(c, i, f"{prefix}.layers.{i}", kinds[i] if kinds else None, state)
               for i in range(layers_n)]

    layer_weights: list[LayerWeights] = []
    kept: set[str] = set()
    for layer in modules:
        linear = sum(m.params for m in layer if m.kind in _LINEAR)
        stored = 0.0
        for m in layer:
            if m.kind in _LINEAR:
                bits = scheme.bits(m.path, m.kind)
                stored += m.params * bits
                if scheme.quantizes and bits >= 16:
                    kept.add(m.kind)
        layer_weights.append(LayerWeights(
            linear=linear,
            bits=stored / linear if linear else 16.0,
            other=sum(m.params for m in layer if m.kind not in _LINEAR),
            replicated=sum(m.params for m in layer if m.replicated and m.kind in _LINEAR),
        ))

    hidden = c.num("hidden_size")
    vocab = c.num("vocab_size")
    tied = bool(c.get("tie_word_embeddings", False))
    embedding = vocab * hidden
    head_path = "language_model.lm_head" if c.nested else "lm_head"
    head_bits = scheme.head_bits(head_path)
    encoder, encoder_note = _encoder(config, hidden)
    if encoder_note:
        notes.append(encoder_note)

    arch, arch_notes = _architecture(c, modules, tied, state)
    notes += arch_notes
    kept_names = {"attn": "attention", "mlp": "dense MLPs", "expert": "experts", "shared": "shared experts"}
    detail = scheme.detail
    if scheme.quantizes:
        unquantized = ["embeddings"] + ([] if head_bits < 16 or tied else ["lm_head"])
        unquantized += [kept_names[k] for k in ("attn", "mlp", "shared", "expert") if k in kept]
        detail += f"; 16-bit: {', '.join(unquantized)}"
    main_bits = scheme.typical_bits if scheme.quantizes else 16.0
    dtype = config.get("torch_dtype") or config.get("dtype") or c.text.get("torch_dtype")
    display = _display_name(scheme.name, dtype)
    return ModelFacts(
        name=name,
        arch=arch.model_copy(update={"weight_format": display if display in BITS else "bf16"}),
        weight_format=WeightFormat(display, main_bits, detail),
        layers=tuple(layer_weights),
        embedding=embedding,
        head=embedding,
        head_bits=head_bits,
        final=hidden,
        encoder=encoder,
        source=source,
        revision=revision,
        dtype=str(dtype) if isinstance(dtype, str) else None,
        notes=tuple(notes),
    )


def _display_name(name: str, dtype: object) -> str:
    if name == "bf16" and dtype in ("float16", "half"):
        return "fp16"
    return name


# --- modules of one decoder layer -----------------------------------------------------


def _layer_modules(c: _Config, i: int, p: str, kind: str | None = None, state: MambaArchitecture | None = None
                   ) -> list[_Module]:
    """One decoder layer's modules; KIND (hybridconfig's) and STATE for a hybrid model's layer."""
    hidden = c.num("hidden_size")
    if kind is None or state is None:
        out = _attention_modules(c, p, hidden)
        norms = 4 if c.model_type in _FOUR_NORMS else 2
        out.append(_Module(f"{p}.input_layernorm", norms * hidden, "norm"))
        return out + _ffn_modules(c, i, p, hidden)
    out = (_attention_modules(c, p, hidden) if kind == hybridconfig.ATTENTION else
           [_Module(*m) for m in hybridconfig.state_modules(c, p, hidden, state)] if kind == hybridconfig.STATE else [])
    out.append(_Module(f"{p}.input_layernorm", hybridconfig.norms(c) * hidden, "norm"))
    ffn = hybridconfig.ffn_modules(c, i, p, hidden, kind)
    return out + (_ffn_modules(c, i, p, hidden) if ffn is None else [_Module(*m) for m in ffn])


def _first_problem(exc: Exception) -> str:
    """A ModelConfigError's message for a reader's or the API model's error."""
    if isinstance(exc, ValidationError):
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"]) or "config"
        return f"{where}: {problem['msg']}"
    return str(exc)


def _head_dim(c: _Config, hidden: int, heads: int) -> int:
    """Attention head size: head_dim (Nemotron-H: attention_head_dim), else hidden / heads."""
    if c.get("head_dim") is None and c.get("attention_head_dim") is not None:
        return c.num("attention_head_dim")
    return c.num("head_dim", hidden // heads)


def _attention_modules(c: _Config, p: str, hidden: int) -> list[_Module]:
    heads = c.num("num_attention_heads")
    a = f"{p}.self_attn"
    if c.get("kv_lora_rank") is not None:
        return _mla_modules(c, a, hidden, heads)
    kv_heads = c.num("num_key_value_heads", heads)
    head_dim = _head_dim(c, hidden, heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = bool(c.get("attention_bias", False))
    qkv_bias = bias or c.model_type in _QKV_BIAS
    if c.model_type == "phi3":
        out = [_Module(f"{a}.qkv_proj", hidden * (q + 2 * kv), "attn")]
    elif c.model_type == "qwen3_next":   # gated attention: the query projection also gives the output gate
        out = [_Module(f"{a}.q_proj", hidden * 2 * q, "attn"), _Module(f"{a}.k_proj", hidden * kv, "attn"),
               _Module(f"{a}.v_proj", hidden * kv, "attn")]
    else:
        out = [_Module(f"{a}.q_proj", hidden * q, "attn"), _Module(f"{a}.k_proj", hidden * kv, "attn"),
               _Module(f"{a}.v_proj", hidden * kv, "attn")]
    out.append(_Module(f"{a}.o_proj", q * hidden, "attn"))
    if qkv_bias:
        out.append(_Module(f"{a}.qkv_bias", q + 2 * kv, "bias"))
    if bias:
        out.append(_Module(f"{a}.o_proj.bias", hidden, "bias"))
    if c.model_type in _QK_NORM:
        out.append(_Module(f"{a}.q_norm", 2 * head_dim, "norm"))
    if c.model_type == "gpt_oss":
        out.append(_Module(f"{a}.sinks", heads, "sink"))
    return out


def _mla_modules(c: _Config, a: str, hidden: int, heads: int) -> list[_Module]:
    q_rank = c.get("q_lora_rank")
    kv_rank = c.num("kv_lora_rank")
    nope, rope, v = c.num("qk_nope_head_dim"), c.num("qk_rope_head_dim"), c.num("v_head_dim")
    out: list[_Module] = []
    if q_rank is None:
        out.append(_Module(f"{a}.q_proj", hidden * heads * (nope + rope), "attn"))
    else:
        q_rank = c.num("q_lora_rank")
        # vLLM keeps the down-projections (q_a, kv_a) whole on every tensor rank.
        out += [_Module(f"{a}.q_a_proj", hidden * q_rank, "attn", replicated=True),
                _Module(f"{a}.q_a_layernorm", q_rank, "norm"),
                _Module(f"{a}.q_b_proj", q_rank * heads * (nope + rope), "attn")]
    out += [_Module(f"{a}.kv_a_proj_with_mqa", hidden * (kv_rank + rope), "attn", replicated=True),
            _Module(f"{a}.kv_a_layernorm", kv_rank, "norm"),
            _Module(f"{a}.kv_b_proj", kv_rank * heads * (nope + v), "attn"),
            _Module(f"{a}.o_proj", heads * v * hidden, "attn")]
    return out


def _experts(c: _Config) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = c.get(key)
        if value:
            return c.num(key)
    return 0


def _is_moe_layer(c: _Config, i: int, layers: int) -> bool:
    if not _experts(c):
        return False
    mt = c.model_type
    if mt in ("deepseek_v2", "deepseek_v3", "kimi_k2") or c.get("first_k_dense_replace") is not None:
        freq = c.num("moe_layer_freq", 1) or 1
        return i >= c.num("first_k_dense_replace", 0) and i % freq == 0
    if mt == "llama4_text":
        moe_layers = c.nums("moe_layers")
        if moe_layers is not None:
            return i in moe_layers
        step = c.num("interleave_moe_layer_step", 1) or 1
        return (i + 1) % step == 0
    if c.get("decoder_sparse_step") is not None or c.get("mlp_only_layers") is not None:
        step = c.num("decoder_sparse_step", 1) or 1
        return i not in (c.nums("mlp_only_layers") or []) and (i + 1) % step == 0
    return True


def _ffn_modules(c: _Config, i: int, p: str, hidden: int) -> list[_Module]:
    mt = c.model_type
    layers = c.num("num_hidden_layers")
    if not _is_moe_layer(c, i, layers):
        size = c.num("intermediate_size_mlp") if mt == "llama4_text" else c.num("intermediate_size")
        m = f"{p}.feed_forward" if mt == "llama4_text" else f"{p}.mlp"
        out = ([_Module(f"{m}.gate_up_proj", hidden * 2 * size, "mlp")] if mt == "phi3" else
               [_Module(f"{m}.gate_proj", hidden * size, "mlp"), _Module(f"{m}.up_proj", hidden * size, "mlp")])
        out.append(_Module(f"{m}.down_proj", size * hidden, "mlp"))
        if c.get("mlp_bias"):
            out.append(_Module(f"{m}.bias", 3 * size, "bias"))
        return out

    experts = _experts(c)
    size = c.num("moe_intermediate_size") if c.get("moe_intermediate_size") is not None else c.num("intermediate_size")
    if mt == "mixtral":
        m = f"{p}.block_sparse_moe"
        return [_Module(f"{m}.gate", experts * hidden, "router"),
                _Module(f"{m}.experts.0.w1", experts * hidden * size, "expert"),
                _Module(f"{m}.experts.0.w3", experts * hidden * size, "expert"),
                _Module(f"{m}.experts.0.w2", experts * size * hidden, "expert")]
    if mt == "gpt_oss":
        m = f"{p}.mlp"
        return [_Module(f"{m}.router", experts * hidden + experts, "router"),
                _Module(f"{m}.experts.gate_up_proj", experts * hidden * 2 * size, "expert"),
                _Module(f"{m}.experts.gate_up_proj_bias", experts * 2 * size, "bias"),
                _Module(f"{m}.experts.down_proj", experts * size * hidden, "expert"),
                _Module(f"{m}.experts.down_proj_bias", experts * hidden, "bias")]
    if mt == "llama4_text":
        m = f"{p}.feed_forward"
        return [_Module(f"{m}.router", experts * hidden, "router"),
                _Module(f"{m}.experts.gate_up_proj", experts * hidden * 2 * size, "expert"),
                _Module(f"{m}.experts.down_proj", experts * size * hidden, "expert"),
                _Module(f"{m}.shared_expert.gate_proj", hidden * size, "shared"),
                _Module(f"{m}.shared_expert.up_proj", hidden * size, "shared"),
                _Module(f"{m}.shared_expert.down_proj", size * hidden, "shared")]
    m = f"{p}.mlp"
    router = experts * hidden + (experts if c.get("topk_method") == "noaux_tc" else 0)
    out = [_Module(f"{m}.gate", router, "router"),
           _Module(f"{m}.experts.0.gate_proj", experts * hidden * size, "expert"),
           _Module(f"{m}.experts.0.up_proj", experts * hidden * size, "expert"),
           _Module(f"{m}.experts.0.down_proj", experts * size * hidden, "expert")]
    shared_size = _shared_size(c, size)
    if shared_size:
        s = f"{m}.shared_experts" if c.get("n_shared_experts") else f"{m}.shared_expert"
        out += [_Module(f"{s}.gate_proj", hidden * shared_size, "shared"),
                _Module(f"{s}.up_proj", hidden * shared_size, "shared"),
                _Module(f"{s}.down_proj", shared_size * hidden, "shared")]
        if c.get("shared_expert_intermediate_size"):
            out.append(_Module(f"{m}.shared_expert_gate", hidden, "router"))
    return out


def _shared_size(c: _Config, expert_size: int) -> int:
    if c.get("n_shared_experts"):
        return c.num("n_shared_experts") * expert_size
    if c.get("shared_expert_intermediate_size"):
        return c.num("shared_expert_intermediate_size")
    return 0


def _shared_count(c: _Config) -> int:
    if c.model_type == "llama4_text" or (c.model_type == "granitemoehybrid" and c.get("shared_intermediate_size")):
        return 1
    if c.get("n_shared_experts"):
        return c.num("n_shared_experts")
    return 1 if c.get("shared_expert_intermediate_size") else 0


# --- architecture facts for the KV cache, the layout rules and the activation reserve ---


def _architecture(c: _Config, modules: list[list[_Module]], tied: bool, state: MambaArchitecture | None = None
                  ) -> tuple[ArchitectureSpec, list[str]]:
    notes: list[str] = []
    hidden, heads, layers = c.num("hidden_size"), c.num("num_attention_heads"), c.num("num_hidden_layers")
    mla: MLAArchitecture | None = None
    if c.get("kv_lora_rank") is not None:
        mla = MLAArchitecture(kv_lora_rank=c.num("kv_lora_rank"), qk_rope_head_dim=c.num("qk_rope_head_dim"))
        kv_heads, head_dim = heads, c.num("qk_nope_head_dim") + c.num("qk_rope_head_dim")
    else:
        kv_heads = c.num("num_key_value_heads", heads)
        head_dim = _head_dim(c, hidden, heads)

    experts = _experts(c)
    moe: MoEArchitecture | None = None
    intermediate = c.num("intermediate_size") if c.get("intermediate_size") is not None else None
    total = sum(m.params for layer in modules for m in layer)
    if experts:
        top_k = c.num("num_experts_per_tok") if c.get("num_experts_per_tok") is not None else c.num("experts_per_token")
        routed = sum(m.params for layer in modules for m in layer if m.kind == "expert")
        embeddings = c.num("vocab_size") * hidden * (1 if tied else 2)
        active = total + embeddings + hidden - routed + routed * top_k // experts
        moe = MoEArchitecture(experts=experts, experts_per_token=top_k, shared_experts=_shared_count(c),
                              active_parameters=active)
        if c.get("moe_intermediate_size") is not None:
            intermediate = c.num("moe_intermediate_size")
    if c.num("num_nextn_predict_layers", 0):
        notes.append(f"{c.num('num_nextn_predict_layers')} multi-token-prediction layer(s) in the checkpoint are "
                     "not counted: vLLM loads them only for speculative decoding")

    window, window_layers, chunk, chunk_layers = _windows(c, layers)
    embeddings = c.num("vocab_size") * hidden * (1 if tied else 2)
    try:
        arch = ArchitectureSpec(
            parameters=total + embeddings + hidden,
            layers=layers,
            hidden_size=hidden,
            attention_heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            vocab_size=c.num("vocab_size"),
            tied_embeddings=tied,
            max_context_length=_max_context(c),
            sliding_window=window,
            sliding_window_layers=window_layers,
            attention_chunk_size=chunk,
            chunked_attention_layers=chunk_layers,
            moe=moe,
            mla=mla,
            mamba=state,
        )
    except ValidationError as exc:
        raise ModelConfigError(_first_problem(exc)) from None
    return arch, notes


def _windows(c: _Config, layers: int) -> tuple[int | None, int | None, int | None, int | None]:
    """(sliding window, how many layers use it, attention chunk, how many layers use it), as vLLM reads them."""
    if c.model_type in hybridconfig.HYBRID_TYPES:
        return None, None, None, None   # their attention layers attend to the whole context
    window = c.get("sliding_window")
    layer_types = c.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention", "chunked_attention")})
        if unknown:
            raise ModelConfigError(
                f"layer_types has {', '.join(map(repr, unknown))}: layers without an attention KV cache "
                "cannot be sized from config.json here (give spec.model.architecture)"
            )
        sliding = sum(1 for t in layer_types if t == "sliding_attention")
        chunked = sum(1 for t in layer_types if t == "chunked_attention")
        windows = (c.num("sliding_window"), sliding) if sliding and window else (None, None)
        chunks = (c.num("attention_chunk_size"), chunked) if chunked and c.get("attention_chunk_size") else (None, None)
        return windows[0], windows[1], chunks[0], chunks[1]
    if c.model_type.startswith(("gemma2", "gemma3")):
        pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or c.defaults.get("sliding_window_pattern")
        if window and pattern:
            return c.num("sliding_window"), layers - layers // int(pattern), None, None
        return None, None, None, None
    if c.model_type == "llama4_text" and c.get("attention_chunk_size"):
        # Chunked local attention on the layers with rotary embeddings (no_rope_layers 1), full on the rest.
        rope_layers = c.nums("no_rope_layers")
        chunked = sum(1 for v in rope_layers if v) if rope_layers else layers - layers // 4
        return None, None, c.num("attention_chunk_size"), chunked
    if "use_sliding_window" in c.text:
        # Qwen: layers from max_window_layers on use the window, when use_sliding_window is on.
        sliding = layers - min(c.num("max_window_layers", 0), layers)
        if c.get("use_sliding_window") and window and sliding:
            return c.num("sliding_window"), sliding, None, None
        return None, None, None, None
    if window:
        return c.num("sliding_window"), layers, None, None
    return None, None, None, None


def _max_context(c: _Config) -> int | None:
    """The max_model_len vLLM derives from the config when none is given."""
    lengths = [c.num(key) for key in _LENGTH_KEYS if c.get(key) is not None]
    if not lengths:
        return None
    length = float(min(lengths))
    rope = c.text.get("rope_scaling") or c.text.get("rope_parameters")
    if isinstance(rope, Mapping) and "gemma3" not in c.model_type:
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("su", "longrope", "llama3"):
            factor = float(rope.get("factor", 1.0) or 1.0)
            if rope_type == "yarn":
                length = float(rope.get("original_max_position_embeddings") or length)
            length *= factor
    return int(length)


# --- the vision encoder ----------------------------------------------------------------


def _encoder(config: Mapping[str, Any], text_hidden: int) -> tuple[int, str | None]:
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        return 0, None
    v = _Config(vision)
    kind = v.model_type
    hidden, inner, depth = v.num("hidden_size"), v.num("intermediate_size"), v.num("num_hidden_layers")
    channels, image, patch = v.num("num_channels", 3), v.num("image_size"), v.num("patch_size")
    layer = 4 * (hidden * hidden + hidden) + (hidden * inner + inner) + (inner * hidden + hidden) + 4 * hidden
    positions = (image // patch) ** 2
    if kind == "siglip_vision_model":
        # patch conv + bias, position embeddings, layers, post-layernorm; Gemma 3's projector and its norm.
        total = channels * patch * patch * hidden + hidden + positions * hidden + depth * layer + 2 * hidden
        total += hidden * text_hidden + hidden
    elif kind == "llama4_vision_model":
        # unfold-conv patch embedding, class embedding, positions (+1 for the class token), pre/post
        # layernorms, layers; the pixel-shuffle adapter MLP and the projector into the text width.
        total = channels * patch * patch * hidden + hidden + (positions + 1) * hidden + 4 * hidden + depth * layer
        total += inner * v.num("projector_input_dim") + v.num("projector_output_dim") ** 2
        total += v.num("vision_output_dim") * text_hidden
    else:
        return 0, f"vision encoder {kind or '(unknown)'} is not counted in the weights"
    return total, f"vision encoder and projector ({total / 1e6:,.0f}M parameters, 16-bit) sit on the first stage"


# --- quantization ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Scheme:
    name: str
    detail: str
    rule: Callable[[str, str], float]      # (module path, kind) -> stored bits
    typical_bits: float = 16.0
    head_rule: Callable[[str], float] | None = None

    @property
    def quantizes(self) -> bool:
        return self.typical_bits < 16

    def bits(self, path: str, kind: str) -> float:
        return self.rule(path, kind)

    def head_bits(self, path: str) -> float:
        return self.head_rule(path) if self.head_rule else 16.0


_NONE = _Scheme("bf16", "unquantized", lambda path, kind: 16.0)


def _matches(pattern: str, module: str, kind: str) -> bool:
    """Does an ignore/target/exclude PATTERN name MODULE, in the conventions checkpoints use?"""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None     # compressed-tensors: re.match on the name
    if "*" in pattern or "?" in pattern:                      # ModelOpt, gpt-oss: globs over the dotted name
        parts = module.split(".")
        return any(fnmatchcase(".".join(parts[:n]), pattern) for n in range(1, len(parts) + 1))
    if pattern[:1].isupper() and "." not in pattern:          # a class name (compressed-tensors)
        if pattern == "Linear":
            return kind in _LINEAR or kind == "head"
        return ((("Attention" in pattern) and kind == "attn") or
                (any(w in pattern for w in ("MLP", "FeedForward")) and kind in ("mlp", "shared")) or
                (any(w in pattern for w in ("Experts", "MoE", "Moe")) and kind == "expert"))
    return pattern in module                                  # transformers, vLLM: a substring of the name


def _any(patterns: object, module: str, kind: str) -> bool:
    if not isinstance(patterns, list):
        return False
    return any(isinstance(p, str) and _matches(p, module, kind) for p in patterns)


def _scheme(qc: object, hf_quant: Mapping[str, Any] | None) -> _Scheme:
    if isinstance(qc, Mapping) and qc:
        method = str(qc.get("quant_method") or "").lower()
        readers: dict[str, Callable[[Mapping[str, Any]], _Scheme]] = {
            "compressed-tensors": _compressed_tensors, "fp8": _fp8, "fbgemm_fp8": _fp8, "awq": _awq,
            "gptq": _gptq, "mxfp4": _mxfp4, "bitsandbytes": _bnb, "modelopt": _modelopt,
        }
        if method not in readers:
            raise ModelConfigError(
                f"quantization_config.quant_method {method or '(none)'!r} is not one the planner sizes "
                f"({', '.join(sorted(readers))})"
            )
        return readers[method](qc)
    if isinstance(hf_quant, Mapping) and isinstance(hf_quant.get("quantization"), Mapping):
        return _modelopt(hf_quant["quantization"], source="hf_quant_config.json")
    return _NONE


def _linear_rule(bits: float, skip: object, kinds: frozenset[str] = frozenset(_LINEAR)) -> Callable[[str, str], float]:
    def rule(path: str, kind: str) -> float:
        return bits if kind in kinds and not _any(skip, path, kind) else 16.0
    return rule


def _fp8(qc: Mapping[str, Any]) -> _Scheme:
    block = qc.get("weight_block_size")
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers")
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        bits = 8 + 32 / (block[0] * block[1])        # one fp32 scale per block
        detail = f"fp8 e4m3, {block[0]}x{block[1]} blocks"
    else:
        bits, detail = 8.0, "fp8 e4m3, per-channel/tensor scales"
    return _Scheme("fp8", f"{qc.get('quant_method')}: {detail}", _linear_rule(bits, skip), bits)


def _awq(qc: Mapping[str, Any]) -> _Scheme:
    bits = int(qc.get("bits") or qc.get("w_bit") or 4)
    group = int(qc.get("group_size") or qc.get("q_group_size") or 128)
    zero = qc.get("zero_point", True)
    if bits != 4:
        raise ModelConfigError(f"quantization_config.bits {bits}: vLLM's AWQ kernels take 4-bit weights only")
    stored = bits + (16 + (bits if zero else 0)) / group
    return _Scheme("awq", f"AWQ {bits}-bit, group {group}{', zero point' if zero else ''}",
                   _linear_rule(stored, qc.get("modules_to_not_convert")), stored)


def _gptq(qc: Mapping[str, Any]) -> _Scheme:
    bits = int(qc.get("bits") or 4)
    group = int(qc.get("group_size") or -1)
    # qweight packed, one fp16 scale and one packed zero point per group (kept even when symmetric).
    stored = bits + ((16 + bits) / group if group > 0 else 0)
    only = qc.get("modules_in_block_to_quantize")
    names = [n for part in only for n in (part if isinstance(part, list) else [part])] if isinstance(only, list) else None

    def rule(path: str, kind: str) -> float:
        if kind not in _LINEAR:
            return 16.0
        if names is not None and not any(isinstance(n, str) and path.endswith(n) for n in names):
            return 16.0
        return stored

    name = "gptq" if bits == 4 else ("gptq-int8" if bits == 8 else "gptq")
    head = stored if qc.get("lm_head") else 16.0
    return _Scheme(name, f"GPTQ {bits}-bit, group {group if group > 0 else 'per channel'}", rule, stored,
                   head_rule=lambda path: head)


def _mxfp4(qc: Mapping[str, Any]) -> _Scheme:
    bits = 4 + 8 / 32      # e2m1 pairs per byte, one e8m0 scale per 32
    return _Scheme("mxfp4", "MXFP4 MoE experts (8-bit scale per 32)",
                   _linear_rule(bits, qc.get("modules_to_not_convert"), frozenset({"expert"})), bits)


def _bnb(qc: Mapping[str, Any]) -> _Scheme:
    skip = qc.get("llm_int8_skip_modules")
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        return _Scheme("bnb-8bit", "bitsandbytes LLM.int8", _linear_rule(8.0, skip), 8.0)
    double = bool(qc.get("bnb_4bit_use_double_quant"))
    # 4-bit codes; an absmax per block of 64: fp32, or with double quantization 8-bit plus an fp32 per 256 blocks.
    bits = 4 + (8 / 64 + 32 / (64 * 256) if double else 32 / 64)
    kind = qc.get("bnb_4bit_quant_type") or "fp4"
    return _Scheme("bnb-4bit", f"bitsandbytes {kind}, blocks of 64{', double-quantized' if double else ''}",
                   _linear_rule(bits, skip), bits)


_MODELOPT: dict[str, tuple[str, float | None]] = {
    "FP8": ("fp8", 8.0), "FP8_PER_CHANNEL_PER_TOKEN": ("fp8", 8.0), "FP8_BLOCK": ("fp8", 8.0),
    "NVFP4": ("nvfp4", None), "NVFP4_AWQ": ("nvfp4", None), "MXFP4": ("mxfp4", 4 + 8 / 32),
    "INT4_AWQ": ("int4", None), "W4A16_AWQ": ("int4", None), "W4A8_AWQ": ("int4", None),
    "INT8_SQ": ("int8", 8.0), "W8A8_SQ_PER_CHANNEL": ("int8", 8.0), "INT8": ("int8", 8.0),
}


def _modelopt(qc: Mapping[str, Any], source: str = "quantization_config") -> _Scheme:
    algo = str(qc.get("quant_algo") or "").upper()
    if algo not in _MODELOPT:
        raise ModelConfigError(f"{source} quant_algo {algo or '(none)'!r} is not one the planner sizes "
                               f"({', '.join(sorted(_MODELOPT))})")
    name, bits = _MODELOPT[algo]
    if bits is None:
        group = int(qc.get("group_size") or (16 if name == "nvfp4" else 128))
        bits = 4 + (8 if name == "nvfp4" else 16) / group
    skip = qc.get("exclude_modules") or qc.get("ignore")
    return _Scheme(name, f"ModelOpt {algo} ({source})", _linear_rule(bits, skip), bits)


def _compressed_tensors(qc: Mapping[str, Any]) -> _Scheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ModelConfigError("quantization_config.config_groups is missing (compressed-tensors)")
    ignore = qc.get("ignore") or []
    read: list[tuple[list[str], float, str, str]] = []   # (targets, bits, format name, words)
    for key, group in groups.items():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            continue
        bits, name, words = _ct_weights(weights, f"quantization_config.config_groups.{key}.weights")
        targets = [t for t in (group.get("targets") or ["Linear"]) if isinstance(t, str)]
        read.append((targets, bits, name, words))
    if not read:
        return _NONE

    def rule(path: str, kind: str) -> float:
        if kind not in _LINEAR or _any(ignore, path, kind):
            return 16.0
        for targets, bits, _, _ in read:
            if any(_matches(t, path, kind) for t in targets):
                return bits
        return 16.0

    _, bits, name, words = read[0]
    detail = "compressed-tensors " + "; ".join(w for _, _, _, w in read)
    if qc.get("kv_cache_scheme"):
        detail += " (fp8 KV-cache scales included: spec.engine.kvCacheDtype fp8 uses them)"
    return _Scheme(name, detail, rule, bits)


def _ct_weights(w: Mapping[str, Any], where: str) -> tuple[float, str, str]:
    num_bits = int(w.get("num_bits") or 8)
    kind = str(w.get("type") or "int")
    strategy = str(w.get("strategy") or "tensor")
    group = w.get("group_size")
    symmetric = w.get("symmetric", True)
    names = {("float", 8): "fp8", ("float", 4): "nvfp4", ("int", 8): "int8", ("int", 4): "int4"}
    name = names.get((kind, num_bits))
    if name is None:
        raise ModelConfigError(f"{where}: {kind} {num_bits}-bit weights are not a format the planner sizes")
    scale = 8 if (kind, num_bits) == ("float", 4) else 16
    if strategy in ("group", "tensor_group") and isinstance(group, int) and group > 0:
        bits = num_bits + (scale + (0 if symmetric else num_bits)) / group
        words = f"W{num_bits} {kind}, group {group}"
    elif strategy == "block" and isinstance(w.get("block_structure"), list):
        bh, bw = w["block_structure"]
        bits = num_bits + scale / (int(bh) * int(bw))
        words = f"W{num_bits} {kind}, {bh}x{bw} blocks"
    else:
        bits = float(num_bits)
        words = f"W{num_bits} {kind}, per {strategy}"
    return bits, name, words
