"""The simulator held to real vLLM: the same requests go to a real vLLM (the release the default engine image
pins, its CPU build serving the tiny model: the session's `real_vllm`) and to `tensorfleet sim` run the same way
(served name "tiny", LoRA on with runtime updating, --max-lora-rank 32, --max-loras 2, --max-model-len 2048,
--max-num-seqs 16), and the answers are compared:

- status codes and media types (without parameters such as charset);
- JSON key sets, recursively, and each field's JSON type; values that naturally differ (ids, times, the text,
  token counts, logprobs, paths) are not compared, except in errors;
- error bodies: the same shape (OpenAI's {"error": {message, type, param, code}} or FastAPI's {"detail": ...}),
  type, param, code and message (vLLM ends a request-validation message with where in its own source the error
  was raised, a path only it has: messages are compared up to there);
- streams: the kinds of events in order (chat's role event, token events, the finishing event, the usage event)
  and every simulator event's keys against vLLM's event of the same kind;
- /tokenize: a prompt or messages (with the chat-template flags), and the bodies it refuses;
- the LoRA endpoints (load, load again, load in place, no adapter at the path, a rank above --max-lora-rank,
  unload, unload of an unknown name), the adapter then listed in /v1/models under its parent and answering;
- /metrics: every family the simulator exports is on vLLM with the same type and label names (families only
  vLLM has are fine).

Every difference that remains is listed in DELIBERATE with its reason. Each area's test fails on a difference
not listed, and on a listed one of its area that no longer shows, so the table stays true. docs/real-engine.md
lists them for readers.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensorfleet import contract
from tensorfleet.testing import loopback, realvllm

SERVED = realvllm.SERVED_NAME
# The real engine's flags (tests/conftest.py's real_vllm), as the simulator takes them; time as fast as it goes.
SIM_ARGS = ("--max-model-len", "2048", "--enable-lora", "--max-lora-rank", "32", "--max-loras", "2",
            "--max-num-seqs", "16", "--time-scale", "0")
SOURCE_LOCATION = "\n\n  File "  # where vLLM's request-validation messages go on to name its own source

# The differences that remain, each with its reason: "<area>/<case>: <what>" (as `Diff.key` writes it).
DELIBERATE: dict[str, str] = {
    "errors/body not an object: status: vLLM 500, sim 400":
        "vLLM crashes on a JSON body that is not an object ('list' object has no attribute 'get'); a client's "
        "mistake is a 400 in the simulator",
    "errors/top_logprobs -1: error.message":
        "-1 asks for the whole vocabulary, and the message names its size: the tiny model's 1024, the simulated "
        "model's (Llama 3's) 128256",
    "refusals/beam search: status: vLLM 200, sim 400":
        "the simulator cannot search beams; it refuses rather than answer as if it had",
    "refusals/prompt_logprobs: status: vLLM 200, sim 400":
        "the simulator scores no prompt; it refuses rather than make the numbers up",
    "refusals/stop_token_ids: status: vLLM 200, sim 400":
        "the simulator draws its answers as words, not token ids, and does not stop on an id",
    "refusals/structured output by regex: status: vLLM 200, sim 400":
        "the simulator writes JSON (json, json_object, choice), not text matching a regex or a grammar",
    "refusals/structured output by grammar: status: vLLM 200, sim 400": "as for a regex",
    "refusals/a JSON schema with a pattern: status: vLLM 200, sim 400":
        "structured.py generates instances of the schema keywords it lists; a pattern is not one of them",
    "lora/load from a Hub id: status: vLLM 404, sim 200":
        "vLLM downloads a Hub id (the test's engine is offline, so it finds none); the simulator reads no Hub "
        "and takes the id as given (a local path it does check)",
    "lora/load: media type: vLLM none, sim text/plain":
        "vLLM answers a load's success with a bare body and no Content-Type; aiohttp always sends one",
    "lora/load in place: media type: vLLM none, sim text/plain": "as for a load",
    "lora/unload: media type: vLLM none, sim text/plain": "as for a load",
    "metrics/tensorfleet_sim_lora_loads: only the simulator has it":
        "the simulator's own counter of adapters brought into a GPU slot (disk or CPU cache), for its tests; "
        "named outside vLLM's namespace",
}


@dataclass(frozen=True)
class Diff:
    key: str      # "<area>/<case>: <what>", what DELIBERATE lists
    detail: str   # the values, for the failure report

    def __str__(self) -> str:
        return f"{self.key}" + (f"  [{self.detail}]" if self.detail else "")


@dataclass(frozen=True)
class Answer:
    status: int
    media: str | None   # the Content-Type without its parameters; None when there is none
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[Any]:
        """An SSE stream's events: each `data:` payload, parsed ("[DONE]" as the string)."""
        out: list[Any] = []
        for block in self.body.decode().split("\n\n"):
            for line in block.split("\n"):
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    out.append(data if data == "[DONE]" else json.loads(data))
        return out


