"""Router replicas tell each other where they send prompts, their load on each engine and their queue's cheapest waiter
there, so every replica's prefix view, load and queue order cover them all: a message as soon as there is news (a
heartbeat without), taken only from the peers' addresses and bounded in size, never sent again. Design:
docs/routing.md#cache-aware-the-default.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from tensorfleet import contract
from tensorfleet.router.backends import Load

log = logging.getLogger("tensorfleet.router.peers")

PEER_HEARTBEAT = 0.5    # seconds: a message at least this often, with the load, while there are peers
PEER_STALE = 1.5        # seconds a peer's load counts after its last message
PEER_TIMEOUT = 1.0      # seconds a post to a peer may take
PEER_MAX_BYTES = 1 << 20
MAX_PLACEMENTS = 4096   # per message
MAX_OUTBOX = 4096       # placements held between messages; past it the oldest are dropped (counted)
MAX_HASHES = 256        # block hashes per placement (the router hashes at most 256 blocks of a prompt)
EXPOSURE_UNIT = 1_000_000  # an engine's exposure (Load.exposure) goes in millionths: a message holds whole numbers
_HASH_LIMIT = 1 << 33   # block hashes are CRC-32s; an opening's hash is 32 bits (+1 bit for an adapter's name)

OUTCOMES = ("sent", "failed", "dropped", "received")   # tensorfleet_router_peer_placements{outcome}

Placement = tuple[str, int | None, tuple[int, ...]]   # engine URL, opening hash, block hashes
Loads = dict[str, Load]   # engine URL -> one replica's load there (or the peers' together)
Heads = dict[str, int]    # engine URL -> prompt characters one replica's cheapest waiter would compute there


class PeerMessageError(ValueError):
    """A peer's message that is not a placements message of this version (answered 400)."""


def _host(url: str) -> str:
    return urlsplit(url).hostname or ""


