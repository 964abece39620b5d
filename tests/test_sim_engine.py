"""The simulator's profile (the capacity it is handed, timing from the catalog) and its scheduler, without HTTP."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import isvc_doc

from tensorfleet import vllm_defaults
from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.catalog import MODELS, ModelEntry
from tensorfleet.planner import make_plan
from tensorfleet.planner.memory import stages
from tensorfleet.prompts import render_chat
from tensorfleet.sim.engine import BlockPool, Engine, RequestRejected, SimRequest
from tensorfleet.sim.profile import (
    DEFAULT_ACCELERATOR,
    DEFAULT_KV_CACHE_TOKENS,
    DEFAULT_MODEL,
    make_profile,
    read_layers,
)
from tensorfleet.sim.tokenizer import count_tokens, tokenize

FAST = 0.001


def words(n: int, salt: str = "") -> list[str]:
    """A prompt of exactly n tokens."""
    tokens = tokenize(" ".join(f"w{salt}{i}x" for i in range(n)))
    assert len(tokens) >= n
    return tokens[:n]


# --- profile ----------------------------------------------------------------------


def test_profile_capacity_is_what_it_is_handed() -> None:
    """The operator hands the simulator its plan's figures as flags; the profile takes them as they are."""
    plan = make_plan(load_inference_service(isvc_doc({
        "model": {"name": "meta-llama/Llama-3.1-70B-Instruct", "maxModelLen": 8192},
        "parallelism": {"tensor": 4, "pipeline": 1},
    })).spec)
    profile = make_profile("meta-llama/Llama-3.1-70B-Instruct", plan.accelerator, tensor=plan.tensor,
                           max_model_len=plan.max_model_len, max_num_seqs=plan.max_num_seqs,
                           kv_cache_tokens=plan.kv_cache_tokens)
    assert (profile.tensor, profile.max_model_len) == (plan.tensor, plan.max_model_len)
    assert (profile.kv_cache_tokens, profile.max_num_seqs) == (plan.kv_cache_tokens, plan.max_num_seqs)
    assert profile.num_blocks == plan.kv_cache_tokens // vllm_defaults.BLOCK_SIZE
    # Figures no plan would give are taken all the same: the simulator does not size anything itself.
    odd = make_profile("meta-llama/Llama-3.1-70B-Instruct", "L4", tensor=3, max_model_len=1000, max_num_seqs=7,
                       kv_cache_tokens=12345, max_num_batched_tokens=99, block_size=32)
    assert (odd.tensor, odd.max_model_len, odd.max_num_seqs, odd.kv_cache_tokens) == (3, 1000, 7, 12345)
    assert (odd.max_num_batched_tokens, odd.block_size, odd.num_blocks) == (99, 32, 12345 // 32)


@pytest.mark.parametrize("entry", MODELS, ids=[m.key for m in MODELS])
@pytest.mark.parametrize("tensor", [1, 2, 8])
def test_timing_bytes_are_the_planners_for_one_stage(entry: ModelEntry, tensor: int) -> None:
    """Weights and KV bytes per GPU come from the same catalog arithmetic the planner sizes a stage with: a decode
    step reads every full-attention layer's KV per context token, and a sliding or chunked one's within its span."""
    arch, max_model_len = entry.arch, 4096
    stage, = stages(arch, arch.weight_format, tensor, 1, 2)
    profile = make_profile(entry.display, "H200-141GB", tensor=tensor, max_model_len=max_model_len)
    assert profile.kv_bytes_per_token_per_gpu == math.ceil(read_layers(arch, max_model_len)
                                                           * stage.kv_bytes_per_token_layer)
    if not (arch.sliding_window or arch.attention_chunk_size):
        assert profile.kv_bytes_per_token_per_gpu == stage.kv_bytes_per_token_per_gpu
    # The planner adds a stage's parts before rounding, the profile rounds the model's total: a byte apart at most.
    assert abs(profile.weight_bytes_per_gpu - stage.weight_bytes_per_gpu) <= 1


def test_capacity_defaults_without_flags_are_vllms() -> None:
    small, large = make_profile(accelerator="L4"), make_profile(accelerator="H100-80GB")
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (vllm_defaults.MAX_NUM_SEQS,
                                                                   vllm_defaults.MAX_NUM_BATCHED_TOKENS)
    assert (large.max_num_seqs, large.max_num_batched_tokens) == (vllm_defaults.LARGE_GPU_MAX_NUM_SEQS,
                                                                   vllm_defaults.LARGE_GPU_MAX_NUM_BATCHED_TOKENS)
    for profile in (small, large):
        assert profile.tensor == vllm_defaults.TENSOR_PARALLEL_SIZE
        assert profile.block_size == vllm_defaults.BLOCK_SIZE
        assert profile.kv_cache_tokens == DEFAULT_KV_CACHE_TOKENS
    # A budget below max-num-seqs is raised to it.
    assert make_profile(accelerator="L4", max_num_seqs=4096).max_num_batched_tokens == 4096


def test_the_simulator_imports_no_planner() -> None:
    code = ("import sys, tensorfleet.sim.cli, tensorfleet.sim.profile, tensorfleet.sim.engine, tensorfleet.sim.server; "
            "print(sorted(m for m in sys.modules if m.startswith('tensorfleet.planner')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_default_profile_is_llama_8b_on_l4() -> None:
    profile = make_profile()
    assert profile.model == DEFAULT_MODEL and profile.accelerator == DEFAULT_ACCELERATOR
    assert profile.max_model_len == 8192


def test_step_time_follows_the_roofline() -> None:
    profile = make_profile("meta-llama/Llama-3.1-8B-Instruct", "H100-80GB")
    one = profile.step_seconds(1, 512, 0)
    # Batch 1 decode is bound by reading the weights once: ~16 GB / (3.35 TB/s x 0.8).
    assert 0.005 < one < 0.012
    assert profile.step_seconds(64, 64 * 512, 0) > one          # more KV to read
    assert profile.step_seconds(1, 8192, 0) > one                # longer context
    assert profile.step_seconds(0, 0, 4096) > 2 * profile.step_seconds(0, 0, 1024) * 0.9  # prefill ~ tokens
    slower = make_profile("meta-llama/Llama-3.1-8B-Instruct", "L4")
    assert slower.step_seconds(1, 512, 0) > 5 * one              # 300 GB/s vs 3350 GB/s


def test_unknown_model_or_gpu_is_refused() -> None:
    with pytest.raises(SpecError, match="--model"):
        make_profile("acme/NotAModel-9B", "L4")
    with pytest.raises(SpecError, match="accelerator"):
        make_profile(DEFAULT_MODEL, "Z9000")


def test_small_kv_override_caps_the_context() -> None:
    profile = make_profile(kv_cache_tokens=512)
    assert profile.kv_cache_tokens == 512 and profile.max_model_len == 512


# --- tokenizer --------------------------------------------------------------------


def test_tokenizer_is_deterministic_and_about_four_chars_per_token() -> None:
    text = "The quick brown fox jumps over the lazy dog, twice: 12345 times!" * 20
    assert tokenize(text) == tokenize(text)
    assert "".join(tokenize(text)) == text
    assert 3.0 < len(text) / count_tokens(text) < 5.0


def test_chat_template_counts_every_message() -> None:
    one = count_tokens(render_chat([{"role": "user", "content": "hi"}]))
    two = count_tokens(render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))
    assert two > one
    parts = render_chat([{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]}])
    assert "look" in parts