def send(url: str, method: str, path: str, body: Any = None, raw: bytes | None = None) -> Answer:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            status, headers, payload = answer.status, answer.headers, answer.read()
    except urllib.error.HTTPError as exc:
        status, headers, payload = exc.code, exc.headers, exc.read()
    content_type = headers.get("Content-Type")
    return Answer(int(status), content_type.split(";")[0].strip() if content_type else None, payload)


@dataclass
class Pair:
    vllm: str
    sim: str
    adapters: dict[str, Path]

    def both(self, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[Answer, Answer]:
        return send(self.vllm, method, path, body, raw), send(self.sim, method, path, body, raw)


@pytest.fixture(scope="module")
def pair(real_vllm: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    port = loopback.free_port()
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    with log.open("wb") as out, loopback.spawn_sim(port, *SIM_ARGS, served_name=SERVED, log=out,
                                                   env={contract.ENV_RUNTIME_LORA_UPDATING: "True"}) as process:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not realvllm.healthy(url, timeout=1):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        # A freshly started CPU engine compiles on its first generation (20-30 s): pay it here, once.
        assert send(real_vllm.url, "POST", "/v1/completions", completion(max_tokens=1)).status == 200
        yield Pair(real_vllm.url, url, dict(real_vllm.adapters))


def test_idle_connections_close_alike(pair: Pair) -> None:
    """vLLM closes a keep-alive connection idle ENGINE_KEEP_ALIVE_S, and so does the simulator; the router and
    the calibrator drop theirs a second sooner (ENGINE_CLIENT_KEEP_ALIVE_S): a request sent on a connection the
    engine is closing fails as if the engine had (CI met it)."""
    from concurrent.futures import ThreadPoolExecutor

    bound = contract.ENGINE_KEEP_ALIVE_S + 5
    with ThreadPoolExecutor(2) as both:
        real, simulated = both.map(lambda url: loopback.idle_connection_lifetime(url, bound), (pair.vllm, pair.sim))
    for lifetime in (real, simulated):
        assert contract.ENGINE_CLIENT_KEEP_ALIVE_S < lifetime < contract.ENGINE_KEEP_ALIVE_S + 1.5, (real, simulated)


# --- comparing ------------------------------------------------------------------------------------------------

def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    kinds: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return kinds[type(value)]


# Objects whose keys are data, not fields: completions' top_logprobs maps tokens to their logprobs.
DATA_KEYS = re.compile(r"(^|\.)top_logprobs\[\d+\]$")


def shape(real: Any, sim: Any, where: str = "") -> list[tuple[str, str]]:
    """(what, detail) for each place where SIM's JSON is not shaped as REAL's: keys, recursively, and types."""
    if _kind(real) != _kind(sim):
        return [(f"type at {where or '.'}: vLLM {_kind(real)}, sim {_kind(sim)}", "")]
    out: list[tuple[str, str]] = []
    if isinstance(real, dict):
        if DATA_KEYS.search(where):
            return []
        for name, only in (("vLLM", real.keys() - sim.keys()), ("sim", sim.keys() - real.keys())):
            if only:
                out.append((f"keys at {where or '.'}: only {name} has {', '.join(sorted(only))}", ""))
        for key in real.keys() & sim.keys():
            out += shape(real[key], sim[key], f"{where}.{key}" if where else key)
    elif isinstance(real, list):
        for index, (a, b) in enumerate(zip(real, sim, strict=False)):
            out += shape(a, b, f"{where}[{index}]")
    return out


def compare(case: str, real: Answer, sim: Answer) -> list[tuple[str, str]]:
    """What differs between two answers to one request: status, media type, and for JSON its shape; for an
    error its type, param, code and message (vLLM's up to its source location); for text the text."""
    if real.status != sim.status:  # answers of different statuses have nothing else to compare
        return [(f"status: vLLM {real.status}, sim {sim.status}", sim.body[:200].decode(errors="replace"))]
    out: list[tuple[str, str]] = []
    if real.media != sim.media:
        out.append((f"media type: vLLM {real.media or 'none'}, sim {sim.media or 'none'}", ""))
    if real.media == "application/json" and sim.media == "application/json":
        a, b = real.json(), sim.json()
        out += shape(a, b)
        if isinstance(a, dict) and isinstance(b, dict) and isinstance(a.get("error"), dict) \
                and isinstance(b.get("error"), dict):
            for field in ("type", "param", "code", "message"):
                mine, theirs = a["error"].get(field), b["error"].get(field)
                if field == "message" and isinstance(mine, str):
                    mine = mine.split(SOURCE_LOCATION)[0]
                if mine != theirs:
                    out.append((f"error.{field}", f"vLLM {mine!r}, sim {theirs!r}"))
        elif isinstance(a, dict) and "detail" in a and a != b:
            out.append(("detail", f"vLLM {a!r}, sim {b!r}"))
    elif real.media != "text/event-stream" and real.status == sim.status == 200 and real.body != sim.body \
            and not real.body.startswith(b"{"):
        out.append(("text", f"vLLM {real.body[:200]!r}, sim {sim.body[:200]!r}"))
    return out


def event_kind(event: Any) -> str:
    if event == "[DONE]":
        return "done"
    choices = event.get("choices")
    if not choices:
        return "usage"
    choice = choices[0]
    if "role" in (choice.get("delta") or {}):
        return "role"
    return "finish" if choice.get("finish_reason") is not None else "token"


def compare_stream(real: Answer, sim: Answer) -> list[tuple[str, str]]:
    """A stream's differences: the answers' own, the kinds of events in order (repeats of a kind as one: how
    many tokens an event carries is timing), and each simulator event's shape against vLLM's first of its kind."""
    out = compare("", real, sim)
    if real.status != 200 or sim.status != 200:
        return out
    real_events, sim_events = real.events(), sim.events()

    def order(events: list[Any]) -> list[str]:
        kinds: list[str] = []
        for event in events:
            if not kinds or kinds[-1] != event_kind(event):
                kinds.append(event_kind(event))
        return kinds

    # A token event may not show when vLLM sends the first tokens with the finish; the rest must agree.
    real_order, sim_order = order(real_events), order(sim_events)
    if [k for k in real_order if k != "token"] != [k for k in sim_order if k != "token"]:
        out.append((f"event kinds: vLLM {real_order}, sim {sim_order}", ""))
    first: dict[str, Any] = {}
    for event in real_events:
        first.setdefault(event_kind(event), event)
    for event in sim_events:
        kind = event_kind(event)
        if kind in first and kind != "done":
            out += [(f"{kind} event: {what}", detail) for what, detail in shape(first[kind], event)]
    return sorted(set(out))


def check(area: str, found: list[Diff]) -> None:
    """Fail on a difference DELIBERATE does not list, and on a listed one of AREA that did not show."""
    keys = {d.key for d in found}
    unlisted = [str(d) for d in found if d.key not in DELIBERATE]
    stale = [key for key in DELIBERATE if key.startswith(f"{area}/") and key not in keys]
    assert not unlisted and not stale, (
        "the simulator differs from real vLLM where DELIBERATE does not say why:\n  " + "\n  ".join(unlisted)
        + ("\nlisted in DELIBERATE but no longer different (remove them):\n  " + "\n  ".join(stale) if stale else ""))


def diffs(area: str, case: str, found: list[tuple[str, str]]) -> list[Diff]:
    return [Diff(f"{area}/{case}: {what}", detail) for what, detail in found]


# --- the endpoints ----------------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "the model serves tokens"}]
ASSISTANT_LAST = [*USER, {"role": "assistant", "content": "the router sends"}]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": USER, "max_tokens": 3, "ignore_eos": True, **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "prompt": "the model serves tokens", "max_tokens": 3, "ignore_eos": True, **extra}


def test_plain_endpoints_answer_alike(pair: Pair) -> None:
    found: list[Diff] = []
    real, sim = pair.both("GET", "/v1/models")
    found += diffs("plain", "models", compare("models", real, sim))
    # The base model's card (a shared engine may list adapters other tests loaded).
    base = [next(card for card in answer.json()["data"] if card["id"] == SERVED) for answer in (real, sim)]
    found += diffs("plain", "models base card", shape(*base))
    for case, method, path in (("health", "GET", "/health"), ("version", "GET", "/version"),
                               ("unknown path", "GET", "/v1/nothing-here"),
                               ("wrong method on a path", "POST", "/v1/models"),
                               ("wrong method on completions", "GET", "/v1/chat/completions"),
                               ("wrong method on health", "PUT", "/health")):
        found += diffs("plain", case, compare(case, *pair.both(method, path)))
    check("plain", found)


def test_answers_have_vllms_fields(pair: Pair) -> None:
    found: list[Diff] = []
    for case, path, body in (
            ("chat", "/v1/chat/completions", chat()),
            ("completion", "/v1/completions", completion()),
            ("completion of token ids", "/v1/completions", completion(prompt=[5, 6, 7, 8])),
            ("chat, two choices", "/v1/chat/completions", chat(n=2)),
            ("chat with logprobs", "/v1/chat/completions", chat(logprobs=True, top_logprobs=2)),
            ("completion with logprobs", "/v1/completions", completion(logprobs=2)),
            ("chat, json_object", "/v1/chat/completions", chat(response_format={"type": "json_object"})),
            ("chat, a choice", "/v1/chat/completions", chat(structured_outputs={"choice": ["yes", "no"]})),
            ("chat continuing the assistant", "/v1/chat/completions",
             chat(messages=ASSISTANT_LAST, continue_final_message=True, add_generation_prompt=False)),
            ("chat continuing the user", "/v1/chat/completions",
             chat(continue_final_message=True, add_generation_prompt=False)),
            ("chat without a generation prompt", "/v1/chat/completions", chat(add_generation_prompt=False)),
            ("fields vLLM 0.19.1 no longer has", "/v1/completions", completion(best_of=2, guided_choice=["a"])),
            ("completion, logprobs true", "/v1/completions", completion(logprobs=True)),
            ("n a numeral", "/v1/completions", completion(n="2")),
            ("chat, add_generation_prompt 0", "/v1/chat/completions", chat(add_generation_prompt=0)),
    ):
        real, sim = pair.both("POST", path, body)
        assert real.status == 200, (case, real.body[:300])
        found += diffs("answers", case, compare(case, real, sim))
        # Both answer in the role the request's flags call for.
        if "messages" in body:
            assert {a.json()["choices"][0]["message"]["role"] for a in (real, sim)} == {
                "user" if case == "chat continuing the user" or "generation" in case else "assistant"}
    check("answers", found)


def test_streams_have_vllms_events(pair: Pair) -> None:
    found: list[Diff] = []
    for options_case, options in (("", None), (", usage", {"include_usage": True}),
                                  (", continuous usage", {"include_usage": True, "continuous_usage_stats": True})):
        for kind, path, body in (("chat", "/v1/chat/completions", chat(max_tokens=4)),
                                 ("completion", "/v1/completions", completion(max_tokens=4))):
            request = {**body, "stream": True, **({"stream_options": options} if options else {})}
            real, sim = pair.both("POST", path, request)
            found += diffs("streams", kind + options_case, compare_stream(real, sim))
            for answer in (real, sim):
                events = answer.events()
                assert events[-1] == "[DONE]" and (event_kind(events[-2]) == "usage") == bool(options)
    check("streams", found)


ERRORS: list[tuple[str, str, dict[str, Any] | bytes]] = [
    # chat templates: continue_final_message needs add_generation_prompt false; both true is refused earlier
    ("continue without add_generation_prompt false", "/v1/chat/completions",
     chat(messages=ASSISTANT_LAST, continue_final_message=True)),
    ("continue and add_generation_prompt both true", "/v1/chat/completions",
     chat(messages=ASSISTANT_LAST, continue_final_message=True, add_generation_prompt=True)),
    ("empty conversation", "/v1/chat/completions", chat(messages=[])),
    ("no messages", "/v1/chat/completions", {"model": SERVED, "max_tokens": 2}),
    ("no prompt", "/v1/completions", {"model": SERVED, "max_tokens": 2}),
    ("empty prompt", "/v1/completions", completion(prompt="")),
    ("body not JSON", "/v1/chat/completions", b"{not json"),
    ("body not an object", "/v1/chat/completions", b"[1, 2]"),
    ("unknown model", "/v1/completions", completion(model="no-such-model")),
    # vLLM's SamplingParams checks
    ("negative temperature", "/v1/chat/completions", chat(temperature=-3)),
    ("negative temperature, completions", "/v1/completions", completion(temperature=-3)),
    ("top_p 0", "/v1/completions", completion(top_p=0)),
    ("top_p above 1", "/v1/completions", completion(top_p=1.5)),
    ("n 0", "/v1/completions", completion(n=0)),
    ("n above VLLM_MAX_N_SEQUENCES", "/v1/completions", completion(n=20000)),
    ("presence_penalty 3", "/v1/completions", completion(presence_penalty=3)),
    ("frequency_penalty -3", "/v1/completions", completion(frequency_penalty=-3)),
    ("repetition_penalty 0", "/v1/completions", completion(repetition_penalty=0)),
    ("top_k -2", "/v1/completions", completion(top_k=-2)),
    ("min_p 2", "/v1/completions", completion(min_p=2)),
    ("min_tokens -1", "/v1/completions", completion(min_tokens=-1)),
    ("min_tokens above max_tokens", "/v1/completions", completion(min_tokens=5)),
    ("max_tokens 0", "/v1/completions", completion(max_tokens=0)),
    ("max_tokens -1, chat", "/v1/chat/completions", chat(max_tokens=-1)),
    ("empty stop string", "/v1/completions", completion(stop=[""])),
    ("logprobs 21", "/v1/completions", completion(logprobs=21)),
    ("logprobs -1", "/v1/completions", completion(logprobs=-1)),
    ("top_logprobs 30", "/v1/chat/completions", chat(logprobs=True, top_logprobs=30)),
    ("top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=3)),
    ("suffix", "/v1/completions", completion(suffix="!")),
    ("stream_options without stream", "/v1/completions", completion(stream_options={"include_usage": True})),
    ("json_schema without its schema", "/v1/chat/completions", chat(response_format={"type": "json_schema"})),
    ("two structured-output constraints", "/v1/chat/completions",
     chat(structured_outputs={"choice": ["a"], "json_object": True})),
    ("no structured-output constraint", "/v1/chat/completions", chat(structured_outputs={})),
    ("an empty choice", "/v1/chat/completions", chat(structured_outputs={"choice": []})),
    ("two structured-output constraints, completions", "/v1/completions",
     completion(structured_outputs={"json": {"type": "object"}, "choice": ["a"]})),
    ("response_format and structured_outputs", "/v1/chat/completions",
     chat(response_format={"type": "json_object"}, structured_outputs={"choice": ["a"]})),
    ("response_format of an unknown type", "/v1/chat/completions", chat(response_format={"type": "yaml"})),
    ("json_schema with no schema in it", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}})),
    ("top_logprobs -1", "/v1/chat/completions", chat(logprobs=True, top_logprobs=-1)),
    # types, as pydantic's lax mode reads them
    ("max_tokens a word", "/v1/completions", completion(max_tokens="many")),
    ("max_tokens a fraction", "/v1/completions", completion(max_tokens=2.5)),
    ("seed a word", "/v1/completions", completion(seed="x")),
    ("temperature a word", "/v1/completions", completion(temperature="abc")),
    ("continue_final_message 'yes'", "/v1/chat/completions", chat(continue_final_message="yes")),
    ("add_generation_prompt 'maybe'", "/v1/chat/completions", chat(add_generation_prompt="maybe")),
    ("n a word", "/v1/completions", completion(n="two")),
    ("stop a number", "/v1/completions", completion(stop=3)),
    ("chat logprobs 2", "/v1/chat/completions", chat(logprobs=2)),
    # lengths
    ("max_tokens above max_model_len", "/v1/completions", completion(max_tokens=5000)),
    ("max_completion_tokens above max_model_len", "/v1/chat/completions", chat(max_completion_tokens=5000)),
    ("prompt too long", "/v1/completions", completion(prompt="the model " * 1100)),
    ("messages too long", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "the model " * 1100}])),
]


