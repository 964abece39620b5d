"""The KV-cache index (router/kvindex.py) on the event sequences vLLM publishes: chains of stored blocks, removals,
clears, adapters, engines with different block sizes; and the operator's wiring of KV events (engine env, ports,
NetworkPolicy, the router's flag) for vLLM engines only. tests/test_kvevents_vllm.py holds the index to a real
vLLM; tests/test_kvevents_recovery.py the subscription to vLLM's own publisher.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from test_render import by_kind, document, rendered

from tensorfleet import contract
from tensorfleet.router.kvevents import apply_batch
from tensorfleet.router.kvindex import KVIndex

BS = 4
PROMPT = list(range(1000, 1024))  # six blocks


def chain(index: KVIndex, engine: str, hashes: list[str], tokens: list[int], parent: str | None = None,
          adapter: str | None = None) -> None:
    index.stored(engine, hashes, parent, tokens, BS, adapter)


def test_the_longest_leading_run_each_engine_holds() -> None:
    index = KVIndex()
    chain(index, "a", ["a1", "a2", "a3"], PROMPT[:12])
    chain(index, "b", ["b1"], PROMPT[:4])
    chain(index, "b", ["b2"], PROMPT[4:8], parent="b1")
    chain(index, "c", ["c1"], PROMPT[4:8])  # the second block's tokens as a first block: another prefix
    assert index.match(PROMPT) == {"a": 3, "b": 2}
    assert index.match(PROMPT, engines=["b", "c"]) == {"b": 2}
    assert index.match(PROMPT[:7]) == {"a": 1, "b": 1}   # a partial block has no key
    assert index.match(PROMPT[4:]) == {"c": 1}
    assert index.blocks("a") == 3 and index.block_size("a") == BS


def test_removed_blocks_end_the_run_and_cleared_engines_hold_nothing() -> None:
    index = KVIndex()
    chain(index, "a", ["a1", "a2", "a3"], PROMPT[:12])
    chain(index, "b", ["b1", "b2"], PROMPT[:8])
    index.removed("a", ["a2", "unknown"])
    assert index.match(PROMPT) == {"a": 1, "b": 2}
    index.cleared("b")
    assert index.match(PROMPT) == {"a": 1} and index.blocks("b") == 0
    index.forget("a")
    assert index.match(PROMPT) == {} and index.engines() == ["b"]
    index.removed("gone", ["x"])  # an engine the index never saw


def test_adapters_and_parents_key_the_blocks() -> None:
    index = KVIndex()
    chain(index, "a", ["a1", "a2"], PROMPT[:8], adapter="sql")
    assert index.match(PROMPT) == {} and index.match(PROMPT, "sql") == {"a": 2}
    # A block stored under a parent the index never saw (its event was lost) is not guessed at.
    chain(index, "b", ["b3"], PROMPT[8:12], parent="b2")
    assert index.orphans("b") == 1 and index.blocks("b") == 0


def test_a_block_hash_stored_again_replaces_its_content() -> None:
    index = KVIndex()
    chain(index, "a", ["h1"], PROMPT[:4])
    chain(index, "a", ["h1"], PROMPT[4:8])
    assert index.match(PROMPT) == {} and index.match(PROMPT[4:]) == {"a": 1} and index.blocks("a") == 1


def test_engines_with_other_block_sizes_are_matched_in_their_own_blocks() -> None:
    index = KVIndex()
    index.stored("small", ["s1", "s2"], None, PROMPT[:8], 4)
    index.stored("large", ["l1"], None, PROMPT[:8], 8)
    assert index.match(PROMPT) == {"small": 2, "large": 1}


def _batch(*events: list[Any]) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), 0])


def test_batches_as_vllm_encodes_them() -> None:
    """vLLM's events are msgspec structs, array-like and tagged: [tag, fields...], later releases adding fields
    at the end; offloaded tiers and a hybrid model's other groups are not the GPU cache the router routes to."""
    index = KVIndex()
    h = [bytes([i]) * 32 for i in range(4)]
    ts, applied = apply_batch(index, "e", _batch(
        ["BlockStored", h[:2], None, PROMPT[:8], BS, None, "GPU", None],
        ["BlockStored", [h[2]], h[1], PROMPT[8:12], BS, None, "GPU", None, None, 0, "full", None, "LOCAL"],
        ["BlockStored", [h[3]], None, PROMPT[:4], BS, None, "CPU", None],
        ["BlockStored", [h[3]], None, PROMPT[:4], BS, None, "GPU", None, None, 1],
        ["SomethingNew", 1, 2]))
    assert (ts, applied) == (1.5, 2)
    assert index.match(PROMPT) == {"e": 3}
    apply_batch(index, "e", _batch(["BlockRemoved", [h[1]], "GPU"]))
    assert index.match(PROMPT) == {"e": 1}
    apply_batch(index, "e", _batch(["AllBlocksCleared"]))
    assert index.blocks("e") == 0


@pytest.mark.parametrize("kind", ["vllm", "simulator"])
def test_engines_publish_and_their_router_subscribes(kind: str) -> None:
    objects = rendered(document(engine={"kind": kind}))
    leader = by_kind(objects, "StatefulSet")[0]
    container = leader["spec"]["template"]["spec"]["containers"][-1]
    env = {var["name"]: var.get("value") for var in container["env"]}
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    router = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    policy = next(o for o in by_kind(objects, "NetworkPolicy") if o["metadata"]["name"].endswith("-engine"))
    admitted = {p["port"] for p in policy["spec"]["ingress"][0]["ports"]}
    config = json.loads(env[contract.ENV_KV_EVENTS_CONFIG])
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    assert config["endpoint"] == f"tcp://*:{contract.KV_EVENTS_PORT}"
    assert config["replay_endpoint"] == f"tcp://*:{contract.KV_EVENTS_REPLAY_PORT}"
    assert config["topic"] == contract.KV_EVENTS_TOPIC
    assert ports[contract.KV_EVENTS_PORT_NAME] == contract.KV_EVENTS_PORT
    assert ports[contract.KV_EVENTS_REPLAY_PORT_NAME] == contract.KV_EVENTS_REPLAY_PORT
    assert "--kv-events" in router["args"]
    assert {contract.KV_EVENTS_PORT, contract.KV_EVENTS_REPLAY_PORT} <= admitted
    # Only the leader runs the engine's API server and its publisher.
    for worker in by_kind(rendered(document(engine={"kind": kind}, parallelism={"pipeline": 2})),
                          "StatefulSet")[1:]:
        names = {p["name"] for p in worker["spec"]["template"]["spec"]["containers"][-1]["ports"]}
        assert contract.KV_EVENTS_PORT_NAME not in names


def test_models_with_sliding_windows_publish_none() -> None:
    """vLLM turns its hybrid KV-cache manager off beside KV events; gpt-oss's alternating 128-token windows would
    then be kept whole, so its engines publish none and its router subscribes to none."""
    objects = rendered(document(model={"name": "openai/gpt-oss-120b", "maxModelLen": None}))
    container = by_kind(objects, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][-1]
    assert contract.ENV_KV_EVENTS_CONFIG not in {var["name"] for var in container["env"]}
    router = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-events" not in router["args"]
