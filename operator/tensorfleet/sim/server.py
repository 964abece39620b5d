"""vLLM's OpenAI-compatible HTTP surface over the simulated engine.

Shapes follow vLLM's server: `/v1/chat/completions` and `/v1/completions`
(JSON, or SSE with one event per token per choice, `usage`, optional
`stream_options.include_usage`), `/v1/models`, `/health` (503 while the
"model loads"), `/metrics`. A client that disconnects aborts its request in the
engine, as vLLM does, so the KV blocks and batch slots are freed at once.

Sampling parameters that shape an answer are honoured, or refused with 400 (as
vLLM refuses what it cannot do, and where only the simulator cannot), never
ignored; params.py checks them and lists the refusals:
  n                 n choices, `choices[i].index` i, each its own engine request
                    (a batch slot and KV blocks, the prompt's shared through the
                    prefix cache; seeded seed + i). `usage` counts the prompt
                    once and every choice's tokens. A stream interleaves the
                    choices' events, each naming its index, and ends each
                    choice with its own finish_reason event.
  stop              a choice ends at the first stop string its text shows:
                    finish_reason "stop", stop_reason the string, the text cut
                    before it (after it, with include_stop_str_in_output). The
                    tokens are checked as they are sampled, so the request
                    stops there in the engine too. A stream holds back the last
                    len(longest stop string) - 1 characters until the choice
                    ends, as vLLM's detokenizer does, so no part of a stop
                    string that is cut is ever sent.
  logprobs          completions (an integer k): `logprobs` {tokens,
                    token_logprobs, top_logprobs (dicts of max(k, 1) tokens, the
                    chosen one first), text_offset}; chat (`logprobs: true`,
                    `top_logprobs` k): `logprobs.content` [{token, logprob,
                    bytes, top_logprobs (k of them)}]. Streamed with each token.
                    The values are drawn, not computed: deterministic per answer
                    and position, the chosen token always the likeliest.
  echo              completions: the prompt before the answer, with its tokens'
                    logprobs (the first one null); `max_tokens: 0` gives the
                    prompt alone (vLLM still samples, and counts, one token).
                    Chat (vLLM's extension): the last message's content before
                    the answer when that message is in the answer's role.
  add_generation_prompt, continue_final_message
                    chat (vLLM's extensions; `chat_prompt`): the assistant
                    header after the messages (default), none (the answer in
                    the last message's role), or the last message, the
                    assistant's, left open and continued (a prefill; what the
                    router sends to resume a broken stream). Both true, or
                    continuing a message that is not the assistant's: 400, as
                    vLLM answers.
  response_format   `json_object`: a small JSON object; `json_schema`: an
                    instance of the schema, for the schemas structured.py can
                    generate (others get 400); vLLM's `guided_json` and
                    `guided_choice` likewise. The document is written whole and
                    then emitted token by token: valid, with finish_reason
                    "stop", unless max_tokens cuts it ("length"), as vLLM's
                    guided decoding is.
  kv_transfer_params
                    with --kv-transfer-config (sim/kvtransfer.py): the prefill
                    half (`do_remote_decode`) answers with the params naming its
                    held KV; the decode half (`do_remote_prefill`) reads that KV
                    over the side channel instead of computing the prompt, or
                    computes it when the KV is gone. Without the flag they are
                    ignored, as vLLM ignores them without a connector.
"""

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
from tensorfleet.sim import kvtransfer
from tensorfleet.sim.engine import WORDS, Engine, RequestRejected, SimRequest
from tensorfleet.sim.lora import LOAD_PATH, UNLOAD_PATH, LoraConfig, LoraError, LoraState
from tensorfleet.sim.metrics import EngineMetrics
from tensorfleet.sim.params import Sampling, parse
from tensorfleet.sim.profile import Profile
from tensorfleet.sim.tokenizer import tokenize

log = logging.getLogger("tensorfleet.sim")

