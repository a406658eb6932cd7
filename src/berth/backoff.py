"""Capped exponential backoff: the one rule every retry in berth waits by.

The delay before retry number ``attempt`` (0 for the first) is ``first_s`` doubled
``attempt`` times, never more than ``cap_s`` (:func:`capped_delay_s`). Where many hosts may
retry the same thing at once it is also jittered (:func:`jittered_delay_s`, and
:class:`Backoff`, which counts the failures itself): *equal jitter* (AWS Architecture Blog,
"Exponential Backoff And Jitter", 2015) keeps half of the capped delay ``d`` and draws the
other half, so the wait lies in ``[d / 2, d)``. The cap is applied before the jitter: hosts
that failed together are then spread over ``[cap_s / 2, cap_s)`` once at the cap, instead of
half of them waiting exactly ``cap_s`` and retrying in step.

Who waits by it: an agent's redials and certificate renewal retries (jittered,
:mod:`berth.agent.dialer`, :mod:`berth.agent.renewal`), the desk worker's retries (jittered,
:mod:`berth.desk.worker`), the restart policy's delays (not jittered: one leader decides them,
:mod:`berth.deployments.restarts`) and a leader service's own start delay where systemd has
no rising one (not jittered, :mod:`berth.restart_backoff`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Final

#: Doublings counted at most: past them every delay is at its cap (any ``first_s`` above
#: 10^-15 s under a cap of hours), and ``2.0 ** attempt`` never overflows on a long outage.
MAX_DOUBLINGS: Final = 64


def capped_delay_s(attempt: int, *, first_s: float, cap_s: float) -> float:
    """``first_s`` doubled ``attempt`` times (``attempt`` 0: ``first_s``), at most
    ``cap_s``; in seconds."""
    return min(cap_s, first_s * 2.0 ** min(max(attempt, 0), MAX_DOUBLINGS))


def jittered_delay_s(
    attempt: int,
    *,
    first_s: float,
    cap_s: float,
    rand: Callable[[], float] = random.random,
) -> float:
    """:func:`capped_delay_s` with equal jitter: its lower half kept, its upper half drawn
    with ``rand`` (uniform in ``[0, 1)``), so never above ``cap_s`` and never below half the
    capped delay (``first_s / 2`` at the least: a refused host never retries in a burst)."""
    delay_s = capped_delay_s(attempt, first_s=first_s, cap_s=cap_s)
    return delay_s / 2 + delay_s / 2 * rand()


class Backoff:
    """:func:`jittered_delay_s` for a caller that retries until it succeeds: it counts the
    failures in a row itself (:meth:`next_delay_s`, :meth:`reset`)."""

    def __init__(
        self, first_s: float, max_s: float, *, rand: Callable[[], float] = random.random
    ) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._rand = rand
        self._failures = 0

    @property
    def failures(self) -> int:
        """Failures in a row since the last :meth:`reset`."""
        return self._failures

    def next_delay_s(self) -> float:
        """Record one more failure and return how long to wait before trying again."""
        attempt, self._failures = self._failures, self._failures + 1
        return jittered_delay_s(attempt, first_s=self.first_s, cap_s=self.max_s, rand=self._rand)

    def reset(self) -> None:
        """A success: the next failure starts from ``first_s`` again."""
        self._failures = 0
