"""Free engine slots left briefly to a peer router replica whose cheapest waiter would compute less prompt there than
any of this replica's, so a slot goes to the cheapest waiter of every replica's queue, as with one router; one the
peer does not take within YIELD_SECONDS goes to this replica's waiters after all. Design:
docs/routing.md#admission-and-the-queue (*Cheapest first*).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

# Seconds a free slot is left for a peer replica whose cheapest waiter would compute less prompt there than any of
# this router's (router/peers.py): it hears of the slot within a message (they go as news comes, a round trip of
# milliseconds) and takes it; one that has not within this time leaves it to this router's waiters.
YIELD_SECONDS = 0.03
# How a slot left to a peer ended (tensorfleet_router_slots_left_to_peers{outcome}): a peer placed a request there
# (taken), or one of this router's requests took it after all (reclaimed).
YIELD_OUTCOMES = ("taken", "reclaimed")


class PeerYield:
    """Which engines' free slots are left to a peer now, and since when."""

    def __init__(self, on_over: Callable[[], None]) -> None:
        """ON_OVER: called when a slot's time for the peer is over (the dispatcher hands it to its own waiters)."""
        self._on_over = on_over
        # The peer replicas' cheapest waiter per engine, as they last told (engine URL -> the prompt characters it
        # would compute there: their Dispatcher.queue_heads); None: no peers.
        self.peer_queue: Callable[[], dict[str, float]] | None = None
        # Called with how each slot left to a peer ended (YIELD_OUTCOMES): the router counts them.
        self.on_end: Callable[[str], None] | None = None
        self._since: dict[str, float] = {}   # engine URL -> when a free slot there was first left to a peer

    def yields(self, url: str, mine: Callable[[], float], block_chars: int) -> bool:
        """Whether to leave the free slot on engine URL to a peer whose cheapest waiter there would compute at least
        a block (BLOCK_CHARS) less prompt than this router's waiter would (MINE(), asked only when a peer has a
        waiter there), for YIELD_SECONDS from the first time."""
        theirs = self.peer_queue().get(url) if self.peer_queue is not None else None
        if theirs is None or theirs + block_chars > mine():
            return False
        loop = asyncio.get_running_loop()
        now = loop.time()
        first = self._since.get(url)
        if first is None:
            self._since[url] = first = now
            loop.call_later(YIELD_SECONDS, self._over, url)
        return now - first < YIELD_SECONDS

    def _over(self, url: str) -> None:
        if url in self._since:
            self._since[url] = -math.inf   # still counted as left, until `end`, but no longer held for the peer
        self._on_over()

    def end(self, url: str, outcome: str) -> None:
        """A request was placed on engine URL: by a peer (`taken`) or by this router (`reclaimed`); a slot left
        there, if any, has ended so."""
        if self._since.pop(url, None) is not None and self.on_end is not None:
            self.on_end(outcome)