class Peers:
    """The other router replicas: where to send this replica's placements, and whose to take."""

    def __init__(self, *, static: Sequence[str] = (), own_address: str | None = None,
                 on_outcome: Callable[[str, int], None] | None = None) -> None:
        """STATIC: peer base URLs given on the command line; OWN_ADDRESS: this pod's IP, left out of the
        discovered ones; ON_OUTCOME(outcome, count): counts placements sent, failed, dropped, received."""
        self.instance = secrets.token_hex(8)  # a message from this process, come back through the Service, is dropped
        self._static = [u.rstrip("/") for u in static]
        self._discovered: list[str] = []
        self._own = own_address
        self._outbox: deque[Placement] = deque(maxlen=MAX_OUTBOX)
        self._dropped = 0
        self._sent_load: tuple[dict[str, list[int]], dict[str, int], Heads] | None = None   # as last sent
        self._sent_at = -PEER_HEARTBEAT
        # Peer instance -> when its last message came, its load, its queue's heads.
        self._loads: dict[str, tuple[float, Loads, Heads]] = {}
        # This replica's queue heads, for the messages (Dispatcher.queue_heads); None: it tells none.
        self.queue_heads_source: Callable[[], Heads] | None = None
        self._news = asyncio.Event()  # set when there is something to tell: run() sends it
        self._on_outcome = on_outcome or (lambda _outcome, _count: None)
        self._update()

    @property
    def urls(self) -> tuple[str, ...]:
        return self._urls

    def allowed(self, address: str | None) -> bool:
        """Whether a post from ADDRESS (the connection's remote IP) is a peer's."""
        return address is not None and address in self._hosts

    def set_discovered(self, urls: Iterable[str]) -> None:
        """The router Service's ready endpoints (this replica among them)."""
        self._discovered = [u for u in urls if self._own is None or _host(u) != self._own]
        self._update()

    def _update(self) -> None:
        self._urls = tuple(dict.fromkeys([*self._static, *self._discovered]))
        self._hosts = frozenset(_host(u) for u in self._urls)

    def share(self, engine: str, hashes: Sequence[int], opening: int | None) -> None:
        """A request went to ENGINE: tell the peers in the next message (`nudge` sends it)."""
        if not self._urls or not hashes:
            return
        if len(self._outbox) == MAX_OUTBOX:
            self._dropped += 1
        self._outbox.append((engine, opening, tuple(hashes[:MAX_HASHES])))

    def nudge(self) -> None:
        """There is news (a placement, or this replica's load changed): send a message now, or as soon as the one
        in flight is answered."""
        if self._urls:
            self._news.set()

    def message(self, block_chars: int, load: Loads, now: float) -> bytes | None:
        """The outbox, LOAD and the queue's heads as one message (emptying the outbox), or None when there is
        nothing new to send (no placements, the load and heads as last sent, the heartbeat not due)."""
        if self._dropped:
            self._on_outcome("dropped", self._dropped)
            self._dropped = 0
        # Compared as sent, not as Load objects: the ledger moves an engine's Load in place, so the last sent
        # would be the same object as the current and a change would wait for the heartbeat.
        wire = ({url: [x.requests, round(x.prefill_chars), round(x.context_chars), round(x.queued_prompt_chars),
                       x.prefilling] for url, x in load.items()},
                # Apart from "load", which a replica before it refuses longer than five numbers.
                {url: round(x.exposure * EXPOSURE_UNIT) for url, x in load.items() if x.exposure},
                self.queue_heads_source() if self.queue_heads_source is not None else {})
        if not self._outbox and wire == self._sent_load and now - self._sent_at < PEER_HEARTBEAT:
            return None
        placements = [[engine, opening, list(hashes)] for engine, opening, hashes in self._outbox]
        self._outbox.clear()
        self._sent_load, self._sent_at = wire, now
        doc = {"from": self.instance, "blockChars": block_chars, "placements": placements, "load": wire[0],
               "exposure": wire[1]}
        if wire[2]:
            doc["queue"] = wire[2]   # none: nothing queued (a replica before it sends none either)
        return json.dumps(doc, separators=(",", ":")).encode()

    @property
    def heard(self) -> bool:
        """Whether any peer's load is kept (it may have gone stale since)."""
        return bool(self._loads)

    def load(self, now: float) -> Loads:
        """The other replicas' load per engine: the sum over the peers heard from within PEER_STALE."""
        total: Loads = {}
        for instance, (heard, load, _heads) in list(self._loads.items()):
            if now - heard > PEER_STALE:
                del self._loads[instance]
                continue
            for url, told in load.items():
                total[url] = total[url] + told if url in total else told
        return total

    def queue_heads(self, now: float) -> dict[str, float]:
        """Per engine, the prompt characters the cheapest waiter of any peer heard from within PEER_STALE would
        compute there (engines none of them has a waiter for left out)."""
        best: dict[str, float] = {}
        for heard, _load, heads in self._loads.values():
            if now - heard <= PEER_STALE:
                for url, chars in heads.items():
                    best[url] = min(best.get(url, chars), chars)
        return best

    async def run(self, session: aiohttp.ClientSession, block_chars: Callable[[], int], load: Callable[[], Loads],
                  clock: Callable[[], float]) -> None:
        """Send every peer the outbox and this replica's LOAD whenever there is news (`nudge`), one message at a
        time (news that comes while one is on its way goes in the next, at once: a wait between messages would delay
        the slots a peer leaves this replica), and at least every PEER_HEARTBEAT seconds; until cancelled."""
        timeout = aiohttp.ClientTimeout(total=PEER_TIMEOUT)
        while True:
            if not self._news.is_set():
                try:
                    async with asyncio.timeout(PEER_HEARTBEAT):
                        await self._news.wait()
                except TimeoutError:
                    pass  # the heartbeat: message() sends the load if it is due
            self._news.clear()
            if not self._urls:
                self._outbox.clear()
                continue
            count = len(self._outbox)
            body = self.message(block_chars(), load(), clock())
            if body is None:
                continue
            results = await asyncio.gather(*(self._post(session, url, body, timeout) for url in self._urls))
            for ok in results:
                self._on_outcome("sent" if ok else "failed", count)

    async def _post(self, session: aiohttp.ClientSession, url: str, body: bytes,
                    timeout: aiohttp.ClientTimeout) -> bool:
        try:
            async with session.post(url + contract.ROUTER_PEER_PATH, data=body, timeout=timeout,
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                if resp.status != 204:
                    log.debug("peer %s answered %d to placements", url, resp.status)
                return resp.status == 204
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.debug("placements to peer %s failed: %s", url, exc)
            return False

    def decode(self, body: bytes, block_chars: int, now: float) -> list[Placement]:
        """A peer's message: its load is kept (see `load`), its placements returned; [] when it is this process's
        own, or hashes blocks of another size (the replicas disagree on the engines' KV block size until their
        next scrape). Raises PeerMessageError."""
        try:
            doc: Any = json.loads(body)
        except ValueError as exc:
            raise PeerMessageError(f"not JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("placements"), list):
            raise PeerMessageError("expected an object with a 'placements' list")
        sender = doc.get("from")
        if not isinstance(sender, str) or not sender or len(sender) > 64:
            raise PeerMessageError("expected 'from', the sender's instance name")
        if sender == self.instance:
            return []
        load = doc.get("load", {})
        if not (isinstance(load, dict) and len(load) <= MAX_PLACEMENTS
                and all(isinstance(v, list) and 2 <= len(v) <= 5 and all(_is_count(x) for x in v)
                        for v in load.values())):
            raise PeerMessageError("'load' is not {engine URL: [requests in flight, prompt characters to compute, "
                                   "prompt characters in flight, prompt characters queued, requests with no first byte back]}")
        exposure = doc.get("exposure", {})
        if not (isinstance(exposure, dict) and len(exposure) <= MAX_PLACEMENTS
                and all(_is_count(v) for v in exposure.values())):
            raise PeerMessageError("'exposure' is not {engine URL: the decodes at risk there, in millionths}")
        heads = doc.get("queue", {})
        if not (isinstance(heads, dict) and len(heads) <= MAX_PLACEMENTS and all(_is_count(v) for v in heads.values())):
            raise PeerMessageError("'queue' is not {engine URL: prompt characters the sender's cheapest queued "
                                   "request would compute there}")
        loads = {url: _load_entry(v) for url, v in load.items()}
        for url, value in exposure.items():
            if url in loads:
                loads[url].exposure = value / EXPOSURE_UNIT
        self._loads[sender] = (now, loads, heads)
        if doc.get("blockChars") != block_chars:
            return []
        raw = doc["placements"]
        if len(raw) > MAX_PLACEMENTS:
            raise PeerMessageError(f"more than {MAX_PLACEMENTS} placements")
        placements: list[Placement] = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and (item[1] is None or _is_hash(item[1])) and isinstance(item[2], list)
                    and len(item[2]) <= MAX_HASHES and all(_is_hash(h) for h in item[2])):
                raise PeerMessageError("a placement is not [engine URL, opening hash or null, [block hashes]]")
            placements.append((item[0], item[1], tuple(item[2])))
        self._on_outcome("received", len(placements))
        return placements


def _load_entry(value: list[int]) -> Load:
    """One engine's load in a message: the numbers an older replica leaves out count as 0."""
    n, chars, context, queued, prefilling = (*value, 0, 0, 0)[:5]
    return Load(requests=n, prefilling=min(prefilling, n), prefill_chars=float(chars), context_chars=float(context),
                queued_prompt_chars=float(queued))


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 53


def _is_hash(value: Any) -> bool:
    return type(value) is int and 0 <= value < _HASH_LIMIT
