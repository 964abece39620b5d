"""A fake of NVIDIA's DRA driver for GPUs in the e2e cluster: what `e2e/cluster up` publishes so that the real
kube-scheduler allocates GPU ResourceClaims (spec.accelerator.allocation deviceClass) on the fake GPU nodes.

It writes what the driver's kubelet plugin and chart would: one ResourceSlice per GPU node (driver
gpu.nvidia.com, the node's own pool, one device per GPU, `gpu-0` ... `gpu-7`, each with the attributes and
capacity the driver publishes, k8s-dra-driver-gpu cmd/gpu-kubelet-plugin/deviceinfo.go: type, uuid, productName
(the NVML device name), brand, architecture, cudaComputeCapability, driverVersion, cudaDriverVersion, pcieBusID,
and the capacity memory in bytes), owned by its Node as the plugin's are; and the DeviceClass `gpu.nvidia.com`
with the selector the driver's chart gives it (whole GPUs). No kubelet plugin prepares the devices: KWOK's
nodes run no containers. Only the Python standard library (it runs before any virtualenv exists); docs/dra.md
says what is proven with it.
"""

from __future__ import annotations

import hashlib
from typing import Any

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
API_VERSION = "resource.k8s.io/v1"
# What the driver reports for the GPUs of a fake node: architecture and compute capability by GFD family.
ARCHITECTURES = {"hopper": ("Hopper", "9.0.0"), "ampere": ("Ampere", "8.0.0"), "ada-lovelace": ("Ada Lovelace", "8.9.0"),
                 "blackwell": ("Blackwell", "10.0.0")}
DRIVER_VERSION, CUDA_DRIVER_VERSION = "570.133.20", "12.8.0"


def device_class() -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "DeviceClass", "metadata": {"name": DEVICE_CLASS},
            "spec": {"selectors": [{"cel": {"expression":
                                            f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu'"}}]}}


def resource_slice(node: dict[str, Any], product: str, family: str, memory_mib: int, gpus: int) -> dict[str, Any]:
    """NODE's slice (the Node as the API server returned it: its uid owns the slice): GPUS devices named PRODUCT
    (the NVML name) with MEMORY_MIB each."""
    name = node["metadata"]["name"]
    architecture, capability = ARCHITECTURES[family]
    devices = []
    for index in range(gpus):
        uuid = hashlib.sha256(f"{name}/{index}".encode()).hexdigest()
        devices.append({
            "name": f"gpu-{index}",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": f"GPU-{uuid[:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:32]}"},
                "productName": {"string": product},
                "brand": {"string": "Nvidia"},
                "architecture": {"string": architecture},
                "cudaComputeCapability": {"version": capability},
                "driverVersion": {"version": DRIVER_VERSION},
                "cudaDriverVersion": {"version": CUDA_DRIVER_VERSION},
                "pcieBusID": {"string": f"0000:{0x18 + 0x10 * index:02x}:00.0"},
            },
            "capacity": {"memory": {"value": f"{memory_mib}Mi"}},
        })
    return {
        "apiVersion": API_VERSION, "kind": "ResourceSlice",
        "metadata": {"name": f"{name}-{DRIVER}",
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name,
                                          "uid": node["metadata"]["uid"], "controller": True}]},
        "spec": {"driver": DRIVER, "nodeName": name,
                 "pool": {"name": name, "generation": 1, "resourceSliceCount": 1}, "devices": devices},
    }
