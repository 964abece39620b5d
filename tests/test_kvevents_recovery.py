"""The router's KV-event subscription recovering from what goes wrong on a real stream: vLLM's own publisher
(vllm.distributed.kv_events.ZmqEventPublisher, run under the real vLLM's interpreter) sends the batches, and the
router's Subscriber must keep its index right through a lost connection (replayed), a loss beyond the replay
buffer (resynced, never claiming a block it cannot vouch for), and a restarted engine (a new publisher whose
numbering starts again).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio
from conftest import require_real_vllm

from tensorfleet.router.kvevents import END_OF_REPLAY, Subscriber
from tensorfleet.router.kvindex import KVIndex
from tensorfleet.testing import realvllm
from tensorfleet.testing.wait import eventually

pytestmark = pytest.mark.asyncio

ENGINE = "engine-0"
BLOCK = 4
BUFFER_STEPS = 4
WAIT_SECONDS = 20.0

# Reads one JSON command a line: {"events": [...]} publishes one batch, {"restart": true} replaces the publisher
# with a new one on the same ports (an engine that restarted). Answers each with the batch's sequence number, on a
# line of its own that starts with @.
PUBLISHER = r"""
import json, sys, time
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
config = json.loads(sys.stdin.readline())
def start():
    return ZmqEventPublisher(0, endpoint=f"tcp://*:{config['port']}", replay_endpoint=f"tcp://*:{config['replay']}",
                             buffer_steps=config["buffer"], topic=config["topic"])
def event(spec):
    if spec["kind"] == "stored":
        parent = bytes.fromhex(spec["parent"]) if spec["parent"] else None
        return BlockStored(block_hashes=[bytes.fromhex(h) for h in spec["hashes"]], parent_block_hash=parent,
                           token_ids=spec["tokens"], block_size=config["block"], lora_id=None, medium="GPU",
                           lora_name=spec.get("adapter"))
    if spec["kind"] == "removed":
        return BlockRemoved(block_hashes=[bytes.fromhex(h) for h in spec["hashes"]], medium="GPU")
    return AllBlocksCleared()
publisher, seq = start(), -1
print("@ready", flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if command.get("restart"):
        publisher.shutdown()
        time.sleep(0.2)
        publisher, seq = start(), -1
        print("@" + json.dumps(seq), flush=True)
        continue
    publisher.publish(KVEventBatch(ts=time.time(), events=[event(spec) for spec in command["events"]]))
    seq += 1
    print("@" + json.dumps(seq), flush=True)
publisher.shutdown()
"""


class Publisher:
    def __init__(self) -> None:
        self.port, self.replay = realvllm.free_port(), realvllm.free_port()
        self.process = subprocess.Popen([realvllm.vllm_python(), "-c", PUBLISHER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=realvllm.engine_env())
        self._send({"port": self.port, "replay": self.replay, "buffer": BUFFER_STEPS, "topic": "kv", "block": BLOCK})
        assert self._read() == "ready"

    def _send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def _read(self) -> str:
        """The script's next answer (its lines start with @; vLLM logs to the same stdout)."""
        assert self.process.stdout is not None
        while True:
            line = self.process.stdout.readline()
            assert line, "vLLM's publisher exited"
            if line.startswith("@"):
                return line[1:].strip()

    def publish(self, *events: dict[str, Any]) -> int:
        self._send({"events": list(events)})
        return int(self._read())

    def restart(self) -> None:
        self._send({"restart": True})
        self._read()

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)


def stored(hashes: list[str], tokens: list[int], parent: str | None = None) -> dict[str, Any]:
    return {"kind": "stored", "hashes": hashes, "tokens": tokens, "parent": parent}


def removed(hashes: list[str]) -> dict[str, Any]:
    return {"kind": "removed", "hashes": hashes}


PROMPT = list(range(100, 124))  # six blocks of BLOCK tokens
H = [f"{i:02x}" * 32 for i in range(1, 7)]  # their hashes as vLLM would publish them (bytes)


@pytest.fixture(scope="module")
def publisher() -> Iterator[Publisher]:
    require_real_vllm()
    running = Publisher()
    try:
        yield running
    finally:
        running.close()


class Stream:
    def __init__(self, publisher: Publisher) -> None:
        self.index = KVIndex()
        self.subscriber = Subscriber(self.index, ENGINE, f"tcp://127.0.0.1:{publisher.port}",
                                     f"tcp://127.0.0.1:{publisher.replay}")
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.subscriber.run())
        await asyncio.wait_for(self.subscriber.synced.wait(), WAIT_SECONDS)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.subscriber.synced.clear()

    async def reach(self, seq: int) -> None:
        async def reached() -> None:
            while self.subscriber.last != seq:
                await asyncio.sleep(0.02)
        await asyncio.wait_for(reached(), WAIT_SECONDS)

    def held(self) -> int:
        return self.index.match(PROMPT).get(ENGINE, 0)


