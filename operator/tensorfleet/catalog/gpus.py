"""NVIDIA GPU types: memory, bandwidth, and the node labels that identify them.

`memory_mib` is the total device memory NVML reports (what `nvidia-smi` shows
and what vLLM's profiler starts from), not the marketing figure: an
"80GB" H100 reports 81559 MiB. Bandwidth is the datasheet peak in GB/s.

GPU feature discovery labels a node `nvidia.com/gpu.product=<NVML device name
with spaces replaced by '-'>`, e.g. `NVIDIA-H100-80GB-HBM3`. GFD releases before
the NVML name change dropped the `NVIDIA-` prefix (`A100-SXM4-80GB`), and clusters
built then still carry those labels, so both forms are matched. Time-sliced
GPUs (`...-SHARED`) are deliberately not matched: tensor parallelism over a
shared GPU is not a serving layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GPUType:
    name: str                      # the value users write in spec.accelerator.type
    memory_mib: int                # per GPU, as NVML reports it
    bandwidth_gbps: int            # HBM/GDDR peak, GB/s (SXM variant where several)
    nvml_names: tuple[str, ...]    # NVML device names of every variant (SXM, PCIe, NVL)
    gpus_per_node: int = 8         # the usual largest node of this type
    bf16: bool = True              # native bfloat16 (compute capability >= 8.0)
    fp8: bool = False              # native fp8 tensor cores (compute capability >= 8.9)
    aliases: tuple[str, ...] = field(default=())

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 1024 * 1024

    @property
    def product_labels(self) -> tuple[str, ...]:
        """Every `nvidia.com/gpu.product` value GFD may report for this type."""
        labels: list[str] = []
        for nvml in self.nvml_names:
            current = nvml.replace(" ", "-")
            labels.append(current)
            legacy = current.removeprefix("NVIDIA-")
            if legacy != current:
                labels.append(legacy)
        return tuple(dict.fromkeys(labels))


GPUS: tuple[GPUType, ...] = (
    GPUType("A100-40GB", 40960, 1555, ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), aliases=("A100",)),
    GPUType("A100-80GB", 81920, 2039, ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe")),
    GPUType("H100-80GB", 81559, 3350, ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"), fp8=True, aliases=("H100",)),
    GPUType("H100-NVL-94GB", 95830, 3900, ("NVIDIA H100 NVL",), fp8=True, aliases=("H100-NVL",)),
    GPUType("H200-141GB", 143771, 4800, ("NVIDIA H200", "NVIDIA H200 NVL"), fp8=True, aliases=("H200",)),
    GPUType("B200-180GB", 183359, 8000, ("NVIDIA B200",), fp8=True, aliases=("B200",)),
    GPUType("L40S", 46068, 864, ("NVIDIA L40S",), fp8=True),
    GPUType("L40", 46068, 864, ("NVIDIA L40",), fp8=True),
    GPUType("L4", 23034, 300, ("NVIDIA L4",), fp8=True),
    GPUType("A10G", 23028, 600, ("NVIDIA A10G",)),
    GPUType("A10", 23028, 600, ("NVIDIA A10",), gpus_per_node=4),
    GPUType("T4", 15360, 320, ("Tesla T4",), bf16=False, gpus_per_node=4),
)


def _key(name: str) -> str:
    return name.strip().upper().replace("_", "-").replace(" ", "-")


_BY_NAME: dict[str, GPUType] = {}
for _gpu in GPUS:
    for _name in (_gpu.name, *_gpu.aliases):
        _BY_NAME[_key(_name)] = _gpu


def find_gpu(name: str) -> GPUType | None:
    """The catalog entry for a spec.accelerator.type value (case-insensitive), or None."""
    return _BY_NAME.get(_key(name))


def gpu_names() -> list[str]:
    return [gpu.name for gpu in GPUS]
