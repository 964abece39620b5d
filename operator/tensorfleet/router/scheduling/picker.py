"""Pickers: the one engine a profile sends a request to, from the candidates' weighted scores. Design:
docs/routing.md#the-scheduling-framework.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from tensorfleet.router.backends import Backend


class Picker(Protocol):
    def pick(self, backends: Sequence[Backend], totals: Sequence[float]) -> Backend:
        """One of BACKENDS (never empty), given each one's weighted score."""


class MaxScore:
    """The highest score. With ROTATE, ties go to each engine in turn (the scan starts at a rotating offset and the
    first maximum wins) instead of always to the first, so equal engines share work."""

    def __init__(self, rotate: bool = True) -> None:
        self.rotate = rotate
        self._counter = itertools.count()

    def pick(self, backends: Sequence[Backend], totals: Sequence[float]) -> Backend:
        n = len(backends)
        if n == 1:
            return backends[0]
        start = next(self._counter) % n if self.rotate else 0
        best = start
        for i in range(1, n):
            j = (start + i) % n
            if totals[j] > totals[best]:
                best = j
        return backends[best]


class RoundRobin:
    """Each request to the next engine in turn, whatever the scores."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, backends: Sequence[Backend], totals: Sequence[float]) -> Backend:
        return backends[next(self._counter) % len(backends)]
