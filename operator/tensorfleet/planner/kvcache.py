"""vLLM's KV-cache manager as the planner sizes it (vllm/v1/core/kv_cache_utils.py, v0.19): layers into groups, free
bytes into blocks, blocks into the two figures vLLM logs at start-up. Pure functions, no policy; held to vLLM's own
functions by tests/test_planner_kvcache.py. Design:
docs/planner.md#blocks-groups-and-the-two-figures-plannerkvcachepy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tensorfleet.api.architecture import ArchitectureSpec

LayerKind = Literal["full", "sliding", "chunked", "mamba", "none"]
# How vLLM keeps a state layer's pages (--mamba-cache-mode): one state per request, an aligned copy beside it
# (prefix caching, models without per-block states), or a state per block (prefix caching).
StateCacheMode = Literal["none", "align", "all"]


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's KV cache, as vLLM's KVCacheSpec kinds see it."""

    kind: LayerKind = "full"   # none: a layer without a cache (Nemotron-H's MLP-only layers)
    window: int = 0   # sliding window or attention chunk, in tokens
    state_cache: StateCacheMode = "none"   # a state layer's

    @property
    def attends(self) -> bool:
        """Whether the layer keeps attention KV per token (state layers and layers without a cache do not)."""
        return self.kind not in ("mamba", "none")

    def blocks_per_request(self, tokens: int, block: int, batched_tokens: int) -> int:
        """Blocks one request of TOKENS tokens may hold in this layer's group (vLLM's max_memory_usage_bytes)."""
        if self.kind == "mamba":
            return {"none": 1, "align": 2}.get(self.state_cache) or math.ceil(tokens / block)
        if self.kind == "sliding":
            return math.ceil(min(self.window - 1 + batched_tokens, tokens) / block) + 1
        if self.kind == "chunked":
            return math.ceil(min(self.window + batched_tokens, tokens) / block)
        return math.ceil(tokens / block)


FULL = LayerSpec()


@dataclass(frozen=True)
class Grouping:
    """The model's layers (indices into its layer list) in KV-cache groups, each of one spec."""

    groups: tuple[tuple[int, ...], ...]
    specs: tuple[LayerSpec, ...]
    padding: int   # layers vLLM adds to fill the last group of a kind

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def group_size_on(self, stage: Sequence[int]) -> int:
        """Layers per group on a pipeline stage holding the layers STAGE (vLLM projects the groups onto it)."""
        held = set(stage)
        return max(sum(1 for layer in group if layer in held) for group in self.groups)


def _spread(count: int, slots: int) -> set[int]:
    """COUNT of SLOTS positions, spread evenly, the last slot included."""
    return {round((k + 1) * slots / count) - 1 for k in range(count)} if count else set()


def model_layers(arch: ArchitectureSpec, state_cache: StateCacheMode = "none") -> list[LayerSpec]:
    """The model's layers in order, each with its cache's kind. A model states how many layers use a window or a
    chunk, or keep a state, not which: they are spread evenly, as every such model interleaves them (Gemma 3
    five sliding to one full, gpt-oss alternating, Llama 4 three chunked to one full, Qwen3-Next three linear to
    one full, Jamba seven Mamba to one attention). Only pipeline stages see the order. STATE_CACHE: how vLLM
    keeps the state layers' pages."""
    attention = arch.attention_layer_count
    windowed = ((arch.sliding_window_layers if arch.sliding_window_layers is not None else attention)
                if arch.sliding_window else 0)
    chunked = ((arch.chunked_attention_layers if arch.chunked_attention_layers is not None else attention)
               if arch.attention_chunk_size else 0)
    at = _spread(attention - windowed - chunked, attention)
    local = iter([LayerSpec("sliding", arch.sliding_window or 0)] * windowed
                 + [LayerSpec("chunked", arch.attention_chunk_size or 0)] * chunked)
    attending = [FULL if index in at else next(local) for index in range(attention)]
    if arch.mamba is None:
        return attending
    # Attention layers spread among all layers; state layers among the rest, the others (no cache) between them.
    state = LayerSpec("mamba", state_cache=state_cache)
    rest = arch.layers - attention
    held = iter(attending)
    states, attended = _spread(arch.mamba.layers, rest), _spread(attention, arch.layers)
    out: list[LayerSpec] = []
    other = 0
    for index in range(arch.layers):
        if index in attended:
            out.append(next(held))
        else:
            out.append(state if other in states else LayerSpec("none"))
            other += 1
    return out


