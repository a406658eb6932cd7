"""UTC calendar days and months for token budgets, from epoch seconds.

Budgets run per UTC calendar day (from 00:00:00Z) and per UTC calendar month (from the 1st,
00:00:00Z), whatever the leader's time zone. :class:`CalendarPosition` says which day and
month a moment falls in and when they end, so the request path compares one float to know
that nothing changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

SECONDS_PER_DAY = 86_400
_EPOCH = date(1970, 1, 1)


@dataclass(frozen=True, slots=True)
class CalendarPosition:
    """The UTC day and month containing a moment.

    ``day_index`` counts days since 1970-01-01; ``month_index`` is ``year * 12 + month - 1``;
    ``day_end_s`` and ``month_end_s`` are the epoch seconds at which each ends.
    """

    day_index: int
    month_index: int
    day_end_s: float
    month_end_s: float

    @classmethod
    def at(cls, epoch_s: float) -> CalendarPosition:
        """The position of the moment ``epoch_s`` (UTC epoch seconds)."""
        day_index = int(epoch_s // SECONDS_PER_DAY)
        today = day_of(day_index)
        next_month = (
            date(today.year + 1, 1, 1)
            if today.month == 12
            else date(today.year, today.month + 1, 1)
        )
        return cls(
            day_index=day_index,
            month_index=today.year * 12 + today.month - 1,
            day_end_s=float((day_index + 1) * SECONDS_PER_DAY),
            month_end_s=datetime(next_month.year, next_month.month, 1, tzinfo=UTC).timestamp(),
        )


def day_of(day_index: int) -> date:
    """The date of a day index (days since 1970-01-01)."""
    return _EPOCH + timedelta(days=day_index)


def day_index_of(day: date) -> int:
    """The day index of ``day`` (days since 1970-01-01)."""
    return (day - _EPOCH).days


def month_start(day: date) -> date:
    """The first day of ``day``'s month."""
    return day.replace(day=1)
