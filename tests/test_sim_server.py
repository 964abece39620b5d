"""The simulator as a real HTTP server on loopback: vLLM's API, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import pytest

from tensorfleet import contract
from tensorfleet.cli import build_parser
from tensorfleet.sim.profile import make_profile
from tensorfleet.sim.tokenizer import count_tokens
from tensorfleet.testing.loopback import (
    MODEL,
    chat,
    free_port,
    metric_value,
    sim,
    spawn_sim,
    sse_events,
    wait_healthy,
)
from tensorfleet.testing.wait import eventually

DOCUMENTED_METRICS = (
    contract.VLLM_METRIC_RUNNING, contract.VLLM_METRIC_WAITING, contract.VLLM_METRIC_KV_CACHE_USAGE,
    contract.VLLM_METRIC_TTFT + "_bucket", contract.VLLM_METRIC_E2E_LATENCY + "_bucket",
    contract.VLLM_METRIC_PROMPT_TOKENS + "_total", contract.VLLM_METRIC_GENERATION_TOKENS + "_total",
    contract.VLLM_METRIC_PREFIX_CACHE_QUERIES + "_total", contract.VLLM_METRIC_PREFIX_CACHE_HITS + "_total",
    contract.VLLM_METRIC_REQUEST_SUCCESS + "_total",
)


@pytest.mark.asyncio
async def test_chat_and_completions_answer_in_openai_shapes() -> None:
    async with sim() as s, aiohttp.ClientSession() as client:
        async with client.post(s.url + "/v1/chat/completions", json=chat("hello", max_tokens=7)) as resp:
            assert resp.status == 200
            body = await resp.json()
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 7
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 7
        async with client.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 3}) as resp:
            body = await resp.json()
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 3
        assert isinstance(body["choices"][0]["text"], str)
        async with client.get(s.url + "/v1/models") as resp:
            models = await resp.json()
        assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.asyncio
async def test_stream_sends_one_event_per_token_as_it_is_generated() -> None:
    # ~70 ms decode steps x 0.3 = ~21 ms per token on the wall clock.
    async with sim(time_scale=0.3) as s, aiohttp.ClientSession() as client:
        request = chat("tell me a story", max_tokens=10, stream=True, stream_options={"include_usage": True})
        async with client.post(s.url + "/v1/chat/completions", json=request) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = [(t, data) async for t, data in sse_events(resp)]
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 10
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 10 and chunks[-1]["choices"] == []
    # Incremental: the first token arrived well before the last one.
    assert events[-1][0] - events[0][0] > 0.1


@pytest.mark.asyncio
async def test_streams_merge_tokens_as_vllm_and_carry_usage_on_every_event_when_asked() -> None:
    """--stream-interval 4: the first token alone, then four at a time, the last one with the finish reason;
    continuous_usage_stats: every event's usage counts its choice's tokens so far, exactly."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    async with sim(stream_interval=4) as s, aiohttp.ClientSession() as client:
        for path, body in (("/v1/chat/completions", chat("tell me a story", max_tokens=10)),
                           ("/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 10})):
            async with client.post(s.url + path, json=body) as resp:
                whole = await resp.json()
            async with client.post(s.url + path, json={**body, "stream": True, "stream_options": options}) as resp:
                events = [data async for _, data in sse_events(resp)]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(data) for data in events[:-1]]
            prompt = whole["usage"]["prompt_tokens"]
            final = chunks.pop()
            assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10
            assert final["usage"]["prompt_tokens"] == prompt and final["usage"]["total_tokens"] == prompt + 10
            if path == "/v1/chat/completions":
                role = chunks.pop(0)
                assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                assert role["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0}
                texts = [c["choices"][0]["delta"]["content"] for c in chunks]
                assert "".join(texts) == whole["choices"][0]["message"]["content"]
            else:
                texts = [c["choices"][0]["text"] for c in chunks]
                assert "".join(texts) == whole["choices"][0]["text"]
            assert [count_tokens(t) for t in texts] == [1, 4, 4, 1]
            assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
            sent = [count_tokens("".join(texts[:i + 1])) for i in range(len(texts))]
            # (vLLM's completions events also name prompt_tokens_details, as null.)
            assert all(c["usage"].pop("prompt_tokens_details", None) is None for c in chunks)
            assert [c["usage"] for c in chunks] == [
                {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n} for n in sent]
        # Without include_usage, continuous_usage_stats adds nothing (vLLM reads it only with include_usage).
        body = chat("hi", max_tokens=3, stream=True, stream_options={"continuous_usage_stats": True})
        async with client.post(s.url + "/v1/chat/completions", json=body) as resp:
            events = [data async for _, data in sse_events(resp)]
        assert not any("usage" in json.loads(data) for data in events[:-1])


@pytest.mark.asyncio
async def test_health_flips_after_the_startup_delay() -> None:
    async with sim(startup_delay=0.5) as s, aiohttp.ClientSession() as client:
        async with client.get(s.url + "/health") as resp:
            assert resp.status == 503
        async with client.post(s.url + "/v1/chat/completions", json=chat("hi")) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "ServiceUnavailableError"

        async def healthy() -> bool:
            async with client.get(s.url + "/health") as r:
                return r.status == 200
        await eventually(healthy, timeout=5)
        async with client.post(s.url + "/v1/chat/completions", json=chat("hi")) as resp:
            assert resp.status == 200


@pytest.mark.asyncio
async def test_bad_requests_get_openai_errors() -> None:
    async with sim(profile=make_profile(max_model_len=256)) as s, aiohttp.ClientSession() as client:
        cases = [
            ("/v1/chat/completions", b"{not json", 400, None),
            ("/v1/chat/completions", b"[1, 2]", 400, None),
            ("/v1/chat/completions", json.dumps({"model": "other", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model"),
            # vLLM's param is null for what its request validation or plain ValueErrors refuse.
            ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), 400, None),
            ("/v1/chat/completions", json.dumps(chat("word " * 400)).encode(), 400, "input_tokens"),
            ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "many"}).encode(), 400, None),
            ("/v1/completions", json.dumps({"model": MODEL, "prompt": {"a": 1}}).encode(), 400, None),
        ]
        for path, data, status, param in cases:
            async with client.post(s.url + path, data=data, headers={"Content-Type": "application/json"}) as resp:
                body = await resp.json()
                assert resp.status == status, (path, data[:40], body)
                assert set(body["error"]) == {"message", "type", "param", "code"}
                assert body["error"]["code"] == status and body["error"]["param"] == param
        # A path it does not serve, or a method a path does not take: FastAPI's answers, as vLLM's server gives.
        for method, path, status, detail in (("POST", "/v1/embeddings", 404, "Not Found"),
                                             ("GET", "/v1/chat/completions", 405, "Method Not Allowed")):
            async with client.request(method, s.url + path, data=b"{}") as resp:
                assert (resp.status, await resp.json()) == (status, {"detail": detail})


