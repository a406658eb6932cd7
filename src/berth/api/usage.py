"""The usage ledger: ``GET /admin/usage``.

Query: ``since`` (``30d``: today, UTC, and the 29 days before; or a date ``2026-01-31``;
default ``30d``), ``key`` (a key's name or id; ``(socket)`` for the leader's Unix socket),
``model`` (a model or route name as clients ask for it), ``by`` (``day``, ``key``, ``model``
or ``node``: what each row sums over; default ``day``).
"""

from __future__ import annotations

import re
from datetime import date, timedelta
from typing import Literal, get_args

from berth.api.base import ApiModel
from berth.errors import ConfigError

UsageGrouping = Literal["day", "key", "model", "node"]
USAGE_GROUPINGS: tuple[UsageGrouping, ...] = get_args(UsageGrouping)
#: ``--since`` when none is given.
DEFAULT_SINCE = "30d"
#: The longest look back ``Nd`` may ask for (about ten years).
MAX_SINCE_DAYS = 3660

_DAYS = re.compile(r"(\d{1,5})d")


#: ``since`` as the schema states it: ``1d`` to ``3660d`` (:data:`MAX_SINCE_DAYS`), or a
#: date (``format: date``, beside it).
SINCE_DAYS_PATTERN = r"^([1-9][0-9]{0,2}|[1-2][0-9]{3}|3[0-5][0-9]{2}|36[0-5][0-9]|3660)[dD]$"


def parse_since(text: str, today: date, *, future_ok: bool = False) -> date:
    """The first day a ``since`` value covers: ``Nd`` is ``today`` and the N-1 days before
    (``1d``: today only), a date is itself.  Raises :class:`ConfigError` for anything else,
    ``0d``, more than :data:`MAX_SINCE_DAYS` days, or a date after ``today`` unless
    ``future_ok`` (the admin API: a window that starts later holds no usage yet; the CLI
    refuses it as a likely typo)."""
    value = text.strip().lower()
    found = _DAYS.fullmatch(value)
    if found is not None:
        days = int(found[1])
        if not 1 <= days <= MAX_SINCE_DAYS:
            raise ConfigError(f"--since: {text!r}: use 1d to {MAX_SINCE_DAYS}d")
        return today - timedelta(days=days - 1)
    try:
        day = date.fromisoformat(value)
    except ValueError:
        raise ConfigError(
            f"--since: {text!r} is neither a number of days (30d) nor a date (2026-01-31)"
        ) from None
    if day > today and not future_ok:
        raise ConfigError(f"--since: {day.isoformat()} is after today ({today.isoformat()}, UTC)")
    return day


def parse_grouping(text: str) -> UsageGrouping:
    """``day``, ``key``, ``model`` or ``node``; :class:`ConfigError` listing them."""
    value = text.strip().lower()
    for grouping in USAGE_GROUPINGS:
        if value == grouping:
            return grouping
    raise ConfigError(f"--by: {text!r}: use one of {', '.join(USAGE_GROUPINGS)}")


class UsageRow(ApiModel):
    """One row of a usage report: the group (``day``, or ``key_id`` and ``key`` (its name),
    or ``model``, or ``node_id``; the others ``null``) and its sums.  ``estimated_tokens``
    is the part of the tokens berth estimated (engines that reported no usage), over
    ``estimated_requests`` requests; ``cached_tokens`` the part of the prompt tokens the
    engines read from their caches, where they said (Messages API answers)."""

    day: date | None = None
    key_id: str | None = None
    key: str | None = None
    model: str | None = None
    node_id: str | None = None
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    estimated_requests: int
    estimated_tokens: int
    cached_tokens: int = 0  # 0 from a leader before it counted them


class UsageReport(ApiModel):
    """``GET /admin/usage``: ``rows`` grouped ``by`` one thing, from ``since`` to ``until``
    (UTC dates, both included), of one key or model when asked, and their ``total``.
    Usage not yet written to the store is included."""

    since: date
    until: date
    by: UsageGrouping
    key: str | None
    model: str | None
    rows: list[UsageRow]
    total: UsageRow
