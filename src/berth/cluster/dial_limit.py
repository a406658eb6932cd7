"""How often one address may open the agent WebSocket: a sliding window (pure, no clock).

An agent redials with backoff, so a healthy one dials a few times an hour; an address that
dials more than ``max_dials`` times in ``window_s`` seconds (a broken agent without
backoff, a copy of an identity in a restart loop, a flood) is refused with the link's
``RATE_LIMITED`` close code, whose reason says when to come back
(:func:`berth.cluster.protocol.errors.rate_limited_reason`); agents wait that long before
their next dial.  The defaults leave room for many agents behind one address (a NAT).
"""

from __future__ import annotations

from collections import deque
from typing import Final

#: Dials allowed per source address within :data:`DIAL_WINDOW_S`.
MAX_DIALS: Final = 60
DIAL_WINDOW_S: Final = 60.0


class DialRateLimiter:
    """Counts dials per address in a sliding window; ``now`` is any monotonic clock (s)."""

    def __init__(self, max_dials: int = MAX_DIALS, window_s: float = DIAL_WINDOW_S) -> None:
        self._max = max_dials
        self._window_s = window_s
        self._dials: dict[str, deque[float]] = {}

    def check(self, address: str, now: float) -> float | None:
        """Count a dial from ``address`` at ``now``: ``None`` when allowed, else the seconds
        until the oldest counted dial leaves the window (the dial is then not counted)."""
        for idle in [a for a, t in self._dials.items() if t[-1] <= now - self._window_s]:
            del self._dials[idle]
        times = self._dials.setdefault(address, deque())
        while times and times[0] <= now - self._window_s:
            times.popleft()
        if len(times) >= self._max:
            return times[0] + self._window_s - now
        times.append(now)
        return None
