"""The simulator's KV-cache events, published as vLLM publishes them (`--kv-events-config`): msgpack batches over a
ZeroMQ PUB socket, numbered from 0, with a ROUTER socket replaying the last `buffer_steps`. The engine makes the
events from its own cache; pyzmq and msgspec are imported only when events are on. Design:
docs/simulator.md#the-prefix-cache-and-kv-events."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tensorfleet.sim")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# vLLM's KVEventsConfig fields (vllm/config/kv_events.py); the simulator has no queue, so max_queue_size is
# accepted and unused.
_FIELDS: dict[str, type | tuple[type, ...]] = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": (str, type(None)),
           "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str}


class KVEventsConfigError(ValueError):
    pass


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""


def parse_config(text: str) -> KVEventsConfig | None:
    """`--kv-events-config` JSON with vLLM's keys and defaults; None when it publishes nothing (events off, or the
    "null" publisher). KVEventsConfigError names what is wrong."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise KVEventsConfigError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise KVEventsConfigError("--kv-events-config must be a JSON object")
    for key, value in raw.items():
        kind = _FIELDS.get(key)
        if kind is None:
            raise KVEventsConfigError(f"--kv-events-config: unknown key {key!r} (vLLM's: {', '.join(_FIELDS)})")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise KVEventsConfigError(f"--kv-events-config: {key} {value!r} is not of the right type")
    enabled = raw.get("enable_kv_cache_events", False)
    publisher = raw.get("publisher") or ("zmq" if enabled else "null")
    if publisher not in ("zmq", "null"):
        raise KVEventsConfigError(f"--kv-events-config: unknown publisher {publisher!r} (zmq or null)")
    if not enabled or publisher == "null":
        return None
    config = KVEventsConfig(**{k: v for k, v in raw.items() if k in KVEventsConfig.__dataclass_fields__})
    if config.buffer_steps < 1 or config.hwm < 0:
        raise KVEventsConfigError("--kv-events-config: buffer_steps must be at least 1 and hwm at least 0")
    return config


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local endpoint, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    """The PUB and replay sockets, and the replay buffer. Create, serve and close inside one event loop."""

    def __init__(self, config: KVEventsConfig) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        self.config = config
        self._zmq = zmq
        self._encode = msgspec.msgpack.Encoder().encode
        # PUB sends never wait (past its high-water mark it drops): a plain socket, sent to from the loop. The
        # replay socket waits for requests: an asyncio one, on the same context.
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.asyncio.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = zmq.asyncio.Context.shadow(self._context.underlying).socket(zmq.ROUTER)
                # A whole buffer answers one request: a ROUTER drops what is past its high-water mark.
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise KVEventsConfigError(f"--kv-events-config: cannot open {config.endpoint} / "
                                      f"{config.replay_endpoint}: {exc}") from None
        self._topic = config.topic.encode()
        self._seq = itertools.count()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="sim-kv-replay")

    def publish(self, events: list[list[Any]]) -> None:
        """Send one batch; never waits (a PUB socket drops what its subscribers cannot take)."""
        seq = next(self._seq)
        payload = self._encode([time.time(), events, 0])
        self.buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=self._zmq.DONTWAIT)
        except self._zmq.ZMQError as exc:
            log.warning("KV event batch %d not sent (replay still has it): %s", seq, exc)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a KV-event replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):  # a copy: batches go on being published meanwhile
                if seq >= first:
                    await self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        # The replay socket belongs to the asyncio shadow of the context, which destroy() would not close.
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.destroy(linger=0)