@pytest.mark.asyncio
async def test_metrics_have_vllm_names_and_labels() -> None:
    async with sim() as s, aiohttp.ClientSession() as client:
        async with client.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 4}) as resp:
            assert resp.status == 200
        async with client.get(s.url + "/metrics") as resp:
            text = await resp.text()
    for name in DOCUMENTED_METRICS:
        assert metric_value(text, name, model_name=MODEL) is not None, name
    assert metric_value(text, contract.VLLM_METRIC_GENERATION_TOKENS + "_total", model_name=MODEL) == 4
    assert metric_value(text, contract.VLLM_METRIC_REQUEST_SUCCESS + "_total", finished_reason="length") == 1
    assert metric_value(text, contract.VLLM_METRIC_TTFT + "_count") == 1
    assert metric_value(text, contract.VLLM_METRIC_CACHE_CONFIG, num_gpu_blocks=str(make_profile().num_blocks)) == 1


@pytest.mark.asyncio
async def test_waiting_gauge_shows_real_queueing_when_kv_runs_out() -> None:
    # 32 blocks: each 300-token request needs 19+, so one runs and the rest wait.
    profile = replace(make_profile(kv_cache_tokens=512), max_num_seqs=64)
    async with sim(profile=profile, time_scale=0.05) as s, aiohttp.ClientSession() as client:
        prompt = " ".join(f"t{i}x" for i in range(150))
        tasks = [asyncio.create_task(client.post(s.url + "/v1/chat/completions",
                                                 json=chat(f"{i} {prompt}", max_tokens=20))) for i in range(4)]
        seen: list[tuple[float, float]] = []

        async def queued() -> bool:
            async with client.get(s.url + "/metrics") as resp:
                text = await resp.text()
            waiting = metric_value(text, contract.VLLM_METRIC_WAITING) or 0
            running = metric_value(text, contract.VLLM_METRIC_RUNNING) or 0
            seen.append((running, waiting))
            return waiting >= 2 and running == 1
        await eventually(queued, timeout=5)
        for response in await asyncio.gather(*tasks):
            assert response.status == 200
            response.release()
        assert s.engine.stats.max_running == 1
        assert metric_value(await (await client.get(s.url + "/metrics")).text(), contract.VLLM_METRIC_KV_CACHE_USAGE) == 0


@pytest.mark.asyncio
async def test_prefix_hits_counted_in_metrics_and_usage() -> None:
    request = chat("a long shared system prompt " * 20, max_tokens=2)
    async with sim() as s, aiohttp.ClientSession() as client:
        # By default usage names no hit, as vLLM's (its --enable-prompt-tokens-details is off).
        for _ in range(2):
            async with client.post(s.url + "/v1/chat/completions", json=request) as resp:
                body = await resp.json()
        assert body["usage"]["prompt_tokens_details"] is None
    async with sim(prompt_tokens_details=True) as s, aiohttp.ClientSession() as client:
        for _ in range(2):
            async with client.post(s.url + "/v1/chat/completions", json=request) as resp:
                body = await resp.json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        async with client.get(s.url + "/metrics") as resp:
            text = await resp.text()
        hits = metric_value(text, contract.VLLM_METRIC_PREFIX_CACHE_HITS + "_total")
        queries = metric_value(text, contract.VLLM_METRIC_PREFIX_CACHE_QUERIES + "_total")
        assert hits == body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert queries == 2 * body["usage"]["prompt_tokens"]


