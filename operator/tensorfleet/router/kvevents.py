"""The router's subscription to one engine's KV events (vLLM's ZeroMQ publisher, `--kv-events-config`):
batches in order into the KV index (router/kvindex.py), with the publisher's replay socket filling any gap,
catching a new subscriber up and noticing a restarted engine. What cannot be recovered clears that engine's
part of the index, so the index may miss blocks but never claims one the engine lost. Design:
docs/routing.md#the-kv-cache-index.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tensorfleet import contract
from tensorfleet.router.kvindex import HELD_MEDIA, KVIndex

log = logging.getLogger(__name__)

END_OF_REPLAY = -1
REPLAY_TIMEOUT_SECONDS = 2.0
RECENT_BATCHES = 1024  # at most what the live socket can have queued during one replay, at the engines' pace
_decoder = msgspec.msgpack.Decoder()

# Positions in vLLM's events (msgspec structs, array_like, tagged with the class name first; fields a newer
# release added come last and are left out when at their default, so every release reads alike up to here).
_STORED_HASHES, _STORED_PARENT, _STORED_TOKENS, _STORED_BLOCK_SIZE = 1, 2, 3, 4
_STORED_MEDIUM, _STORED_ADAPTER, _STORED_GROUP = 6, 7, 9
_REMOVED_HASHES, _REMOVED_MEDIUM, _REMOVED_GROUP = 1, 2, 3


def _at(event: Sequence[Any], index: int) -> Any:
    return event[index] if len(event) > index else None


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _held(medium: Any, group: Any) -> bool:
    # Only the first KV-cache group (a hybrid model's others are sliding-window or state pages) on the GPU.
    return medium in HELD_MEDIA and group in (None, 0)


def apply_batch(index: KVIndex, engine: str, payload: bytes) -> tuple[float, int]:
    """Apply one published batch (msgpack: [ts, events, data parallel rank]) to the index; its timestamp and the
    number of events applied. Unknown event kinds are skipped: a newer release may add some."""
    batch = _decoder.decode(payload)
    applied = 0
    for event in batch[1]:
        kind = event[0] if isinstance(event, list) and event else None
        if kind == "BlockStored":
            if _held(_at(event, _STORED_MEDIUM), _at(event, _STORED_GROUP)):
                index.stored(engine, [_hashable(h) for h in event[_STORED_HASHES]],
                             _hashable(event[_STORED_PARENT]), event[_STORED_TOKENS], event[_STORED_BLOCK_SIZE],
                             _at(event, _STORED_ADAPTER))
                applied += 1
        elif kind == "BlockRemoved":
            if _held(_at(event, _REMOVED_MEDIUM), _at(event, _REMOVED_GROUP)):
                index.removed(engine, [_hashable(h) for h in event[_REMOVED_HASHES]])
                applied += 1
        elif kind == "AllBlocksCleared":
            index.cleared(engine)
            applied += 1
    return float(batch[0]), applied


def endpoints(address: str) -> tuple[str, str]:
    """An engine's publisher and replay endpoints, from its host (or IP)."""
    host = f"[{address}]" if ":" in address else address
    return f"tcp://{host}:{contract.KV_EVENTS_PORT}", f"tcp://{host}:{contract.KV_EVENTS_REPLAY_PORT}"


@dataclass
class StreamStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0          # sequence numbers skipped on the live stream
    replayed: int = 0      # batches the replay socket filled in
    resyncs: int = 0       # times the engine's part of the index was cleared: restart, or a gap beyond replay
    errors: list[str] = field(default_factory=list)


