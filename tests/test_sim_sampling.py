"""The simulator's sampling parameters on a real server on loopback: n, stop, logprobs, echo and structured
output honoured in vLLM's shapes, or refused with 400 as vLLM refuses them; never ignored."""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import jsonschema
import pytest

from tensorfleet.sim.params import MAX_LOGPROBS, MAX_N, VOCAB_SIZE
from tensorfleet.sim.tokenizer import tokenize
from tensorfleet.testing.loopback import MODEL, chat, sim, sse_events

pytestmark = pytest.mark.asyncio

PROMPT = "The quick brown fox jumps over the lazy dog"


async def post(client: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with client.post(url + path, json=body) as resp:
        return resp.status, await resp.json()


async def stream(client: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with client.post(url + path, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        events = [data async for _, data in sse_events(resp)]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def completion(prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, **extra}


async def serving() -> tuple[AsyncExitStack, str, aiohttp.ClientSession, Any]:
    stack = AsyncExitStack()
    s = await stack.enter_async_context(sim())
    client = await stack.enter_async_context(aiohttp.ClientSession())
    return stack, s.url, client, s


# --- n ----------------------------------------------------------------------------------------------------------

async def test_n_gives_n_indexed_choices_each_an_engine_sequence_and_usage_counts_them_all() -> None:
    stack, url, client, s = await serving()
    async with stack:
        status, body = await post(client, url, "/v1/completions", completion(n=3, max_tokens=6, seed=11))
        assert status == 200, body
        choices = body["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        assert len({c["text"] for c in choices}) == 3  # three samples, not one thrice
        assert all(len(tokenize(c["text"])) == 6 and c["finish_reason"] == "length" for c in choices)
        usage = body["usage"]
        assert usage["completion_tokens"] == 18 and usage["prompt_tokens"] == len(tokenize(PROMPT))
        assert usage["total_tokens"] == usage["prompt_tokens"] + 18
        # Three sequences in the batch at once, as vLLM's parallel sampling runs them.
        assert s.engine.stats.max_running == 3
        # Deterministic with a seed; choice 0 is what n=1 gives.
        again = (await post(client, url, "/v1/completions", completion(n=3, max_tokens=6, seed=11)))[1]
        assert [c["text"] for c in again["choices"]] == [c["text"] for c in choices]
        single = (await post(client, url, "/v1/completions", completion(max_tokens=6, seed=11)))[1]
        assert single["choices"][0]["text"] == choices[0]["text"]


async def test_a_stream_of_n_choices_names_each_choice_in_its_events() -> None:
    stack, url, client, _ = await serving()
    async with stack:
        chunks = await stream(client, url, "/v1/chat/completions",
                              chat("hello", max_tokens=4, n=2, stream_options={"include_usage": True}))
        by_index: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for chunk in chunks:
            for choice in chunk["choices"]:
                by_index[choice["index"]].append(choice)
        assert sorted(by_index) == [0, 1]
        for events in by_index.values():
            assert events[0]["delta"] == {"role": "assistant", "content": ""}
            assert len([e for e in events if e["delta"].get("content")]) == 4
            assert events[-1]["finish_reason"] == "length" and events[-1]["stop_reason"] is None
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def body_error(kind: str, loc: tuple[Any, ...], msg: str, value: Any) -> str:
    """The message vLLM's request validation (pydantic's, through FastAPI) gives, up to its source location."""
    return f"1 validation error:\n  {({'type': kind, 'loc': loc, 'msg': msg, 'input': value})!r}"


async def test_n_and_best_of_out_of_range_are_refused_like_vllm() -> None:
    stack, url, client, _ = await serving()
    async with stack:
        for extra, message, param in (
                ({"n": 0}, "n must be at least 1, got 0.", None),
                ({"n": MAX_N + 1}, (f"n must be at most {MAX_N}, got {MAX_N + 1}. To increase this limit, set the "
                                   "VLLM_MAX_N_SEQUENCES environment variable."), None),
                ({"n": "two"}, body_error("int_parsing", ("body", "n"), "Input should be a valid integer, unable to "
                                          "parse string as an integer", "two"), None),
                ({"use_beam_search": True}, "use_beam_search is not supported by the simulator", "use_beam_search"),
        ):
            status, body = await post(client, url, "/v1/completions", completion(**extra))
            assert (status, body["error"]["message"], body["error"]["param"]) == (400, message, param)
        # vLLM reads "2" as 2 (pydantic's lax mode), and 0.19.1 has no best_of: it ignores it, as it ignores any
        # field it does not know.
        for extra, choices in (({"n": "2"}, 2), ({"best_of": 2}, 1)):
            status, body = await post(client, url, "/v1/completions", completion(max_tokens=2, **extra))
            assert status == 200 and len(body["choices"]) == choices


# --- stop ------------------------------------------------------------------------------------------------------------

def stop_after(text: str, stop: str) -> tuple[str, int]:
    """The text vLLM returns for `stop` (cut before the first occurrence) and the tokens generated to find it."""
    words = tokenize(text)
    count = next(k for k in range(1, len(words) + 1) if stop in "".join(words[:k]))
    return text[: text.index(stop)], count


async def test_stop_cuts_the_text_at_the_first_stop_string_and_ends_the_request_there() -> None:
    stack, url, client, _ = await serving()
    async with stack:
        request = completion(max_tokens=30, seed=3)
        full = (await post(client, url, "/v1/completions", request))[1]["choices"][0]["text"]
        words = tokenize(full)
        stop = words[6] + words[7]  # two words: the stop string spans tokens
        expected, tokens = stop_after(full, stop)
        body = (await post(client, url, "/v1/completions", {**request, "stop": [" never-said", stop]}))[1]
        choice = body["choices"][0]
        assert choice["text"] == expected and stop not in choice["text"]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        assert body["usage"]["completion_tokens"] == tokens < 30  # the rest was never generated
        kept = (await post(client, url, "/v1/completions",
                           {**request, "stop": stop, "include_stop_str_in_output": True}))[1]["choices"][0]
        assert kept["text"] == expected + stop
        # Streamed: the deltas add up to the cut text (a stream cannot take back what it sent, so no event
        # carried any of the stop string: the start of one is held back until it is known not to be one).
        chunks = await stream(client, url, "/v1/completions", {**request, "stop": stop})
        texts = [c["choices"][0]["text"] for c in chunks]
        assert "".join(texts) == expected
        assert len(texts) == tokens  # an event per token, the last one with the finish reason (as vLLM sends it)
        assert (chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"]) == ("stop", stop)
        # A stop string that never shows: the answer runs to max_tokens.
        missed = (await post(client, url, "/v1/completions", {**request, "stop": "\n"}))[1]["choices"][0]
        assert (missed["text"], missed["finish_reason"], missed["stop_reason"]) == (full, "length", None)


async def test_chat_stop_and_bad_stop_values() -> None:
    stack, url, client, _ = await serving()
    async with stack:
        request = chat("tell me", max_tokens=25, seed=5)
        full = (await post(client, url, "/v1/chat/completions", request))[1]["choices"][0]["message"]["content"]
        stop = tokenize(full)[4]
        expected, _ = stop_after(full, stop)
        choice = (await post(client, url, "/v1/chat/completions", {**request, "stop": stop}))[1]["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", stop)
        empty = "stop cannot contain an empty string."
        for bad, message in (("", empty), ([" a", ""], empty)):
            status, body = await post(client, url, "/v1/chat/completions", {**request, "stop": bad})
            assert (status, body["error"]["message"], body["error"]["param"]) == (400, message, None)
        status, body = await post(client, url, "/v1/chat/completions", {**request, "stop": 3})
        assert (status, body["error"]["type"], body["error"]["param"]) == (400, "Bad Request", None)
        assert body["error"]["message"].startswith("2 validation errors:\n  {'type': 'string_type', 'loc': ('body', "
                                                   "'stop', 'str'), 'msg': 'Input should be a valid string'")


# --- logprobs --------------------------------------------------------------------------------------------------------

async def test_completion_logprobs_in_vllm_shape() -> None:
    stack, url, client, _ = await serving()
    async with stack:
        request = completion(max_tokens=5, logprobs=3, seed=1)
        body = (await post(client, url, "/v1/completions", request))[1]
        choice = body["choices"][0]
        logprobs = choice["logprobs"]
        assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert logprobs["tokens"] == tokenize(choice["text"])
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(5)]
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                       strict=True):
            assert logprob < 0 and len(top) == 3 and top[token] == logprob == max(top.values())
        assert (await post(client, url, "/v1/completions", request))[1]["choices"][0]["logprobs"] == logprobs
        one = (await post(client, url, "/v1/completions", {**request, "logprobs": 0}))[1]["choices"][0]["logprobs"]
        assert all(len(top) == 1 for top in one["top_logprobs"])
        # Streamed: each token's event carries its own (the last one's with the finish reason).
        chunks = await stream(client, url, "/v1/completions", request)
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
        streamed = [c["choices"][0]["logprobs"] for c in chunks]
        assert [s["tokens"] for s in streamed] == [[t] for t in logprobs["tokens"]]
        assert [s["text_offset"] for s in streamed] == [[o] for o in logprobs["text_offset"]]
        too_many = (f"Requested sample logprobs of {MAX_LOGPROBS + 1}, which is greater than max allowed: "
                    f"{MAX_LOGPROBS} (parameter=logprobs, value={MAX_LOGPROBS + 1})")
        status, error = await post(client, url, "/v1/completions", {**request, "logprobs": MAX_LOGPROBS + 1})
        assert (status, error["error"]["message"], error["error"]["param"]) == (400, too_many, "logprobs")
        # Refused by vLLM's request validation, which names the parameter.
        status, error = await post(client, url, "/v1/completions", {**request, "logprobs": -1})
        assert (status, error["error"]["type"], error["error"]["param"]) == (400, "Bad Request", "logprobs")
        assert "'msg': 'Value error, `logprobs` must be a positive value. (parameter=logprobs, value=-1)'" \
            in error["error"]["message"]
        # true is 1 to vLLM (pydantic's lax mode).
        status, one = await post(client, url, "/v1/completions", {**request, "logprobs": True})
        assert status == 200 and all(len(top) == 1 for top in one["choices"][0]["logprobs"]["top_logprobs"])


async def test_chat_logprobs_in_vllm_shape() -> None:
    stack, url, client, _ = await serving()
    async with stack:
        request = chat("hello", max_tokens=4, logprobs=True, top_logprobs=2)
        choice = (await post(client, url, "/v1/chat/completions", request))[1]["choices"][0]
        content = choice["logprobs"]["content"]
        assert "".join(entry["token"] for entry in content) == choice["message"]["content"]
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert entry["bytes"] == list(entry["token"].encode())
            assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"]
            assert entry["top_logprobs"][0]["logprob"] == entry["logprob"] > entry["top_logprobs"][1]["logprob"]
        plain = (await post(client, url, "/v1/chat/completions", chat("hello", max_tokens=4, logprobs=True)))[1]
        assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
        assert (await post(client, url, "/v1/chat/completions", chat("hello")))[1]["choices"][0]["logprobs"] is None
        chunks = await stream(client, url, "/v1/chat/completions", request)
        tokens = [c["choices"][0]["logprobs"]["content"] for c in chunks if c["choices"][0]["delta"].get("content")]
        assert [t[0]["token"] for t in tokens] == [e["token"] for e in content]
        for extra, message, param in (
                # -1 asks for every token of the vocabulary (the simulated model's: Llama 3's).
                ({"top_logprobs": -1}, (f"Requested sample logprobs of {VOCAB_SIZE}, which is greater than max "
                                       f"allowed: 20 (parameter=logprobs, value={VOCAB_SIZE})"), "logprobs"),
                ({"top_logprobs": 21}, ("Requested sample logprobs of 21, which is greater than max allowed: 20 "
                                       "(parameter=logprobs, value=21)"), "logprobs"),
                ({"logprobs": 2}, body_error("bool_parsing", ("body", "logprobs"), "Input should be a valid boolean, "
                                             "unable to interpret input", 2), None),
                ({"prompt_logprobs": 1}, "prompt_logprobs is not supported by the simulator", "prompt_logprobs"),
        ):
            status, body = await post(client, url, "/v1/chat/completions", {**request, **extra})
            assert (status, body["error"]["message"], body["error"]["param"]) == (400, message, param)
        # Refused by vLLM's request validation, which names the parameter.
        status, body = await post(client, url, "/v1/chat/completions", {**request, "logprobs": False, "top_logprobs": 2})
        assert (status, body["error"]["type"], body["error"]["param"]) == (400, "Bad Request", "top_logprobs")
        assert "'msg': 'Value error, when using `top_logprobs`, `logprobs` must be set to true. " \
               "(parameter=top_logprobs)'" in body["error"]["message"]


# --- echo ---------------------------------------------------------------------------------------------------------

async def test_echo_puts_the_prompt_before_the_answer() -> None:
    stack, url, client, _ = await serving()
    async with stack:
        plain = (await post(client, url, "/v1/completions", completion(max_tokens=3, seed=2)))[1]
        echoed = (await post(client, url, "/v1/completions", completion(max_tokens=3, seed=2, echo=True,
                                                                        logprobs=1)))[1]
        choice = echoed["choices"][0]
        assert choice["text"] == PROMPT + plain["choices"][0]["text"]
        prompt_tokens = tokenize(PROMPT)
        assert choice["logprobs"]["tokens"][: len(prompt_tokens)] == prompt_tokens
        assert len(choice["logprobs"]["tokens"]) == len(prompt_tokens) + 3
        assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
        assert all(lp < 0 for lp in choice["logprobs"]["token_logprobs"][1:])
        assert echoed["usage"]["completion_tokens"] == 3
        # max_tokens 0 with echo: the prompt alone.
        alone = (await post(client, url, "/v1/completions", completion(max_tokens=0, echo=True)))[1]
        assert alone["choices"][0]["text"] == PROMPT
        assert (await post(client, url, "/v1/completions", completion(max_tokens=0)))[0] == 400
        chunks = await stream(client, url, "/v1/completions", completion(max_tokens=3, seed=2, echo=True))
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
        assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
        # Chat (vLLM's extension): the assistant's last message is continued.
        messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there,"}]
        body = (await post(client, url, "/v1/chat/completions",
                           {"model": MODEL, "messages": messages, "max_tokens": 3, "echo": True}))[1]
        assert body["choices"][0]["message"]["content"].startswith("Hi there,")
        assert len(body["choices"][0]["message"]["content"]) > len("Hi there,")
        chunks = await stream(client, url, "/v1/chat/completions",
                              {"model": MODEL, "messages": messages, "max_tokens": 3, "echo": True})
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
            body["choices"][0]["message"]["content"]


# --- structured output -------------------------------------------------------------------------------------------

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 3, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "home": {"$ref": "#/$defs/Address"},
        "born": {"type": "string", "format": "date"},
        "id": {"type": "string", "format": "uuid"},
        "kind": {"const": "person"},
    },
    "required": ["name", "age", "score", "active", "tags", "home", "kind"],
    "additionalProperties": False,
    "$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"},
                                                          "floor": {"type": ["integer", "null"]}},
                          "required": ["street", "zip"]}},
}


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


