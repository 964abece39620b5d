"""Prefill/decode disaggregation in the simulator: a prefill half holds its KV, a decode half reads it over the
side channel instead of computing the prompt, and falls back to computing it when the KV is gone."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from tensorfleet import contract
from tensorfleet.sim import kvtransfer
from tensorfleet.sim.kvtransfer import TransferConfig, TransferConfigError, parse_config
from tensorfleet.sim.tokenizer import tokenize
from tensorfleet.testing.loopback import MODEL, chat, free_port, metric_value, sim, sse_events

PROMPT = "Explain how a continuous batching scheduler admits requests " * 12


def transfer(**overrides: Any) -> TransferConfig:
    fields: dict[str, Any] = {"connector": kvtransfer.CONNECTOR, "role": "kv_both", "side_channel_host": "127.0.0.1",
                              "side_channel_port": free_port(), "link_bytes_per_s": 100e9 / 8}
    return TransferConfig(**{**fields, **overrides})


async def post(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with client.post(url, json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return answer


async def metrics(client: aiohttp.ClientSession, url: str) -> str:
    async with client.get(url + "/metrics") as resp:
        return await resp.text()


def computed(text: str) -> tuple[float | None, float | None]:
    """Prompt tokens computed on the engine itself (sum) over how many requests (count)."""
    return (metric_value(text, contract.VLLM_METRIC_PREFILL_KV_COMPUTED + "_sum"),
            metric_value(text, contract.VLLM_METRIC_PREFILL_KV_COMPUTED + "_count"))


@pytest.mark.asyncio
async def test_the_decode_half_reads_the_prompts_kv_and_computes_none_of_it() -> None:
    prompt_len = len(tokenize(PROMPT))
    async with sim(kv_transfer=transfer()) as prefill, sim(kv_transfer=transfer()) as decode, \
            sim() as colocated, aiohttp.ClientSession() as client:
        request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24}
        first = await post(client, prefill.url + "/v1/completions",
                           {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        params = first["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.server.config.kv_transfer.side_channel_port)  # type: ignore[union-attr]
        block = prefill.server.profile.block_size
        assert len(params["remote_block_ids"]) == -(-(prompt_len + 1) // block)  # the prompt and its one token
        assert prefill.server.engine is not None and len(prefill.server.engine.held) == 1  # held, not freed

        answer = await post(client, decode.url + "/v1/completions", {**request, "kv_transfer_params": params})
        assert answer["usage"]["completion_tokens"] == 24 and answer["usage"]["prompt_tokens"] == prompt_len
        # The same answer as an engine that computed the prompt itself.
        assert answer["choices"][0]["text"] == (await post(client, colocated.url + "/v1/completions",
                                                           request))["choices"][0]["text"]
        assert not prefill.server.engine.held  # read, so freed

        prefill_text, decode_text = await metrics(client, prefill.url), await metrics(client, decode.url)
    assert computed(prefill_text) == (prompt_len, 1)
    assert metric_value(prefill_text, contract.VLLM_METRIC_PROMPT_TOKENS + "_total") == prompt_len
    assert metric_value(prefill_text, contract.VLLM_METRIC_GENERATION_TOKENS + "_total") == 1
    # The decode engine computed only the prompt's last token (for its logits): none of the transferred KV.
    assert computed(decode_text) == (1, 1)
    assert metric_value(decode_text, contract.VLLM_METRIC_EXTERNAL_PREFIX_CACHE_HITS + "_total") == prompt_len - 1
    assert metric_value(decode_text, contract.VLLM_METRIC_GENERATION_TOKENS + "_total") == 24


@pytest.mark.asyncio
async def test_a_streamed_chat_decode_half_answers_every_token() -> None:
    async with sim(kv_transfer=transfer()) as prefill, sim(kv_transfer=transfer()) as decode, \
            aiohttp.ClientSession() as client:
        request = chat(PROMPT, max_tokens=12)
        first = await post(client, prefill.url + "/v1/chat/completions",
                           {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        streamed = {**request, "stream": True, "stream_options": {"include_usage": True},
                    "kv_transfer_params": first["kv_transfer_params"]}
        async with client.post(decode.url + "/v1/chat/completions", json=streamed) as resp:
            events = [json.loads(data) async for _, data in sse_events(resp) if data != "[DONE]"]
        tokens = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
        assert len(tokens) == 12 and events[-1]["usage"]["completion_tokens"] == 12
        assert computed(await metrics(client, decode.url))[0] == 1


@pytest.mark.asyncio
async def test_kv_that_is_gone_or_unknown_is_computed_locally() -> None:
    prompt_len = len(tokenize(PROMPT))
    # A hold of 1 simulated second at time scale 0.01: gone 10 ms after the prefill half finished.
    async with sim(kv_transfer=transfer(hold_seconds=1.0)) as prefill, sim(kv_transfer=transfer()) as decode, \
            aiohttp.ClientSession() as client:
        request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
        first = await post(client, prefill.url + "/v1/completions",
                           {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        await asyncio.sleep(0.05)
        expired = await post(client, decode.url + "/v1/completions",
                             {**request, "kv_transfer_params": first["kv_transfer_params"]})
        assert expired["usage"]["completion_tokens"] == 5
        assert prefill.server.engine is not None and not prefill.server.engine.held
        unknown = {**first["kv_transfer_params"], "remote_engine_id": "another-engine"}
        await post(client, decode.url + "/v1/completions", {**request, "kv_transfer_params": unknown})
        incomplete = {"do_remote_prefill": True, "remote_host": "127.0.0.1"}
        await post(client, decode.url + "/v1/completions", {**request, "kv_transfer_params": incomplete})
        text = await metrics(client, decode.url)
    # Three requests, each computed whole here (the prefix cache holds the prompt after the first: vLLM's too).
    total, count = computed(text)
    assert count == 3 and total is not None and total >= prompt_len
    assert not metric_value(text, contract.VLLM_METRIC_EXTERNAL_PREFIX_CACHE_HITS + "_total")


@pytest.mark.asyncio
async def test_the_transfer_takes_the_kv_bytes_over_the_link() -> None:
    # 1 Gbit/s at time scale 1: the prompt's KV (128 KiB a token for Llama 3.1 8B) takes a visible while.
    slow = transfer(link_bytes_per_s=1e9 / 8)
    async with sim(kv_transfer=transfer(), time_scale=0.0) as prefill, sim(kv_transfer=slow, time_scale=1.0) as decode, \
            aiohttp.ClientSession() as client:
        request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        first = await post(client, prefill.url + "/v1/completions",
                           {**request, "kv_transfer_params": {"do_remote_decode": True}})
        assert decode.server.engine is not None
        expected = decode.server.engine.transfer_seconds(len(tokenize(PROMPT)), slow.link_bytes_per_s)
        assert expected > 0.05
        started = time.perf_counter()
        await post(client, decode.url + "/v1/completions", {**request, "kv_transfer_params": first["kv_transfer_params"]})
        assert time.perf_counter() - started >= expected


@pytest.mark.asyncio
async def test_a_prefill_half_with_several_choices_is_refused_and_params_without_a_connector_are_ignored() -> None:
    async with sim(kv_transfer=transfer()) as prefill, sim() as plain, aiohttp.ClientSession() as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "n": 2, "kv_transfer_params": {"do_remote_decode": True}}
        async with client.post(prefill.url + "/v1/completions", json=body) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "n"
        answer = await post(client, plain.url + "/v1/completions", {**body, "n": 1})
        # vLLM's answer always has the field: null without a connector.
        assert answer["kv_transfer_params"] is None and plain.server.engine is not None and not plain.server.engine.held


def test_the_transfer_config_is_vllms_flag_and_each_mistake_names_its_field() -> None:
    config = parse_config('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', listen_host="10.1.2.3",
                          environ={})
    assert (config.side_channel_host, config.side_channel_port) == ("10.1.2.3", kvtransfer.DEFAULT_SIDE_CHANNEL_PORT)
    assert config.produces and config.consumes and config.hold_seconds == kvtransfer.DEFAULT_HOLD_SECONDS
    config = parse_config('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}', listen_host="0.0.0.0",
                          link_gbps=400, environ={kvtransfer.SIDE_CHANNEL_HOST_ENV: "10.9.9.9",
                                                  kvtransfer.SIDE_CHANNEL_PORT_ENV: "5601",
                                                  kvtransfer.HOLD_SECONDS_ENV: "30"})
    assert (config.side_channel_host, config.side_channel_port, config.hold_seconds) == ("10.9.9.9", 5601, 30.0)
    assert config.link_bytes_per_s == 400e9 / 8 and config.consumes and not config.produces
    for text, env, needle in [
        ("{nope", {}, "not JSON"),
        ("[]", {}, "JSON object"),
        ('{"kv_connector": "LMCacheConnectorV1"}', {}, "kv_connector 'LMCacheConnectorV1'"),
        ('{"kv_connector": "NixlConnector", "kv_role": "both"}', {}, "kv_role 'both'"),
        ('{"kv_connector": "NixlConnector"}', {kvtransfer.SIDE_CHANNEL_PORT_ENV: "x"}, kvtransfer.SIDE_CHANNEL_PORT_ENV),
        ('{"kv_connector": "NixlConnector"}', {kvtransfer.SIDE_CHANNEL_PORT_ENV: "70000"},
         kvtransfer.SIDE_CHANNEL_PORT_ENV),
    ]:
        with pytest.raises(TransferConfigError, match=needle):
            parse_config(text, listen_host="0.0.0.0", environ=env)
