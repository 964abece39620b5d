"""Stream resumption against real router and simulator processes: a stream whose engine hangs, stalls or dies
after part of the answer reached the client goes on from another engine as one uninterrupted stream; what a
continuation cannot reproduce still ends with the SSE error event. The simulator answers greedily (a prompt
holding the start of an answer is answered with the rest), so the resumed text must be exactly the answer an
engine that never broke gives."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tensorfleet import contract
from tensorfleet.router import resume, tokencount
from tensorfleet.router.resume import StreamState
from tensorfleet.sim.tokenizer import count_tokens
from tensorfleet.testing.loopback import (
    MODEL,
    chat,
    fake_engine,
    metric_value,
    router,
    sim,
    sim_process,
    sse_events,
)
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio

CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=30)  # only ever reached when a test fails
PROMPT = "Tell me about the history of the bicycle, in detail."
RESUMED = contract.ROUTER_METRIC_STREAM_RESUMPTIONS + "_total"
STREAM_ERRORS = contract.ROUTER_METRIC_STREAM_ERRORS + "_total"


async def answer(client: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The whole answer an engine gives BODY unstreamed: what the stream must add up to (stream_options go: vLLM
    takes them only with a stream)."""
    whole = {name: value for name, value in body.items() if name != "stream_options"}
    async with client.post(url + path, json={**whole, "stream": False}) as resp:
        assert resp.status == 200
        result: dict[str, Any] = await resp.json()
        return result


async def stream_through(client: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], *,
                         after: int = 0, then: Callable[[], None] | None = None,
                         headers: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """Stream BODY; THEN() once AFTER events arrived. The engine that started it, and every event's data."""
    events: list[str] = []
    async with client.post(url + path, json=body, headers=headers) as resp:
        assert resp.status == 200
        backend = resp.headers[contract.BACKEND_HEADER]
        async for _, data in sse_events(resp):
            events.append(data)
            if len(events) == after and then is not None:
                then()
    return backend, events


def parsed(events: list[str]) -> list[dict[str, Any]]:
    """The JSON events before [DONE], which must end the stream."""
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def assert_one_stream(chunks: list[dict[str, Any]], expected: dict[str, Any], max_tokens: int, *, chat: bool) -> str:
    """One id, the full answer once (no text missing or repeated), one finish, usage for the original prompt."""
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert {c["model"] for c in chunks} == {MODEL}
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    if chat:
        text = "".join(ch["delta"].get("content") or "" for ch in choices)
        assert sum(1 for ch in choices if "role" in ch["delta"]) == 1  # the role delta once, first
        assert "role" in choices[0]["delta"]
        assert text == expected["choices"][0]["message"]["content"]
    else:
        text = "".join(ch["text"] for ch in choices)
        assert text == expected["choices"][0]["text"]
    assert count_tokens(text) == max_tokens
    assert [ch["finish_reason"] for ch in choices if ch["finish_reason"]] == ["length"]
    assert choices[-1]["finish_reason"] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == max_tokens
    assert usage["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + max_tokens
    return text


async def metrics(client: aiohttp.ClientSession, url: str) -> str:
    async with client.get(url + "/metrics") as resp:
        return await resp.text()


# --- resumed -------------------------------------------------------------------------------------------------

async def test_a_completion_stream_whose_engine_hangs_mid_way_is_finished_by_another_engine() -> None:
    async with sim_process("--time-scale", "0.2") as (hung_url, process), AsyncExitStack() as stack:
        live = await stack.enter_async_context(sim())
        # Health checks every 0.1 s with a 0.5 s bound find the hang and eject it as unresponsive; its stream, quiet
        # since, is resumed then (long before --stream-idle-timeout's 30 s).
        r = await stack.enter_async_context(router([hung_url, live.url], strategy="round-robin", health_timeout=0.5))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "stream": True,
                "stream_options": {"include_usage": True}}
        expected = await answer(client, live.url, "/v1/completions", body)
        live_before = live.engine.stats.prompt_tokens
        try:
            backend, events = await stream_through(client, r.url, "/v1/completions", body, after=5,
                                                   then=lambda: process.send_signal(signal.SIGSTOP))
        finally:
            process.send_signal(signal.SIGCONT)
        assert backend == hung_url
        chunks = parsed(events)
        assert not any("error" in c for c in chunks)
        assert_one_stream(chunks, expected, 300, chat=False)
        assert live.engine.stats.prompt_tokens > live_before  # the continuation ran there
        text = await metrics(client, r.url)
        assert metric_value(text, RESUMED, reason="unresponsive") == 1
        assert metric_value(text, STREAM_ERRORS, backend=hung_url) is None