async def test_json_object_and_json_schema_answers_are_valid_json() -> None:
    stack, url, client, _ = await serving()
    async with stack:
        body = (await post(client, url, "/v1/chat/completions",
                           chat("a person", max_tokens=200, response_format={"type": "json_object"})))[1]
        choice = body["choices"][0]
        assert isinstance(json.loads(choice["message"]["content"]), dict) and choice["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == len(tokenize(choice["message"]["content"]))
        body = (await post(client, url, "/v1/chat/completions",
                           chat("a person", max_tokens=400, n=8, response_format=response_format(SCHEMA))))[1]
        for choice in body["choices"]:
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
            assert choice["finish_reason"] == "stop"
        assert len({c["message"]["content"] for c in body["choices"]}) > 1
        # Completions too, and streamed: the deltas add up to the same document.
        request = completion(max_tokens=400, seed=9, response_format=response_format(SCHEMA))
        whole = (await post(client, url, "/v1/completions", request))[1]["choices"][0]["text"]
        jsonschema.validate(json.loads(whole), SCHEMA)
        chunks = await stream(client, url, "/v1/completions", request)
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole
        # vLLM's own spelling, structured_outputs.
        own = (await post(client, url, "/v1/completions", completion(max_tokens=400,
                                                                     structured_outputs={"json": SCHEMA})))[1]
        jsonschema.validate(json.loads(own["choices"][0]["text"]), SCHEMA)
        picked = (await post(client, url, "/v1/chat/completions",
                             chat("?", structured_outputs={"choice": ["yes", "no"]})))[1]
        assert picked["choices"][0]["message"]["content"] in ("yes", "no")
        # vLLM 0.19.1 no longer has the guided_* fields: it ignores them, and so does the simulator.
        plain = (await post(client, url, "/v1/completions", completion(max_tokens=8, seed=3)))[1]
        for extra in ({"guided_json": SCHEMA}, {"guided_choice": ["yes", "no"]}, {"guided_regex": "[a-z]+"}):
            ignored = (await post(client, url, "/v1/completions", completion(max_tokens=8, seed=3, **extra)))[1]
            assert ignored["choices"][0]["text"] == plain["choices"][0]["text"]


async def test_max_tokens_cuts_a_document_short_as_with_vllm() -> None:
    stack, url, client, _ = await serving()
    async with stack:
        request = chat("a person", seed=4, response_format=response_format(SCHEMA))
        whole = (await post(client, url, "/v1/chat/completions", {**request, "max_tokens": 400}))[1]
        document = whole["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(document), SCHEMA)
        body = (await post(client, url, "/v1/chat/completions", {**request, "max_tokens": 3}))[1]
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
        assert choice["message"]["content"] == "".join(tokenize(document)[:3])
        with pytest.raises(ValueError):
            json.loads(choice["message"]["content"])


async def test_schemas_and_formats_the_simulator_cannot_follow_are_refused() -> None:
    stack, url, client, _ = await serving()
    async with stack:
        cases: list[tuple[dict[str, Any], str, str]] = [
            (response_format({"type": "string", "pattern": "^[a-z]+$"}), "pattern", "response_format"),
            (response_format({"oneOf": [{"type": "string"}, {"type": "integer"}]}), "oneOf", "response_format"),
            (response_format({"type": "string", "format": "duration"}), "format 'duration'", "response_format"),
            (response_format({"type": "integer", "minimum": 5, "maximum": 4}), "numeric bounds", "response_format"),
            (response_format({"type": "integer", "multipleOf": 3}), "multipleOf", "response_format"),
            (response_format({"$ref": "https://example.com/schema.json"}), "$ref", "response_format"),
            ({"type": "structural_tag", "structures": [], "triggers": []}, "not supported by the simulator",
             "response_format"),
        ]
        for fmt, fragment, param in cases:
            status, body = await post(client, url, "/v1/chat/completions", chat("x", response_format=fmt))
            assert status == 400 and fragment in body["error"]["message"], (fmt, body)
            assert body["error"]["param"] == param and body["error"]["type"] == "BadRequestError"
        unsupported: list[tuple[dict[str, Any], str]] = [
            ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs.regex is not supported by the simulator"),
            ({"structured_outputs": {"grammar": 'root ::= "a"'}},
             "structured_outputs.grammar is not supported by the simulator"),
        ]
        for extra, fragment in unsupported:
            status, body = await post(client, url, "/v1/completions", completion(**extra))
            assert status == 400 and fragment in body["error"]["message"], (extra, body)
            assert body["error"]["param"] == "structured_outputs"
        # What vLLM itself refuses, as it refuses it: its request validation ("Bad Request"), then its own checks.
        refused: list[tuple[str, dict[str, Any], str, str, str | None]] = [
            ("/v1/chat/completions", {"response_format": {"type": "json_schema"}},
             ("When response_format type is 'json_schema', the 'json_schema' field must be provided. "
             "(parameter=response_format)"), "Bad Request", "response_format"),
            ("/v1/chat/completions", {"response_format": {"type": "yaml"}},
             "'msg': \"Input should be 'text', 'json_object' or 'json_schema'\"", "Bad Request", None),
            ("/v1/completions", {"structured_outputs": {"json": SCHEMA, "choice": ["a"]}},
             ("You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice'). "
             "(parameter=structured_outputs)"), "Bad Request", "structured_outputs"),
            ("/v1/completions", {"structured_outputs": {"choice": []}}, "Choice '[]' cannot be an empty list",
             "BadRequestError", None),
            ("/v1/completions", {"suffix": "!"}, "suffix is not currently supported", "BadRequestError", None),
        ]
        for path, extra, fragment, type_, refused_param in refused:
            request = chat("x", **extra) if path.endswith("chat/completions") else completion(**extra)
            status, body = await post(client, url, path, request)
            assert status == 400 and fragment in body["error"]["message"], (extra, body)
            assert (body["error"]["type"], body["error"]["param"]) == (type_, refused_param), (extra, body)