MAX_BODY_BYTES = 32 * 1024 * 1024
_ENGINE_KEY: web.AppKey[Engine] = web.AppKey("engine", Engine)
GENERATION_HEADER = f"{ROLE_OPEN}assistant\n"  # what render_chat ends with: the generation prompt


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
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get(contract.HEALTH_PATH, self.health)
        app.router.add_get(contract.METRICS_PATH, self.metrics_handler)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        if self.config.lora is not None and self.config.runtime_lora_updating:
            app.router.add_post(LOAD_PATH, self.load_lora)
            app.router.add_post(UNLOAD_PATH, self.unload_lora)
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, app: web.Application) -> Any:
        self.engine = Engine(self.profile, time_scale=self.config.time_scale, seed=self.config.seed)
        if self.config.lora is not None:
            self.engine.lora = LoraState(self.config.lora, self.config.served_model_name)
            for name, path in self.config.lora_modules:
                self.engine.lora.add(name, path)
        self.metrics = EngineMetrics(self.engine, self.config.served_model_name)
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
        """The base model, then each LoRA adapter with the base as its parent, as vLLM lists them."""
        base = {"id": self.config.served_model_name, "object": "model", "created": self._created, "owned_by": "vllm",
                "root": self.config.model, "parent": None, "max_model_len": self.profile.max_model_len}
        adapters = self.engine.lora.adapters.values() if self.engine is not None and self.engine.lora else ()
        return web.json_response({"object": "list", "data": [base, *(
            {"id": a.name, "object": "model", "created": self._created, "owned_by": "vllm", "root": a.path,
             "parent": self.config.served_model_name, "max_model_len": None} for a in adapters)]})

    async def load_lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime adapter load: {"lora_name", "lora_path"}."""
        body = await self._adapter_body(request, ("lora_name", "lora_path"))
        if isinstance(body, web.Response):
            return body
        assert self.engine is not None and self.engine.lora is not None
        try:
            self.engine.lora.add(body["lora_name"], body["lora_path"])
        except LoraError as exc:
            return error_response(400, str(exc))
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime adapter unload: {"lora_name"}."""
        body = await self._adapter_body(request, ("lora_name",))
        if isinstance(body, web.Response):
            return body
        assert self.engine is not None and self.engine.lora is not None
        try:
            self.engine.lora.remove(body["lora_name"])
        except LoraError as exc:
            return error_response(404 if exc.not_found else 400, str(exc))
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    async def _adapter_body(self, request: web.Request, fields: tuple[str, ...]) -> dict[str, str] | web.Response:
        try:
            body = await request.json()
        except ValueError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        for name in fields:
            if not isinstance(body.get(name), str) or not body[name]:
                return error_response(400, f"{name} is required (a non-empty string)", param=name)
        return {name: body[name] for name in fields}

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
        if model is not None and model not in (self.config.served_model_name, self.config.model) \
                and self._adapter(model) is None:
            return error_response(404, f"The model `{model}` does not exist.", param="model")
        return body

    def _adapter(self, model: Any) -> str | None:
        """MODEL when it names a LoRA adapter this engine serves."""
        lora = self.engine.lora if self.engine is not None else None
        return model if lora is not None and isinstance(model, str) and model in lora.adapters else None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
            return error_response(400, "messages must be a non-empty list of message objects", param="messages")
        try:
            sampling = parse(body, chat=True)
            prompt, role = chat_prompt(body, messages)
        except RequestRejected as exc:
            return error_response(400, str(exc), param=exc.param)
        # vLLM's chat `echo`: the last message's content goes before the answer when it is in the answer's role.
        last = messages[-1]
        echo = content_text(last.get("content")) if sampling.echo and last.get("role") == role else ""
        return await self._generate(request, body, tokenize(prompt), sampling,
                                    _Answer(chat=True, sampling=sampling, echo_text=echo, role=role))

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
        try:
            sampling = parse(body, chat=False)
        except RequestRejected as exc:
            return error_response(400, str(exc), param=exc.param)
        answer = _Answer(chat=False, sampling=sampling)
        if sampling.echo:
            answer.echo_text = prompt if isinstance(prompt, str) else "".join(tokens)
            answer.echo_tokens = tokens
        return await self._generate(request, body, tokens, sampling, answer)

    async def _generate(self, request: web.Request, body: dict[str, Any], tokens: list[str], sampling: Sampling,
                        answer: _Answer) -> web.StreamResponse:
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
                                             remote_tokens=remote_tokens, arrival=arrival, lora=lora))
        except RequestRejected as exc:
            for choice in choices:
                engine.abort(choice)
            return error_response(400, str(exc), param=exc.param)
        answer.id = f"{'chatcmpl' if answer.chat else 'cmpl'}-{uuid.uuid4().hex}"
        answer.model = lora or self.config.served_model_name  # vLLM names the adapter a request used
        try:
            if body.get("stream"):
                options = body.get("stream_options") or {}
                usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
                return await self._stream(request, choices, wakeup, answer, include_usage=usage)
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

    def _usage(self, choices: list[SimRequest]) -> dict[str, Any]:
        """vLLM's usage: the prompt once, the completion tokens of every choice."""
        prompt = choices[0].prompt_len
        generated = sum(c.generated for c in choices)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
        }
        if choices[0].cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": choices[0].cached_tokens}
        return usage

    def _final(self, choices: list[SimRequest], answer: _Answer) -> dict[str, Any]:
        out = []
        for index, sim in enumerate(choices):
            text = answer.echo_text + ("" if answer.sampling.prompt_only else sim.text)
            choice: dict[str, Any] = {"index": index}
            if answer.chat:
                choice["message"] = {"role": answer.role, "content": text, "tool_calls": []}
            else:
                choice["text"] = text
            choice["logprobs"] = answer.logprobs(sim, 0, sim.generated, first=True)
            choice["finish_reason"] = sim.finish_reason
            choice["stop_reason"] = sim.stop_reason
            out.append(choice)
        return {
            "id": answer.id,
            "object": "chat.completion" if answer.chat else "text_completion",
            "created": answer.created,
            "model": answer.model,
            "choices": out,
            "usage": self._usage(choices),
        }

    async def _stream(self, request: web.Request, choices: list[SimRequest], wakeup: asyncio.Event,
                      answer: _Answer, *, include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache"})
        obj = "chat.completion.chunk" if answer.chat else "text_completion"
        # Every token event is the same JSON around one string; build the halves once per choice instead of
        # serialising a dict per token.
        prefix = (f'data: {{"id":"{answer.id}","object":"{obj}","created":{answer.created},'
                  f'"model":{json.dumps(answer.model)},"choices":[{{').encode()
        streams = [_ChoiceStream(i, sim, answer, prefix + f'"index":{i},'.encode()) for i, sim in enumerate(choices)]
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
                              "choices": [], "usage": self._usage(choices)})
        await response.write(out + SSE_DONE)
        await response.write_eof()
        return response