async def test_a_chat_stream_that_stalls_is_continued_from_the_assistant_message_sent() -> None:
    async with sim_process("--time-scale", "0.2") as (stalled_url, process), AsyncExitStack() as stack:
        live = await stack.enter_async_context(sim())
        # No health checks after the first: only the stall timeout can notice.
        r = await stack.enter_async_context(router([stalled_url, live.url], strategy="round-robin",
                                                   health_interval=60, stream_idle_timeout=0.5))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        body = chat(PROMPT, max_tokens=300, stream=True, stream_options={"include_usage": True})
        expected = await answer(client, live.url, "/v1/chat/completions", body)
        try:
            backend, events = await stream_through(client, r.url, "/v1/chat/completions", body, after=8,
                                                   then=lambda: process.send_signal(signal.SIGSTOP))
        finally:
            process.send_signal(signal.SIGCONT)
        assert backend == stalled_url
        chunks = parsed(events)
        assert_one_stream(chunks, expected, 300, chat=True)
        assert metric_value(await metrics(client, r.url), RESUMED, reason="stalled") == 1
        assert r.router.pool.backends[stalled_url].in_flight == 0


async def test_a_stream_whose_engine_process_is_killed_goes_on_and_the_next_requests_avoid_it() -> None:
    async with sim_process("--time-scale", "0.2") as (dead_url, process), AsyncExitStack() as stack:
        live = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([dead_url, live.url], strategy="round-robin"))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        body = chat("long", max_tokens=300, stream=True)  # no usage asked: the stream ends at [DONE]
        expected = await answer(client, live.url, "/v1/chat/completions", body)
        backend, events = await stream_through(client, r.url, "/v1/chat/completions", body, after=3,
                                               then=lambda: process.send_signal(signal.SIGKILL))
        assert backend == dead_url
        chunks = parsed(events)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == expected["choices"][0]["message"]["content"] and count_tokens(text) == 300
        assert not any("usage" in c and c["usage"] for c in chunks)
        assert metric_value(await metrics(client, r.url), RESUMED, reason="failed") == 1
        assert not r.router.pool.backends[dead_url].healthy  # a reset connection ejects at once
        async with client.post(r.url + "/v1/chat/completions", json=chat("after", max_tokens=2)) as resp:
            assert resp.status == 200 and resp.headers[contract.BACKEND_HEADER] == live.url


async def test_a_resumed_stream_of_merged_events_counts_its_tokens_exactly(tmp_path: Path) -> None:
    """Engines that send several tokens in one event (vLLM does when its HTTP handler falls behind the engine,
    and with --stream-interval): the continuation is given exactly the tokens left, the client's usage counts the
    original prompt and every completion token, and the API key is charged exactly that."""
    keys = tmp_path / "keys"
    keys.write_text("team-a:sk-team-a-5d1e\n")
    async with sim_process("--time-scale", "0.2", "--stream-interval", "4") as (hung_url, process), \
            AsyncExitStack() as stack:
        live = await stack.enter_async_context(sim(stream_interval=4))
        r = await stack.enter_async_context(router([hung_url, live.url], strategy="round-robin", health_timeout=0.5,
                                                   api_keys=str(keys), tokens_per_minute=100_000))
        limits = r.router.key_limits
        limits.clock = lambda: 0.0  # no refill: the bucket shows the charge
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "stream": True,
                "stream_options": {"include_usage": True}}
        expected = await answer(client, live.url, "/v1/completions", body)
        try:
            backend, events = await stream_through(client, r.url, "/v1/completions", body, after=5,
                                                   then=lambda: process.send_signal(signal.SIGSTOP),
                                                   headers={"Authorization": "Bearer sk-team-a-5d1e"})
        finally:
            process.send_signal(signal.SIGCONT)
        assert backend == hung_url
        chunks = parsed(events)
        assert max(count_tokens(c["choices"][0]["text"]) for c in chunks if c["choices"]) >= 4  # merged
        assert_one_stream(chunks, expected, 300, chat=False)  # no token missing or too many; its usage exact
        # Only the final usage event the client asked for (completions events say `"usage": null`, as vLLM's do).
        assert [c for c in chunks if c.get("usage")] == [chunks[-1]]
        assert metric_value(await metrics(client, r.url), RESUMED, reason="unresponsive") == 1
        used = expected["usage"]["prompt_tokens"] + 300
        await eventually(lambda: limits.tokens_left("team-a") == 100_000 - used)