# --- block pool -------------------------------------------------------------------


def test_block_pool_shares_evicts_lru_and_frees() -> None:
    pool = BlockPool(4)
    pool.acquire_hashed(1)
    pool.acquire_hashed(1)
    assert pool.refs[1] == 2 and pool.free == 3
    pool.acquire_anonymous(1)
    pool.release([1], 1)
    pool.release([1], 0)
    assert pool.used == 0 and list(pool.evictable) == [1]   # cached, unreferenced
    for h in (2, 3, 4):
        pool.acquire_hashed(h)
    pool.acquire_hashed(5)                                   # evicts 1, the oldest
    assert 1 not in pool.evictable and pool.cached_prefix([1]) == 0
    assert pool.used == 4 and pool.free == 0


# --- scheduler --------------------------------------------------------------------


async def run_all(engine: Engine, requests: list[SimRequest], timeout: float = 10.0) -> None:
    await asyncio.wait_for(asyncio.gather(*(r.wait(r.max_tokens) for r in requests)), timeout)


@pytest.mark.asyncio
async def test_requests_queue_when_kv_blocks_run_out() -> None:
    # 16 blocks of 16 tokens; each request needs 7 blocks for its prompt and
    # up to 8 with its answer, so only two run at once however many slots exist.
    profile = replace(make_profile(kv_cache_tokens=256), max_num_seqs=64)
    engine = Engine(profile, time_scale=FAST)
    engine.start()
    try:
        requests = [engine.submit(words(100, str(i)), 20) for i in range(5)]
        await asyncio.sleep(0)
        await run_all(engine, requests)
        assert engine.stats.max_running == 2
        assert engine.stats.max_waiting >= 3
        assert all(r.finish_reason == "length" and r.generated == 20 for r in requests)
        assert engine.pool.used == 0 and engine.num_running == 0 and engine.num_waiting == 0
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_batch_slots_bound_running_requests() -> None:
    profile = replace(make_profile(), max_num_seqs=3)
    engine = Engine(profile, time_scale=FAST)
    engine.start()
    try:
        requests = [engine.submit(words(20, str(i)), 5) for i in range(8)]
        await run_all(engine, requests)
        assert engine.stats.max_running == 3
        assert engine.stats.max_waiting >= 5
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_prefix_cache_hits_are_counted_and_lru_evicted() -> None:
    profile = make_profile(kv_cache_tokens=320)  # 20 blocks
    engine = Engine(profile, time_scale=FAST)
    engine.start()
    try:
        prompt = words(100, "a")
        first = engine.submit(prompt, 2)
        await run_all(engine, [first])
        assert engine.stats.prefix_hits == 0 and engine.stats.prefix_queries == 100
        second = engine.submit(prompt, 2)
        await run_all(engine, [second])
        assert second.cached_tokens == 96            # 6 full blocks of 16
        assert engine.stats.prefix_hits == 96 and engine.stats.prefix_queries == 200
        # A shared prefix hits on its full blocks only.
        branch = engine.submit(prompt[:50] + words(50, "b"), 2)
        await run_all(engine, [branch])
        assert branch.cached_tokens == 48
        # Enough other prompts push the first one out of the 20-block cache.
        for i in range(4):
            await run_all(engine, [engine.submit(words(100, f"c{i}"), 2)])
        again = engine.submit(prompt, 2)
        await run_all(engine, [again])
        assert again.cached_tokens == 0
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_fully_cached_prompt_recomputes_its_last_token() -> None:
    engine = Engine(make_profile(), time_scale=FAST)
    engine.start()
    try:
        prompt = words(64)
        await run_all(engine, [engine.submit(prompt, 1)])
        again = engine.submit(prompt, 1)
        await run_all(engine, [again])
        assert again.cached_tokens == 48  # 63 tokens may hit; whole blocks of them: 3
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_decode_growth_preempts_and_every_request_still_finishes() -> None:
    # 8 blocks: two 40-token prompts fit (3 blocks each), but their answers
    # need more blocks than remain, so the newer one is preempted and recomputed.
    profile = replace(make_profile(kv_cache_tokens=128), max_num_seqs=8)
    engine = Engine(profile, time_scale=FAST)
    engine.start()
    try:
        requests = [engine.submit(words(40, str(i)), 60) for i in range(2)]
        await run_all(engine, requests)
        assert engine.stats.preemptions >= 1
        assert [r.generated for r in requests] == [60, 60]
        assert engine.pool.used == 0
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_abort_frees_blocks_at_once() -> None:
    engine = Engine(make_profile(), time_scale=0.05)
    engine.start()
    try:
        request = engine.submit(words(100), 500)
        await request.wait(0)
        assert engine.num_running == 1 and engine.pool.used > 0
        engine.abort(request)
        assert engine.num_running == 0 and engine.pool.used == 0
        assert request.finish_reason == "abort" and engine.stats.aborted == 1
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_requests_vllm_would_refuse_are_rejected() -> None:
    engine = Engine(make_profile(max_model_len=1024), time_scale=FAST)
    with pytest.raises(RequestRejected, match="maximum context length is 1024"):
        engine.submit(words(1000), 100)
    with pytest.raises(RequestRejected):
        engine.submit([], 10)
    with pytest.raises(RequestRejected, match="max_tokens"):
        engine.submit(words(10), 0)


