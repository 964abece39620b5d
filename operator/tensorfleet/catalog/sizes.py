"""Bytes of a model's weights and KV cache from its architecture facts, pure functions that the planner
(planner/memory.py) and the simulator both size with: the catalog's coarse weights at the format's bits (facts read
from a config.json carry their own, per layer), sharded over tensor ranks, and the KV cache per token and layer.
Design: docs/planner.md#kv-cache-bytes-per-token."""

from __future__ import annotations

from tensorfleet.api.architecture import ArchitectureSpec
from tensorfleet.catalog.facts import DEFAULT_VOCAB
from tensorfleet.catalog.formats import BITS

# Weight bytes per parameter of quantizable (linear) layers, per format.
BYTES_PER_PARAMETER: dict[str, float] = {name: bits / 8 for name, bits in BITS.items()}
EMBEDDING_BYTES = 2  # embeddings and output head stay 16-bit under every format


def kv_element_bytes(kv_cache_dtype: str) -> int:
    """Bytes of one KV-cache element: fp8, or `auto` (the 16-bit model dtype)."""
    return 1 if kv_cache_dtype == "fp8" else 2


def embedding_parameters(arch: ArchitectureSpec) -> int:
    """Parameters of one embedding matrix (input, or output head)."""
    return (arch.vocab_size or DEFAULT_VOCAB) * arch.hidden_size


def _all_embedding_parameters(arch: ArchitectureSpec) -> int:
    """Input embedding plus output head (one matrix when they are tied)."""
    return embedding_parameters(arch) * (1 if arch.tied_embeddings else 2)


def layer_weight_bytes(arch: ArchitectureSpec, weight_format: str) -> float:
    """Bytes of one transformer layer (all tensor ranks together)."""
    body = max(arch.parameters - _all_embedding_parameters(arch), 0)
    return body * BYTES_PER_PARAMETER[weight_format] / arch.layers


def total_weight_bytes(arch: ArchitectureSpec, weight_format: str) -> int:
    return int(layer_weight_bytes(arch, weight_format) * arch.layers + _all_embedding_parameters(arch) * EMBEDDING_BYTES)


def kv_bytes_per_token_layer(arch: ArchitectureSpec, tensor: int, kv_element_bytes: int) -> int:
    """KV-cache bytes one token needs in one layer on one tensor rank: 2 (K and V) x KV heads on the rank x head dim
    x element bytes, the rank's heads max(1, kv_heads / tensor) (vLLM replicates heads when tensor > kv_heads); for
    MLA, (kv_lora_rank + qk_rope_head_dim) x element bytes on every rank (the latent is not split by head).
    Sliding-window and chunked layers take the same; how vLLM pools them is planner/kvcache.py's."""
    if arch.mla is not None:
        return (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * kv_element_bytes
    kv_heads = arch.kv_heads or arch.attention_heads
    head_dim = arch.head_dim or arch.hidden_size // arch.attention_heads
    heads_here = max(1, kv_heads // tensor)
    return 2 * heads_here * head_dim * kv_element_bytes

