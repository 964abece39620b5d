"""The charges of this router's requests on its engines: what placing a request adds to an engine's own Load
(router/backends.py), taken back at its first byte and at its end, so the load the scheduler reads is exactly the
requests in flight. Design: docs/routing.md#the-scheduling-framework.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tensorfleet.router.backends import Backend
from tensorfleet.router.scheduling import RequestInfo

log = logging.getLogger(__name__)


@dataclass
class Charge:
    """What one request adds to its engine's Load: its uncached prompt characters (`prefill`; `queued`, the part
    the prompt queue bound counts) until its first byte, its whole prompt (`context`), its `exposure`
    (scheduling/request.py) and its slot until it ends."""

    prefill: float = 0.0
    queued: float = 0.0
    context: float = 0.0
    exposure: float = 0.0
    prefilling: bool = True


class Ledger:
    """Every charge this router has on its engines, one per request and engine: the one place an engine's own
    Load moves, so what a request added is exactly what comes off at its first byte and at its end."""

    def __init__(self) -> None:
        self._charges: dict[tuple[int, str], tuple[RequestInfo, Charge]] = {}

    def __len__(self) -> int:
        return len(self._charges)

    def get(self, backend: Backend, info: RequestInfo) -> Charge | None:
        entry = self._charges.get((id(info), backend.url))
        return entry[1] if entry is not None and entry[0] is info else None

    def charge(self, backend: Backend, info: RequestInfo, charge: Charge) -> None:
        self._charges[(id(info), backend.url)] = (info, charge)
        load = backend.own
        load.requests += 1
        load.prefilling += 1
        load.prefill_chars += charge.prefill
        load.queued_prompt_chars += charge.queued
        load.context_chars += charge.context
        load.exposure += charge.exposure

    def first_byte(self, backend: Backend, info: RequestInfo) -> Charge | None:
        """The request's first byte came back: its prompt work comes off (once). The charge, or None when there
        was none left to take off."""
        charge = self.get(backend, info)
        if charge is None or not charge.prefilling:
            return None
        load = backend.own
        load.prefilling = max(load.prefilling - 1, 0)
        load.prefill_chars = max(load.prefill_chars - charge.prefill, 0.0)
        load.queued_prompt_chars = max(load.queued_prompt_chars - charge.queued, 0.0)
        charge.prefilling = False
        return charge

    def release(self, backend: Backend, info: RequestInfo) -> bool:
        """The request ended on BACKEND (or never went): everything it added comes off. False when it had no charge
        there (released twice, or never charged: a bug, logged, that must not fail the request it ends)."""
        self.first_byte(backend, info)
        entry = self._charges.pop((id(info), backend.url), None)
        if entry is None or entry[0] is not info:
            log.error("no charge of this request on %s to release", backend.url)
            return False
        load = backend.own
        load.requests -= 1
        load.context_chars = max(load.context_chars - entry[1].context, 0.0)
        # A sum of fractions: with no request left, exactly none, whatever the rounding of the additions.
        load.exposure = max(load.exposure - entry[1].exposure, 0.0) if load.requests else 0.0
        return True
