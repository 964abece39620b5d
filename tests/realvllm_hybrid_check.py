"""Runs under the real vLLM's interpreter (tensorfleet.testing.realvllm.run_script), not in the suite's.

Reads {"cases": [{"name", "config_dir" (a directory holding a hybrid model's config.json), "tensor", "kinds" (one per
layer: attention, mamba, none), "stages" ([first, end) layer ranges, one per pipeline stage), "free" (bytes for the
KV cache on each stage's GPUs), "max_model_len", "batched_tokens", "prefix_caching", "kv_cache_dtype" (auto, fp8),
"lengths"}]} as JSON on stdin. For each case it reads the config as vLLM does (its ModelConfig, no weights), lets
vLLM's own HybridAttentionMambaModelConfig choose the attention block size and pad the state page, asks the model
class for its state shapes and element types, declares each layer's spec as the engine's layers do on a GPU
(FullAttentionSpec at the default block of 16, which vLLM's page unification raises; MambaSpec with the padded
page), and runs vLLM's own `get_kv_cache_configs` over the stages. No GPU is needed.

Prints one JSON line: {"vllm": version, "results": [{"name", "block_size" (vLLM's "Setting attention block size"),
"state_bytes" (one state layer's unpadded page), "page_bytes", "num_blocks", "groups", "logged_tokens",
"concurrency": {length: vLLM's maximum concurrency}}]}.
"""

import copy
import json
import logging
import math
import re
import sys
from types import SimpleNamespace


def main() -> None:
    payload = json.load(sys.stdin)
    logging.disable(logging.WARNING)
    import torch
    import vllm
    from vllm.config import CacheConfig, ModelConfig
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, HybridAttentionMambaModelConfig
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    logged: list[str] = []

    class Capture:
        def _keep(self, message: str, *args: object, **_: object) -> None:
            logged.append(message % args if args else message)

        info = info_once = warning = warning_once = debug = _keep

    kv_cache_utils.logger = Capture()

    results = []
    for case in payload["cases"]:
        model = ModelConfig(model=case["config_dir"], tokenizer=case["config_dir"], skip_tokenizer_init=True,
                            max_model_len=case["max_model_len"], dtype="bfloat16")
        cache = CacheConfig(enable_prefix_caching=case["prefix_caching"], cache_dtype=case["kv_cache_dtype"])
        parallel = SimpleNamespace(tensor_parallel_size=case["tensor"], pipeline_parallel_size=len(case["stages"]),
                                   decode_context_parallel_size=1, prefill_context_parallel_size=1)
        config = SimpleNamespace(
            model_config=model, cache_config=cache, parallel_config=parallel, speculative_config=None,
            num_speculative_tokens=0, attention_config=SimpleNamespace(backend=None),
            scheduler_config=SimpleNamespace(enable_chunked_prefill=True, disable_hybrid_kv_cache_manager=False,
                                             max_num_batched_tokens=case["batched_tokens"]))
        if model.architecture in MODELS_CONFIG_MAP:
            MODELS_CONFIG_MAP[model.architecture].verify_and_update_config(config)
        HybridAttentionMambaModelConfig.verify_and_update_config(config)
        model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
        shapes = model_cls.get_mamba_state_shape_from_config(config)
        dtypes = model_cls.get_mamba_state_dtype_from_config(config)
        kv_dtype = torch.bfloat16 if case["kv_cache_dtype"] == "auto" else torch.float8_e4m3fn
        attention = FullAttentionSpec(block_size=CacheConfig.DEFAULT_BLOCK_SIZE,
                                      num_kv_heads=model.get_num_kv_heads(parallel), head_size=model.get_head_size(),
                                      dtype=kv_dtype)
        state = MambaSpec(shapes=tuple(tuple(s) for s in shapes), dtypes=tuple(dtypes),
                          block_size=cache.mamba_block_size, page_size_padded=cache.mamba_page_size_padded,
                          mamba_cache_mode=cache.mamba_cache_mode)
        specs = {"attention": ("self_attn.attn", attention), "mamba": ("mixer", state)}
        workers = [{f"model.layers.{i}.{specs[case['kinds'][i]][0]}": specs[case["kinds"][i]][1]
                    for i in range(first, end) if case["kinds"][i] != "none"} for first, end in case["stages"]]
        model.original_max_model_len = case["max_model_len"]
        del logged[:]
        configs = kv_cache_utils.get_kv_cache_configs(config, copy.deepcopy(workers), case["free"])
        sizes = [int(m.group(1).replace(",", "")) for line in logged
                 if (m := re.search(r"GPU KV cache size: ([\d,]+) tokens", line))]
        first = configs[0]
        concurrency = {}
        for length in case["lengths"]:
            model.max_model_len = length
            concurrency[str(length)] = kv_cache_utils.get_max_concurrency_for_kv_cache_config(config, first)
        model.max_model_len = case["max_model_len"]
        results.append({
            "name": case["name"],
            "block_size": cache.block_size,
            "state_bytes": sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(state.shapes, state.dtypes)),
            "page_bytes": state.page_size_bytes,
            "num_blocks": first.num_blocks,
            "groups": len(first.kv_cache_groups),
            "logged_tokens": sizes[0] if sizes else None,
            "concurrency": concurrency,
        })
    print(json.dumps({"vllm": vllm.__version__, "results": results}))


if __name__ == "__main__":
    main()
