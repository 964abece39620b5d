"""Capacity planning: does a model fit, on which layout, and how much KV cache is left. Design: docs/planner.md."""

from tensorfleet.planner.entry import make_plan
from tensorfleet.planner.lora import LoraPlan
from tensorfleet.planner.plan import Plan, valid_tensor_sizes

__all__ = ["LoraPlan", "Plan", "make_plan", "valid_tensor_sizes"]
