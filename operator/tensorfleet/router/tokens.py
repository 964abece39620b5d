"""The prompt's token ids as the engines tokenize it, for placement by the KV index (router/kvindex.py): a
completion's prompt given as ids is taken as is; anything else is asked of an engine's `/tokenize` (vLLM's,
with the chat template's own fields), within a short timeout. Failing only means placing without them.
Design: docs/routing.md#the-kv-cache-index.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from tensorfleet.router.resume import CHAT_PATH, COMPLETIONS_PATH

TOKENIZE_PATH = "/tokenize"
TOKENIZE_TIMEOUT_SECONDS = 0.5
# The fields of a chat completion that shape how vLLM renders and tokenizes its prompt (TokenizeChatRequest).
CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                        "chat_template_kwargs", "tools", "mm_processor_kwargs")


def _token_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(type(item) is int for item in value):
        return value
    return None


def tokenize_request(path: str, body: Mapping[str, Any], model: str | None) -> list[int] | dict[str, Any] | None:
    """The prompt's ids when the body gives them; else the `/tokenize` body that yields them; None when there is
    no single prompt to tokenize (a batch of prompts, an unknown path)."""
    name = model or body.get("model")
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        request = {"model": name, "messages": messages}
        request.update((key, body[key]) for key in CHAT_TEMPLATE_FIELDS if key in body)
        return request
    if path == COMPLETIONS_PATH:
        prompt = body.get("prompt")
        ids = _token_list(prompt)
        if ids is not None:
            return ids
        if isinstance(prompt, str):
            return {"model": name, "prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
    return None


async def fetch_tokens(session: aiohttp.ClientSession, engine_url: str, request: Mapping[str, Any],
                       timeout: float = TOKENIZE_TIMEOUT_SECONDS) -> list[int] | None:
    """The ids `engine_url`'s /tokenize gives for REQUEST; None on any failure."""
    try:
        async with session.post(f"{engine_url}{TOKENIZE_PATH}", data=json.dumps(request),
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as answer:
            if answer.status != 200:
                return None
            body = await answer.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
    return _token_list(body.get("tokens")) if isinstance(body, dict) else None
