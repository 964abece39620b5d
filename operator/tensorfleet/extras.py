"""Which optional dependencies (pyproject's extras) each long-running process needs, and the one-line error naming
the extra to install when they are missing: a command calls `require` before it imports its extra's modules. Design:
docs/architecture.md#one-package-an-extra-per-process."""

from __future__ import annotations

import importlib.util

# Extra -> the top-level modules its commands cannot start without. tests/
# test_packaging.py keeps it in step with pyproject.toml. nvidia-ml-py
# (pynvml) is in the worker extra but is not listed: without it the launcher
# still runs and `tensorfleet-worker health` says NVML is unavailable (exit 3).
MODULES: dict[str, tuple[str, ...]] = {
    "operator": ("kopf", "kubernetes", "aiohttp", "prometheus_client"),
    "router": ("aiohttp", "prometheus_client", "kubernetes"),
    "sim": ("aiohttp", "prometheus_client"),
    "worker": ("prometheus_client",),
}


class MissingExtra(Exception):
    """A command's extra is not installed; str() is the line to print after `error: `."""

    def __init__(self, command: str, extra: str, missing: list[str]) -> None:
        super().__init__(f"{command} needs the {extra} extra ({', '.join(missing)} not installed): "
                         f"pip install 'tensorfleet[{extra}]'")
        self.command = command
        self.extra = extra
        self.missing = missing


def missing(extra: str) -> list[str]:
    """The modules of EXTRA that cannot be imported here (found, not imported)."""
    return [module for module in MODULES[extra] if importlib.util.find_spec(module) is None]


def require(command: str, extra: str) -> None:
    """Raise MissingExtra when COMMAND (as the user typed it) lacks a module of EXTRA."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(command, extra, absent)