def test_errors_are_vllms(pair: Pair) -> None:
    found: list[Diff] = []
    for case, path, body in ERRORS:
        if isinstance(body, bytes):
            real, sim = pair.both("POST", path, raw=body)
        else:
            real, sim = pair.both("POST", path, body)
        assert real.status >= 400, (case, real.body[:300])
        found += diffs("errors", case, compare(case, real, sim))
    check("errors", found)


TOKENIZE: list[tuple[str, dict[str, Any] | bytes]] = [
    ("prompt", {"model": SERVED, "prompt": "the model serves tokens"}),
    ("prompt with its token strings", {"model": SERVED, "prompt": "the model serves tokens",
                                       "return_token_strs": True}),
    ("prompt without a model", {"prompt": "the model serves tokens"}),
    ("prompt without special tokens", {"model": SERVED, "prompt": "the model", "add_special_tokens": False}),
    ("empty prompt", {"model": SERVED, "prompt": ""}),
    ("messages", {"model": SERVED, "messages": USER}),
    ("messages with token strings", {"model": SERVED, "messages": USER, "return_token_strs": True}),
    ("messages without a generation prompt", {"model": SERVED, "messages": USER, "add_generation_prompt": False}),
    ("messages continuing the assistant", {"model": SERVED, "messages": ASSISTANT_LAST,
                                           "add_generation_prompt": False, "continue_final_message": True}),
    ("prompt and messages", {"model": SERVED, "prompt": "the model", "messages": USER}),
    # refused
    ("neither prompt nor messages", {"model": SERVED}),
    ("prompt as token ids", {"model": SERVED, "prompt": [1, 2, 3]}),
    ("continue without add_generation_prompt false", {"model": SERVED, "messages": ASSISTANT_LAST,
                                                      "continue_final_message": True}),
    ("continue and add_generation_prompt both true", {"model": SERVED, "messages": ASSISTANT_LAST,
                                                      "continue_final_message": True, "add_generation_prompt": True}),
    ("empty conversation", {"model": SERVED, "messages": []}),
    ("return_token_strs a word", {"model": SERVED, "prompt": "x", "return_token_strs": "maybe"}),
    ("unknown model", {"model": "no-such-model", "prompt": "x"}),
    ("body not JSON", b"{not json"),
]


