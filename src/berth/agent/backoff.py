"""Capped exponential backoff with equal jitter: how an agent spaces its redials and its
certificate renewal retries."""

from __future__ import annotations

import random
from collections.abc import Callable

#: The first redial delay before jitter, in seconds (it doubles up to ``redial_max_s``).
BACKOFF_BASE_S = 1.0
#: The largest redial delay, in seconds: the ``redial_max_s`` setting's default.
REDIAL_MAX_S = 30.0


def backoff_delay(
    attempt: int,
    *,
    base_s: float = BACKOFF_BASE_S,
    cap_s: float = REDIAL_MAX_S,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before redial number ``attempt`` (0 for the first retry).

    The delay doubles from ``base_s`` and is clamped to ``cap_s`` first, then jittered with
    *equal jitter* (AWS Architecture Blog, "Exponential Backoff And Jitter", 2015): half of
    the clamped delay ``d`` is kept and the other half drawn with ``rand`` (uniform in
    ``[0, 1)``), so the wait lies in ``[d / 2, d)``: never above ``cap_s``, never below half
    the clamped delay (``base_s / 2`` at the least, so a refused agent never redials in a
    burst).  Clamping before the jitter keeps agents that lost the leader together spread
    over ``[cap_s / 2, cap_s)`` at the cap; jitter first, then clamp, put half of them at
    exactly ``cap_s``, redialling in step.
    """
    clamped_s = min(cap_s, base_s * 2.0 ** min(attempt, 30))
    return clamped_s / 2 + clamped_s / 2 * rand()
