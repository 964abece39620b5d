"""Does a live object already hold everything we would apply? Every rendered field must be present with the same
value; defaults and other managers' fields are ignored, quantities compare by value and Go's `omitempty` zeros
count as absent, so applies that would change nothing are skipped. Design: docs/architecture.md#the-reconcile-loop.
"""

from __future__ import annotations

from typing import Any

from kubernetes.utils import parse_quantity


def _same_scalar(desired: Any, live: Any) -> bool:
    if desired == live:
        return True
    if isinstance(desired, str) and isinstance(live, str | int | float):
        try:
            return bool(parse_quantity(desired) == parse_quantity(str(live)))
        except (ValueError, TypeError):
            return False
    return False


# Go's `omitempty`: a field applied as false, 0, "", [] or {} is stored and returned absent, so an absent
# field holds a desired zero value.
def _zero(value: Any) -> bool:
    if value is None or value is False:
        return True
    if isinstance(value, int | float):
        return value == 0
    return isinstance(value, str | list | dict) and len(value) == 0


def contains(live: Any, desired: Any) -> bool:
    """True when `live` holds every field and list item of `desired`."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        return all(contains(live[key], value) if key in live else _zero(value) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return False
        return all(contains(l_item, d_item) for l_item, d_item in zip(live, desired, strict=True))
    return _same_scalar(desired, live)
