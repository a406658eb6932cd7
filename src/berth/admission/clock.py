"""The clocks admission reads: a monotonic one for the per-minute windows, the wall clock
(UTC epoch seconds) for calendar days and months and for key expiry.

:class:`SystemClock` is the real one; :class:`ManualClock` is moved by hand, for tests.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Two readings, in seconds: ``monotonic()`` never goes back; ``time()`` is UTC epoch."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    """The process's clocks: :func:`time.monotonic` and :func:`time.time` themselves (no
    Python call in between: they are read on every request)."""

    __slots__ = ()

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


class ManualClock:
    """A clock that moves only when told (:meth:`advance`); both readings move together."""

    __slots__ = ("_monotonic", "_wall")

    def __init__(self, wall_s: float = 1_767_225_600.0) -> None:
        """``wall_s`` is the starting UTC epoch time (default 2026-01-01 00:00:00Z)."""
        self._wall = wall_s
        self._monotonic = 1000.0

    def monotonic(self) -> float:
        return self._monotonic

    def time(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        """Move both clocks ``seconds`` on (``ValueError`` for a negative step)."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._monotonic += seconds
        self._wall += seconds
