"""Tensorfleet: a Kubernetes operator that serves LLMs with vLLM on GPU fleets. Design: docs/architecture.md."""

from tensorfleet.contract import __version__

__all__ = ["__version__"]
