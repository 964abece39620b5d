"""vLLM's OpenAI-compatible HTTP surface over the simulated engine.

Shapes follow vLLM's server: `/v1/chat/completions` and `/v1/completions`
(JSON, or SSE with one event per token, `usage`, optional
`stream_options.include_usage`), `/v1/models`, `/health` (503 while the
"model loads"), `/metrics`. A client that disconnects aborts its request in the
engine, as vLLM does, so the KV blocks and batch slot are freed at once.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tensorfleet import contract
from tensorfleet.httpapi import SSE_CONTENT_TYPE, SSE_DONE, error_response, sse_event
from tensorfleet.prompts import render_chat
from tensorfleet.sim.engine import Engine, RequestRejected, SimRequest
from tensorfleet.sim.metrics import EngineMetrics
from tensorfleet.sim.profile import Profile
from tensorfleet.sim.tokenizer import tokenize

log = logging.getLogger("tensorfleet.sim")

MAX_BODY_BYTES = 32 * 1024 * 1024
_ENGINE_KEY: web.AppKey[Engine] = web.AppKey("engine", Engine)


@dataclass
class SimConfig:
    served_model_name: str
    model: str
    startup_delay: float = 0.0
    time_scale: float = 1.0
    seed: int = 0


class SimServer:
    def __init__(self, profile: Profile, config: SimConfig) -> None:
        self.profile = profile
        self.config = config
        self.engine: Engine | None = None
        self.metrics: EngineMetrics | None = None
        self._ready_at = 0.0
        self._created = int(time.time())

    # --- app -----------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get(contract.HEALTH_PATH, self.health)
        app.router.add_get(contract.METRICS_PATH, self.metrics_handler)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, app: web.Application) -> Any:
        self.engine = Engine(self.profile, time_scale=self.config.time_scale, seed=self.config.seed)
        self.metrics = EngineMetrics(self.engine, self.config.served_model_name)
        self.engine.start()
        loop_time = self.engine._clock()
        self._ready_at = loop_time + self.config.startup_delay
        app[_ENGINE_KEY] = self.engine
        yield
        await self.engine.stop()

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine._clock() >= self._ready_at

    # --- plain endpoints -------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        if not self.ready:
            return web.Response(status=503, text="loading model")
        return web.Response(status=200)

    async def metrics_handler(self, _: web.Request) -> web.Response:
        assert self.metrics is not None
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": f"tensorfleet-sim {contract.__version__}"})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.config.served_model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.profile.max_model_len,
        }]})

    async def not_found(self, request: web.Request) -> web.Response:
        return error_response(404, f"{request.method} {request.path} is not an endpoint of this server")

    # --- completions ------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        if not self.ready:
            return error_response(503, "the model is still loading; retry when /health returns 200")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in (self.config.served_model_name, self.config.model):
            return error_response(404, f"The model `{model}` does not exist.", param="model")
        if body.get("n", 1) != 1:
            return error_response(400, "the simulator supports n=1 only", param="n")
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
            return error_response(400, "messages must be a non-empty list of message objects", param="messages")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        return await self._generate(request, body, tokenize(render_chat(messages)), limit, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            tokens = [str(t) for t in prompt]  # token ids: one token each
        elif isinstance(prompt, str):
            tokens = tokenize(prompt)
        else:
            return error_response(400, "prompt must be a string or a list of token ids", param="prompt")
        return await self._generate(request, body, tokens, body.get("max_tokens", 16), chat=False)

    async def _generate(self, request: web.Request, body: dict[str, Any], tokens: list[str], limit: Any,
                        *, chat: bool) -> web.StreamResponse:
        engine = request.app[_ENGINE_KEY]
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
            return error_response(400, "max_tokens must be an integer", param="max_tokens")
        seed = body.get("seed")
        try:
            sim = engine.submit(tokens, limit, seed=seed if isinstance(seed, int) else None)
        except RequestRejected as exc:
            return error_response(400, str(exc), param=exc.param)
        prefix = "chatcmpl" if chat else "cmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            if body.get("stream"):
                options = body.get("stream_options") or {}
                usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
                return await self._stream(request, sim, response_id, chat=chat, include_usage=usage)
            await sim.wait(sim.max_tokens)
            return web.json_response(self._final(sim, response_id, chat))
        finally:
            # Client gone (handler cancelled or write failed): free the slot.
            engine.abort(sim)

    def _usage(self, sim: SimRequest) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": sim.prompt_len,
            "completion_tokens": sim.generated,
            "total_tokens": sim.prompt_len + sim.generated,
        }
        if sim.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": sim.cached_tokens}
        return usage

    def _final(self, sim: SimRequest, response_id: str, chat: bool) -> dict[str, Any]:
        name = self.config.served_model_name
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": sim.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": sim.text, "tool_calls": []}
        else:
            choice["text"] = sim.text
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": [choice],
            "usage": self._usage(sim),
        }

    async def _stream(self, request: web.Request, sim: SimRequest, response_id: str, *, chat: bool,
                      include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache"})
        created = int(time.time())
        name = self.config.served_model_name
        obj = "chat.completion.chunk" if chat else "text_completion"
        # Every token event is the same JSON around one string; build the two
        # halves once instead of serialising a dict per token.
        head = (f'data: {{"id":"{response_id}","object":"{obj}","created":{created},"model":{json.dumps(name)},'
                f'"choices":[{{"index":0,').encode()
        tail_open = b',"logprobs":null,"finish_reason":null}]}\n\n'
        await response.prepare(request)
        sent = 0
        while True:
            count = await sim.wait(sent)
            if count > sent:
                pieces = []
                if chat and sent == 0:
                    # vLLM sends the role with the first token, not before it.
                    pieces.append(head + b'"delta":{"role":"assistant","content":""}' + tail_open)
                for word in sim.output_words[sent:count]:
                    text = json.dumps(word).encode()
                    field = b'"delta":{"content":' + text + b"}" if chat else b'"text":' + text
                    pieces.append(head + field + tail_open)
                sent = count
                await response.write(b"".join(pieces))
            if sim.finished:
                break
        if sim.finish_reason == "abort":
            return response
        final: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": sim.finish_reason}
        if chat:
            final["delta"] = {}
        else:
            final["text"] = ""
        chunk = {"id": response_id, "object": obj, "created": created, "model": name, "choices": [final]}
        out = sse_event(chunk)
        if include_usage:
            out += sse_event({"id": response_id, "object": obj, "created": created, "model": name, "choices": [],
                              "usage": self._usage(sim)})
        await response.write(out + SSE_DONE)
        await response.write_eof()
        return response