def test_tokenize_is_vllms(pair: Pair) -> None:
    found: list[Diff] = []
    for case, body in TOKENIZE:
        real, sim = pair.both("POST", "/tokenize", raw=body) if isinstance(body, bytes) \
            else pair.both("POST", "/tokenize", body)
        found += diffs("tokenize", case, compare(case, real, sim))
        if real.status == sim.status == 200:
            assert all(a.json()["count"] == len(a.json()["tokens"]) for a in (real, sim)), case
    check("tokenize", found)


# What vLLM does and the simulator cannot: refused (400), never answered as if done.
REFUSALS: list[tuple[str, str, dict[str, Any]]] = [
    ("beam search", "/v1/completions", completion(use_beam_search=True, n=2)),
    ("prompt_logprobs", "/v1/completions", completion(prompt_logprobs=1)),
    ("stop_token_ids", "/v1/completions", completion(stop_token_ids=[5])),
    ("structured output by regex", "/v1/chat/completions", chat(structured_outputs={"regex": "[a-z]+"})),
    ("structured output by grammar", "/v1/chat/completions", chat(structured_outputs={"grammar": 'root ::= "a"'})),
    ("a JSON schema with a pattern", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "string", "pattern": "^[a-z]+$"}}})),
]


def test_what_only_the_simulator_refuses_is_listed(pair: Pair) -> None:
    found: list[Diff] = []
    for case, path, body in REFUSALS:
        found += diffs("refusals", case, compare(case, *pair.both("POST", path, body)))
    check("refusals", found)


