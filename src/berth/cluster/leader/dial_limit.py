"""How often one node may open the agent WebSocket: a sliding window (pure, no clock).

An agent redials with backoff (1, 2, 4 ... s up to ``redial_max_s``), so a healthy one dials
a handful of times in its worst minute; a node that dials more than ``max_dials`` times in
``window_s`` seconds (an agent without backoff, copies of one identity in a restart loop)
is refused with the link's ``RATE_LIMITED`` close code, whose reason says when to come back
(:func:`berth.cluster.protocol.errors.rate_limited_reason`); agents wait that long before
their next dial.  Counted per node, after its certificate identified it, so many agents
behind one address (a NAT) never count against each other; a dial without a valid
certificate is refused before it counts.
"""

from __future__ import annotations

from collections import deque
from typing import Final

#: Dials allowed per node within :data:`DIAL_WINDOW_S`.
MAX_DIALS: Final = 20
DIAL_WINDOW_S: Final = 60.0


class DialRateLimiter:
    """Counts dials per key (a node id) in a sliding window; ``now`` is any monotonic
    clock (seconds)."""

    def __init__(self, max_dials: int = MAX_DIALS, window_s: float = DIAL_WINDOW_S) -> None:
        self._max = max_dials
        self._window_s = window_s
        self._dials: dict[str, deque[float]] = {}

    def check(self, key: str, now: float) -> float | None:
        """Count a dial of ``key`` (the node's id) at ``now``: ``None`` when allowed,
        else the seconds until the oldest counted dial leaves the window (the dial is then
        not counted)."""
        for idle in [a for a, t in self._dials.items() if t[-1] <= now - self._window_s]:
            del self._dials[idle]
        times = self._dials.setdefault(key, deque())
        while times and times[0] <= now - self._window_s:
            times.popleft()
        if len(times) >= self._max:
            return times[0] + self._window_s - now
        times.append(now)
        return None
