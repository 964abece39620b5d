"""Byte arithmetic for one GPU of a vLLM replica, as vLLM's start-up profiling finds it: the budget (GPU memory x
gpu_memory_utilization) less the weights on the GPU (per pipeline stage, as vLLM splits the layers), the profiling
pass's activation peak and non-torch memory; on vLLM's CPU backend the container's memory request less vLLM's own
processes, in whole GiB. Pure functions, no policy. Design: docs/planner.md#free-bytes-per-gpu-plannermemorypy."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tensorfleet.api.architecture import ArchitectureSpec
from tensorfleet.catalog.facts import EMBEDDING_BITS, ModelFacts, from_architecture
from tensorfleet.catalog.sizes import DEFAULT_VOCAB, kv_bytes_per_token_layer
from tensorfleet.planner.kvcache import model_layers

GiB = 1024**3
MiB = 1024**2

# The CUDA total vLLM starts from is NVML's total less what the driver keeps:
# an H100 reporting 81559 MiB in nvidia-smi shows total_memory=79.19GiB in
# vLLM's log, an A100-40GB 40960 MiB shows 39.50GiB.
DRIVER_RESERVED_BYTES = 512 * MiB
# Measured "non-torch forward increase" in vLLM 0.19 logs on H100: 0.25-0.27 GiB
# on one GPU; 2.07-2.21 GiB per GPU once tensor parallelism brings NCCL and the
# custom all-reduce buffers; under 0.1 GiB for pipeline-only layouts. Without
# custom all-reduce (PCIe cards without peer-to-peer access, or
# --disable-custom-all-reduce) NCCL alone: about 1.4 GiB less (Qwen2-7B at tensor 2
# on A100s that log "Custom allreduce is disabled", tests/data/published_vllm_logs.yaml).
NON_TORCH_SINGLE_GPU = int(0.27 * GiB)
NON_TORCH_TENSOR_PARALLEL = int(2.1 * GiB)
NON_TORCH_NCCL_ONLY = int(0.7 * GiB)
NON_TORCH_PIPELINE_ONLY = int(0.1 * GiB)
# The tensor sizes vLLM's custom all-reduce supports (vllm/distributed/device_communicators/custom_all_reduce.py).
CUSTOM_ALL_REDUCE_SIZES = (2, 4, 6, 8)
# vLLM's own processes on its CPU backend, beside the weights, activations and KV cache: measured 1.9 GiB
# resident (API server 0.9 GiB, engine core 1.0 GiB besides a 1 GiB KV cache and 3 MiB of weights) with
# vLLM 0.19.1's CPU build serving a tiny Llama (tensorfleet.testing.tinymodel); 3 GiB leaves room for a
# real model's tokenizer and torch.compile's working memory.
CPU_RUNTIME_BYTES = 3 * GiB
# With tensor parallel on CPU the engine core starts one worker process per rank: measured 0.9 GiB resident
# each beside its KV cache (tensor 2: API server 0.87, engine core 0.85, two workers 1.9 GiB each with 1 GiB
# of KV cache).
CPU_WORKER_BYTES = 1 * GiB


def cpu_runtime_bytes(tensor: int) -> int:
    """vLLM's own processes on its CPU backend with TENSOR worker processes (one runs inside the engine core)."""
    return CPU_RUNTIME_BYTES + (tensor - 1) * CPU_WORKER_BYTES
# fp32 logits plus the sampler's working copy during profiling.
LOGITS_COPIES = 2
ACTIVATION_BYTES = 2


@dataclass(frozen=True)
class Stage:
    layers: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int    # every attention layer of the stage as full attention (what vLLM's logged pool counts)
    first: int = 0                     # the index of its first layer
    kv_bytes_per_token_layer: int = 0  # one layer's, on one GPU

    @property
    def layer_indices(self) -> range:
        return range(self.first, self.first + self.layers)


def stage_layers(layers: int, pipeline: int) -> list[int]:
    """Layers per pipeline stage, as vLLM's get_pp_indices partitions them: an even share each, the remainder to
    the stages before the last."""
    share, remainder = divmod(layers, pipeline)
    parts = [share] * pipeline
    # vLLM gives the extra layers to the stages before the last one.
    for i in range(2, remainder + 2):
        parts[-i % pipeline] += 1
    return parts


def stages(arch: ArchitectureSpec, weight_format: str, tensor: int, pipeline: int, kv_element_bytes: int
           ) -> list[Stage]:
    """Stages of a model known by its totals (catalog, spec.model.architecture) in WEIGHT_FORMAT."""
    facts = from_architecture("", arch, weight_format, "catalog")
    return facts_stages(facts, tensor, pipeline, kv_element_bytes)


def facts_stages(facts: ModelFacts, tensor: int, pipeline: int, kv_element_bytes: int, bits: float | None = None
                 ) -> list[Stage]:
    """Weights and KV bytes per token on one GPU of each pipeline stage.

    The first stage also holds the input embedding and any vision encoder, the
    last the final norm and the output head (vLLM gives the last stage its own
    copy of a tied head when pipeline > 1). BITS re-quantizes every linear weight
    (fp8 at load time); otherwise each layer counts as its checkpoint stores it.
    """
    arch = facts.arch
    per_layer_kv = kv_bytes_per_token_layer(arch, tensor, kv_element_bytes)
    # A hybrid model's state layers (and layers without a cache) hold no KV per token.
    attending = [spec.attends for spec in model_layers(arch)]
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
        out.append(Stage(count, math.ceil(weights + fixed / tensor), sum(attending[first - count:first]) * per_layer_kv,
                         first - count, per_layer_kv))
    return out


def activation_peak_bytes(arch: ArchitectureSpec, tensor: int, batched_tokens: int, num_seqs: int) -> int:
    """Peak activation memory of vLLM's profiling forward pass (BATCHED_TOKENS tokens) on one rank: the MLP's
    gate, up and activation buffers on this rank, a few hidden-size buffers, and fp32 logits for NUM_SEQS sampled
    rows with the sampler's working copy. Calibrated against the logs in tests/test_planner_published.py."""
    intermediate = arch.intermediate_size or 4 * arch.hidden_size
    if arch.moe is not None:
        # Routed tokens fan out to experts_per_token expert MLPs.
        intermediate *= arch.moe.experts_per_token
    mlp = batched_tokens * 3 * intermediate // tensor * ACTIVATION_BYTES
    hidden = batched_tokens * 6 * arch.hidden_size * ACTIVATION_BYTES
    logits = num_seqs * (arch.vocab_size or DEFAULT_VOCAB) * 4 * LOGITS_COPIES
    return mlp + hidden + logits


def custom_all_reduce(tensor: int, nvlink: bool, disabled: bool) -> bool:
    """Whether vLLM's custom all-reduce runs: tensor parallel over NVLink-joined GPUs, at a size it supports, and
    not turned off (--disable-custom-all-reduce)."""
    return tensor in CUSTOM_ALL_REDUCE_SIZES and nvlink and not disabled


def non_torch_bytes(tensor: int, pipeline: int, all_reduce: bool = True) -> int:
    """Memory vLLM's profiler finds beside torch's: CUDA context, NCCL, and custom all-reduce buffers where
    ALL_REDUCE (custom_all_reduce) says they run."""
    if tensor > 1:
        return NON_TORCH_TENSOR_PARALLEL if all_reduce else NON_TORCH_NCCL_ONLY
    return NON_TORCH_SINGLE_GPU if pipeline == 1 else NON_TORCH_PIPELINE_ONLY


def cuda_total_bytes(nvml_total_bytes: int) -> int:
    return nvml_total_bytes - DRIVER_RESERVED_BYTES
