"""The bound on request-body bytes held at once, over all requests (the router's and the gateway's), and each
request's Body charged to it. Design: docs/security.md#clients-of-the-router.
"""

from __future__ import annotations


class BodyBudget:
    """Request-body bytes the router holds at once, over all requests: its memory bound for what clients send.

    A request takes bytes as they arrive, not as its Content-Length announces, so a slow sender holds only what
    it has sent; it gives them back once no retry can need them (the answer's first byte reached the client) or
    when it ends. When a take would pass the limit the request is refused (503): its sender can retry, and the
    router's memory stays bounded whatever arrives at once. Bodies larger than `large` bytes may fill only
    `large_share` of the budget, so a burst of big bodies leaves room for ordinary requests.
    """

    def __init__(self, limit: int, *, large: int = 1024 * 1024, large_share: float = 0.75) -> None:
        self.limit = limit
        self.large = min(large, limit)
        self.large_limit = int(limit * large_share)
        self.used = 0
        self.peak = 0
        self.refused = 0

    def take(self, n: int, *, held: int = 0) -> bool:
        """Charge `n` more bytes to a request that holds `held` already; False (nothing charged) if over."""
        limit = self.limit if held + n <= self.large else self.large_limit
        if self.used + n > limit:
            self.refused += 1
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n


class Body:
    """One request's body as it arrives, its bytes charged to a BodyBudget until released."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.data = bytearray()
        self.held = 0

    def add(self, chunk: bytes) -> bool:
        if not self.budget.take(len(chunk), held=self.held):
            return False
        self.held += len(chunk)
        self.data += chunk
        return True

    def replace(self, data: bytes) -> bool:
        """Send DATA instead (the same request, rewritten), charging the difference; False (nothing changed) if
        the budget cannot take it."""
        extra = len(data) - self.held
        if extra > 0 and not self.budget.take(extra, held=self.held):
            return False
        if extra < 0:
            self.budget.give(-extra)
        self.held += extra
        self.data = bytearray(data)
        return True

    def release(self) -> None:
        """Give the bytes back: no retry can need them any more."""
        self.data = bytearray()
        self.budget.give(self.held)
        self.held = 0
