"""LoRA adapters on a simulated engine, as vLLM serves them (`--enable-lora`): adapters known by name, at most
`--max-loras` of them in a batch, GPU slots and a CPU cache kept least recently used, and the time to bring an
adapter in charged to the step that first runs it. Design: docs/simulator.md#lora-adapters."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tensorfleet import contract

RUNTIME_UPDATING_ENV = contract.ENV_RUNTIME_LORA_UPDATING  # vLLM's: enables the load and unload endpoints
LOAD_PATH = contract.LORA_LOAD_PATH
UNLOAD_PATH = contract.LORA_UNLOAD_PATH


class LoraError(ValueError):
    """An adapter request the engine refuses, with vLLM's answer: STATUS and error TYPE_ (vLLM 0.19.1's: 400
    "InvalidUserInput" for a request it does not try, 404 "NotFoundError" for no adapter at the path or no such
    name to unload, 500 "InternalServerError" for an adapter the engine cannot take, such as one of too high a
    rank); `not_found` for the 404s."""

    def __init__(self, message: str, *, status: int = 400, type_: str = "InvalidUserInput") -> None:
        super().__init__(message)
        self.status = status
        self.type_ = type_

    @property
    def not_found(self) -> bool:
        return self.status == 404


@dataclass(frozen=True)
class LoraConfig:
    max_loras: int = 1            # vLLM's default
    max_rank: int = 16            # vLLM's default --max-lora-rank
    max_cpu_loras: int = 1        # vLLM's default: max_loras
    load_seconds: float = 0.1     # from disk into a GPU slot (simulated seconds)
    swap_seconds: float = 0.005   # from the CPU cache into a GPU slot


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    rank: int


def parse_module(text: str) -> tuple[str, str]:
    """One --lora-modules value: `name=path`, or vLLM's JSON form {"name": ..., "path": ...}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise LoraError(f"--lora-modules {text!r}: not JSON ({exc})") from None
        name, path = raw.get("name") if isinstance(raw, dict) else None, raw.get("path") if isinstance(raw, dict) else None
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise LoraError(f"--lora-modules {text!r}: expected name=path or {{\"name\": ..., \"path\": ...}}")
    return name, path


def adapter_rank(path: str, default: int) -> int:
    """The adapter's rank from its adapter_config.json (PEFT's `r`) when PATH is a directory holding one; else
    DEFAULT (the simulator cannot read a Hub id's files)."""
    config = Path(path) / "adapter_config.json"
    try:
        rank = json.loads(config.read_text()).get("r")
    except (OSError, ValueError, AttributeError):
        return default
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0 else default


class LoraState:
    """The adapters an engine knows, its GPU slots and CPU cache, and what bringing adapters in cost."""

    def __init__(self, config: LoraConfig, served_name: str) -> None:
        self.config = config
        self.served_name = served_name
        self.adapters: dict[str, Adapter] = {}
        self.gpu: OrderedDict[str, None] = OrderedDict()   # in a GPU slot, least recently used first
        self.cpu: OrderedDict[str, None] = OrderedDict()   # in the CPU cache
        self.loads = 0   # brought in from disk
        self.swaps = 0   # brought in from the CPU cache

    def add(self, name: str, path: str, *, replace: bool = False) -> Adapter:
        """Serve adapter NAME from PATH (REPLACE: in place of the one of that name, vLLM's load_inplace)."""
        if name in self.adapters and not replace:
            raise LoraError(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                            "place, set 'load_inplace' to True.")
        if name == self.served_name:
            raise LoraError(f"The lora adapter '{name}' has the base model's served name.")
        if path.startswith("/") and not (Path(path) / "adapter_config.json").is_file():
            # vLLM reads a local path as it is, and a Hub id from the Hub (which the simulator cannot reach).
            raise LoraError(f"Loading lora {name} failed: No adapter found for {path}", status=404,
                            type_="NotFoundError")
        rank = adapter_rank(path, self.config.max_rank)
        if rank > self.config.max_rank:
            # vLLM's engine refuses it while adding it: its API server answers 500.
            raise LoraError(f"Call to add_lora method failed: LoRA rank {rank} is greater than max_lora_rank "
                            f"{self.config.max_rank}.", status=500, type_="InternalServerError")
        adapter = Adapter(name, path, rank)
        if replace:
            self.gpu.pop(name, None)
            self.cpu.pop(name, None)
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise LoraError(f"The lora adapter '{name}' cannot be found.", status=404, type_="NotFoundError")
        self.gpu.pop(name, None)
        self.cpu.pop(name, None)

    def activate(self, name: str, active: Iterable[str]) -> float:
        """Put NAME in a GPU slot for this step (ACTIVE: the adapters the batch already uses, which keep theirs);
        the simulated seconds that takes."""
        if name in self.gpu:
            self.gpu.move_to_end(name)
            return 0.0
        keep = set(active)
        while len(self.gpu) >= self.config.max_loras:
            victim = next((n for n in self.gpu if n not in keep), None)
            if victim is None:
                break  # the scheduler never activates more than max_loras at once
            del self.gpu[victim]
        self.gpu[name] = None
        if name in self.cpu:
            self.cpu.move_to_end(name)
            self.swaps += 1
            return self.config.swap_seconds
        self.cpu[name] = None
        while len(self.cpu) > self.config.max_cpu_loras:
            self.cpu.popitem(last=False)
        self.loads += 1
        return self.config.load_seconds
