"""NVIDIA GPU types: memory (NVML's total), bandwidth, and how to find their nodes: the GFD product label in both
its forms, each managed cloud's own labels (one nodeSelectorTerm each) and, under DRA, a CEL selector on the
driver's attributes; plus `CPU`, vLLM's CPU backend, which is not a GPU type. A leaf module: it imports only the
contract. Design: docs/architecture.md#gpu-types-and-the-nodes-that-have-them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tensorfleet import contract


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
    gke_accelerators: tuple[str, ...] = field(default=())      # cloud.google.com/gke-accelerator values
    karpenter_gpu: tuple[str, int | None] | None = None         # (instance-gpu-name, instance-gpu-memory or None)
    azure_vm_sizes: tuple[str, ...] = field(default=())         # node.kubernetes.io/instance-type values on AKS
    # GPUs of a node all joined by NVLink (the SXM boards): vLLM's custom all-reduce runs under tensor parallelism.
    # PCIe cards without peer-to-peer access leave it to NCCL (vLLM logs "Custom allreduce is disabled").
    nvlink: bool = False

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

    def node_selector_terms(self) -> list[dict[str, Any]]:
        """One nodeSelectorTerm per labelling that identifies this GPU: GFD's, GKE's, Karpenter's, AKS's VM size."""
        terms = [_term((contract.GPU_PRODUCT_LABEL, self.product_labels))]
        if self.gke_accelerators:
            terms.append(_term((contract.GKE_ACCELERATOR_LABEL, self.gke_accelerators)))
        if self.karpenter_gpu is not None:
            name, memory = self.karpenter_gpu
            expressions: list[tuple[str, tuple[str, ...]]] = [(contract.KARPENTER_GPU_NAME_LABEL, (name,))]
            if memory is not None:
                expressions.append((contract.KARPENTER_GPU_MEMORY_LABEL, (str(memory),)))
            terms.append(_term(*expressions))
        if self.azure_vm_sizes:
            terms.append(_term((contract.INSTANCE_TYPE_LABEL, self.azure_vm_sizes)))
        return terms

    def dra_selector(self) -> str:
        """CEL for a DRA device request: a GPU of this type (any variant's NVML name) with at least the memory the
        plan assumed (the driver's `memory` capacity is NVML's total, as `memory_mib` is)."""
        domain = contract.NVIDIA_DRA_DRIVER
        names = ", ".join(f"'{name}'" for name in self.nvml_names)
        return (f"device.driver == '{domain}' && device.attributes['{domain}'].productName in [{names}] && "
                f"device.capacity['{domain}'].memory.compareTo(quantity('{self.memory_mib}Mi')) >= 0")


def _term(*expressions: tuple[str, tuple[str, ...]]) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": "In", "values": list(values)} for key, values in expressions]}


GPUS: tuple[GPUType, ...] = (
    GPUType("A100-40GB", 40960, 1555, ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), aliases=("A100",), nvlink=True,
            gke_accelerators=("nvidia-tesla-a100",), karpenter_gpu=("a100", 40960),
            azure_vm_sizes=("Standard_ND96asr_v4",)),
    GPUType("A100-80GB", 81920, 2039, ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), nvlink=True,
            gke_accelerators=("nvidia-a100-80gb",), karpenter_gpu=("a100", 81920),
            azure_vm_sizes=("Standard_NC24ads_A100_v4", "Standard_NC48ads_A100_v4", "Standard_NC96ads_A100_v4",
                            "Standard_ND96amsr_A100_v4")),
    GPUType("H100-80GB", 81559, 3350, ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"), fp8=True, aliases=("H100",),
            nvlink=True,
            gke_accelerators=("nvidia-h100-80gb", "nvidia-h100-mega-80gb"), karpenter_gpu=("h100", None),
            azure_vm_sizes=("Standard_ND96isr_H100_v5",)),
    GPUType("H100-NVL-94GB", 95830, 3900, ("NVIDIA H100 NVL",), fp8=True, aliases=("H100-NVL",),
            azure_vm_sizes=("Standard_NC40ads_H100_v5", "Standard_NC80adis_H100_v5")),
    GPUType("H200-141GB", 143771, 4800, ("NVIDIA H200", "NVIDIA H200 NVL"), fp8=True, aliases=("H200",), nvlink=True,
            gke_accelerators=("nvidia-h200-141gb",), karpenter_gpu=("h200", None),
            azure_vm_sizes=("Standard_ND96isr_H200_v5",)),
    GPUType("B200-180GB", 183359, 8000, ("NVIDIA B200",), fp8=True, aliases=("B200",), nvlink=True,
            gke_accelerators=("nvidia-b200",), karpenter_gpu=("b200", None)),
    GPUType("L40S", 46068, 864, ("NVIDIA L40S",), fp8=True, karpenter_gpu=("l40s", None)),
    GPUType("L40", 46068, 864, ("NVIDIA L40",), fp8=True),
    GPUType("L4", 23034, 300, ("NVIDIA L4",), fp8=True, gke_accelerators=("nvidia-l4",), karpenter_gpu=("l4", None)),
    GPUType("A10G", 23028, 600, ("NVIDIA A10G",), karpenter_gpu=("a10g", None)),
    GPUType("A10", 23028, 600, ("NVIDIA A10",), gpus_per_node=4,
            azure_vm_sizes=("Standard_NV36ads_A10_v5", "Standard_NV72ads_A10_v5")),
    GPUType("T4", 15360, 320, ("Tesla T4",), bf16=False, gpus_per_node=4,
            gke_accelerators=("nvidia-tesla-t4",), karpenter_gpu=("t4", None),
            azure_vm_sizes=("Standard_NC4as_T4_v3", "Standard_NC8as_T4_v3", "Standard_NC16as_T4_v3",
                            "Standard_NC64as_T4_v3")),
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


# vLLM's CPU backend: the spec.accelerator.type value, as the plan and the pod env spell it.
CPU = contract.CPU_ACCELERATOR


def is_cpu(name: str) -> bool:
    """Whether a spec.accelerator.type value (case-insensitive) names vLLM's CPU backend."""
    return _key(name) == CPU


def accelerator_names() -> list[str]:
    """Every spec.accelerator.type: the GPU types, then CPU."""
    return [*gpu_names(), CPU]
