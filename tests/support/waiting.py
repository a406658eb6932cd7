"""Waiting for an event instead of sleeping: poll a condition until it holds or a deadline
passes.

A test waits for what it means (a counter reaching a value, a state, a log line) with a
generous deadline, so that a slow or loaded machine only makes it take longer; the deadline
is there to end a test whose event never comes, not to measure speed.  Speed targets live
in ``scripts/bench_*.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: A deadline for events that normally take well under a second (a counter moving, a
#: request arriving): generous so that two cores shared by many test runs do not fail it.
EVENT_TIMEOUT_S = 30.0


def wait_for(
    predicate: Callable[[], T], timeout_s: float, what: str, *, interval_s: float = 0.05
) -> T:
    """Call ``predicate`` every ``interval_s`` seconds until it returns a truthy value, and
    return that value.

    Raises ``AssertionError`` naming ``what`` (and the last value seen) when ``timeout_s``
    seconds pass first. Exceptions from ``predicate`` propagate.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}; last seen: {value!r}")
        time.sleep(interval_s)


async def wait_for_async(
    predicate: Callable[[], T], timeout_s: float, what: str, *, interval_s: float = 0.005
) -> T:
    """:func:`wait_for` inside an event loop: sleeps with ``asyncio.sleep`` between calls, so
    the tasks the condition depends on keep running."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}; last seen: {value!r}")
        await asyncio.sleep(interval_s)
