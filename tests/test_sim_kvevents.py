"""The simulator's token ids, /tokenize, and KV events (sim/kvevents.py), without a real engine: the events its
cache makes, batched per step; the publisher's wire format and replay; the ids /tokenize answers being the ids
its prefix cache hashes. tests/test_kvevents_vllm.py holds the router's index to the published events end to end.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from tensorfleet import engine_settings
from tensorfleet.prompts import render_chat
from tensorfleet.router.kvevents import apply_batch
from tensorfleet.router.kvindex import KVIndex
from tensorfleet.sim.engine import Engine, hash_blocks
from tensorfleet.sim.kvevents import KVEventsConfig, KVEventsConfigError, Publisher, binds, parse_config
from tensorfleet.sim.lora import LoraConfig, LoraState
from tensorfleet.sim.profile import make_profile
from tensorfleet.sim.tokenizer import token_ids, tokenize
from tensorfleet.testing.loopback import MODEL, free_port, sim

BLOCK = 16
TEXT = "The operator renders one StatefulSet per pipeline stage, and the router in front of them picks an engine."


def words(n: int, salt: str = "") -> list[str]:
    tokens = tokenize(" ".join(f"w{salt}{i}x" for i in range(n)))
    return tokens[:n]


# --- token ids --------------------------------------------------------------------------------------------------

def test_token_ids_and_block_hashes_are_the_same_in_every_process() -> None:
    """Python salts str hashes per process; the ids (CRC-32) and the block hashes (of ints) must not depend on it."""
    code = ("from tensorfleet.sim.engine import hash_blocks; from tensorfleet.sim.tokenizer import token_ids, "
            f"tokenize; ids = token_ids(tokenize({TEXT!r}), 128256); print(ids); print(hash_blocks(ids, 16, 'a'))")
    runs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout for seed in ("1", "2")}
    ids = token_ids(tokenize(TEXT), 128256)
    assert runs == {f"{ids}\n{hash_blocks(ids, 16, 'a')}\n"}
    assert all(0 <= i < 128256 for i in ids) and len(set(ids)) > len(ids) // 2


def test_the_vocabulary_is_the_models() -> None:
    assert make_profile("meta-llama/Llama-3.1-8B-Instruct").vocab_size == 128256
    assert make_profile("Qwen/Qwen2.5-7B-Instruct").vocab_size == 152064


def test_an_adapters_blocks_are_its_own() -> None:
    ids = token_ids(tokenize(TEXT), 128256)
    base, tuned, other = (hash_blocks(ids, BLOCK, lora) for lora in (None, "a", "b"))
    assert len(base) == len(ids) // BLOCK and not set(base) & set(tuned) and not set(tuned) & set(other)
    assert hash_blocks(ids[:BLOCK * 2], BLOCK, "a") == tuned[:2]  # chained: a prefix's blocks are the same


# --- the engine's events ----------------------------------------------------------------------------------------

def _engine(**capacity: Any) -> tuple[Engine, list[list[list[Any]]]]:
    engine = Engine(replace(make_profile(), **capacity), time_scale=0)
    batches: list[list[list[Any]]] = []
    engine.publish_kv_events(batches.append)
    return engine, batches


async def _run(engine: Engine, prompt: list[str], **options: Any) -> None:
    request = engine.submit(prompt, 1, **options)
    while not request.finished:
        await request.wait(request.generated)
    await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_blocks_entering_the_cache_are_stored_with_their_parent_and_tokens() -> None:
    engine, batches = _engine()
    engine.start()
    try:
        prompt = words(3 * BLOCK + 5)
        await _run(engine, prompt)
        ids = token_ids(prompt, engine.profile.vocab_size)
        hashes = hash_blocks(ids, BLOCK)
        assert batches == [[["BlockStored", hashes, None, ids[:3 * BLOCK], BLOCK, None, "GPU", None]]]
        # A prompt sharing two blocks stores only its new ones, under the last shared one.
        fork = prompt[:2 * BLOCK] + words(2 * BLOCK, "f")
        await _run(engine, fork)
        fork_ids = token_ids(fork, engine.profile.vocab_size)
        fork_hashes = hash_blocks(fork_ids, BLOCK)
        assert batches[1:] == [[["BlockStored", fork_hashes[2:], hashes[1], fork_ids[2 * BLOCK:], BLOCK, None, "GPU",
                                 None]]]
        # The same prompt again stores nothing: no batch.
        await _run(engine, prompt)
        assert len(batches) == 2
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_an_adapters_blocks_are_stored_under_its_name() -> None:
    engine, batches = _engine()
    engine.lora = LoraState(LoraConfig(), MODEL)
    engine.lora.add("support", "org/support")
    engine.start()
    try:
        prompt = words(2 * BLOCK + 1)
        await _run(engine, prompt)
        await _run(engine, prompt, lora="support")
        ids = token_ids(prompt, engine.profile.vocab_size)
        assert [b[0][7] for b in batches] == [None, "support"]
        assert batches[1][0][1] == hash_blocks(ids, BLOCK, "support") != batches[0][0][1]
        assert engine.stats.prefix_hits == 0
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_evicted_blocks_are_removed_and_answer_blocks_stored_when_freed() -> None:
    engine, batches = _engine(kv_cache_tokens=8 * BLOCK, max_model_len=8 * BLOCK)
    vocab = engine.profile.vocab_size
    engine.start()
    try:
        first = words(2 * BLOCK, "a")
        request = engine.submit(first, BLOCK + 1)  # its answer fills a block of its own
        while not request.finished:
            await request.wait(request.generated)
        await asyncio.sleep(0)
        ids = token_ids([*first, *request.output_words[:BLOCK]], vocab)
        hashes = hash_blocks(ids, BLOCK)
        assert [event for batch in batches for event in batch] == [
            ["BlockStored", hashes[:2], None, ids[:2 * BLOCK], BLOCK, None, "GPU", None],
            ["BlockStored", hashes[2:3], hashes[1], ids[2 * BLOCK:3 * BLOCK], BLOCK, None, "GPU", None]]
        others = [words(2 * BLOCK, salt) for salt in "bcdef"]  # 10 blocks through a cache of 8
        for prompt in others:
            await _run(engine, prompt)
        removed = [h for batch in batches for event in batch if event[0] == "BlockRemoved" for h in event[1]]
        assert set(hashes) <= set(removed)
        # Read by the router's index, the events leave it holding what the cache holds.
        index = KVIndex()
        encode = msgspec.msgpack.Encoder().encode
        for batch in batches:
            apply_batch(index, "e", encode([0.0, batch, 0]))
        pool = engine.pool
        assert index.blocks("e") == len(pool.refs) + len(pool.evictable) <= 8
        for prompt in [first, *others]:
            prompt_ids = token_ids(prompt, vocab)
            assert index.match(prompt_ids).get("e", 0) == pool.cached_prefix(hash_blocks(prompt_ids, BLOCK))
        assert index.match(token_ids(first, vocab)) == {} and index.orphans("e") == 0
    finally:
        await engine.stop()


# --- the publisher ----------------------------------------------------------------------------------------------

def test_the_config_reads_vllms_json() -> None:
    operator = parse_config(engine_settings.kv_events_config(5557, 5558))
    assert operator == KVEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558", topic="kv",
                                      buffer_steps=10_000)
    assert parse_config('{"enable_kv_cache_events": false}') is None
    assert parse_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    assert parse_config('{"enable_kv_cache_events": true}') == KVEventsConfig()
    for bad in ('{"enable_kv_cache_events": true, "port": 1}', '{"enable_kv_cache_events": true, "publisher": "x"}',
                '{"enable_kv_cache_events": true, "buffer_steps": "many"}', "[]", "{"):
        with pytest.raises(KVEventsConfigError):
            parse_config(bad)
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and not binds("tcp://10.0.0.1:5557")


@pytest.mark.asyncio
async def test_batches_go_out_numbered_and_are_replayed_from_the_buffer() -> None:
    pub_port, replay_port = free_port(), free_port()
    publisher = Publisher(KVEventsConfig(endpoint=f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}",
                                         buffer_steps=3, topic="kv"))
    publisher.start()
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        warm = 0  # PUB drops what it sends before the subscription arrives: send until one gets through
        while not warm or not await sub.poll(100):
            publisher.publish([["AllBlocksCleared"]])
            warm += 1
        while await sub.poll(100):
            await sub.recv_multipart()
        for n in range(5):
            publisher.publish([["BlockRemoved", [n], "GPU"]])
        decode = msgspec.msgpack.Decoder().decode
        for n in range(5):
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert (topic, int.from_bytes(seq, "big")) == (b"kv", warm + n)
            assert decode(payload)[1:] == [[["BlockRemoved", [n], "GPU"]], 0]
        await dealer.send_multipart((b"", (warm + 1).to_bytes(8, "big")))
        replies = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(4)]
        # The batches before the last 3 fell out of the buffer: the last 3, then the end.
        assert [int.from_bytes(r[1], "big", signed=True) for r in replies] == [warm + 2, warm + 3, warm + 4, -1]
        assert all(r[0] == b"" for r in replies) and replies[-1][2] == b""
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        context.term()
        await publisher.close()


# --- /tokenize --------------------------------------------------------------------------------------------------

async def _post(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with client.post(url, json=body) as resp:
        return resp.status, await resp.json()


@pytest.mark.asyncio
async def test_tokenize_answers_the_ids_the_prefix_cache_hashes() -> None:
    messages = [{"role": "system", "content": TEXT}, {"role": "user", "content": TEXT + " Which one?"}]
    async with sim(prompt_tokens_details=True, time_scale=0) as s, aiohttp.ClientSession() as client:
        vocab = s.server.profile.vocab_size
        status, answer = await _post(client, s.url + "/tokenize", {"model": MODEL, "prompt": TEXT,
                                                                     "return_token_strs": True})
        assert status == 200
        assert answer == {"count": len(tokenize(TEXT)), "max_model_len": s.server.profile.max_model_len,
                          "tokens": token_ids(tokenize(TEXT), vocab), "token_strs": tokenize(TEXT)}
        status, chat = await _post(client, s.url + "/tokenize", {"messages": messages})
        assert status == 200 and chat["token_strs"] is None
        assert chat["tokens"] == token_ids(tokenize(render_chat(messages)), vocab)
        status, bare = await _post(client, s.url + "/tokenize", {"messages": messages, "add_generation_prompt": False})
        assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]

        # A chat completion caches its prompt's blocks; the ids /tokenize gave for its messages hit them all.
        status, _ = await _post(client, s.url + "/v1/chat/completions",
                                {"model": MODEL, "messages": messages, "max_tokens": 1})
        assert status == 200
        status, by_ids = await _post(client, s.url + "/v1/completions",
                                     {"model": MODEL, "prompt": chat["tokens"], "max_tokens": 1})
        assert status == 200 and by_ids["usage"]["prompt_tokens"] == chat["count"]
        assert by_ids["usage"]["prompt_tokens_details"]["cached_tokens"] == (chat["count"] - 1) // BLOCK * BLOCK
        # And the other way: ids first, then the text.
        status, _ = await _post(client, s.url + "/v1/completions",
                                {"model": MODEL, "prompt": answer["tokens"], "max_tokens": 1})
        status, by_text = await _post(client, s.url + "/v1/completions", {"model": MODEL, "prompt": TEXT,
                                                                          "max_tokens": 1})
        assert by_text["usage"]["prompt_tokens_details"]["cached_tokens"] == (answer["count"] - 1) // BLOCK * BLOCK


@pytest.mark.asyncio
async def test_tokenize_refuses_what_vllm_refuses() -> None:
    async with sim(time_scale=0) as s, aiohttp.ClientSession() as client:
        status, body = await _post(client, s.url + "/tokenize", {"model": MODEL})
        assert status == 400 and body["error"]["message"].startswith("2 validation errors:")
        status, body = await _post(client, s.url + "/tokenize", {"model": "other", "prompt": "x"})
        assert status == 404 and body["error"]["param"] == "model"
        status, body = await _post(client, s.url + "/tokenize", {"messages": []})
        assert status == 400 and "empty conversation" in body["error"]["message"]
        # Both fields: vLLM reads a chat.
        status, body = await _post(client, s.url + "/tokenize", {"prompt": "x", "messages": [
            {"role": "user", "content": "x"}]})
        assert status == 200 and body["count"] == len(tokenize(render_chat([{"role": "user", "content": "x"}])))


def test_the_cli_refuses_a_bad_config() -> None:
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "sim", "--served-model-name", "m",
                           "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "port": 1})],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "unknown key 'port'" in done.stderr
