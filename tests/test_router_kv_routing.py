"""Router replicas agreeing through the engines' KV events: two simulators publish them, one router sends a
conversation's first turn to one engine, and a second router that never saw it (no peers) sends the next turn
to the engine that holds it, by its token ids from the engines' /tokenize and the index, where without the
index it would send it to the conversation's home by rendezvous, the other engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from test_kvevents_vllm import SimEngine, simulator

from tensorfleet import contract
from tensorfleet.prompts import goes_on, opening_chars, prompt_text
from tensorfleet.router.backends import Backend
from tensorfleet.router.scheduling import RequestInfo, hash_prompt, make_profile
from tensorfleet.testing.loopback import RunningRouter, router
from tensorfleet.testing.wait import eventually

SYSTEM = "You answer questions about running language models on GPU clusters. " * 6


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimEngine, SimEngine]]:
    with simulator(tmp_path_factory.mktemp("x")) as x, simulator(tmp_path_factory.mktemp("y")) as y:
        yield x, y


def turns(question: str, answer: str | None = None, follow: str | None = None) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    if answer is not None and follow is not None:
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow}]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}


def home_of(body: dict[str, Any], urls: list[str]) -> str:
    """Where cache-aware without the index sends a later turn this router never saw: its rendezvous home."""
    text, chars = prompt_text(body), opening_chars(body)
    hashes, opening, inside = hash_prompt(text, chars)
    pool = [Backend(url) for url in urls]
    info = RequestInfo(prefix_hashes=hashes, opening=opening, opening_blocks=inside, prompt_chars=len(text),
                       continues=goes_on(text, chars))
    return make_profile("cache-aware").pick(pool, pool, info).url


async def chat(client: aiohttp.ClientSession, r: RunningRouter, body: dict[str, Any]) -> str:
    async with client.post(f"{r.url}/v1/chat/completions", data=json.dumps(body),
                           headers={"Content-Type": "application/json"}) as answer:
        assert answer.status == 200, await answer.text()
        await answer.read()
        return answer.headers[contract.BACKEND_HEADER]


@pytest.mark.asyncio
async def test_a_replica_that_never_saw_a_conversation_follows_it_by_the_engines_kv_events(
        engines: tuple[SimEngine, SimEngine], tmp_path: Path) -> None:
    x, y = engines
    urls = [x.url, y.url]
    # A conversation whose home (for a router without the index) is y, started on x by a router that has x only.
    question = next(q for q in (f"question number {i}: how do KV caches page?" for i in range(64))
                    if home_of(turns(q, "a", "b"), urls) == y.url)
    later = turns(question, "They are paged in blocks of sixteen tokens each. " * 4, "And evicted how?")
    async with (aiohttp.ClientSession() as client,
                router([x.url], model=x.served_name) as first,
                # The engines share this host: each one's own ports, not the contract's.
                router(urls, model=x.served_name, kv_events=True,
                       kv_event_endpoints=tuple((e.url, *e.kv_events) for e in engines)) as second,
                router(urls, model=x.served_name) as blind):
        second_kv = second.router.fleet.kv
        assert second_kv is not None
        assert await chat(client, first, turns(question)) == x.url
        await eventually(lambda: second_kv.index.blocks(x.url) > 0, timeout=10,
                         message="the second router's index holding the first turn's blocks on x")
        assert await chat(client, second, later) == x.url      # where its conversation is, by the index
        assert await chat(client, blind, later) == y.url       # its home, without the index
        subscriber = second_kv.subscriber(x.url)
        assert subscriber is not None and subscriber.stats.resyncs == 0


def test_the_router_takes_engines_kv_endpoints_and_refuses_a_malformed_one(capsys: pytest.CaptureFixture[str]) -> None:
    from tensorfleet.cli import build_parser

    args = build_parser().parse_args(["router", "--backend", "http://h:8001", "--kv-events",
                                      "--kv-events-endpoint", "http://h:8001/=tcp://h:6001,tcp://h:6002"])
    assert args.kv_events_endpoint == [("http://h:8001", "tcp://h:6001", "tcp://h:6002")]
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["router", "--kv-events-endpoint", "http://h:8001=h:6001"])
    assert refused.value.code == 2
    assert "want ENGINE_URL=tcp://HOST:PORT,tcp://HOST:REPLAY_PORT" in capsys.readouterr().err
