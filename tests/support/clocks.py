"""Clocks that tests control."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class StepClock:
    """Wall-clock readings for the store that advance one second per reading, from
    2025-01-01 UTC, so that creation order is unambiguous."""

    def __init__(self) -> None:
        self.now = datetime(2025, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


class HeldClock:
    """Wall-clock readings that stand still until the test moves them (:meth:`advance`),
    shared by several stores as one host's clock is."""

    def __init__(self) -> None:
        self.now = datetime(2025, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)