@pytest.mark.asyncio
async def test_client_disconnect_aborts_the_request() -> None:
    async with sim(time_scale=0.2) as s, aiohttp.ClientSession() as client:
        resp = await client.post(s.url + "/v1/chat/completions", json=chat("go on", max_tokens=2000, stream=True))
        await resp.content.readany()
        assert s.engine.num_running == 1
        resp.close()  # drop the connection mid-stream
        await eventually(lambda: s.engine.num_running == 0 and s.engine.stats.aborted == 1)
        assert s.engine.pool.used == 0
        # Non-streaming too: the handler is cancelled while waiting.
        task = asyncio.create_task(client.post(s.url + "/v1/chat/completions", json=chat("wait", max_tokens=2000)))
        await eventually(lambda: s.engine.num_running == 1)
        task.cancel()
        await eventually(lambda: s.engine.num_running == 0 and s.engine.stats.aborted == 2)


def test_cli_takes_the_launcher_flags_and_ignores_unknown_vllm_flags() -> None:
    args = build_parser().parse_args([
        "sim", "--host", "127.0.0.1", "--port", "9000", "--served-model-name", "m", "--model", "Qwen/Qwen2.5-7B-Instruct",
        "--accelerator", "L40S", "--tensor-parallel-size", "1", "--max-model-len", "4096", "--max-num-seqs", "32",
        "--kv-cache-tokens", "10000", "--startup-delay", "2", "--time-scale", "0.5", "--seed", "3",
        "--gpu-memory-utilization", "0.9", "--enable-prefix-caching", "--dtype=bfloat16", "--max-num-batched-tokens", "512",
    ])
    assert (args.host, args.port, args.served_model_name, args.accelerator) == ("127.0.0.1", 9000, "m", "L40S")
    assert (args.max_model_len, args.max_num_seqs, args.kv_cache_tokens, args.seed) == (4096, 32, 10000, 3)
    assert args.max_num_batched_tokens == 512
    assert args.ignored_args == ["--gpu-memory-utilization", "0.9", "--enable-prefix-caching", "--dtype=bfloat16"]
    defaults = build_parser().parse_args(["sim", "--served-model-name", "m"])
    assert (defaults.host, defaults.port, defaults.ignored_args) == ("0.0.0.0", contract.ENGINE_PORT, [])
    # Abbreviations of known flags are not guessed from unknown ones.
    assert build_parser().parse_args(["sim", "--served-model-name", "m", "--max-num", "3"]).ignored_args == ["--max-num", "3"]


@pytest.mark.asyncio
async def test_cli_process_serves_with_extra_flags() -> None:
    port = free_port()
    with spawn_sim(port, "--accelerator", "H100-80GB", "--time-scale", "0.01", "--gpu-memory-utilization", "0.92",
                   "--disable-log-requests") as process:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url)
        async with aiohttp.ClientSession() as client:
            async with client.post(url + "/v1/chat/completions", json=chat("hi", max_tokens=3)) as resp:
                assert resp.status == 200
            async with client.get(url + "/metrics") as resp:
                text = await resp.text()
        assert metric_value(text, contract.VLLM_METRIC_CACHE_CONFIG,
                            num_gpu_blocks=str(make_profile(accelerator="H100-80GB").num_blocks)) == 1
        assert process.poll() is None


@pytest.mark.asyncio
async def test_time_scale_zero_runs_without_sleeping() -> None:
    # 200 simulated L4 decode steps are 14 s of model time; at scale 0 the
    # request must finish well inside the guard.
    async with sim(time_scale=0.0) as s, aiohttp.ClientSession() as client:
        post = client.post(s.url + "/v1/chat/completions", json=chat("x", max_tokens=200))
        async with await asyncio.wait_for(post, 10) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 200


@pytest.mark.asyncio
async def test_next_turn_hits_on_the_answer_blocks_too() -> None:
    async with sim(prompt_tokens_details=True) as s, aiohttp.ClientSession() as client:
        messages = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "First question?"}]
        async with client.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                    "max_tokens": 40}) as resp:
            first = await resp.json()
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And then?"}]
        async with client.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                    "max_tokens": 4}) as resp:
            second = await resp.json()
    # Everything the first turn computed (its prompt and all but the last
    # answer token), in whole blocks, is a hit.
    computed = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == computed // 16 * 16


def test_registering_the_commands_imports_no_server_code() -> None:
    # `tensorfleet plan` must stay fast: sim and router load aiohttp only when run.
    import subprocess
    import sys

    code = ("import sys; from tensorfleet.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'uvloop', 'prometheus_client')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
