"""vLLM's OpenAI-compatible HTTP surface over the simulated engine: chat and completions (JSON or streamed as vLLM
streams), /tokenize, /v1/models, /health, /metrics and the LoRA endpoints, with every sampling parameter that shapes
an answer honoured or refused with 400, never ignored. Design: docs/simulator.md#the-http-surface."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tensorfleet import contract
from tensorfleet.httpapi import SSE_CONTENT_TYPE, SSE_DONE, error_response, sse_event
from tensorfleet.prompts import ROLE_CLOSE, ROLE_OPEN, content_text, render_chat
from tensorfleet.sim import kvtransfer, validation
from tensorfleet.sim.engine import WORDS, Engine, RequestRejected, SimRequest
from tensorfleet.sim.kvevents import KVEventsConfig, Publisher
from tensorfleet.sim.lora import LOAD_PATH, UNLOAD_PATH, LoraConfig, LoraError, LoraState
from tensorfleet.sim.metrics import EngineMetrics
from tensorfleet.sim.params import Sampling, parse
from tensorfleet.sim.profile import Profile
from tensorfleet.sim.tokenizer import token_ids, tokenize
from tensorfleet.sim.validation import LoadLoraRequest, UnloadLoraRequest

log = logging.getLogger("tensorfleet.sim")

MAX_BODY_BYTES = 32 * 1024 * 1024
_ENGINE_KEY: web.AppKey[Engine] = web.AppKey("engine", Engine)
GENERATION_HEADER = f"{ROLE_OPEN}assistant\n"  # what render_chat ends with: the generation prompt
LORA_INPUT_ERROR = "InvalidUserInput"  # vLLM's error type for a LoRA request it refuses to try


def rejection(exc: RequestRejected) -> web.Response:
    """vLLM's error answer to a request it refuses."""
    return error_response(exc.status, str(exc), param=exc.param, type_=exc.type_)


