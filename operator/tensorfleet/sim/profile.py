"""Capacity and timing of the simulated engine, derived from the planner.

Capacity comes from `make_plan`, the same sizing the operator puts in
`status.plan`: KV-cache tokens per replica and max-num-seqs. Timing is a
roofline model of one engine step (one forward pass over the whole batch):

    step = overhead + max(bytes read / (bandwidth x BANDWIDTH_EFFICIENCY),
                          FLOPs / (peak x COMPUTE_EFFICIENCY))

  bytes read  the weights of one GPU (every step reads all of them; for MoE
              only the experts the batch routes to), plus the KV cache of
              every decoding sequence's context
  FLOPs       2 x active parameters per token (the matmuls; attention FLOPs
              are left out), for every token in the step: one per decoding
              sequence plus the prefill chunk, divided over tensor ranks

so a small decode batch is memory-bound (time ~ weights / bandwidth and it
grows with context through the KV reads), a large batch or a long prefill is
compute-bound (time ~ tokens). Efficiency fractions are typical of vLLM on
datacenter GPUs: decode kernels reach 70-85% of HBM bandwidth, prefill
reaches 40-60% model FLOPs utilisation; the step overhead is the scheduler,
sampling and kernel launches vLLM v1 spends per step (1-3 ms measured).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from tensorfleet import contract
from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.catalog import find_gpu, find_model
from tensorfleet.planner import make_plan
from tensorfleet.planner.memory import KV_BLOCK_SIZE
from tensorfleet.planner.plan import LARGE_GPU_BATCHED_TOKENS, LARGE_GPU_MAX_SEQS, SMALL_GPU_BATCHED_TOKENS

log = logging.getLogger("tensorfleet.sim")

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_ACCELERATOR = "L4"
DEFAULT_MAX_MODEL_LEN = 8192

BANDWIDTH_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.5
STEP_OVERHEAD_SECONDS = 0.002
# Tensor parallelism adds two all-reduces per layer; NVLink makes that
# roughly a fixed cost per step at serving batch sizes.
TENSOR_PARALLEL_OVERHEAD_SECONDS = 0.0005

# Dense bf16/fp16 tensor-core peak (datasheet, without sparsity), TFLOPS.
# The catalog has no compute figures; only the simulator needs them.
PEAK_TFLOPS: dict[str, float] = {
    "A100-40GB": 312, "A100-80GB": 312, "H100-80GB": 989, "H100-NVL-94GB": 835, "H200-141GB": 989,
    "B200-180GB": 2250, "L40S": 362, "L40": 181, "L4": 121, "A10G": 70, "A10": 125, "T4": 65,
}


@dataclass(frozen=True)
class Profile:
    model: str
    accelerator: str
    tensor: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_tokens: int
    block_size: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    bandwidth_bytes_per_s: float     # effective, after BANDWIDTH_EFFICIENCY
    flops_per_s: float               # effective, after COMPUTE_EFFICIENCY
    flops_per_token_per_gpu: float   # 2 x active parameters / tensor
    active_fraction: float           # active / total parameters (1 for dense models)
    experts_touched_per_token: float  # experts_per_token / experts (MoE), else 1
    overhead_s: float

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size

    def weight_bytes_read(self, batch: int) -> float:
        """Weight bytes one step reads: all of a dense model; for MoE, the
        always-active share plus the experts at least one token routes to."""
        if self.active_fraction >= 1.0:
            return float(self.weight_bytes_per_gpu)
        touched = 1.0 - (1.0 - self.experts_touched_per_token) ** max(batch, 1)
        share = self.active_fraction + (1.0 - self.active_fraction) * touched
        return self.weight_bytes_per_gpu * min(share, 1.0)

    def step_seconds(self, decode_seqs: int, context_tokens: int, prefill_tokens: int) -> float:
        """Simulated duration of one step (see the module docstring)."""
        tokens = decode_seqs + prefill_tokens
        if tokens == 0:
            return 0.0
        read = self.weight_bytes_read(tokens) + context_tokens * self.kv_bytes_per_token_per_gpu
        memory_s = read / self.bandwidth_bytes_per_s
        compute_s = tokens * self.flops_per_token_per_gpu / self.flops_per_s
        return self.overhead_s + max(memory_s, compute_s)

    def describe(self) -> str:
        single = self.step_seconds(1, 512, 0)
        return (f"{self.model} on {self.accelerator} x{self.tensor}: {self.kv_cache_tokens} KV tokens "
                f"({self.num_blocks} blocks of {self.block_size}), max-num-seqs {self.max_num_seqs}, "
                f"decode step {single * 1e3:.1f} ms at batch 1, "
                f"prefill {self.flops_per_token_per_gpu / self.flops_per_s * 1e6:.0f} us/token")


def make_profile(model: str | None = None, accelerator: str | None = None, *, tensor: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 kv_cache_tokens: int | None = None, max_num_batched_tokens: int | None = None) -> Profile:
    """A profile for MODEL on ACCELERATOR, sized by the planner.

    Raises SpecError (naming the flag's field) when the planner refuses the
    combination, e.g. a model that does not fit the GPU.
    """
    model = model or DEFAULT_MODEL
    accelerator = accelerator or DEFAULT_ACCELERATOR
    spec: dict[str, object] = {"model": {"name": model}, "accelerator": {"type": accelerator}}
    entry, _ = find_model(model)
    if entry is None:
        raise SpecError("--model", f"{model!r} is not in the catalog; use one `tensorfleet catalog` lists")
    limit = entry.arch.max_context_length
    spec["model"] = {"name": model, "maxModelLen": max_model_len or min(DEFAULT_MAX_MODEL_LEN, limit or DEFAULT_MAX_MODEL_LEN)}
    if tensor:
        spec["parallelism"] = {"tensor": tensor, "pipeline": 1}
    if max_num_seqs:
        spec["engine"] = {"maxNumSeqs": max_num_seqs}
    document = {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "sim"}, "spec": spec}
    plan = make_plan(load_inference_service(document).spec)
    gpu = find_gpu(plan.accelerator)
    assert gpu is not None  # the planner resolved it
    arch = entry.arch
    active = arch.parameters
    touched = 1.0
    if arch.moe is not None:
        active = arch.moe.active_parameters or arch.parameters * arch.moe.experts_per_token // arch.moe.experts
        touched = arch.moe.experts_per_token / arch.moe.experts
    # vLLM's default chunked-prefill budget follows the same large-GPU rule as max-num-seqs.
    batched = LARGE_GPU_BATCHED_TOKENS if plan.max_num_seqs >= LARGE_GPU_MAX_SEQS else SMALL_GPU_BATCHED_TOKENS
    overhead = STEP_OVERHEAD_SECONDS + (TENSOR_PARALLEL_OVERHEAD_SECONDS if plan.tensor > 1 else 0.0)
    kv_tokens = kv_cache_tokens if kv_cache_tokens is not None else plan.kv_cache_tokens
    if kv_tokens < plan.max_model_len:
        # vLLM refuses to start here; the simulator serves shorter requests
        # instead, so tests can run it with a tiny cache.
        log.warning("KV cache of %d tokens is smaller than max-model-len %d; serving at most %d tokens per request",
                    kv_tokens, plan.max_model_len, kv_tokens)
    return Profile(
        model=model,
        accelerator=plan.accelerator,
        tensor=plan.tensor,
        max_model_len=min(plan.max_model_len, kv_tokens),
        max_num_seqs=plan.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max(batched, plan.max_num_seqs),
        kv_cache_tokens=kv_tokens,
        block_size=KV_BLOCK_SIZE,
        weight_bytes_per_gpu=plan.weight_bytes_per_gpu,
        kv_bytes_per_token_per_gpu=plan.kv_bytes_per_token_per_gpu,
        bandwidth_bytes_per_s=gpu.bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY,
        flops_per_s=PEAK_TFLOPS.get(gpu.name, 100.0) * 1e12 * COMPUTE_EFFICIENCY,
        flops_per_token_per_gpu=2.0 * active / plan.tensor,
        active_fraction=min(active / arch.parameters, 1.0),
        experts_touched_per_token=touched,
        overhead_s=overhead,
    )


def resilient_profile(model: str | None, accelerator: str | None, **options: int | None) -> Profile:
    """make_profile, falling back to the default model's (then GPU's) timing
    when the planner cannot size MODEL on ACCELERATOR.

    A simulator pod must start whatever the InferenceService names: a model
    outside the catalog (sized from spec.model.architecture) or a layout the
    planner would refuse still gets an engine, with a warning that its timing
    is borrowed. Capacity overrides (--kv-cache-tokens, ...) still apply.
    """
    attempts = [(model, accelerator, options)]
    attempts.append((DEFAULT_MODEL, accelerator, {**options, "tensor": None}))
    attempts.append((DEFAULT_MODEL, DEFAULT_ACCELERATOR, {**options, "tensor": None, "max_model_len": None}))
    first_error: SpecError | None = None
    for name, gpu, opts in attempts:
        try:
            profile = make_profile(name, gpu, **opts)
        except SpecError as exc:
            first_error = first_error or exc
            continue
        if first_error is not None:
            log.warning("cannot size %s on %s (%s); simulating with the timing of %s on %s",
                        model or DEFAULT_MODEL, accelerator or DEFAULT_ACCELERATOR, first_error,
                        profile.model, profile.accelerator)
            profile = replace(profile, model=model or profile.model)
        return profile
    assert first_error is not None
    raise first_error