class Subscriber:
    """One engine's stream into the index, until cancelled.

    A batch is known by its sequence number and its timestamp together: a restarted engine numbers from 0
    again, and after a lost connection the first thing to learn is whether the publisher at the other end is the
    one whose batches were applied. So on every (re)connection and every gap the subscriber asks the replay
    socket for the last batch it applied: the same timestamp means the same publisher, and the batches after it
    are applied; anything else means a new one, whose buffer is applied from the start on an emptied index.
    """

    def __init__(self, index: KVIndex, engine: str, endpoint: str, replay_endpoint: str | None = None, *,
                 topic: str = contract.KV_EVENTS_TOPIC, context: zmq.asyncio.Context | None = None) -> None:
        self.index, self.engine = index, engine
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.context = context or zmq.asyncio.Context.instance()
        self.last: int | None = None   # the last sequence number applied
        self._last_ts: float | None = None  # and its batch's timestamp
        # The timestamps of the batches applied lately, by sequence number: a live batch that a replay already
        # applied (the socket queued it meanwhile) is one of them, where a restarted engine's would not be.
        self._recent: dict[int, float | None] = {}
        self.stats = StreamStats()
        self.synced = asyncio.Event()  # set once what the publisher buffered at the start is in

    async def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(self.endpoint)
        try:
            await self._catch_up()
            self.synced.set()
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await monitor.recv_multipart()
                    # (Re)connected: to the publisher whose batches were applied, or to a restarted engine's.
                    await self._catch_up()
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) == 3:
                        await self.live(int.from_bytes(frames[1], "big", signed=True), frames[2])
        finally:
            sub.disable_monitor()
            monitor.close()
            sub.close()

    async def _catch_up(self, until: int | None = None) -> bool:
        """Apply what the publisher buffered past the last batch applied (everything, for a new subscriber or a
        new publisher); False when there is no replay socket or it did not answer."""
        if not self.replay_endpoint:
            return False
        if self.last is not None:
            outcome = await self._replay(self.last, until, same_as=self._last_ts)
            if outcome != _ANOTHER:
                return outcome == _ANSWERED
            self._resync("the engine restarted (its publisher no longer has the last batch applied)")
        return await self._replay(0, until) == _ANSWERED

    async def live(self, seq: int, payload: bytes) -> None:
        """Apply batch SEQ (its PAYLOAD as published) from the live stream, catching up first past a gap."""
        if self.last is not None and seq <= self.last:
            ts = _timestamp(payload)
            if seq in self._recent and self._recent[seq] == ts:
                return   # a replay applied it already (the socket queued it meanwhile)
            if ts is not None and self._last_ts is not None and ts < self._last_ts:
                # Older than the last batch applied: this publisher's, queued on the socket while a replay went
                # past it. A restarted engine's batches are newer than anything its predecessor sent.
                return
            # Numbering started again: a new publisher, so a restarted engine with an empty cache.
            self._resync(f"sequence went back from {self.last} to {seq}: the engine restarted")
            await self._catch_up(until=seq)
        elif self.last is not None and seq > self.last + 1:
            self.stats.gaps += 1
            start = self.last + 1
            if not await self._catch_up(until=seq):
                self._resync(f"batches {start}..{seq - 1} were lost and could not be replayed")
        elif self.last is None and seq > 0:
            await self._catch_up(until=seq)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        if self.last is not None and seq <= self.last:
            return
        try:
            ts, applied = apply_batch(self.index, self.engine, payload)
        except (msgspec.DecodeError, IndexError, TypeError, ValueError) as exc:
            # A batch the index cannot read may have removed blocks: trust nothing from before it.
            self._resync(f"batch {seq} could not be read ({exc})")
            ts, applied = None, 0
        self.stats.events += applied
        self.stats.batches += 1
        self.last, self._last_ts = seq, ts
        self._recent[seq] = ts
        if len(self._recent) > RECENT_BATCHES:
            del self._recent[next(iter(self._recent))]

    def _resync(self, why: str) -> None:
        log.warning("KV events of %s: %s; its blocks are forgotten until it reports them again", self.engine, why)
        self.stats.resyncs += 1
        self.stats.errors = [*self.stats.errors[-9:], why]
        self.index.cleared(self.engine)
        self.last = self._last_ts = None
        self._recent.clear()

    async def _replay(self, start: int, until: int | None, same_as: float | None = None) -> str:
        """Ask the publisher for its buffered batches from `start` (up to `until`, exclusive) and apply them.
        With SAME_AS, batch `start` must be there with that timestamp, else nothing is applied (_ANOTHER: another
        publisher). Where it no longer holds `start`, the engine's part of the index is resynced first and what
        it still holds applied."""
        assert self.replay_endpoint
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            first = True
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT_SECONDS * 1000):
                    return _SILENT
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if first and same_as is not None and (seq != start or _timestamp(frames[2]) != same_as):
                    return _ANOTHER
                if seq == END_OF_REPLAY:
                    return _ANSWERED
                if first and seq > start > 0:
                    self._resync(f"the publisher no longer holds batches {start}..{seq - 1}")
                first = False
                if until is None or seq < until:
                    if self.last is None or seq > self.last:
                        self.stats.replayed += 1
                    self._apply(seq, frames[2])
        finally:
            dealer.close()


_ANSWERED, _SILENT, _ANOTHER = "answered", "silent", "another"


def _timestamp(payload: bytes) -> float | None:
    try:
        return float(_decoder.decode(payload)[0])
    except (msgspec.DecodeError, IndexError, TypeError, ValueError):
        return None