def test_lora_endpoints_are_vllms(pair: Pair, tmp_path: Path) -> None:
    # An adapter of rank 64, above --max-lora-rank 32: the rank-32 one with its config saying 64 (vLLM reads
    # the config, and refuses, before it reads the weights).
    wide = tmp_path / "tiny-lora-r64"
    shutil.copytree(pair.adapters["tiny-lora-r32"], wide)
    config = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    name = "sim-vs-vllm-r8"
    found: list[Diff] = []
    load, unload = contract.LORA_LOAD_PATH, contract.LORA_UNLOAD_PATH
    steps: list[tuple[str, str, dict[str, Any] | bytes]] = [
        ("load", load, {"lora_name": name, "lora_path": str(pair.adapters["tiny-lora-r8"])}),
        ("load again", load, {"lora_name": name, "lora_path": str(pair.adapters["tiny-lora-r8"])}),
        ("load in place", load, {"lora_name": name, "lora_path": str(pair.adapters["tiny-lora-r16"]),
                                 "load_inplace": True}),
        ("no adapter at the path", load, {"lora_name": "sim-vs-vllm-gone", "lora_path": str(tmp_path / "none")}),
        ("rank above max-lora-rank", load, {"lora_name": "sim-vs-vllm-r64", "lora_path": str(wide)}),
        ("empty name and path", load, {"lora_name": "", "lora_path": ""}),
        ("no path", load, {"lora_name": "sim-vs-vllm-x"}),
        ("load body not JSON", load, b"not json"),
        ("unload unknown", unload, {"lora_name": "sim-vs-vllm-never-loaded"}),
        ("unload empty name", unload, {"lora_name": ""}),
        ("unload no name", unload, {}),
        ("load from a Hub id", load, {"lora_name": "sim-vs-vllm-hub", "lora_path": "tensorfleet-test/no-such-lora"}),
    ]
    try:
        for case, path, body in steps:
            real, sim = pair.both("POST", path, raw=body) if isinstance(body, bytes) else pair.both("POST", path, body)
            found += diffs("lora", case, compare(case, real, sim))
        # vLLM's codes, which the operator's adapter sync reads (controller/adapters.py).
        assert [s for s in (send(pair.vllm, "POST", load, steps[3][2]).status,
                            send(pair.vllm, "POST", load, steps[4][2]).status)] == [404, 500]
        # The adapter is listed under its base model, and answers under its own name, on both.
        real, sim = pair.both("GET", "/v1/models")
        cards = [next(c for c in a.json()["data"] if c["id"] == name) for a in (real, sim)]
        assert [c["parent"] for c in cards] == [SERVED, SERVED]
        found += diffs("lora", "adapter's card", shape(*cards))
        real, sim = pair.both("POST", "/v1/completions", completion(model=name))
        found += diffs("lora", "completion with the adapter", compare("", real, sim))
        assert [a.json()["model"] for a in (real, sim)] == [name, name]
    finally:
        send(pair.sim, "POST", unload, {"lora_name": "sim-vs-vllm-hub"})
        real, sim = pair.both("POST", unload, {"lora_name": name})
    found += diffs("lora", "unload", compare("unload", real, sim))
    assert real.status == sim.status == 200
    assert all(c["id"] != name for a in pair.both("GET", "/v1/models") for c in a.json()["data"])
    check("lora", found)