@web.middleware
async def fastapi_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """What vLLM's FastAPI server answers for a path it does not serve, or a method a path does not take:
    FastAPI's own bodies, not OpenAI error objects."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(m for m in exc.allowed_methods if m != "HEAD"))
        return web.json_response({"detail": "Method Not Allowed"}, status=405, headers={"Allow": allowed})
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)


@dataclass
class SimConfig:
    served_model_name: str
    model: str
    startup_delay: float = 0.0
    time_scale: float = 1.0
    seed: int = 0
    kv_transfer: kvtransfer.TransferConfig | None = None  # --kv-transfer-config: prefill/decode halves
    bind_host: str = "0.0.0.0"  # where the KV side channel listens (the server's --host)
    lora: LoraConfig | None = None  # --enable-lora
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) served from the start
    runtime_lora_updating: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING: the load and unload endpoints
    stream_interval: int = 1  # vLLM's --stream-interval: tokens per stream event after the first
    prompt_tokens_details: bool = False  # vLLM's --enable-prompt-tokens-details: usage names the prefix-cache hit
    kv_events: KVEventsConfig | None = None  # --kv-events-config: publish the KV cache's events (sim/kvevents.py)


class SimServer:
    def __init__(self, profile: Profile, config: SimConfig) -> None:
        self.profile = profile
        self.config = config
        self.engine: Engine | None = None
        self.metrics: EngineMetrics | None = None
        self._ready_at = 0.0
        self._created = int(time.time())
        self._client: aiohttp.ClientSession | None = None  # reads KV from prefill engines' side channels

    # --- app -----------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[fastapi_errors])
        app.router.add_get(contract.HEALTH_PATH, self.health)
        app.router.add_get(contract.METRICS_PATH, self.metrics_handler)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/tokenize", self.tokenize)
        if self.config.lora is not None and self.config.runtime_lora_updating:
            app.router.add_post(LOAD_PATH, self.load_lora)
            app.router.add_post(UNLOAD_PATH, self.unload_lora)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, app: web.Application) -> Any:
        self.engine = Engine(self.profile, time_scale=self.config.time_scale, seed=self.config.seed)
        if self.config.lora is not None:
            self.engine.lora = LoraState(self.config.lora, self.config.served_model_name)
            for name, path in self.config.lora_modules:
                self.engine.lora.add(name, path)
        self.metrics = EngineMetrics(self.engine, self.config.served_model_name)
        publisher = Publisher(self.config.kv_events) if self.config.kv_events is not None else None
        if publisher is not None:
            publisher.start()
            self.engine.publish_kv_events(publisher.publish)
        self.engine.start()
        loop_time = self.engine._clock()
        self._ready_at = loop_time + self.config.startup_delay
        app[_ENGINE_KEY] = self.engine
        side_channel: web.AppRunner | None = None
        transfer = self.config.kv_transfer
        if transfer is not None:
            self.engine.hold_seconds = transfer.hold_seconds
            self._client = aiohttp.ClientSession()
            if transfer.produces:
                side_channel = web.AppRunner(self.side_channel_app(), access_log=None)
                await side_channel.setup()
                await web.TCPSite(side_channel, self.config.bind_host, transfer.side_channel_port).start()
        yield
        if side_channel is not None:
            await side_channel.cleanup()
        if self._client is not None:
            await self._client.close()
        await self.engine.stop()
        if publisher is not None:
            await publisher.close()

    def side_channel_app(self) -> web.Application:
        """The KV side channel (sim/kvtransfer.py): a decode engine reads the blocks a prefill half holds."""
        app = web.Application(client_max_size=1024 * 1024)
        app.router.add_post(kvtransfer.READ_PATH, self.read_kv)
        return app

    async def read_kv(self, request: web.Request) -> web.Response:
        """Hand over held KV: free the blocks, answer how many prompt tokens they cover (404: not held here)."""
        assert self.engine is not None and self.config.kv_transfer is not None
        try:
            body = await request.json()
            engine_id, blocks = body["engine_id"], body["block_ids"]
            if not isinstance(blocks, list) or not all(isinstance(b, int) for b in blocks):
                raise TypeError("block_ids")
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"a KV read needs engine_id and block_ids: {exc}")
        held = (self.engine.release_transfer(blocks) if engine_id == self.config.kv_transfer.engine_id else None)
        if held is None:
            return error_response(404, "those KV blocks are not held here (unknown, or the hold expired)")
        return web.json_response({"tokens": held.prompt_len})

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
        """The base model, then each LoRA adapter with the base as its parent, as vLLM lists them (each with
        vLLM's one default permission entry)."""
        def card(name: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
            now = int(time.time())
            return {"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": max_model_len, "permission": [{
                        "id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": now,
                        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                        "organization": "*", "group": None, "is_blocking": False}]}

        adapters = self.engine.lora.adapters.values() if self.engine is not None and self.engine.lora else ()
        return web.json_response({"object": "list", "data": [
            card(self.config.served_model_name, self.config.model, None, self.profile.max_model_len),
            *(card(a.name, a.path, self.config.served_model_name, None) for a in adapters)]})

    async def load_lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime adapter load: {"lora_name", "lora_path", "load_inplace"}; its answers and codes
        (LoraError: 400 for what it refuses to try, 404 for no adapter at the path, 500 for one it cannot take)."""
        body = await self._adapter_body(request, LoadLoraRequest)
        if isinstance(body, web.Response):
            return body
        assert self.engine is not None and self.engine.lora is not None
        name, path = body["lora_name"], body["lora_path"]
        if not name or not path:
            return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.", type_=LORA_INPUT_ERROR)
        try:
            self.engine.lora.add(name, path, replace=bool(body.get("load_inplace")))
        except LoraError as exc:
            return error_response(exc.status, str(exc), type_=exc.type_)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime adapter unload: {"lora_name"}; 404 for a name it does not serve."""
        body = await self._adapter_body(request, UnloadLoraRequest)
        if isinstance(body, web.Response):
            return body
        assert self.engine is not None and self.engine.lora is not None
        if not body["lora_name"]:
            return error_response(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                                  type_=LORA_INPUT_ERROR)
        try:
            self.engine.lora.remove(body["lora_name"])
        except LoraError as exc:
            return error_response(exc.status, str(exc), type_=exc.type_)
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    async def _adapter_body(self, request: web.Request, model: type[validation.Request]
                            ) -> dict[str, Any] | web.Response:
        """The body of a LoRA request, validated as vLLM validates it (its errors for what does not)."""
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                return error_response(400, "request body must be a JSON object")
            return validation.validate(model, body)
        except json.JSONDecodeError as exc:
            return rejection(validation.json_rejected(exc))
        except RequestRejected as exc:
            return rejection(exc)

    # --- completions ------------------------------------------------------------
    async def _body(self, request: web.Request, schema: validation.Schema) -> dict[str, Any] | web.Response:
        """The request's body as vLLM reads it (validation.py), or the answer vLLM gives instead."""
        if not self.ready:
            return error_response(503, "the model is still loading; retry when /health returns 200")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            return rejection(validation.json_rejected(exc))
        except (ValueError, UnicodeDecodeError) as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        try:
            body = validation.validate(schema, body)
        except RequestRejected as exc:
            return rejection(exc)
        model = body.get("model")
        if model is not None and model not in (self.config.served_model_name, self.config.model) \
                and self._adapter(model) is None:
            return error_response(404, f"The model `{model}` does not exist.", param="model")
        return body

    def _adapter(self, model: Any) -> str | None:
        """MODEL when it names a LoRA adapter this engine serves."""
        lora = self.engine.lora if self.engine is not None else None
        return model if lora is not None and isinstance(model, str) and model in lora.adapters else None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, validation.ChatRequest)
        if isinstance(body, web.Response):
            return body
        messages = body["messages"]
        if not messages:
            return error_response(400, "Cannot apply chat template to an empty conversation. Provide at least one "
                                  "message.")
        try:
            # vLLM renders the prompt before it reads the sampling parameters.
            prompt, role = chat_prompt(body, messages)
            sampling = parse(body, chat=True)
        except RequestRejected as exc:
            return rejection(exc)
        # vLLM's chat `echo`: the last message's content goes before the answer when it is in the answer's role.
        last = messages[-1]
        echo = content_text(last.get("content")) if sampling.echo and last.get("role") == role else ""
        return await self._generate(request, body, tokenize(prompt), sampling,
                                    _Answer(chat=True, sampling=sampling, echo_text=echo, role=role))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, validation.CompletionRequest)
        if isinstance(body, web.Response):
            return body
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        ids: list[int] | None = None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            # Token ids, hashed as they are (the text's own ids hash the same); their text is the numerals.
            ids, tokens = list(prompt), [str(t) for t in prompt]
        elif isinstance(prompt, str):
            tokens = tokenize(prompt)
        else:
            return error_response(400, "prompt must be a string or a list of token ids", param="prompt")
        try:
            sampling = parse(body, chat=False)
        except RequestRejected as exc:
            return rejection(exc)
        answer = _Answer(chat=False, sampling=sampling)
        if sampling.echo:
            answer.echo_text = prompt if isinstance(prompt, str) else "".join(tokens)
            answer.echo_tokens = tokens
        return await self._generate(request, body, tokens, sampling, answer, ids)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a `prompt`, or `messages` rendered as a chat completion's prompt (its
        add_generation_prompt and continue_final_message); {count, max_model_len, tokens, token_strs (the
        pieces, with return_token_strs)}. No special tokens are added: the simulator's prompts have none."""
        body = await self._body(request, validation.TOKENIZE)
        if isinstance(body, web.Response):
            return body
        if "messages" in body:  # vLLM took it for a chat (validation.TOKENIZE)
            messages = body["messages"]
            if not messages:
                return error_response(400, "Cannot apply chat template to an empty conversation. Provide at least "
                                      "one message.")
            try:
                prompt, _ = chat_prompt(body, messages)
            except RequestRejected as exc:
                return rejection(exc)
        else:
            prompt = body["prompt"]
        pieces = tokenize(prompt)
        ids = token_ids(pieces, self.profile.vocab_size)
        return web.json_response({"count": len(ids), "max_model_len": self.profile.max_model_len, "tokens": ids,
                                  "token_strs": pieces if body.get("return_token_strs") else None})

    async def _generate(self, request: web.Request, body: dict[str, Any], tokens: list[str], sampling: Sampling,
                        answer: _Answer, ids: list[int] | None = None) -> web.StreamResponse:
        engine = request.app[_ENGINE_KEY]
        wakeup = asyncio.Event()  # the choices' one waiter: this handler
        choices: list[SimRequest] = []
        remote_decode, remote_tokens, arrival = False, 0, None
        lora = self._adapter(body.get("model"))
        params, transfer = body.get("kv_transfer_params"), self.config.kv_transfer
        if transfer is not None and params is not None:
            if kvtransfer.wants_remote_decode(params) and transfer.produces:
                if sampling.n != 1:
                    return error_response(400, "a prefill half (kv_transfer_params.do_remote_decode) takes n 1",
                                          param="n")
                remote_decode = True
            elif kvtransfer.wants_remote_prefill(params) and transfer.consumes:
                arrival = engine._clock()
                remote_tokens = await self._read_remote(params, len(tokens))
        try:
            for index in range(sampling.n):
                output = None
                if sampling.structure is not None:
                    output = tokenize(sampling.structure(random.Random(engine.sample_seed(tokens, sampling.seed,
                                                                                          index))))
                choices.append(engine.submit(tokens, sampling.max_tokens, seed=sampling.seed, index=index,
                                             output=output, stop=sampling.stop, include_stop=sampling.include_stop,
                                             wakeup=wakeup, remote_decode=remote_decode,
                                             remote_tokens=remote_tokens, arrival=arrival, lora=lora,
                                             max_tokens_param=sampling.max_tokens_param, token_ids=ids))
        except RequestRejected as exc:
            for choice in choices:
                engine.abort(choice)
            return rejection(exc)
        answer.id = f"{'chatcmpl' if answer.chat else 'cmpl'}-{uuid.uuid4().hex}"
        answer.model = lora or self.config.served_model_name  # vLLM names the adapter a request used
        try:
            if body.get("stream"):
                options = body.get("stream_options") or {}
                usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
                # As vLLM reads them: continuous usage only with include_usage.
                continuous = usage and isinstance(options, Mapping) and bool(options.get("continuous_usage_stats"))
                return await self._stream(request, choices, wakeup, answer, include_usage=usage,
                                          continuous_usage=continuous)
            while not all(c.finished for c in choices):
                wakeup.clear()  # nothing runs between the check and here: no wakeup is lost
                await wakeup.wait()
            final = self._final(choices, answer)
            if remote_decode and choices[0].transfer_blocks and transfer is not None:
                final["kv_transfer_params"] = {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_engine_id": transfer.engine_id, "remote_block_ids": list(choices[0].transfer_blocks),
                    "remote_host": transfer.side_channel_host, "remote_port": transfer.side_channel_port,
                    "tp_size": self.profile.tensor,
                }
            return web.json_response(final)
        finally:
            # Client gone (handler cancelled or write failed): free the slots.
            for choice in choices:
                engine.abort(choice)

    async def _read_remote(self, params: Mapping[str, Any], prompt_len: int) -> int:
        """The decode half: read the prompt's KV from the prefill engine PARAMS name, taking the transfer's time;
        the prompt tokens it covered, 0 when none arrived (the prompt is then computed here, as vLLM does)."""
        assert self._client is not None and self.config.kv_transfer is not None and self.engine is not None
        remote = kvtransfer.RemoteKV.from_params(params)
        if remote is None:
            log.warning("kv_transfer_params name no remote KV whole; computing the prompt here")
            return 0
        url = f"http://{remote.host}:{remote.port}{kvtransfer.READ_PATH}"
        try:
            async with self._client.post(url, json={"engine_id": remote.engine_id, "block_ids": list(remote.block_ids)},
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                answer = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("reading KV from %s failed (%s); computing the prompt here", url, exc)
            return 0
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, int) or tokens != prompt_len:
            log.warning("KV at %s is not this prompt's (%s); computing the prompt here", url,
                        "not held" if answer is None else f"{tokens} tokens for {prompt_len}")
            return 0
        seconds = self.engine.transfer_seconds(tokens, self.config.kv_transfer.link_bytes_per_s)
        await asyncio.sleep(seconds * self.config.time_scale)
        return tokens

    def _usage(self, choices: list[SimRequest], *, streamed: bool = False) -> dict[str, Any]:
        """vLLM's usage: the prompt once, the completion tokens of every choice; `prompt_tokens_details` (the
        prefix-cache hit) with --enable-prompt-tokens-details and a hit, else null (left out of a stream's)."""
        prompt = choices[0].prompt_len
        generated = sum(c.generated for c in choices)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + generated,
            "completion_tokens": generated,
        }
        details = None
        if self.config.prompt_tokens_details and choices[0].cached_tokens:
            details = {"cached_tokens": choices[0].cached_tokens}
        if details is not None or not streamed:
            usage["prompt_tokens_details"] = details
        return usage

    def _final(self, choices: list[SimRequest], answer: _Answer) -> dict[str, Any]:
        """The whole answer, with every field vLLM's has (those the simulator has no value for null: token ids,
        prompt logprobs, the fingerprint, the tier)."""
        out = []
        for index, sim in enumerate(choices):
            text = answer.echo_text + ("" if answer.sampling.prompt_only else sim.text)
            choice: dict[str, Any] = {"index": index}
            if answer.chat:
                choice["message"] = {"role": answer.role, "content": text, "refusal": None, "annotations": None,
                                     "audio": None, "function_call": None, "tool_calls": [], "reasoning": None}
            else:
                choice["text"] = text
            choice["logprobs"] = answer.logprobs(sim, 0, sim.generated, first=True)
            choice["finish_reason"] = sim.finish_reason
            choice["stop_reason"] = sim.stop_reason
            choice["token_ids"] = None
            if not answer.chat:
                choice["prompt_logprobs"] = None
                choice["prompt_token_ids"] = None
            out.append(choice)
        final: dict[str, Any] = {
            "id": answer.id,
            "object": "chat.completion" if answer.chat else "text_completion",
            "created": answer.created,
            "model": answer.model,
            "choices": out,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self._usage(choices),
        }
        if answer.chat:
            final["prompt_logprobs"] = None
            final["prompt_token_ids"] = None
        final["kv_transfer_params"] = None
        return final

    async def _stream(self, request: web.Request, choices: list[SimRequest], wakeup: asyncio.Event,
                      answer: _Answer, *, include_usage: bool, continuous_usage: bool = False) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache"})
        obj = "chat.completion.chunk" if answer.chat else "text_completion"
        # Every token event is the same JSON around its fields; build the head once per choice instead of
        # serialising a dict per event.
        prefix = (f'data: {{"id":"{answer.id}","object":"{obj}","created":{answer.created},'
                  f'"model":{json.dumps(answer.model)},"choices":[{{').encode()
        prompt = choices[0].prompt_len if continuous_usage else None
        streams = [_ChoiceStream(i, sim, answer, prefix + f'"index":{i},'.encode(), self.config.stream_interval,
                                 prompt) for i, sim in enumerate(choices)]
        await response.prepare(request)
        while True:
            wakeup.clear()  # what the engine does while this writes wakes the wait below at once
            pieces = [piece for stream in streams for piece in stream.events()]
            if pieces:
                await response.write(b"".join(pieces))
            if all(sim.finished for sim in choices):
                break
            await wakeup.wait()
        if any(sim.finish_reason == "abort" for sim in choices):
            return response
        out = b""
        if include_usage:
            out += sse_event({"id": answer.id, "object": obj, "created": answer.created, "model": answer.model,
                              "choices": [], "usage": self._usage(choices, streamed=True)})
        await response.write(out + SSE_DONE)
        await response.write_eof()
        return response