@pytest.mark.asyncio
async def test_same_prompt_and_seed_give_the_same_answer() -> None:
    engine = Engine(make_profile(), time_scale=FAST, seed=7)
    engine.start()
    try:
        a, b = engine.submit(words(10), 12), engine.submit(words(10), 12)
        await run_all(engine, [a, b])
        assert a.text == b.text and count_tokens(a.text) == 12
        unbounded = engine.submit(words(10, "z"), None)
        await run_all(engine, [unbounded])
        assert unbounded.finish_reason == "stop" and unbounded.generated >= 16
    finally:
        await engine.stop()


def test_models_outside_the_catalog_still_get_an_engine() -> None:
    from tensorfleet.sim.profile import resilient_profile

    unknown = resilient_profile("acme/Private-13B", "H100-80GB", kv_cache_tokens=50_000, max_num_seqs=64)
    assert unknown.model == "acme/Private-13B" and unknown.accelerator == "H100-80GB"
    assert unknown.kv_cache_tokens == 50_000 and unknown.max_num_seqs == 64
    # Borrowed timing: the default model's on that GPU.
    assert unknown.weight_bytes_per_gpu == make_profile(DEFAULT_MODEL, "H100-80GB").weight_bytes_per_gpu
    nowhere = resilient_profile("acme/Private-13B", "Z9000", kv_cache_tokens=4096, tensor=2)
    assert nowhere.accelerator == DEFAULT_ACCELERATOR and (nowhere.kv_cache_tokens, nowhere.tensor) == (4096, 2)
    # A layout the operator would never plan is not judged here: it is simulated as handed.
    too_big = resilient_profile("meta-llama/Llama-3.1-405B-Instruct", "L4", tensor=1)
    assert too_big.model == "meta-llama/Llama-3.1-405B-Instruct" and too_big.accelerator == "L4"
    exact = resilient_profile("meta-llama/Llama-3.1-8B-Instruct", "H100-80GB")
    assert exact == make_profile("meta-llama/Llama-3.1-8B-Instruct", "H100-80GB")