def families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Each family of a /metrics page: its type and the label names of its samples (a histogram's `le` aside)."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        labels = {name for sample in family.samples for name in sample.labels if name != "le"}
        out[family.name] = (family.type, frozenset(labels))
    return out


def test_every_metric_the_simulator_exports_is_vllms(pair: Pair) -> None:
    pair.both("POST", "/v1/completions", completion())  # every histogram has a sample
    real, sim = (families(send(url, "GET", contract.METRICS_PATH).body.decode()) for url in (pair.vllm, pair.sim))
    found: list[Diff] = []
    for name, (kind, labels) in sorted(sim.items()):
        if name not in real:
            found.append(Diff(f"metrics/{name}: only the simulator has it", ""))
            continue
        if real[name][0] != kind:
            found.append(Diff(f"metrics/{name}: type", f"vLLM {real[name][0]}, sim {kind}"))
        if real[name][1] != labels:
            found.append(Diff(f"metrics/{name}: labels", f"only vLLM: {sorted(real[name][1] - labels)}, "
                                                         f"only sim: {sorted(labels - real[name][1])}"))
    check("metrics", found)


def test_the_comparison_sees_what_differs() -> None:
    """The comparison itself (no engine): what it must catch, it catches; values it must not compare, it does not."""
    def answer(body: Any, status: int = 200, media: str = "application/json") -> Answer:
        return Answer(status, media, body if isinstance(body, bytes) else json.dumps(body).encode())

    real = answer({"id": "a", "choices": [{"text": "x", "token_ids": None, "logprobs": {"top_logprobs": [{"x": -1}]}}]})
    same = answer({"id": "b", "choices": [{"text": "yy", "token_ids": None, "logprobs": {"top_logprobs": [{"y": -2}]}}]})
    assert compare("", real, same) == []
    missing = answer({"id": "b", "choices": [{"text": "x", "logprobs": None}]})
    assert sorted(what for what, _ in compare("", real, missing)) == [
        "keys at choices[0]: only vLLM has token_ids", "type at choices[0].logprobs: vLLM object, sim null"]
    assert [w for w, _ in compare("", real, answer({}, 400))] == ["status: vLLM 200, sim 400"]
    error = {"error": {"message": "m\n\n  File \"x.py\", line 1", "type": "Bad Request", "param": None, "code": 400}}
    assert compare("", answer(error, 400), answer({"error": {**error["error"], "message": "m"}}, 400)) == []
    other_param = answer({"error": {**error["error"], "message": "m", "param": "n"}}, 400)
    assert sorted(w for w, _ in compare("", answer(error, 400), other_param)) == [
        "error.param", "type at error.param: vLLM null, sim string"]
    stream = b'data: {"choices":[{"delta":{"role":"assistant"},"finish_reason":null}]}\n\n' \
             b'data: {"choices":[{"delta":{"content":"a"},"finish_reason":"length","stop_reason":null}]}\n\n' \
             b"data: [DONE]\n\n"
    lacking = stream.replace(b',"stop_reason":null', b"")
    assert [w for w, _ in compare_stream(answer(stream, media="text/event-stream"),
                                         answer(lacking, media="text/event-stream"))] == [
        "finish event: keys at choices[0]: only vLLM has stop_reason"]
    unfinished = stream.replace(b'"finish_reason":"length"', b'"finish_reason":null')
    assert any(w.startswith("event kinds") for w, _ in compare_stream(answer(stream, media="text/event-stream"),
                                                                       answer(unfinished, media="text/event-stream")))


def test_the_table_names_only_areas_that_are_compared() -> None:
    areas = {"plain", "answers", "streams", "errors", "refusals", "lora", "metrics", "tokenize"}
    assert {key.split("/")[0] for key in DELIBERATE} <= areas
    assert all(reason.strip() for reason in DELIBERATE.values())
