"""vLLM's own defaults, stated once: what `vllm serve` uses for a setting nobody passes, as of the release the
default engine image pins (`contract.VLLM_IMAGE`, v0.19.1), on CUDA and on the CPU backend. The planner sizes with
them, the API applies them as defaults and the simulator falls back to them; imports nothing from Tensorfleet.
Design: docs/real-engine.md#what-is-checked-against-it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# For the OpenAI server (UsageContext.OPENAI_API_SERVER) on CUDA.
GPU_MEMORY_UTILIZATION: Final = 0.9      # --gpu-memory-utilization, CacheConfig's default
BLOCK_SIZE: Final = 16                   # --block-size: the CUDA platform's when not given (check_and_update_config)
TENSOR_PARALLEL_SIZE: Final = 1          # --tensor-parallel-size and --pipeline-parallel-size: one GPU, one stage
PIPELINE_PARALLEL_SIZE: Final = 1        # (ParallelConfig)

# --max-num-seqs and --max-num-batched-tokens (the chunked-prefill token budget of one step), raised on GPUs of 70 GiB
# or more whose name does not contain "a100": vLLM measured the larger budget lowering A100 throughput
# (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults).
MAX_NUM_SEQS: Final = 256
MAX_NUM_BATCHED_TOKENS: Final = 2048
LARGE_GPU_MAX_NUM_SEQS: Final = 1024
LARGE_GPU_MAX_NUM_BATCHED_TOKENS: Final = 8192
# vLLM compares the device's total memory with 70 GiB; NVML's figure (the
# catalog's) is 0.5 GiB above it, which moves no catalog GPU across the line.
LARGE_GPU_MIN_MIB: Final = 70 * 1024
LARGE_GPU_EXCLUDED_NAME: Final = "a100"

# vLLM's CPU backend (accelerator CPU; vllm/platforms/cpu.py and the same get_batch_defaults): the block size its
# platform sets when --block-size is not given, and the batch limits per CPU worker (cpu_batch_defaults).
CPU_BLOCK_SIZE: Final = 128
CPU_MAX_NUM_SEQS: Final = 128
CPU_MAX_NUM_BATCHED_TOKENS: Final = 2048


@dataclass(frozen=True)
class BatchDefaults:
    """vLLM's batch limits for one GPU type."""

    max_num_seqs: int
    max_num_batched_tokens: int


def cpu_batch_defaults(world_size: int = 1) -> BatchDefaults:
    """`--max-num-seqs` and `--max-num-batched-tokens` as vLLM defaults them on its CPU backend with WORLD_SIZE
    workers (EngineArgs.get_batch_defaults scales both by it there)."""
    return BatchDefaults(CPU_MAX_NUM_SEQS * world_size, CPU_MAX_NUM_BATCHED_TOKENS * world_size)


def batch_defaults(*, gpu_memory_mib: int, gpu_name: str) -> BatchDefaults:
    """`--max-num-seqs` and `--max-num-batched-tokens` as vLLM defaults them on this GPU."""
    if gpu_memory_mib >= LARGE_GPU_MIN_MIB and LARGE_GPU_EXCLUDED_NAME not in gpu_name.lower():
        return BatchDefaults(LARGE_GPU_MAX_NUM_SEQS, LARGE_GPU_MAX_NUM_BATCHED_TOKENS)
    return BatchDefaults(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
