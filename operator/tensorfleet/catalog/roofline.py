"""The roofline figures of one engine step, shared by the simulator's timing (sim/profile.py) and the planner's sizing
for latency targets (planner/sizing.py), so that both answer with one model: step = overhead + max(bytes read /
(bandwidth x BANDWIDTH_EFFICIENCY), FLOPs / (peak x COMPUTE_EFFICIENCY)). Design: docs/simulator.md#timing-a-step."""

from __future__ import annotations

# Typical of vLLM on datacenter GPUs: decode kernels reach 70-85% of HBM bandwidth, prefill 40-60% model FLOPs
# utilisation; the overhead is the scheduler, sampling and kernel launches vLLM v1 spends per step (1-3 ms measured).
BANDWIDTH_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.5
STEP_OVERHEAD_SECONDS = 0.002
# Tensor parallelism adds two all-reduces per layer; NVLink makes that
# roughly a fixed cost per step at serving batch sizes.
TENSOR_PARALLEL_OVERHEAD_SECONDS = 0.0005

# Dense bf16/fp16 tensor-core peak (datasheet, without sparsity), TFLOPS.
# The GPU catalog (gpus.py) has no compute figures; only step timing needs them.
PEAK_TFLOPS: dict[str, float] = {
    "A100-40GB": 312, "A100-80GB": 312, "H100-80GB": 989, "H100-NVL-94GB": 835, "H200-141GB": 989,
    "B200-180GB": 2250, "L40S": 362, "L40": 181, "L4": 121, "A10G": 70, "A10": 125, "T4": 65,
}
# The peak assumed for a GPU PEAK_TFLOPS does not list.
DEFAULT_PEAK_TFLOPS = 100.0
