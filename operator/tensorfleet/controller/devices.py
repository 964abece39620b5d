"""The GPUs NVIDIA's DRA driver offers on each node, from the operator's watch of ResourceSlices, for InferenceServices
whose engine pods claim their GPUs (spec.accelerator.allocation deviceClass): a spec that no node can satisfy is
warned about when it is accepted, and a pod the scheduler cannot place is diagnosed with what the nodes do offer.
A device counts as the planned GPU type by the very test the claims' selector makes (gpus.GPUType.dra_selector:
productName and memory); only the newest generation of each pool counts, as the scheduler's. Devices are counted,
not what other claims hold: like a node's allocatable, this is what a node could give (docs/dra.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorfleet import contract
from tensorfleet.api.base import quantity_bytes
from tensorfleet.gpus import GPUType


@dataclass(frozen=True)
class _Device:
    product: str | None
    memory_bytes: int | None


@dataclass(frozen=True)
class _Slice:
    node: str | None
    pool: str
    generation: int
    devices: tuple[_Device, ...]


@dataclass(frozen=True)
class Offer:
    """What the nodes offer of one GPU type through DRA."""

    gpu: str
    device_class: str
    per_node: tuple[tuple[str, int], ...]  # (node, matching devices), most first
    driver_seen: bool                       # any ResourceSlice of the driver at all

    def most(self) -> int:
        return self.per_node[0][1] if self.per_node else 0

    def short_of(self, wanted: int) -> str | None:
        """Why no node can give one pod WANTED devices; None when one can."""
        if self.most() >= wanted:
            return None
        if not self.driver_seen:
            return (f"no ResourceSlice of driver {contract.NVIDIA_DRA_DRIVER} is published: is NVIDIA's DRA driver "
                    "installed on the GPU nodes?")
        if not self.per_node:
            return f"no node offers a {self.gpu} through DRA (ResourceSlices of {contract.NVIDIA_DRA_DRIVER})"
        node, count = self.per_node[0]
        return (f"no node offers {wanted} {self.gpu} through DRA: the most is {count}, on {node} "
                f"(ResourceSlices of {contract.NVIDIA_DRA_DRIVER})")


class Devices:
    """The driver's ResourceSlices, reduced to what a GPU type's claim tests, by slice name."""

    def __init__(self) -> None:
        self._slices: dict[str, _Slice] = {}

    def observed(self, obj: Mapping[str, Any], *, deleted: bool = False) -> None:
        """Take a ResourceSlice from a watch event."""
        name = (obj.get("metadata") or {}).get("name") or ""
        spec = obj.get("spec") or {}
        if deleted or spec.get("driver") != contract.NVIDIA_DRA_DRIVER:
            self._slices.pop(name, None)
            return
        pool = spec.get("pool") or {}
        self._slices[name] = _Slice(node=spec.get("nodeName"), pool=str(pool.get("name") or ""),
                                    generation=int(pool.get("generation") or 0),
                                    devices=tuple(_device(d) for d in spec.get("devices") or []))

    def offer(self, gpu: GPUType, device_class: str) -> Offer:
        newest: dict[str, int] = {}
        for piece in self._slices.values():
            newest[piece.pool] = max(newest.get(piece.pool, 0), piece.generation)
        counts: dict[str, int] = {}
        for piece in self._slices.values():
            if piece.node is None or piece.generation != newest[piece.pool]:
                continue
            matching = sum(1 for d in piece.devices if d.product in gpu.nvml_names
                           and d.memory_bytes is not None and d.memory_bytes >= gpu.memory_bytes)
            if matching:
                counts[piece.node] = counts.get(piece.node, 0) + matching
        ranked = tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0])))
        return Offer(gpu=gpu.name, device_class=device_class, per_node=ranked, driver_seen=bool(self._slices))


def _device(device: Mapping[str, Any]) -> _Device:
    """A device's productName and memory, under the driver's domain whether the key is qualified or not."""
    def pick(table: Mapping[str, Any], key: str) -> Any:
        return table.get(key, table.get(f"{contract.NVIDIA_DRA_DRIVER}/{key}"))

    product = (pick(device.get("attributes") or {}, "productName") or {}).get("string")
    memory = (pick(device.get("capacity") or {}, "memory") or {}).get("value")
    try:
        memory_bytes = quantity_bytes(str(memory)) if memory is not None else None
    except ValueError:
        memory_bytes = None
    return _Device(product=product, memory_bytes=memory_bytes)