def chat_prompt(body: Mapping[str, Any], messages: list[Mapping[str, Any]]) -> tuple[str, str]:
    """The prompt a chat request's messages render to, and the role its answer is in, as vLLM builds them from
    `add_generation_prompt` (default true: the assistant header after the messages, the answer the assistant's)
    and `continue_final_message` (the last message left open, whoever's it is, the answer continuing it in its
    role; it needs `add_generation_prompt: false`). BODY is validated (validation.py refuses both set true);
    RequestRejected (400) for what vLLM's chat template refuses."""
    generation_prompt = body.get("add_generation_prompt", True)
    continue_final = body.get("continue_final_message", False)
    if continue_final and generation_prompt:
        # transformers' apply_chat_template, which vLLM calls: the default generation prompt is on.
        raise RequestRejected("continue_final_message and add_generation_prompt are not compatible. Use "
                              "continue_final_message when you want the model to continue the final message, and "
                              "add_generation_prompt when you want to add a header that will prompt it to start a "
                              "new assistant message instead.")
    text = render_chat(messages).removesuffix(GENERATION_HEADER)
    if generation_prompt:
        return text + GENERATION_HEADER, "assistant"
    # No generation prompt: vLLM answers in the last message's role.
    role = messages[-1].get("role")
    role = role if isinstance(role, str) else "assistant"
    if continue_final:
        return text.removesuffix(f"{ROLE_CLOSE}\n"), role
    return text, role