async def test_a_resumed_chat_stream_carries_exact_running_usage_on_every_event() -> None:
    async with sim_process("--time-scale", "0.2", "--stream-interval", "3") as (stalled_url, process), \
            AsyncExitStack() as stack:
        live = await stack.enter_async_context(sim(stream_interval=3))
        r = await stack.enter_async_context(router([stalled_url, live.url], strategy="round-robin",
                                                   health_interval=60, stream_idle_timeout=0.5))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        body = chat(PROMPT, max_tokens=200, stream=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
        expected = await answer(client, live.url, "/v1/chat/completions", body)
        try:
            backend, events = await stream_through(client, r.url, "/v1/chat/completions", body, after=6,
                                                   then=lambda: process.send_signal(signal.SIGSTOP))
        finally:
            process.send_signal(signal.SIGCONT)
        assert backend == stalled_url
        chunks = parsed(events)
        assert_one_stream(chunks, expected, 200, chat=True)
        prompt = expected["usage"]["prompt_tokens"]
        text = ""
        for chunk in chunks[:-1]:
            text += chunk["choices"][0]["delta"].get("content") or ""
            assert chunk["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt + count_tokens(text),
                                      "completion_tokens": count_tokens(text)}
        assert metric_value(await metrics(client, r.url), RESUMED, reason="stalled") == 1


# --- fake engines that break in set ways -------------------------------------------------------------------
# --- fake engines that break in set ways -------------------------------------------------------------------

def stalling(*events: dict[str, Any]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A `fake_engine` handler: starts an SSE stream, sends EVENTS, then nothing more."""
    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events))
        await asyncio.sleep(3600)
        return response
    return handle


def completion_event(text: str, id_: str = "cmpl-stalled") -> dict[str, Any]:
    return {"id": id_, "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}


def chat_event(delta: dict[str, Any], id_: str = "chatcmpl-stalled") -> dict[str, Any]:
    return {"id": id_, "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}


async def test_a_stall_after_part_of_an_answer_resumes_with_the_text_sent_and_the_tokens_left() -> None:
    async with AsyncExitStack() as stack:
        # Its events carry the usage the router asks for (vLLM's continuous_usage_stats): the 2 tokens sent.
        stalled_url, calls = await stack.enter_async_context(fake_engine(stalling(
            {**completion_event(" once"), "usage": usage(1, 1)}, {**completion_event(" upon"), "usage": usage(1, 2)})))
        live = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([stalled_url, live.url], strategy="round-robin",
                                                   health_interval=60, stream_idle_timeout=0.3))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        body = {"model": MODEL, "prompt": "x", "max_tokens": 6, "min_tokens": 3, "stream": True}
        # What the live engine gives the continuation: "x once upon", 4 tokens.
        rest = await answer(client, live.url, "/v1/completions", {**body, "prompt": "x once upon", "max_tokens": 4})
        backend, events = await stream_through(client, r.url, "/v1/completions", body)
        assert backend == stalled_url
        await eventually(lambda: calls == ["/v1/completions", "closed"])  # the router hung up on it
        chunks = parsed(events)
        assert {c["id"] for c in chunks} == {"cmpl-stalled"} and {c["created"] for c in chunks} == {1}
        assert not any(c.get("usage") for c in chunks)  # the client asked for none (completions: null, as vLLM)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == " once upon" + rest["choices"][0]["text"] and count_tokens(text) == 6


async def test_streams_a_continuation_cannot_reproduce_still_end_with_the_error_event() -> None:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"n": 2}),
        ("/v1/completions", {"best_of": 2}),
        ("/v1/completions", {"logprobs": 1}),
        ("/v1/completions", {"echo": True}),
        ("/v1/completions", {"prompt": [1, 2, 3]}),
        ("/v1/completions", {"prompt_logprobs": 1}),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
        ("/v1/chat/completions", {"tool_choice": "required", "tools": []}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"},
                                               {"role": "assistant", "content": "Once"}],
                                  "continue_final_message": True, "add_generation_prompt": False}),
    ]
    async with AsyncExitStack() as stack:
        stalled_url, calls = await stack.enter_async_context(fake_engine(stalling(completion_event(" first"))))
        live = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([stalled_url, live.url], strategy="round-robin",
                                                   health_interval=60, stream_idle_timeout=0.3))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        for path, extra in cases:
            base = {"model": MODEL, "prompt": "x"} if path == "/v1/completions" else chat("x")
            backend, events = await stream_through(client, r.url, path, {**base, "max_tokens": 5, "stream": True,
                                                                         **extra})
            assert backend == stalled_url, extra  # round-robin: the live engine takes the request in between
            error = json.loads(events[-1])["error"]
            assert error["code"] == 504 and "sent nothing for 0.3s" in error["message"], extra
            assert "[DONE]" not in events
            # The live engine's one request in between, from the round-robin.
            async with client.post(r.url + path, json={**base, "max_tokens": 1}) as resp:
                assert resp.status == 200 and resp.headers[contract.BACKEND_HEADER] == live.url
        assert calls.count("/v1/completions") + calls.count("/v1/chat/completions") == len(cases)
        text = await metrics(client, r.url)
        assert metric_value(text, RESUMED, reason="stalled") is None
        assert metric_value(text, STREAM_ERRORS, backend=stalled_url) == len(cases)


async def test_a_stream_with_tool_calls_in_flight_is_not_resumed() -> None:
    async with AsyncExitStack() as stack:
        stalled_url, _ = await stack.enter_async_context(fake_engine(stalling(
            chat_event({"role": "assistant", "content": ""}),
            chat_event({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": "{\"ci"}}]}))))
        live = await stack.enter_async_context(sim())
        r = await stack.enter_async_context(router([stalled_url, live.url], health_interval=60,
                                                   strategy="round-robin", stream_idle_timeout=0.3))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        _, events = await stream_through(client, r.url, "/v1/chat/completions",
                                         chat("weather?", stream=True, tools=tools, tool_choice="auto"))
        assert "error" in json.loads(events[-1])
        assert live.engine.stats.prompt_tokens == 0


async def test_resumptions_are_bounded_and_never_go_back_to_an_engine_the_stream_broke_on() -> None:
    async with AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(fake_engine(stalling(
            *([chat_event({"role": "assistant", "content": ""}, f"chatcmpl-{i}")] if i == 0 else []),
            chat_event({"content": f" part{i}"}, f"chatcmpl-{i}")))) for i in range(3)]
        r = await stack.enter_async_context(router([url for url, _ in fakes], strategy="round-robin",
                                                   health_interval=60, stream_idle_timeout=0.3,
                                                   stream_resumptions=2))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        backend, events = await stream_through(client, r.url, "/v1/chat/completions", chat("x", stream=True))
        assert backend == fakes[0][0]
        error = json.loads(events[-1])["error"]
        assert error["code"] == 504 and "the answer is incomplete" in error["message"]
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["id"] for c in chunks} == {"chatcmpl-0"}
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text.startswith(" part0") and sorted(text.split()) == ["part0", "part1", "part2"]  # once each
        assert [calls.count("/v1/chat/completions") for _, calls in fakes] == [1, 1, 1]
        text = await metrics(client, r.url)
        assert metric_value(text, RESUMED, reason="stalled") == 2
        assert sum(metric_value(text, STREAM_ERRORS, backend=url) or 0 for url, _ in fakes) == 1
    # Resumptions to spare, but no engine the stream has not broken on: it ends there.
    async with AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(fake_engine(stalling(chat_event({"content": f" part{i}"}))))
                 for i in range(2)]
        r = await stack.enter_async_context(router([url for url, _ in fakes], health_interval=60,
                                                   stream_idle_timeout=0.3, stream_resumptions=5))
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=CLIENT_TIMEOUT))
        _, events = await stream_through(client, r.url, "/v1/chat/completions", chat("x", stream=True))
        assert "error" in json.loads(events[-1])
        assert [calls.count("/v1/chat/completions") for _, calls in fakes] == [1, 1]
        assert metric_value(await metrics(client, r.url), RESUMED, reason="stalled") == 1


# --- the relay's bookkeeping, event by event -----------------------------------------------------------------

def sse(*events: dict[str, Any] | str) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events)


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": prompt}}


async def test_events_split_across_reads_reach_the_client_whole_and_a_continuation_is_rewritten() -> None:
    body = json.dumps(chat("x", max_tokens=10, min_tokens=4, stream=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True})).encode()
    state = StreamState.start("/v1/chat/completions", body)
    first = sse({**chat_event({"role": "assistant", "content": ""}, "chatcmpl-a"), "usage": usage(7, 0)},
                {**chat_event({"content": " Hel"}, "chatcmpl-a"), "usage": usage(7, 1)},
                {**chat_event({"content": "lo \"w\""}, "chatcmpl-a"), "usage": usage(7, 2)})
    cut = len(first) - 5
    assert state.feed(first[:cut]) == first[:first.rindex(b"data: ")]  # whole events only
    assert state.feed(first[cut:]) == first[first.rindex(b"data: "):]
    assert ("".join(state.text), state.tokens) == (' Hello "w"', 2)
    body_next = state.continuation_body()
    assert body_next is not None
    assert body_next["messages"][-1] == {"role": "assistant", "content": ' Hello "w"'}
    assert (body_next["continue_final_message"], body_next["add_generation_prompt"]) == (True, False)
    assert (body_next["max_tokens"], body_next["min_tokens"]) == (8, 2)
    state.begin_continuation()
    # The continuation: its prompt holds the 2 tokens sent; its role delta goes, its id becomes the stream's.
    out = state.feed(sse({**chat_event({"role": "assistant", "content": ""}, "chatcmpl-b"), "usage": usage(9, 0)},
                         {**chat_event({"content": " world"}, "chatcmpl-b"), "usage": usage(9, 1)},
                         {"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 2, "model": MODEL,
                          "choices": [], "usage": usage(9, 8)}, "[DONE]"))
    events = [json.loads(line[6:]) for line in out.split(b"\n\n") if line.startswith(b"data: {")]
    assert [e["id"] for e in events] == ["chatcmpl-a", "chatcmpl-a"] and {e["created"] for e in events} == {1}
    assert events[0]["choices"][0]["delta"] == {"content": " world"}
    assert events[0]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert events[1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17}
    assert out.endswith(b"data: [DONE]\n\n") and state.done and state.tokens == 10


async def test_a_completion_continuation_takes_vllms_default_max_tokens_and_ends_when_none_are_left() -> None:
    state = StreamState.start("/v1/completions", json.dumps({"prompt": ["Once"], "stream": True}).encode())
    state.feed(sse(*(completion_event(f" w{i}") for i in range(5))))
    body = state.continuation_body()
    assert body is not None and (body["prompt"], body["max_tokens"]) == ("Once w0 w1 w2 w3 w4", 16 - 5)
    state.feed(sse(*(completion_event(f" v{i}") for i in range(11))))
    assert state.continuation_body() is None and not state.complete  # all 16 sent, the finish event lost
    finish, done, rest = state.ending().split(b"\n\n")
    assert json.loads(finish.removeprefix(b"data: ")) == {
        "id": "cmpl-stalled", "object": "text_completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "finish_reason": "length", "logprobs": None, "text": ""}]}
    assert (done, rest) == (b"data: [DONE]", b"")


def compact(event: dict[str, Any]) -> dict[str, Any] | str:
    """EVENT as vLLM writes it (no spaces): what StreamState reads without a whole parse."""
    return json.dumps(event, separators=(",", ":"))


def running(prompt: int, completion: int) -> dict[str, Any]:
    """An event's usage with vLLM's continuous_usage_stats, in its key order."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


@pytest.mark.parametrize("write", [compact, lambda event: event], ids=["as-vllm", "spaced"])
async def test_the_engines_counts_drive_the_continuation_and_the_client_gets_only_the_usage_it_asked(
        write: Callable[[dict[str, Any]], dict[str, Any] | str]) -> None:
    # The client asked for no usage; the router asked the engine for it on every event (resume.ask_usage).
    client_body = {**chat("x", max_tokens=10, min_tokens=6), "stream": True}
    asked = resume.ask_usage(json.dumps(client_body, separators=(",", ":")).encode(), client_body)
    assert asked is not None, "a body without stream_options gets them"
    body, options = asked
    assert json.loads(body) == {**client_body, "stream_options": resume.USAGE_OPTIONS} == {**client_body,
                                                                                            "stream_options": options}
    state = StreamState.start("/v1/chat/completions", body, usage=(False, False), added=True)
    out = state.feed(sse(write({**chat_event({"role": "assistant", "content": ""}, "chatcmpl-a"), "usage": running(7, 0)}),
                         write({**chat_event({"content": " one two three"}, "chatcmpl-a"), "usage": running(7, 3)}),
                         write({**chat_event({"content": " four"}, "chatcmpl-a"), "usage": running(7, 4)})))
    events = [json.loads(line[6:]) for line in out.split(b"\n\n") if line]
    assert [e["choices"][0]["delta"] for e in events] == [{"role": "assistant", "content": ""},
                                                          {"content": " one two three"}, {"content": " four"}]
    assert not any("usage" in e for e in events)  # cut: the client did not ask for it
    assert (state.tokens, state.prompt_tokens) == (4, 7)  # 4 tokens in 2 events
    continuation = state.continuation_body()
    assert continuation is not None and (continuation["max_tokens"], continuation["min_tokens"]) == (6, 2)
    assert continuation["stream_options"] == resume.USAGE_OPTIONS
    state.begin_continuation()
    # The continuation's prompt holds the text sent (4 more tokens): the client's usage would not say so.
    out = state.feed(sse(write({**chat_event({"role": "assistant", "content": ""}, "chatcmpl-b"), "usage": running(11, 0)}),
                         write({**chat_event({"content": " five six"}, "chatcmpl-b"), "usage": running(11, 2)}),
                         write({"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 2, "model": MODEL,
                                "choices": [], "usage": running(11, 6)}), "[DONE]"))
    events = [json.loads(line[6:]) for line in out.split(b"\n\n") if line.startswith(b"data: {")]
    assert [e["choices"][0]["delta"] for e in events] == [{"content": " five six"}]  # no usage event: not asked
    assert "usage" not in events[0] and out.endswith(b"data: [DONE]\n\n")
    assert (state.tokens, state.prompt_tokens) == (10, 7)
    # A client that asked for the final usage event gets it, counted as one stream: the original prompt, all 10.
    state = StreamState.start("/v1/chat/completions", body, usage=(True, False), added=True)
    state.feed(sse(write({**chat_event({"content": " one two three four"}, "chatcmpl-a"), "usage": running(7, 4)})))
    state.begin_continuation()
    out = state.feed(sse(write({**chat_event({"content": " five"}, "chatcmpl-b"), "usage": running(11, 1)}),
                         write({"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 2, "model": MODEL,
                                "choices": [], "usage": running(11, 6)})))
    events = [json.loads(line[6:]) for line in out.split(b"\n\n") if line]
    assert "usage" not in events[0]
    assert events[1]["usage"] == {"prompt_tokens": 7, "total_tokens": 17, "completion_tokens": 10}
    # Completions events without usage say `"usage": null` in vLLM: so do the ones it is cut from.
    state = StreamState.start("/v1/completions", json.dumps({"prompt": "x", "stream": True}).encode(),
                              usage=(False, False), added=True)
    out = state.feed(sse(write({**completion_event(" one two"), "usage": {**running(1, 2),
                                                                            "prompt_tokens_details": None}})))
    assert json.loads(out[6:])["usage"] is None and (state.tokens, state.prompt_tokens) == (2, 1)
    state.begin_continuation()
    out = state.feed(sse(write({**completion_event(" three", "cmpl-b"), "usage": running(3, 1)})))
    assert json.loads(out[6:])["usage"] is None and (state.tokens, state.prompt_tokens) == (3, 1)


async def test_an_engine_that_reports_no_usage_is_counted_from_its_text_not_its_events() -> None:
    state = StreamState.start("/v1/completions", json.dumps({"prompt": "Once", "max_tokens": 20,
                                                             "stream": True}).encode())
    state.feed(sse(completion_event(" a bb ccc"), completion_event(" dd")))  # 12 characters in 2 events
    assert state.tokens == tokencount.estimate_tokens(12, 2) == 4  # a token per 3 characters, at least one per event
    body = state.continuation_body()
    assert body is not None and (body["prompt"], body["max_tokens"]) == ("Once a bb ccc dd", 16)
    # Its finish event (with the last token, as vLLM sends it) sent, the engine broke before the rest: the
    # stream ends, with the usage event the client asked for when an engine counted the prompt.
    body_usage = json.dumps({"prompt": "Once", "max_tokens": 3, "stream": True,
                             "stream_options": {"include_usage": True}}).encode()
    state = StreamState.start("/v1/completions", body_usage, usage=(True, False), added=True)
    state.feed(sse(compact({**completion_event(" w0 w1"), "usage": running(2, 2)}),
                   compact({**completion_event(" w2"), "choices": [{"index": 0, "text": " w2", "logprobs": None,
                                                                    "finish_reason": "length"}],
                            "usage": running(2, 3)})))
    assert state.complete and state.continuation_body() is None
    finish, done, rest = state.ending().split(b"\n\n")
    assert json.loads(finish.removeprefix(b"data: "))["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                                                     "total_tokens": 5}
    assert (done, rest) == (b"data: [DONE]", b"")
