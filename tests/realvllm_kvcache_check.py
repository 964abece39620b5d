"""Runs under the real vLLM's interpreter (tensorfleet.testing.realvllm.run_script), not in the suite's.

Reads {"cases": [{"name", "kinds" (one per layer: full, sliding, chunked), "window", "layer_bytes" (KV bytes one
token takes in one layer on one GPU), "stages" ([first, end) layer ranges, one per pipeline stage), "free"
(bytes for the KV cache on each stage's GPUs), "max_model_len", "batched_tokens", "hybrid", "lengths"
(request lengths to ask the concurrency at)}]} as JSON on stdin. For each case it builds the layers' KV-cache
specs as vLLM's attention layers declare them (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec,
block 16, bfloat16, one KV head of the size that gives `layer_bytes`) and runs vLLM's own
`get_kv_cache_configs` over the stages, as the engine core does at start-up, with a configuration holding only
what those functions read. Nothing is loaded and no GPU is needed.

Prints one JSON line: {"vllm": version, "results": [{"name", "num_blocks", "groups", "logged_tokens" (vLLM's
"GPU KV cache size" line, as logged), "concurrency": {length: vLLM's maximum concurrency at that length}}]}.
"""

import copy
import json
import re
import sys
from types import SimpleNamespace
from typing import Any


def main() -> None:
    payload = json.load(sys.stdin)
    import torch
    import vllm
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    logged: list[str] = []

    class Capture:
        """kv_cache_utils' logger, keeping every line: its `info_once` would print a second case's identical
        line only once."""

        def _keep(self, message: str, *args: object, **_: object) -> None:
            logged.append(message % args if args else message)

        info = info_once = warning = warning_once = debug = _keep

    kv_cache_utils.logger = Capture()

    def spec(kind: str, case: dict[str, Any]) -> Any:  # a vLLM KVCacheSpec
        # K and V of one head: layer_bytes = 2 x head size x 2 bytes (bfloat16).
        common = {"block_size": 16, "num_kv_heads": 1, "head_size": case["layer_bytes"] // 4,
                  "dtype": torch.bfloat16}
        if kind == "sliding":
            return SlidingWindowSpec(sliding_window=case["window"], **common)
        if kind == "chunked":
            return ChunkedLocalAttentionSpec(attention_chunk_size=case["window"], **common)
        return FullAttentionSpec(**common)

    def config(case: dict[str, Any], length: int) -> SimpleNamespace:
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not case["hybrid"],
                                             max_num_batched_tokens=case["batched_tokens"]),
            model_config=SimpleNamespace(max_model_len=length, original_max_model_len=length),
            parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
            cache_config=SimpleNamespace(num_gpu_blocks_override=None, mamba_cache_mode="none"))

    results = []
    for case in payload["cases"]:
        workers = [{f"model.layers.{i}.attn": spec(case["kinds"][i], case) for i in range(first, end)}
                   for first, end in case["stages"]]
        del logged[:]
        configs = kv_cache_utils.get_kv_cache_configs(config(case, case["max_model_len"]), copy.deepcopy(workers),
                                                      case["free"])
        sizes = [int(m.group(1).replace(",", "")) for line in logged
                 if (m := re.search(r"GPU KV cache size: ([\d,]+) tokens", line))]
        first = configs[0]
        results.append({
            "name": case["name"],
            "num_blocks": first.num_blocks,
            "groups": len(first.kv_cache_groups),
            "logged_tokens": sizes[0] if sizes else None,
            "concurrency": {str(length): kv_cache_utils.get_max_concurrency_for_kv_cache_config(config(case, length),
                                                                                               first)
                            for length in case["lengths"]},
        })
    print(json.dumps({"vllm": vllm.__version__, "results": results}))


if __name__ == "__main__":
    main()
