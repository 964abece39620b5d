"""The router's KV-cache index held to a real vLLM (the session's `real_vllm`, publishing its KV events) and to
the simulator (`tensorfleet sim` run the same way, with --kv-events-config): the router subscribes as it does to
every engine, and before each request the index predicts how many of the prompt's tokens the engine will find in
its prefix cache; the engine's own counter (vllm:prefix_cache_hits) must move by exactly that. Prompts go as
token ids, so nothing in between tokenizes. A second subscriber started later (a restarted router) catches up
through the publisher's replay to the same index. On a simulator with a small cache, the index follows its
evictions (BlockRemoved).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from test_sim_vs_vllm import SIM_ARGS

from tensorfleet import contract, engine_settings
from tensorfleet.router.kvevents import Subscriber
from tensorfleet.router.kvindex import KVIndex
from tensorfleet.testing import loopback, realvllm, tinymodel

pytestmark = pytest.mark.asyncio

ENGINE = "engine-0"
VOCAB = 1000          # the tiny model's ids below its special tokens
SETTLE_SECONDS = 0.5  # no new batch for this long: the engine has published what the last request stored
SETTLE_LIMIT_SECONDS = 20.0


def _post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _hits(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:prefix_cache_hits":
            return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    raise AssertionError("vLLM exports no vllm:prefix_cache_hits")


class Stream:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.index = KVIndex()
        endpoint, replay = engine.kv_events
        self.subscriber = Subscriber(self.index, ENGINE, endpoint, replay)
        self.task = asyncio.get_running_loop().create_task(self.subscriber.run())

    async def settle(self) -> None:
        """Until no batch has come for SETTLE_SECONDS (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_LIMIT_SECONDS
        seen = -1
        while self.subscriber.stats.batches != seen and loop.time() < deadline:
            seen = self.subscriber.stats.batches
            await asyncio.sleep(SETTLE_SECONDS)
        assert not self.task.done(), self.task.exception()

    async def complete(self, tokens: list[int], model: str) -> None:
        status, text = await asyncio.to_thread(_post, f"{self.engine.url}/v1/completions",
                                               {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0})
        assert status == 200, text
        await self.settle()

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@dataclass
class SimEngine:
    """A `tensorfleet sim` process, with what the tests read of a RealEngine."""

    url: str
    served_name: str
    kv_events: tuple[str, str]
    adapters: dict[str, Path] = field(default_factory=dict)


@contextmanager
def simulator(folder: Path, *args: str) -> Iterator[SimEngine]:
    """`tensorfleet sim` publishing its KV events on two free ports, serving the tiny model's name with runtime
    LoRA updating and ARGS; adapters of the tiny model's names and ranks (a config each) in FOLDER."""
    adapters = {}
    for name, rank in tinymodel.ADAPTER_RANKS.items():
        (folder / name).mkdir()
        (folder / name / "adapter_config.json").write_text(json.dumps({"r": rank}))
        adapters[name] = folder / name
    port, ports = loopback.free_port(), (loopback.free_port(), loopback.free_port())
    log = folder / "sim.log"
    with log.open("wb") as out, loopback.spawn_sim(
            port, *args, "--kv-events-config", engine_settings.kv_events_config(*ports),
            served_name=realvllm.SERVED_NAME, log=out, env={contract.ENV_RUNTIME_LORA_UPDATING: "True"}) as process:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not realvllm.healthy(url, timeout=1):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield SimEngine(url, realvllm.SERVED_NAME, (f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"),
                        adapters)


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimEngine]:
    """The simulator run as the session's real vLLM is (test_sim_vs_vllm's SIM_ARGS)."""
    with simulator(tmp_path_factory.mktemp("sim"), *SIM_ARGS) as engine:
        yield engine


@pytest.fixture(params=["vllm", "sim"])
def engine(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("real_vllm" if request.param == "vllm" else "sim_engine")


@asynccontextmanager
async def subscribed(engine: Any) -> AsyncIterator[Stream]:
    assert engine.kv_events, "the engine publishes no KV events"
    opened = Stream(engine)
    try:
        # The warm-up and earlier tests' blocks come first, through the replay of a new subscriber.
        await asyncio.wait_for(opened.subscriber.synced.wait(), SETTLE_LIMIT_SECONDS)
        await opened.settle()
        yield opened
    finally:
        await opened.stop()


@pytest_asyncio.fixture
async def stream(engine: Any) -> AsyncIterator[Stream]:
    async with subscribed(engine) as opened:
        yield opened


def _predicted(index: KVIndex, tokens: list[int], adapter: str | None) -> int:
    """Tokens the engine will find cached: the blocks the index says it holds, but never the prompt's last token
    (vLLM computes at least that one), in whole blocks."""
    size = index.block_size(ENGINE)
    assert size
    held = index.match(tokens, adapter).get(ENGINE, 0)
    return min(held, (len(tokens) - 1) // size) * size


async def _check(stream: Stream, tokens: list[int], adapter: str | None = None) -> int:
    expected = _predicted(stream.index, tokens, adapter)
    before = await asyncio.to_thread(_hits, stream.engine.url)
    await stream.complete(tokens, adapter or stream.engine.served_name)
    after = await asyncio.to_thread(_hits, stream.engine.url)
    assert after - before == expected, (
        f"the index predicted {expected} cached tokens of {len(tokens)}; the engine found {after - before}")
    return expected


async def test_the_index_predicts_the_engines_prefix_cache_hits(stream: Stream) -> None:
    rng = random.Random(37)
    await stream.complete([rng.randrange(VOCAB) for _ in range(600)], stream.engine.served_name)
    size = stream.index.block_size(ENGINE)
    assert size, "a prompt of 600 tokens stored no block"
    base = [rng.randrange(VOCAB) for _ in range(5 * size + size // 2)]
    fork = base[:3 * size] + [rng.randrange(VOCAB) for _ in range(3 * size)]
    adapter = next(iter(tinymodel.ADAPTER_RANKS))

    assert await _check(stream, base) == 0            # never seen
    assert await _check(stream, base) == 5 * size     # every whole block but the one holding the last token
    assert await _check(stream, fork) == 3 * size     # the shared leading blocks only
    assert await _check(stream, fork) == 5 * size

    status, text = await asyncio.to_thread(_post, f"{stream.engine.url}/v1/load_lora_adapter",
                                           {"lora_name": adapter, "lora_path": str(stream.engine.adapters[adapter])})
    assert status == 200 or "already" in text, text
    assert await _check(stream, base, adapter) == 0   # the adapter's blocks are its own
    assert await _check(stream, base, adapter) == 5 * size
    assert stream.subscriber.stats.resyncs == 0 and stream.index.orphans(ENGINE) == 0

    # A router that starts now rebuilds the same index from the publisher's replay buffer.
    late = Stream(stream.engine)
    try:
        await asyncio.wait_for(late.subscriber.synced.wait(), SETTLE_LIMIT_SECONDS)
        await late.settle()
        assert late.index.held(ENGINE) == stream.index.held(ENGINE)
        assert late.subscriber.last == stream.subscriber.last
        for tokens, adapter_name in ((base, None), (fork, None), (base, adapter)):
            assert late.index.match(tokens, adapter_name) == stream.index.match(tokens, adapter_name)
    finally:
        await late.stop()


async def test_the_index_follows_the_simulators_evictions(tmp_path: Path) -> None:
    """A cache of 16 blocks overrun by other prompts: the first prompt's blocks are evicted (BlockRemoved), and
    the index predicts the miss the simulator then reports."""
    with simulator(tmp_path, "--kv-cache-tokens", "256", "--max-model-len", "128", "--time-scale", "0") as sim:
        async with subscribed(sim) as stream:
            rng = random.Random(41)
            await stream.complete([rng.randrange(VOCAB) for _ in range(32)], sim.served_name)  # the block size
            assert stream.index.block_size(ENGINE) == 16
            first = [rng.randrange(VOCAB) for _ in range(64)]
            assert await _check(stream, first) == 0
            assert await _check(stream, first) == 48   # 4 blocks held, the last token's computed
            for _ in range(5):                         # 20 blocks of other prompts through 16
                await _check(stream, [rng.randrange(VOCAB) for _ in range(64)])
            assert stream.index.blocks(ENGINE) <= 16
            assert await _check(stream, first) == 0
            assert stream.subscriber.stats.resyncs == 0 and stream.index.orphans(ENGINE) == 0
