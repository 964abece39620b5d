"""The simulator's chat prompt flags (`add_generation_prompt`, `continue_final_message`) as vLLM takes them, and
its greedy answers: a request whose prompt is another's plus the start of its answer is answered with the rest,
which is what makes a router's continuation of a broken stream checkable."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest

from tensorfleet.sim.engine import greedy_words
from tensorfleet.sim.tokenizer import count_tokens, tokenize
from tensorfleet.testing.loopback import MODEL, chat, sim, sse_events

QUESTION = "Why is the sky blue? Answer at length."
# What vLLM 0.19.1 answers (from transformers' apply_chat_template) for continue_final_message with the default
# generation prompt on.
INCOMPATIBLE = ("continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
                "when you want the model to continue the final message, and add_generation_prompt when you want to "
                "add a header that will prompt it to start a new assistant message instead.")


async def post(client: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with client.post(url + path, json=body) as resp:
        return resp.status, await resp.json()


def test_greedy_words_continue_their_own_text() -> None:
    words = greedy_words("a prompt", 0, 40)
    assert len(set(words)) > 10  # words, not one word repeated
    for k in (1, 17, 39):
        assert greedy_words("a prompt" + "".join(words[:k]), 0, 40 - k) == words[k:]
    assert greedy_words("a prompt", 1, 40) != words  # the seed picks other words
    assert greedy_words("another prompt", 0, 40) != words


@pytest.mark.asyncio
async def test_a_completion_prompt_that_holds_the_start_of_an_answer_gets_the_rest() -> None:
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        client = await stack.enter_async_context(aiohttp.ClientSession())
        body = {"model": MODEL, "prompt": QUESTION, "max_tokens": 30}
        status, full = await post(client, s.url, "/v1/completions", body)
        assert status == 200
        text = full["choices"][0]["text"]
        words = tokenize(text)
        assert len(words) == 30
        status, rest = await post(client, s.url, "/v1/completions",
                                  {**body, "prompt": QUESTION + "".join(words[:12]), "max_tokens": 18})
        assert status == 200 and rest["choices"][0]["text"] == "".join(words[12:])
        assert rest["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"] + 12


@pytest.mark.asyncio
async def test_continue_final_message_continues_the_assistant_message() -> None:
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        client = await stack.enter_async_context(aiohttp.ClientSession())
        status, full = await post(client, s.url, "/v1/chat/completions", chat(QUESTION, max_tokens=25))
        assert status == 200
        words = tokenize(full["choices"][0]["message"]["content"])
        assert len(words) == 25
        prefill = chat(QUESTION, max_tokens=15)
        prefill["messages"].append({"role": "assistant", "content": "".join(words[:10])})
        status, rest = await post(client, s.url, "/v1/chat/completions",
                                  {**prefill, "continue_final_message": True, "add_generation_prompt": False})
        assert status == 200, rest
        message = rest["choices"][0]["message"]
        assert (message["role"], message["content"]) == ("assistant", "".join(words[10:]))
        assert rest["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"] + 10
        # add_generation_prompt defaults to true, and vLLM's chat template takes only one of the two.
        status, refused = await post(client, s.url, "/v1/chat/completions", {**prefill, "continue_final_message": True})
        assert status == 400 and refused["error"]["message"] == INCOMPATIBLE
        # Streamed: the role delta, then the rest of the answer.
        async with client.post(s.url + "/v1/chat/completions",
                               json={**prefill, "continue_final_message": True, "add_generation_prompt": False,
                                     "stream": True}) as resp:
            events = [data async for _, data in sse_events(resp)]
        deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert "".join(d.get("content", "") for d in deltas) == "".join(words[10:])
        # Without the flag the assistant message is a finished turn: a new answer follows it.
        status, new_turn = await post(client, s.url, "/v1/chat/completions", prefill)
        assert status == 200 and not new_turn["choices"][0]["message"]["content"].startswith("".join(words[10:13]))


@pytest.mark.asyncio
async def test_without_a_generation_prompt_the_answer_is_in_the_last_messages_role() -> None:
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        client = await stack.enter_async_context(aiohttp.ClientSession())
        with_header = (await post(client, s.url, "/v1/chat/completions", chat(QUESTION, max_tokens=5)))[1]
        status, body = await post(client, s.url, "/v1/chat/completions",
                                  chat(QUESTION, max_tokens=5, add_generation_prompt=False))
        assert status == 200 and body["choices"][0]["message"]["role"] == "user"
        # The header's tokens are not in the prompt.
        assert body["usage"]["prompt_tokens"] == with_header["usage"]["prompt_tokens"] - count_tokens("<|start|>assistant\n")
        # Continuing the last message, whoever's it is (vLLM does not ask that it be the assistant's): the user's
        # message left open, the answer in the user's role.
        status, going_on = await post(client, s.url, "/v1/chat/completions",
                                      chat(QUESTION, max_tokens=5, add_generation_prompt=False,
                                           continue_final_message=True))
        assert status == 200 and going_on["choices"][0]["message"]["role"] == "user"
        assert going_on["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"] - count_tokens("<|end|>\n")


BOTH = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


def _body_error(kind: str, loc: tuple[str, ...], msg: str, value: Any, **ctx: Any) -> str:
    """The message vLLM's request validation (pydantic's, through FastAPI) gives, up to its source location."""
    error: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx:
        error["ctx"] = ctx
    return f"1 validation error:\n  {error!r}"


@pytest.mark.asyncio
@pytest.mark.parametrize(("extra", "message", "type_"), [
    # Both set true: vLLM's request validation refuses it (the whole body is the error's input).
    ({"continue_final_message": True, "add_generation_prompt": True},
     lambda body: _body_error("value_error", ("body",), f"Value error, {BOTH}", body, error=ValueError(BOTH)),
     "Bad Request"),
    # add_generation_prompt left at its default, true: the chat template refuses it.
    ({"continue_final_message": True}, lambda body: INCOMPATIBLE, "BadRequestError"),
    # "yes" is true to vLLM (pydantic's lax mode), so the same.
    ({"continue_final_message": "yes"}, lambda body: INCOMPATIBLE, "BadRequestError"),
    ({"add_generation_prompt": "maybe"},
     lambda body: _body_error("bool_parsing", ("body", "add_generation_prompt"),
                              "Input should be a valid boolean, unable to interpret input", "maybe"),
     "Bad Request"),
])
async def test_prompt_flags_vllm_refuses_are_refused(extra: dict[str, Any], message: Any, type_: str) -> None:
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(sim())
        client = await stack.enter_async_context(aiohttp.ClientSession())
        request = chat(QUESTION, **extra)
        status, body = await post(client, s.url, "/v1/chat/completions", request)
        assert status == 400 and body["error"]["message"] == message(request), body
        assert body["error"]["type"] == type_ and body["error"]["param"] is None
        assert s.engine.stats.prompt_tokens == 0
