"""Capacity and timing of the simulated engine: the capacity it is handed (vLLM's defaults for what is not), and the
time of one step, from the catalog's roofline or from a StepModel fitted to a real engine (a calibrated profile).
Design: docs/simulator.md#timing-a-step."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from tensorfleet import vllm_defaults
from tensorfleet.api import SpecError
from tensorfleet.api.architecture import ArchitectureSpec
from tensorfleet.catalog import find_gpu, find_model, gpu_names, sizes
from tensorfleet.catalog.facts import DEFAULT_VOCAB
from tensorfleet.catalog.roofline import (
    BANDWIDTH_EFFICIENCY,
    COMPUTE_EFFICIENCY,
    PEAK_TFLOPS,
    STEP_OVERHEAD_SECONDS,
    TENSOR_PARALLEL_OVERHEAD_SECONDS,
)

log = logging.getLogger("tensorfleet.sim")

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_ACCELERATOR = "L4"
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_KV_CACHE_TOKENS = 32768

# The KV-cache dtype the timing assumes: the model's own (vLLM's `auto`).
KV_CACHE_DTYPE = "auto"


@dataclass(frozen=True)
class StepModel:
    """A step time fitted to a real engine (the fit is sim/calibrate.py's): overhead + per decoding sequence + per
    prefill token + per context token of the decoding sequences, and the latency a request spends outside the
    engine loop before its first step (vLLM's API server: HTTP, tokenization, the hop to the engine core and back),
    slower while the engine is busy where the API server shares the host's CPU with the engine core."""

    overhead_s: float          # per step, whatever it holds
    per_decode_seq_s: float    # per decoding sequence in the step
    per_prefill_token_s: float  # per prompt token computed in the step
    per_context_token_s: float  # per token of context the decoding sequences attend over
    first_token_s: float = 0.0  # a request's latency outside the engine loop (before its first step), engine idle
    first_token_busy_s: float | None = None  # the same while the engine runs other requests (None: first_token_s)

    def first_token_delay(self, busy: bool) -> float:
        """The latency before a request's first step; BUSY: the engine is running other requests."""
        return self.first_token_busy_s if busy and self.first_token_busy_s is not None else self.first_token_s

    def step_seconds(self, decode_seqs: int, context_tokens: int, prefill_tokens: int) -> float:
        if decode_seqs + prefill_tokens == 0:
            return 0.0
        return (self.overhead_s + self.per_decode_seq_s * decode_seqs + self.per_prefill_token_s * prefill_tokens
                + self.per_context_token_s * context_tokens)

    def describe(self) -> str:
        return (f"step = {self.overhead_s * 1e3:.3f} ms + {self.per_decode_seq_s * 1e3:.4f} ms x decode seqs + "
                f"{self.per_prefill_token_s * 1e6:.3f} us x prefill tokens + "
                f"{self.per_context_token_s * 1e9:.3f} ns x context tokens; first token +{self.first_token_s * 1e3:.2f} ms"
                + ("" if self.first_token_busy_s is None else f" (+{self.first_token_busy_s * 1e3:.2f} ms when busy)"))


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
    fitted: StepModel | None = None  # a calibrated step time, instead of the roofline
    source: str = ""                 # where a calibrated profile came from (the engine it measured)
    vocab_size: int = DEFAULT_VOCAB  # the model's (the catalog's vocabSize): what the simulator's token ids range over

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
        """Simulated duration of one step: the fitted model's, else the roofline's, overhead + max(bytes read /
        effective bandwidth, FLOPs / effective peak), the bytes being this GPU's weights (for MoE, the experts the
        batch routes to) and the decoding sequences' KV, the FLOPs 2 x active parameters per token over the tensor
        ranks (attention FLOPs left out)."""
        if self.fitted is not None:
            return self.fitted.step_seconds(decode_seqs, context_tokens, prefill_tokens)
        tokens = decode_seqs + prefill_tokens
        if tokens == 0:
            return 0.0
        read = self.weight_bytes_read(tokens) + context_tokens * self.kv_bytes_per_token_per_gpu
        memory_s = read / self.bandwidth_bytes_per_s
        compute_s = tokens * self.flops_per_token_per_gpu / self.flops_per_s
        return self.overhead_s + max(memory_s, compute_s)

    def describe(self) -> str:
        single = self.step_seconds(1, 512, 0)
        if self.fitted is not None:
            return (f"calibrated against {self.source or 'an engine'}: {self.kv_cache_tokens} KV tokens "
                    f"({self.num_blocks} blocks of {self.block_size}), max-model-len {self.max_model_len}, "
                    f"max-num-seqs {self.max_num_seqs}, max-num-batched-tokens {self.max_num_batched_tokens}, "
                    f"decode step {single * 1e3:.2f} ms at batch 1 ({self.fitted.describe()})")
        return (f"{self.model} on {self.accelerator} x{self.tensor}: {self.kv_cache_tokens} KV tokens "
                f"({self.num_blocks} blocks of {self.block_size}), max-num-seqs {self.max_num_seqs}, "
                f"decode step {single * 1e3:.1f} ms at batch 1, "
                f"prefill {self.flops_per_token_per_gpu / self.flops_per_s * 1e6:.0f} us/token")


def make_profile(model: str | None = None, accelerator: str | None = None, *, tensor: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 kv_cache_tokens: int | None = None, max_num_batched_tokens: int | None = None,
                 block_size: int | None = None) -> Profile:
    """A profile for MODEL on ACCELERATOR x TENSOR with the capacity it is handed, vLLM's defaults
    (tensorfleet.vllm_defaults) for what is not, except DEFAULT_MAX_MODEL_LEN (or the model's context when shorter)
    and DEFAULT_KV_CACHE_TOKENS, about what the planner gives Llama 3.1 8B on one L4 at maxModelLen 8192.

    Raises SpecError (naming the flag) when the catalog does not know the
    model or the GPU, whose facts the timing needs.
    """
    model = model or DEFAULT_MODEL
    accelerator = accelerator or DEFAULT_ACCELERATOR
    entry, implied_format = find_model(model)
    if entry is None:
        raise SpecError("--model", f"{model!r} is not in the catalog; use one `tensorfleet catalog` lists")
    gpu = find_gpu(accelerator)
    if gpu is None:
        raise SpecError("--accelerator", f"unknown GPU type {accelerator!r}; known types: {', '.join(gpu_names())}")
    arch = entry.arch
    tensor = tensor or vllm_defaults.TENSOR_PARALLEL_SIZE
    max_model_len = max_model_len or min(DEFAULT_MAX_MODEL_LEN, arch.max_context_length or DEFAULT_MAX_MODEL_LEN)
    batch = vllm_defaults.batch_defaults(gpu_memory_mib=gpu.memory_mib, gpu_name=gpu.name)
    max_num_seqs = max_num_seqs or batch.max_num_seqs
    kv_tokens = kv_cache_tokens if kv_cache_tokens is not None else DEFAULT_KV_CACHE_TOKENS
    if kv_tokens < max_model_len:
        # vLLM refuses to start here; the simulator serves shorter requests
        # instead, so tests can run it with a tiny cache.
        log.warning("KV cache of %d tokens is smaller than max-model-len %d; serving at most %d tokens per request",
                    kv_tokens, max_model_len, kv_tokens)
    weight_format = implied_format or arch.weight_format
    kv_per_layer = sizes.kv_bytes_per_token_layer(arch, tensor, sizes.kv_element_bytes(KV_CACHE_DTYPE))
    active = arch.parameters
    touched = 1.0
    if arch.moe is not None:
        active = arch.moe.active_parameters or arch.parameters * arch.moe.experts_per_token // arch.moe.experts
        touched = arch.moe.experts_per_token / arch.moe.experts
    overhead = STEP_OVERHEAD_SECONDS + (TENSOR_PARALLEL_OVERHEAD_SECONDS if tensor > 1 else 0.0)
    return Profile(
        model=model,
        accelerator=gpu.name,
        tensor=tensor,
        max_model_len=min(max_model_len, kv_tokens),
        max_num_seqs=max_num_seqs,
        # A step holds at least one token of every sequence it may run.
        max_num_batched_tokens=max_num_batched_tokens or max(batch.max_num_batched_tokens, max_num_seqs),
        kv_cache_tokens=kv_tokens,
        block_size=block_size or vllm_defaults.BLOCK_SIZE,
        weight_bytes_per_gpu=math.ceil(sizes.total_weight_bytes(arch, weight_format) / tensor),
        kv_bytes_per_token_per_gpu=math.ceil(read_layers(arch, max_model_len) * kv_per_layer),
        bandwidth_bytes_per_s=gpu.bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY,
        flops_per_s=PEAK_TFLOPS.get(gpu.name, 100.0) * 1e12 * COMPUTE_EFFICIENCY,
        flops_per_token_per_gpu=2.0 * active / tensor,
        active_fraction=min(active / arch.parameters, 1.0),
        experts_touched_per_token=touched,
        overhead_s=overhead,
        vocab_size=arch.vocab_size or DEFAULT_VOCAB,
    )


def read_layers(arch: ArchitectureSpec, max_model_len: int) -> float:
    """Layers whose KV a decode step reads per context token, as full-attention equivalents: a sliding-window or
    chunked layer reads at most its window, spread here over a full-length context (the step's timing, not the
    pool's size, which comes from the plan). A hybrid model's state layers (Mamba, linear attention) keep a fixed
    state per sequence, no KV per token: only its attention layers count."""
    layers = float(arch.attention_layer_count)
    for span, count in ((arch.sliding_window, arch.sliding_window_layers),
                        (arch.attention_chunk_size, arch.chunked_attention_layers)):
        if span:
            local = count if count is not None else arch.layers
            layers -= local * (1.0 - min(1.0, span / max_model_len))
    return layers


def resilient_profile(model: str | None, accelerator: str | None, **capacity: int | None) -> Profile:
    """make_profile, borrowing the default model's (then the default GPU's)
    timing when the catalog does not know MODEL (or ACCELERATOR).

    A simulator pod must start whatever the InferenceService names: a model
    outside the catalog (which the operator sized from spec.model.architecture)
    still gets an engine, with a warning that its timing is borrowed. The
    capacity it is handed applies all the same.
    """
    attempts = [(model, accelerator), (DEFAULT_MODEL, accelerator), (DEFAULT_MODEL, DEFAULT_ACCELERATOR)]
    first_error: SpecError | None = None
    for name, gpu in attempts:
        try:
            profile = make_profile(name, gpu, **capacity)
        except SpecError as exc:
            first_error = first_error or exc
            continue
        if first_error is not None:
            log.warning("no timing facts for %s on %s (%s); simulating with the timing of %s on %s",
                        model or DEFAULT_MODEL, accelerator or DEFAULT_ACCELERATOR, first_error,
                        profile.model, profile.accelerator)
            profile = replace(profile, model=model or profile.model)
        return profile
    assert first_error is not None
    raise first_error