def group_layers(layers: Sequence[LayerSpec], hybrid: bool) -> Grouping:
    """vLLM's get_kv_cache_groups for layers of one page size (a state layer's page padded to an attention one's).
    HYBRID: its hybrid KV-cache manager is on; without it vLLM cannot put state and attention layers in one group
    and refuses to start (ValueError here too). Layers without a cache are left out."""
    if not hybrid and any(spec.kind == "mamba" for spec in layers) and any(spec.attends for spec in layers):
        raise ValueError("without the hybrid KV-cache manager vLLM cannot group state layers with attention ones")
    if not hybrid and len(set(layers)) > 1 and FULL in layers:
        # vLLM's unify_hybrid_kv_cache_specs: windows and chunks kept as full layers. A model of one kind (all
        # sliding, say) is left as it is.
        layers = [FULL if spec.kind not in ("full", "none") else spec for spec in layers]
    kinds: dict[LayerSpec, list[int]] = {}
    for index, spec in enumerate(layers):
        if spec.kind != "none":
            kinds.setdefault(spec, []).append(index)
    if len(kinds) == 1:
        (spec, members), = kinds.items()
        return Grouping((tuple(members),), (spec,), 0)
    counts = [len(members) for members in kinds.values()]
    size = min(counts)
    if max(counts) < size * 1.5:
        size = max(counts)
    groups: list[tuple[int, ...]] = []
    specs: list[LayerSpec] = []
    padding = 0
    for spec, members in kinds.items():
        count = math.ceil(len(members) / size)
        padding += count * size - len(members)
        for i in range(count):
            groups.append(tuple(members[i::count]))
            specs.append(spec)
    return Grouping(tuple(groups), tuple(specs), padding)


@dataclass(frozen=True)
class KVPool:
    """One engine's KV cache as vLLM lays it out: NUM_BLOCKS blocks in each group."""

    num_blocks: int
    block_size: int
    specs: tuple[LayerSpec, ...]   # one per group
    batched_tokens: int            # max-num-batched-tokens, which bounds a sliding or chunked group's blocks
    # The smallest block of any group, which vLLM's logged pool counts in: a state group's block is the whole
    # max_model_len when it keeps one state per request, so only a shorter max_model_len than the block shows.
    logged_block: int | None = None

    @property
    def tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens"."""
        return self.num_blocks // len(self.specs) * (self.logged_block or self.block_size)

    def blocks_per_request(self, tokens: int) -> int:
        return sum(spec.blocks_per_request(tokens, self.block_size, self.batched_tokens) for spec in self.specs)

    def concurrency(self, tokens: int) -> float:
        """vLLM's "Maximum concurrency for TOKENS tokens per request"."""
        return self.num_blocks / self.blocks_per_request(max(tokens, 1))

    def longest_request(self, limit: int) -> int:
        """The longest request (at most LIMIT tokens) whose blocks fit the pool: vLLM's estimated maximum
        model length; 0 when not even one block's worth fits."""
        low, high = 0, limit
        while low < high:
            middle = (low + high + 1) // 2
            if self.blocks_per_request(middle) <= self.num_blocks:
                low = middle
            else:
                high = middle - 1
        return low


def pool(grouping: Grouping, stages: Sequence[tuple[Sequence[int], int]], page_bytes: int, block_size: int,
         batched_tokens: int, logged_block: int | None = None) -> tuple[KVPool, int]:
    """The engine's pool from each pipeline stage's (layers, free bytes per GPU), PAGE_BYTES a block of one layer
    on one GPU; and the index of the stage with the fewest blocks (the engine takes its figure). A stage holding
    no layer with a cache has no say."""
    blocks = {index: max(free, 0) // page_bytes // grouping.group_size_on(layers)
              for index, (layers, free) in enumerate(stages) if grouping.group_size_on(layers)}
    worst = min(blocks, key=blocks.__getitem__)
    return KVPool(blocks[worst], block_size, grouping.specs, batched_tokens, logged_block), worst
