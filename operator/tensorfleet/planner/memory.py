"""Byte arithmetic for one GPU of a vLLM replica. Pure functions, no policy.

Method (the one vLLM's own start-up profiling follows; see vllm/v1/worker/
gpu_worker.py `determine_available_memory` and vllm/worker/worker.py before it):

    budget  = total GPU memory x gpu_memory_utilization
    kv      = budget - weights - peak activations - non-torch memory
    tokens  = floor(kv / (block_size x kv bytes per token)) x block_size

vLLM logs the result as "GPU KV cache size: N tokens"; with tensor
parallelism every rank holds the same tokens for its share of the KV heads, and
with pipeline parallelism the engine takes the smallest stage's figure.

Weights and KV-cache bytes per token are the model's: its ModelFacts
(`tensorfleet.catalog.facts`, read from config.json by `catalog/modelconfig.py`,
or the catalog's totals) carry the weights layer by layer, and
`tensorfleet.catalog.sizes` computes the KV cache (and says how). Pipeline parallelism
splits layers the way vLLM's `get_pp_indices` does: an even share each, the
remainder to the stages before the last; the first stage also holds the input
embedding, the last the output head. The block size is vLLM's default
(`tensorfleet.vllm_defaults`).

Reserve (what the profiler measures beside weights), calibrated against the
published vLLM start-up logs cited in tests/test_planner_published.py:
    activations     peak of one dummy forward pass of max_num_batched_tokens
                    tokens: MLP gate/up/act buffers on this rank plus a few
                    hidden-size buffers, plus fp32 logits for max_num_seqs
                    sampled rows (and the sampler's working copies)
    non-torch       CUDA context, cuBLAS workspaces; with tensor >= 2 also
                    NCCL and custom all-reduce buffers
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tensorfleet.api.models import ArchitectureSpec
from tensorfleet.catalog.facts import EMBEDDING_BITS, ModelFacts, from_architecture
from tensorfleet.catalog.sizes import DEFAULT_VOCAB, effective_kv_layers, kv_bytes_per_token_layer

GiB = 1024**3
MiB = 1024**2

# The CUDA total vLLM starts from is NVML's total less what the driver keeps:
# an H100 reporting 81559 MiB in nvidia-smi shows total_memory=79.19GiB in
# vLLM's log, an A100-40GB 40960 MiB shows 39.50GiB.
DRIVER_RESERVED_BYTES = 512 * MiB
# Measured "non-torch forward increase" in vLLM 0.19 logs on H100: 0.25-0.27 GiB
# on one GPU; 2.07-2.21 GiB per GPU once tensor parallelism brings NCCL and the
# custom all-reduce buffers; under 0.1 GiB for pipeline-only layouts.
NON_TORCH_SINGLE_GPU = int(0.27 * GiB)
NON_TORCH_TENSOR_PARALLEL = int(2.1 * GiB)
NON_TORCH_PIPELINE_ONLY = int(0.1 * GiB)
# fp32 logits plus the sampler's working copy during profiling.
LOGITS_COPIES = 2
ACTIVATION_BYTES = 2


@dataclass(frozen=True)
class Stage:
    layers: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int


def stage_layers(layers: int, pipeline: int) -> list[int]:
    """Layers per pipeline stage, as vLLM partitions them."""
    share, remainder = divmod(layers, pipeline)
    parts = [share] * pipeline
    # vLLM gives the extra layers to the stages before the last one.
    for i in range(2, remainder + 2):
        parts[-i % pipeline] += 1
    return parts


def stages(
    arch: ArchitectureSpec, weight_format: str, tensor: int, pipeline: int, kv_element_bytes: int, max_model_len: int
) -> list[Stage]:
    """Stages of a model known by its totals (catalog, spec.model.architecture) in WEIGHT_FORMAT."""
    facts = from_architecture("", arch, weight_format, "catalog")
    return facts_stages(facts, tensor, pipeline, kv_element_bytes, max_model_len)


def facts_stages(
    facts: ModelFacts, tensor: int, pipeline: int, kv_element_bytes: int, max_model_len: int,
    bits: float | None = None,
) -> list[Stage]:
    """Weights and KV bytes per token on one GPU of each pipeline stage.

    The first stage also holds the input embedding and any vision encoder, the
    last the final norm and the output head (vLLM gives the last stage its own
    copy of a tied head when pipeline > 1). BITS re-quantizes every linear weight
    (fp8 at load time); otherwise each layer counts as its checkpoint stores it.
    """
    arch = facts.arch
    per_layer_kv = kv_bytes_per_token_layer(arch, tensor, kv_element_bytes)
    out: list[Stage] = []
    first = 0
    for index, count in enumerate(stage_layers(arch.layers, pipeline)):
        weights = sum(layer.bytes_per_gpu(tensor, bits) for layer in facts.layers[first:first + count])
        first += count
        fixed = 0.0
        if index == 0:
            fixed += (facts.embedding + facts.encoder) * EMBEDDING_BITS / 8
        if index == pipeline - 1:
            fixed += facts.final * EMBEDDING_BITS / 8
            if not (facts.tied and pipeline == 1):
                fixed += facts.head * (EMBEDDING_BITS if facts.tied else facts.head_bits) / 8
        kv_per_token = math.ceil(effective_kv_layers(arch, count, max_model_len) * per_layer_kv)
        out.append(Stage(count, math.ceil(weights + fixed / tensor), kv_per_token))
    return out


def activation_peak_bytes(arch: ArchitectureSpec, tensor: int, batched_tokens: int, num_seqs: int) -> int:
    """Peak activation memory of vLLM's profiling forward pass on one rank."""
    intermediate = arch.intermediate_size or 4 * arch.hidden_size
    if arch.moe is not None:
        # Routed tokens fan out to experts_per_token expert MLPs.
        intermediate *= arch.moe.experts_per_token
    mlp = batched_tokens * 3 * intermediate // tensor * ACTIVATION_BYTES
    hidden = batched_tokens * 6 * arch.hidden_size * ACTIVATION_BYTES
    logits = num_seqs * (arch.vocab_size or DEFAULT_VOCAB) * 4 * LOGITS_COPIES
    return mlp + hidden + logits


def non_torch_bytes(tensor: int, pipeline: int) -> int:
    if tensor > 1:
        return NON_TORCH_TENSOR_PARALLEL
    return NON_TORCH_SINGLE_GPU if pipeline == 1 else NON_TORCH_PIPELINE_ONLY


def cuda_total_bytes(nvml_total_bytes: int) -> int:
    return nvml_total_bytes - DRIVER_RESERVED_BYTES