@dataclass
class _ChoiceStream:
    """One choice's events in a stream, as vLLM writes them: each carries the tokens produced since the last one
    (the first token alone, then `interval` at a time, the rest with the finish reason), and with continuous
    usage (PROMPT set) the choice's running usage."""

    index: int
    sim: SimRequest
    answer: _Answer
    head: bytes                 # the event up to this choice's fields
    interval: int = 1           # vLLM's --stream-interval
    prompt: int | None = None   # the prompt's tokens: continuous usage on every event
    sent: int = 0               # tokens sent
    shown: int = 0              # characters of the answer sent (a stop string's possible start held back)
    offset: int = 0             # characters sent, echo included (completions' text_offset)
    ended: bool = False

    def events(self) -> list[bytes]:
        """The events for what the engine produced since the last call (none while fewer than `interval`
        tokens are pending and the choice goes on)."""
        sim, answer = self.sim, self.answer
        count = sim.generated
        if self.ended or sim.finish_reason == "abort":
            return []
        finishing = sim.finished
        if count == self.sent and not finishing:
            return []
        if not finishing and self.sent and count - self.sent < self.interval:
            return []
        pieces: list[bytes] = []
        start = self.sent
        if sim.holdback or sim.cut is not None:
            # With stop strings the visible text is the answer cut, its possible stop-string start held back.
            text = sim.text
            length = sum(len(w) for w in sim.output_words[:count])
            visible = len(text) if finishing else min(max(0, length - sim.holdback), len(text))
            delta = text[self.shown:visible]
            self.shown = max(self.shown, visible)
        else:
            delta = "".join(sim.output_words[start:count])
        if answer.sampling.prompt_only:
            delta = ""
        if start == 0 and count:
            if answer.chat:
                # vLLM sends the role before the first tokens, in an event of its own; then what `echo` repeats.
                pieces.append(self._event(b'"delta":{"role":' + json.dumps(answer.role).encode()
                                          + b',"content":""}', b"null", 0, opening=True, first=True))
                if answer.echo_text:
                    pieces.append(self._event(b'"delta":{"content":' + json.dumps(answer.echo_text).encode() + b"}",
                                              b"null", 0, opening=True))
            else:
                delta = answer.echo_text + delta
        encoded = json.dumps(delta).encode()
        field = b'"delta":{"content":' + encoded + b"}" if answer.chat else b'"text":' + encoded
        logprobs = answer.logprobs(sim, start, count, first=start == 0, offset=self.offset) if count > start else None
        self.offset += len(delta)
        encoded_logprobs = b"null" if logprobs is None else json.dumps(logprobs, separators=(",", ":")).encode()
        finish = (sim.finish_reason, sim.stop_reason) if finishing else None
        pieces.append(self._event(field, encoded_logprobs, count, finish))
        self.sent = count
        self.ended = finishing
        return pieces

    def _event(self, field: bytes, logprobs: bytes, tokens: int, finish: tuple[str | None, str | None] | None = None,
               *, opening: bool = False, first: bool = False) -> bytes:
        """One event of this choice: FIELD (its delta or text), its logprobs, its finish, and with continuous
        usage the choice's TOKENS so far; with the fields vLLM 0.19.1 writes in each kind of event. Completions:
        all of them, every time (stop_reason, prompt_token_ids, token_ids, usage: null when not sent). Chat (vLLM
        leaves out what it did not set): an OPENING event (the role's, FIRST, with the request's
        prompt_token_ids; echo's) has no stop_reason or token_ids, a token's has token_ids, and the finishing
        one stop_reason too; usage only when continuous."""
        chat = self.answer.chat
        tail = b',"finish_reason":' + (b"null" if finish is None else json.dumps(finish[0]).encode())
        stop = b',"stop_reason":' + (b"null" if finish is None else json.dumps(finish[1]).encode())
        if not chat:
            tail += stop + b',"prompt_token_ids":null,"token_ids":null'
        elif not opening:
            tail += (stop if finish is not None else b"") + b',"token_ids":null'
        usage = b"" if chat else b',"usage":null'
        if self.prompt is not None:
            usage = (f',"usage":{{"prompt_tokens":{self.prompt},"total_tokens":{self.prompt + tokens},'
                     f'"completion_tokens":{tokens}').encode() + (b"}" if chat else b',"prompt_tokens_details":null}')
        return (self.head + field + b',"logprobs":' + logprobs + tail + b"}]" + usage
                + (b',"prompt_token_ids":null' if first else b"") + b"}\n\n")