@pytest_asyncio.fixture
async def stream(publisher: Publisher) -> AsyncIterator[Stream]:
    publisher.restart()  # each case starts from a fresh engine
    opened = Stream(publisher)
    await opened.start()
    try:
        yield opened
    finally:
        await opened.stop()


async def test_a_lost_connection_is_replayed(stream: Stream, publisher: Publisher) -> None:
    await stream.reach(publisher.publish(stored(H[:2], PROMPT[:8])))
    assert stream.held() == 2
    await stream.stop()
    replayed = stream.subscriber.stats.replayed
    publisher.publish(stored(H[2:4], PROMPT[8:16], parent=H[1]))
    publisher.publish(removed([H[3]]))
    last = publisher.publish(stored(H[3:5], PROMPT[12:20], parent=H[2]))
    await holding(publisher, last)   # all three wait in the replay buffer: they come back replayed, none live
    await stream.start()
    await stream.reach(last)
    assert stream.held() == 5
    assert stream.subscriber.stats.replayed - replayed == 3 and stream.subscriber.stats.resyncs == 0


async def test_a_loss_beyond_the_replay_buffer_forgets_rather_than_guesses(stream: Stream,
                                                                          publisher: Publisher) -> None:
    await stream.reach(publisher.publish(stored(H[:3], PROMPT[:12])))
    await stream.stop()
    # More batches than the publisher keeps: the eviction of the first block is among those lost.
    lost = publisher.publish(removed([H[0]]))
    for _ in range(BUFFER_STEPS):
        last = publisher.publish(removed(["ff" * 32]))
    # Until the publisher's thread has taken the last batch, a replay would still hold the eviction, and nothing
    # would be lost.
    assert lost not in await holding(publisher, last)
    await stream.start()
    await stream.reach(last)
    assert stream.subscriber.stats.resyncs == 1
    assert stream.held() == 0 and stream.index.blocks(ENGINE) == 0
    # Blocks stored from here on are indexed again.
    await stream.reach(publisher.publish(stored(H[:2], PROMPT[:8])))
    assert stream.held() == 2


async def holding(publisher: Publisher, seq: int) -> dict[int, bytes]:
    """The publisher's replay buffer (`buffered`) once it holds batch SEQ: vLLM's publisher sends and buffers from a
    thread of its own, so a batch `publish` has numbered may not be there yet."""
    async def held() -> dict[int, bytes] | None:
        batches = await buffered(publisher)
        return batches if seq in batches else None
    found: dict[int, bytes] = await eventually(held, WAIT_SECONDS, f"batch {seq} in the publisher's replay buffer")
    return found


async def buffered(publisher: Publisher) -> dict[int, bytes]:
    """The batches the publisher holds for replay, as it sends them: sequence number -> payload."""
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{publisher.replay}")
    batches: dict[int, bytes] = {}
    try:
        await dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            assert await dealer.poll(WAIT_SECONDS * 1000), "the publisher did not answer the replay request"
            _, seq_frame, payload = await dealer.recv_multipart()
            seq = int.from_bytes(seq_frame, "big", signed=True)
            if seq == END_OF_REPLAY:
                return batches
            batches[seq] = payload
    finally:
        dealer.close()


async def test_a_late_batch_of_the_same_engine_is_not_taken_for_a_restart(stream: Stream,
                                                                         publisher: Publisher) -> None:
    # A batch numbered at or below the last one applied, and older: it waited on the live socket while a replay
    # (after a reconnection) went past it. It is not a restarted engine's, whose batches are newer.
    first = publisher.publish(stored(H[:2], PROMPT[:8]))
    second = publisher.publish(stored(H[2:3], PROMPT[8:12], parent=H[1]))
    await stream.reach(second)
    payloads = await buffered(publisher)
    fed = Subscriber(KVIndex(), ENGINE, f"tcp://127.0.0.1:{publisher.port}")   # not run: given batches by hand
    await fed.live(second, payloads[second])
    await fed.live(first, payloads[first])
    assert fed.stats.resyncs == 0 and fed.last == second
    # The restarted engine's first batch is numbered lower still, and newer: that one is a restart.
    publisher.restart()
    again = publisher.publish(stored(H[:1], PROMPT[:4]))
    await fed.live(again, (await holding(publisher, again))[again])
    assert fed.stats.resyncs == 1 and fed.last == again
    assert fed.index.match(PROMPT).get(ENGINE, 0) == 1


async def test_a_restarted_engine_holds_nothing_it_held_before(stream: Stream, publisher: Publisher) -> None:
    publisher.publish(stored(H[:2], PROMPT[:8]))
    await stream.reach(publisher.publish(stored(H[2:4], PROMPT[8:16], parent=H[1])))
    assert stream.held() == 4
    publisher.restart()
    # The new engine's first batch is numbered 0 again; its cache is empty but for what it stores now.
    await stream.reach(publisher.publish(stored(H[4:5], PROMPT[16:20], parent=H[3]),
                                          stored(H[:1], PROMPT[:4])))
    assert stream.subscriber.stats.resyncs == 1
    assert stream.held() == 1
    assert stream.index.orphans(ENGINE) == 1  # the first block's child under a parent it no longer holds
