"""vLLM's own defaults, stated once: what `vllm serve` uses for a setting nobody passes.

The planner sizes memory with them, the API documents and applies them as
InferenceService defaults, and the simulator falls back to them when it is run
without the operator's figures. Figures are those of the vLLM release the default
engine image pins (`contract.VLLM_IMAGE`, vllm/vllm-openai v0.19.1; also
worker-image/Dockerfile's VLLM_VERSION), for the OpenAI server
(`UsageContext.OPENAI_API_SERVER`) on CUDA:

  GPU_MEMORY_UTILIZATION   `--gpu-memory-utilization`, CacheConfig's default
  BLOCK_SIZE               `--block-size`: tokens per KV-cache block; the CUDA
                           platform sets 16 when it is not given
                           (vllm/platforms/cuda.py, check_and_update_config)
  TENSOR_PARALLEL_SIZE,    `--tensor-parallel-size`, `--pipeline-parallel-size`:
  PIPELINE_PARALLEL_SIZE   one GPU, one stage (ParallelConfig)
  MAX_NUM_SEQS,            `--max-num-seqs`, `--max-num-batched-tokens` (the
  MAX_NUM_BATCHED_TOKENS   chunked-prefill token budget of one step): 256 and
                           2048, raised to 1024 and 8192 on GPUs with 70 GiB or
                           more whose name does not contain "a100" (vLLM measured
                           the larger budget lowering A100 throughput); see
                           vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults

On vLLM's CPU backend (accelerator CPU; vllm/platforms/cpu.py and the same
get_batch_defaults):

  CPU_BLOCK_SIZE           the CPU platform sets 128 when --block-size is not given
  CPU_MAX_NUM_SEQS,        128 and 2048 per CPU worker, times the workers (tensor x pipeline)
  CPU_MAX_NUM_BATCHED_TOKENS

Imports nothing from Tensorfleet: every layer, the worker included, may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

GPU_MEMORY_UTILIZATION: Final = 0.9
BLOCK_SIZE: Final = 16
TENSOR_PARALLEL_SIZE: Final = 1
PIPELINE_PARALLEL_SIZE: Final = 1

MAX_NUM_SEQS: Final = 256
MAX_NUM_BATCHED_TOKENS: Final = 2048
LARGE_GPU_MAX_NUM_SEQS: Final = 1024
LARGE_GPU_MAX_NUM_BATCHED_TOKENS: Final = 8192
# vLLM compares the device's total memory with 70 GiB; NVML's figure (the
# catalog's) is 0.5 GiB above it, which moves no catalog GPU across the line.
LARGE_GPU_MIN_MIB: Final = 70 * 1024
LARGE_GPU_EXCLUDED_NAME: Final = "a100"

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