def chat_prompt(body: Mapping[str, Any], messages: list[Mapping[str, Any]]) -> tuple[str, str]:
    """The prompt a chat request's messages render to, and the role its answer is in, as vLLM builds them from
    `add_generation_prompt` (default true: the assistant header after the messages, the answer the assistant's)
    and `continue_final_message` (the last message left open, the answer continuing it; that message must be
    the assistant's). RequestRejected (400) for what vLLM refuses."""
    flags = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise RequestRejected(f"{name} must be a boolean", name)
        flags[name] = default if value is None else value
    # vLLM checks what was sent: continue_final_message with add_generation_prompt left out is accepted.
    if body.get("continue_final_message") is True and body.get("add_generation_prompt") is True:
        raise RequestRejected("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              "continue_final_message")
    text = render_chat(messages).removesuffix(GENERATION_HEADER)
    if flags["continue_final_message"]:
        if messages[-1].get("role") != "assistant":
            raise RequestRejected("Cannot set `continue_final_message` to True when the last message is not from "
                                  "the assistant.", "continue_final_message")
        return text.removesuffix(f"{ROLE_CLOSE}\n"), "assistant"
    if flags["add_generation_prompt"]:
        return text + GENERATION_HEADER, "assistant"
    # No generation prompt: vLLM answers in the last message's role.
    role = messages[-1].get("role")
    return text, role if isinstance(role, str) else "assistant"


_TAIL = b',"finish_reason":null,"stop_reason":null}]}\n\n'


@dataclass
class _ChoiceStream:
    """One choice's events in a stream: a token event per token, then one with its finish reason."""

    index: int
    sim: SimRequest
    answer: _Answer
    head: bytes                 # the event up to this choice's fields
    sent: int = 0               # tokens sent
    shown: int = 0              # characters of the answer sent (a stop string's possible start held back)
    offset: int = 0             # characters sent, echo included (completions' text_offset)
    ended: bool = False

    def events(self) -> list[bytes]:
        """The events for what the engine produced since the last call."""
        sim, answer = self.sim, self.answer
        pieces: list[bytes] = []
        count = sim.generated
        # With stop strings the visible text is the answer cut and held back; without, each token's own text.
        text = sim.text if sim.holdback or sim.cut is not None else None
        length = sum(len(w) for w in sim.output_words[:self.sent]) if text is not None else 0
        for k in range(self.sent, count):
            word = sim.output_words[k]
            if text is not None:
                length += len(word)
                visible = len(text) if sim.finished and k == count - 1 else min(max(0, length - sim.holdback),
                                                                                 len(text))
                delta = text[self.shown:visible]
                self.shown = max(self.shown, visible)
            else:
                delta = word
            if answer.sampling.prompt_only:
                delta = ""
            if k == 0 and answer.chat:
                # vLLM sends the role with the first token, not before it; then what `echo` repeats.
                pieces.append(self.head + b'"delta":{"role":' + json.dumps(answer.role).encode()
                              + b',"content":""},"logprobs":null' + _TAIL)
                if answer.echo_text:
                    pieces.append(self.head + b'"delta":{"content":' + json.dumps(answer.echo_text).encode()
                                  + b'},"logprobs":null' + _TAIL)
            elif k == 0:
                delta = answer.echo_text + delta
            encoded = json.dumps(delta).encode()
            field = b'"delta":{"content":' + encoded + b"}" if answer.chat else b'"text":' + encoded
            logprobs = answer.logprobs(sim, k, k + 1, first=k == 0, offset=self.offset)
            self.offset += len(delta)
            encoded_logprobs = b"null" if logprobs is None else json.dumps(logprobs, separators=(",", ":")).encode()
            pieces.append(self.head + field + b',"logprobs":' + encoded_logprobs + _TAIL)
        self.sent = count
        if sim.finished and not self.ended and sim.finish_reason != "abort":
            self.ended = True
            final: dict[str, Any] = {"index": self.index, "logprobs": None, "finish_reason": sim.finish_reason,
                                     "stop_reason": sim.stop_reason}
            final["delta" if answer.chat else "text"] = {} if answer.chat else ""
            pieces.append(sse_event({"id": answer.id, "object": "chat.completion.chunk" if answer.chat else
                                     "text_completion", "created": answer.created, "model": answer.model,
                                     "choices": [final]}))
        return pieces


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
