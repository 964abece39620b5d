"""What NVIDIA's DRA driver offers per node (controller/devices.py), and what the status makes of it: the
ResourceSlices are those the driver publishes (attribute names and shapes from k8s-dra-driver-gpu), as the e2e
cluster's fake driver writes them (e2e/dra.py) for the real scheduler."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.catalog import GPUType, find_gpu
from tensorfleet.controller.devices import Devices
from tensorfleet.controller.reconcile import device_warnings
from tensorfleet.planner import make_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
import dra  # e2e/dra.py: the fake driver's objects


def gpu(name: str) -> GPUType:
    found = find_gpu(name)
    assert found is not None
    return found


H100, A100_40 = gpu("H100-80GB"), gpu("A100-40GB")


def node(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"uid-{name}"}}


def h100_slice(name: str, gpus: int = 8, **changes: Any) -> dict[str, Any]:
    found = dra.resource_slice(node(name), "NVIDIA H100 80GB HBM3", "hopper", 81559, gpus)
    found["spec"]["pool"].update(changes)
    return found


def test_devices_count_per_node_by_the_claims_own_test() -> None:
    devices = Devices()
    devices.observed(h100_slice("h100-a"))
    devices.observed(h100_slice("h100-b", gpus=4))
    devices.observed(dra.resource_slice(node("a100-a"), "NVIDIA A100-SXM4-80GB", "ampere", 81920, 8))
    offer = devices.offer(H100, "gpu.nvidia.com")
    assert offer.per_node == (("h100-a", 8), ("h100-b", 4))
    assert offer.short_of(8) is None
    assert offer.short_of(16) == ("no node offers 16 H100-80GB through DRA: the most is 8, on h100-a "
                                  "(ResourceSlices of gpu.nvidia.com)")
    # The 40 GB A100's name is not the 80 GB one's.
    assert devices.offer(A100_40, "gpu.nvidia.com").short_of(1) == (
        "no node offers a A100-40GB through DRA (ResourceSlices of gpu.nvidia.com)")


def test_less_memory_than_the_plan_assumed_does_not_count() -> None:
    devices = Devices()
    devices.observed(dra.resource_slice(node("h100-small"), "NVIDIA H100 80GB HBM3", "hopper", 81000, 8))
    assert devices.offer(H100, "gpu.nvidia.com").per_node == ()


def test_only_the_newest_generation_of_a_pool_counts_and_a_deleted_slice_goes() -> None:
    devices = Devices()
    old = h100_slice("h100-a", gpus=8, generation=1)
    devices.observed(old)
    newer = h100_slice("h100-a", gpus=2, generation=2)
    newer["metadata"]["name"] = "h100-a-gpu.nvidia.com-v2"
    devices.observed(newer)
    assert devices.offer(H100, "x").per_node == (("h100-a", 2),)
    devices.observed(newer, deleted=True)
    assert devices.offer(H100, "x").per_node == (("h100-a", 8),)
    devices.observed(old, deleted=True)
    offer = devices.offer(H100, "x")
    assert not offer.driver_seen and "is NVIDIA's DRA driver installed" in (offer.short_of(1) or "")


def test_qualified_attribute_names_count_and_other_drivers_do_not() -> None:
    devices = Devices()
    piece = h100_slice("h100-q", gpus=1)
    device = piece["spec"]["devices"][0]
    device["attributes"] = {f"{contract.NVIDIA_DRA_DRIVER}/productName": device["attributes"]["productName"]}
    device["capacity"] = {f"{contract.NVIDIA_DRA_DRIVER}/memory": device["capacity"]["memory"]}
    devices.observed(piece)
    other = h100_slice("h100-other")
    other["spec"]["driver"] = "gpu.example.com"
    devices.observed(other)
    assert devices.offer(H100, "x").per_node == (("h100-q", 1),)


def test_a_spec_no_node_can_satisfy_is_warned_about_once_the_driver_is_seen() -> None:
    doc = {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "big", "namespace": "ml"},
           "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
                    "accelerator": {"type": "H100-80GB", "allocation": "deviceClass", "gpusPerNode": 16},
                    "parallelism": {"tensor": 16}}}
    plan = make_plan(load_inference_service(doc).spec)
    devices = Devices()
    assert device_warnings(plan, devices.offer(H100, "gpu.nvidia.com")) == [], "no slice seen yet: no guess"
    devices.observed(h100_slice("h100-a"))
    (warning,) = device_warnings(plan, devices.offer(H100, "gpu.nvidia.com"))
    assert warning.startswith("no node offers 16 H100-80GB through DRA: the most is 8, on h100-a")
    assert device_warnings(plan, None) == []