def draw_logprobs(seed: int, position: int, token: str, entries: int) -> list[tuple[str, float]]:
    """A token's simulated log-probability among the likeliest `entries` tokens at its position: the token itself
    first (the simulator's model always picks its likeliest token), then others, each less likely. Deterministic
    per seed (the answer's, or the prompt's) and position."""
    rng = random.Random(seed * 1_000_003 + position)
    top = [(token, -round(rng.uniform(0.0005, 1.5), 4))]
    for word in rng.sample(WORDS, min(entries, len(WORDS))):
        if len(top) >= entries:
            break
        if word != token:
            top.append((word, round(top[-1][1] - rng.uniform(0.05, 2.0), 4)))
    return top


@dataclass
class _Answer:
    """How one request's answer is written: its kind, what it echoes, its logprobs."""

    chat: bool
    sampling: Sampling
    echo_text: str = ""                    # before the answer (completions: the prompt; chat: vLLM's echo)
    echo_tokens: list[str] = field(default_factory=list)  # completions: the prompt's tokens, for their logprobs
    role: str = "assistant"                # chat: the answer's role (the last message's without a generation prompt)
    id: str = ""
    model: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def logprobs(self, sim: SimRequest, start: int, end: int, *, first: bool, offset: int = 0) -> Any:
        """The logprobs object of tokens start..end of a choice (with the echoed prompt's, for the first), in
        vLLM's shape for the endpoint: completions {tokens, token_logprobs, top_logprobs, text_offset}, chat
        {content: [{token, logprob, bytes, top_logprobs}]}; None when the request asked for none."""
        count = self.sampling.logprobs
        if count is None:
            return None
        seed = sim.sample_seed
        if self.chat:
            return {"content": [self._chat_entry(draw_logprobs(seed, k, sim.output_words[k], max(count, 1)), count)
                                for k in range(start, end)]}
        steps: list[tuple[str, list[tuple[str, float]] | None]] = []
        if first and self.echo_tokens:
            # The prompt's first token has no logprob (nothing before it); the others are scored as a model
            # scores a prompt: the same for every choice.
            prompt_seed = zlib.crc32("".join(self.echo_tokens).encode())
            steps += [(t, None if p == 0 else draw_logprobs(prompt_seed, -1 - p, t, max(count, 1)))
                      for p, t in enumerate(self.echo_tokens)]
        if not self.sampling.prompt_only:
            steps += [(sim.output_words[k], draw_logprobs(seed, k, sim.output_words[k], max(count, 1)))
                      for k in range(start, end)]
        offsets = []
        for token, _ in steps:
            offsets.append(offset)
            offset += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": [None if top is None else top[0][1] for _, top in steps],
            "tokens": [token for token, _ in steps],
            "top_logprobs": [None if top is None else dict(top) for _, top in steps],
        }

    @staticmethod
    def _chat_entry(top: list[tuple[str, float]], count: int) -> dict[str, Any]:
        token, logprob = top[0]
        return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top[:count]]}
