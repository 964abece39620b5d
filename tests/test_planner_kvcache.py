"""The planner's model of vLLM's KV-cache manager (planner/kvcache.py): groups, blocks, the logged pool and the
maximum concurrency, for full, sliding-window and chunked-attention layers, with the hybrid manager on and off,
over pipeline stages. Held to vLLM's own functions (get_kv_cache_configs, run by the real vLLM CPU build:
tests/realvllm_kvcache_check.py) on the layer layouts of real models; and through the plan to the router's
per-engine ceiling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import isvc_doc, require_real_vllm
from test_modelconfig import facts

from tensorfleet.api import load_inference_service
from tensorfleet.api.architecture import ArchitectureSpec
from tensorfleet.planner import kvcache, make_plan
from tensorfleet.planner.memory import GiB, stage_layers
from tensorfleet.render import render
from tensorfleet.testing import realvllm

CHECK_SCRIPT = Path(__file__).with_name("realvllm_kvcache_check.py")
BLOCK = 16


def _arch(layers: int, **fields: Any) -> ArchitectureSpec:
    return ArchitectureSpec(parameters=10**9, layers=layers, hidden_size=1024, attention_heads=8, kv_heads=8, **fields)


# --- the layouts of real models -------------------------------------------------------------------


def test_gemma_3_interleaves_five_windows_to_one_full_layer_and_pads_its_groups() -> None:
    """Gemma 3 27B: 52 sliding layers and 10 full; groups of 10, the sliding ones in 6 groups with 8 padding
    layers (vLLM: "Add 8 padding layers, may waste at most 15.38% KV cache memory"), 7 groups in all."""
    layers = kvcache.model_layers(facts("google/gemma-3-27b-it").arch)
    assert [spec.kind for spec in layers[:12]] == ["sliding"] * 5 + ["full"] + ["sliding"] * 5 + ["full"]
    grouping = kvcache.group_layers(layers, hybrid=True)
    assert (len(grouping.groups), grouping.padding, grouping.group_size_on(range(62))) == (7, 8, 10)
    assert [spec.kind for spec in grouping.specs].count("sliding") == 6
    # Off (a KV connector, KV events, the flag): one group, every layer full.
    off = kvcache.group_layers(layers, hybrid=False)
    assert (len(off.groups), off.specs, off.group_size_on(range(62))) == (1, (kvcache.FULL,), 62)


@pytest.mark.parametrize(("repo", "groups", "size"), [
    ("openai/gpt-oss-120b", 2, 18),                       # alternating: 18 + 18
    ("openai/gpt-oss-20b", 2, 12),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 4, 12),  # 36 chunked in 3 groups + 12 full
    ("google/gemma-2-9b-it", 2, 21),                       # 21 + 21
    ("meta-llama/Llama-3.1-8B-Instruct", 1, 32),
])
def test_groups_of_real_models(repo: str, groups: int, size: int) -> None:
    grouping = kvcache.group_layers(kvcache.model_layers(facts(repo).arch), hybrid=True)
    assert (len(grouping.groups), grouping.group_size_on(range(facts(repo).arch.layers))) == (groups, size)


def test_the_logged_pool_counts_every_layer_and_the_concurrency_the_window() -> None:
    """vLLM logs the pool as if every layer kept full attention; a sliding layer holds at most window - 1 + B
    tokens of a request, so at long contexts far more requests fit than pool / length."""
    grouping = kvcache.group_layers(kvcache.model_layers(_arch(6, sliding_window=1024, sliding_window_layers=5)),
                                    hybrid=True)
    page = BLOCK * 4096
    pool, worst = kvcache.pool(grouping, [(range(6), 60 * GiB)], page, BLOCK, 8192)
    assert worst == 0 and len(grouping.groups) == 6
    assert pool.num_blocks == 60 * GiB // page // 1
    assert pool.tokens == pool.num_blocks // 6 * BLOCK
    # At 131072 tokens a request takes 8192 blocks of the full group and 577 of each sliding one.
    assert pool.blocks_per_request(131072) == 8192 + 5 * (-(-(1023 + 8192) // BLOCK) + 1)
    assert pool.concurrency(131072) > 3 * pool.tokens / 131072
    # A pool of full attention only: the concurrency is pool / length.
    full = kvcache.pool(kvcache.group_layers([kvcache.FULL] * 6, True), [(range(6), 60 * GiB)], page, BLOCK, 8192)[0]
    assert full.concurrency(8192) == full.tokens / 8192
    assert full.longest_request(10**9) == full.tokens


def test_pipeline_stages_each_count_their_own_blocks_and_the_engine_takes_the_fewest() -> None:
    arch = _arch(62, sliding_window=1024, sliding_window_layers=52)
    grouping = kvcache.group_layers(kvcache.model_layers(arch), hybrid=True)
    split = stage_layers(62, 2)
    stages = [(range(split[0]), 30 * GiB), (range(split[0], 62), 31 * GiB)]
    pool, worst = kvcache.pool(grouping, stages, BLOCK * 4096, BLOCK, 8192)
    blocks = [free // (BLOCK * 4096) // grouping.group_size_on(layers) for layers, free in stages]
    assert pool.num_blocks == min(blocks) and worst == blocks.index(min(blocks))


# --- held to vLLM's own arithmetic --------------------------------------------------------------------


LAYOUTS: list[tuple[str, ArchitectureSpec]] = [
    ("gemma-3-27b", facts("google/gemma-3-27b-it").arch),
    ("gemma-3-4b", facts("google/gemma-3-4b-it").arch),
    ("gemma-2-9b", facts("google/gemma-2-9b-it").arch),
    ("gpt-oss-120b", facts("openai/gpt-oss-120b").arch),
    ("gpt-oss-20b", facts("openai/gpt-oss-20b").arch),
    ("llama-4-scout", facts("meta-llama/Llama-4-Scout-17B-16E-Instruct").arch),
    ("llama-3.1-8b", facts("meta-llama/Llama-3.1-8B-Instruct").arch),
    ("deepseek-v2-lite", facts("deepseek-ai/DeepSeek-V2-Lite-Chat").arch),
    ("all-sliding", _arch(32, sliding_window=4096)),                     # Mistral v0.1's kind: one uniform group
    ("odd-pattern", _arch(25, sliding_window=512, sliding_window_layers=13)),  # 13 + 12: groups of 13, 1 padding
    ("few-full", _arch(40, sliding_window=2048, sliding_window_layers=36)),
]
CASES: list[dict[str, Any]] = []
for _name, _arch_spec in LAYOUTS:
    _layers = kvcache.model_layers(_arch_spec)
    _window = _arch_spec.sliding_window or _arch_spec.attention_chunk_size or 0
    for _pipeline in (1, 2, 3):
        for _hybrid in (True, False):
            _bounds, _first = [], 0
            for _count in stage_layers(_arch_spec.layers, _pipeline):
                _bounds.append((_first, _first + _count))
                _first += _count
            CASES.append({
                "name": f"{_name}-pp{_pipeline}-{'hybrid' if _hybrid else 'unified'}",
                "kinds": [spec.kind for spec in _layers], "window": _window,
                "layer_bytes": 2 * 2 * 128 * (1 + len(CASES) % 4),   # 1 to 4 KV heads of 128 on a rank
                "stages": _bounds,
                "free": [int((37.5 - 3.25 * stage) * GiB) for stage in range(_pipeline)],
                "max_model_len": (8192, 32768, 131072)[len(CASES) % 3],
                "batched_tokens": (8192, 2048, 16384)[len(CASES) % 3],
                "hybrid": _hybrid,
                "lengths": [1, 100, 1000, 3000, 8192, 20000, 131072],
            })


@pytest.fixture(scope="module")
def vllm_answers() -> dict[str, Any]:
    python = require_real_vllm()
    found = realvllm.run_script(CHECK_SCRIPT.read_text(), {"cases": CASES}, python=python)
    assert isinstance(found, dict)
    return {result["name"]: result for result in found["results"]}


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_blocks_pool_and_concurrency_are_vllms(vllm_answers: dict[str, Any], case: dict[str, Any]) -> None:
    vllm = vllm_answers[case["name"]]
    layers = [kvcache.FULL if kind == "full" else kvcache.LayerSpec(kind, case["window"]) for kind in case["kinds"]]
    grouping = kvcache.group_layers(layers, case["hybrid"])
    pool, _ = kvcache.pool(grouping, [(range(first, end), free) for (first, end), free in
                                      zip(case["stages"], case["free"], strict=True)],
                           BLOCK * case["layer_bytes"], BLOCK, case["batched_tokens"])
    assert (pool.num_blocks, len(grouping.groups)) == (vllm["num_blocks"], vllm["groups"])
    assert pool.tokens == vllm["logged_tokens"]
    for length in case["lengths"]:
        assert pool.concurrency(length) == pytest.approx(vllm["concurrency"][str(length)], rel=1e-12), length


# --- through the plan to the router -----------------------------------------------------------------------


def _plan(repo: str, **spec: Any) -> Any:
    doc = isvc_doc({"model": {"name": repo, "maxModelLen": 131072}, "accelerator": {"type": "H100-80GB"}, **spec})
    return make_plan(load_inference_service(doc).spec, facts(repo))


@pytest.mark.parametrize("repo", ["google/gemma-3-27b-it", "openai/gpt-oss-120b"])
def test_the_routers_ceiling_is_vllms_concurrency_at_the_typical_request(repo: str) -> None:
    """The per-engine ceiling the router is rendered with is vLLM's maximum concurrency at typicalRequestTokens
    (max-num-seqs caps it), not the logged pool over the length, which undercounts what sliding layers hold."""
    plan = _plan(repo, parallelism={"tensor": 8 if "120b" in repo else 2, "pipeline": 1},
                 engine={"maxNumSeqs": 4096})
    for typical in (2048, 16384, 65536):
        ceiling = plan.engine_concurrency(typical)
        assert ceiling == min(plan.max_num_seqs, int(plan.kv_pool.concurrency(typical)))
    # Past a window and a step's budget a sliding layer holds no more of a request: long requests fit far more
    # often than the pool over their length says.
    assert plan.engine_concurrency(65536) > 1.5 * (plan.kv_cache_tokens // 65536)
    assert plan.max_concurrency == plan.kv_pool.concurrency(131072) > plan.kv_cache_tokens / 131072


def test_a_kv_connector_or_the_flag_turns_the_hybrid_manager_off() -> None:
    """spec.prefill runs a KV connector, which turns vLLM's hybrid manager off (vLLM warns so); so does
    --disable-hybrid-kv-cache-manager in engine.args: every window layer then holds full-length KV."""
    on = _plan("google/gemma-3-27b-it", parallelism={"tensor": 2, "pipeline": 1})
    flag = _plan("google/gemma-3-27b-it", parallelism={"tensor": 2, "pipeline": 1},
                 engine={"args": ["--disable-hybrid-kv-cache-manager"]})
    split = make_plan(load_inference_service(isvc_doc({
        "model": {"name": "google/gemma-3-27b-it", "maxModelLen": 131072}, "accelerator": {"type": "H100-80GB"},
        "parallelism": {"tensor": 2}, "prefill": {"parallelism": {"tensor": 2}},
    })).spec, facts("google/gemma-3-27b-it"))
    assert len(on.kv_pool.specs) == 7 and len(flag.kv_pool.specs) == 1 and len(split.kv_pool.specs) == 1
    assert split.prefill is not None and len(split.prefill.kv_pool.specs) == 1
    # Without the padding layers the unified pool holds more tokens, and far fewer long requests.
    assert flag.kv_cache_tokens > on.kv_cache_tokens
    assert flag.max_concurrency == flag.kv_cache_tokens / 131072 < on.max_concurrency / 3


def test_the_rendered_router_ceiling_follows() -> None:
    doc = isvc_doc({"model": {"name": "openai/gpt-oss-120b", "maxModelLen": 131072},
                    "parallelism": {"tensor": 8, "pipeline": 1}, "engine": {"maxNumSeqs": 4096},
                    "router": {"typicalRequestTokens": 32768}}, name="oss")
    isvc = load_inference_service(doc)
    plan = make_plan(isvc.spec, facts("openai/gpt-oss-120b"))
    router = next(o for o in render(isvc, plan) if o["kind"] == "Deployment" and o["metadata"]["name"] == "oss-router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-concurrency-per-backend") + 1] == str(plan.engine_concurrency(32768))
    assert plan.engine_concurrency(32768) > plan.kv_cache_tokens // 32768


def test_the_cpu_backend_runs_the_hybrid_manager_too() -> None:
    """vLLM's CPU platform supports the hybrid manager (0.19 and 0.32: support_hybrid_kv_cache), so a sliding-
    window model on accelerator CPU is grouped as on a GPU; the flag still turns it off there."""
    def plan(*args: str) -> Any:
        return make_plan(load_inference_service(isvc_doc({
            "model": {"name": "google/gemma-2-2b-it", "maxModelLen": 8192}, "accelerator": {"type": "CPU"},
            "engine": {"resources": {"requests": {"cpu": "4", "memory": "64Gi"}}, "args": list(args)},
        })).spec, facts("google/gemma-2-2b-it"))

    on, off = plan(), plan("--disable-hybrid-kv-cache-manager")
    assert on.fits and len(on.kv_pool.specs) == 2 and len(off.kv_pool.specs) == 1
