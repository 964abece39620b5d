"""The one polling loop the harnesses share (tensorfleet.testing.wait): it returns what came, tolerates only what
it is told to, and says what it waited for and what it last saw when time runs out."""

from __future__ import annotations

import itertools

import pytest

from tensorfleet.testing.wait import eventually, poll, wait_for


def test_poll_returns_the_first_truthy_result_or_the_last_one() -> None:
    counter = itertools.count()
    assert poll(lambda: next(counter) >= 3 and "ready", timeout=5, interval=0) == (True, "ready")
    assert poll(lambda: 0, timeout=0.05, interval=0.01) == (False, 0)


def test_wait_for_names_what_it_waited_for_and_tolerates_only_what_it_is_told() -> None:
    def not_yet() -> None:
        raise AssertionError("replicas 1 of 2")

    with pytest.raises(AssertionError, match=r"waiting for two replicas; last: AssertionError\('replicas 1 of 2'\)"):
        wait_for(not_yet, timeout=0.05, message="two replicas", interval=0.01, tolerate=(AssertionError,))
    with pytest.raises(AssertionError, match="^replicas 1 of 2$"):
        wait_for(not_yet, timeout=0.05, interval=0.01)


@pytest.mark.asyncio
async def test_eventually_awaits_and_times_out_naming_the_message() -> None:
    counter = itertools.count()

    async def check() -> int:
        return next(counter) >= 2

    assert await eventually(check, timeout=5, interval=0) is True
    with pytest.raises(AssertionError, match="timed out after 0.05s waiting for nothing"):
        await eventually(lambda: None, timeout=0.05, message="nothing", interval=0.01)
