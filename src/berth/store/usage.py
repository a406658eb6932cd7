"""The usage ledger: requests and tokens per key, model, node and UTC day.

:class:`UsageMethods` is mixed into :class:`berth.store.Store`.  The leader never writes a
row per request: its admission stage sums requests in memory and adds each batch with
:meth:`UsageMethods.add_usage`, one transaction per batch.  Adding is an UPDATE of the row's
counters (``requests = requests + n``), or an INSERT where the row is new, so batches from
the same day accumulate and the SQL is the same on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from datetime import date
from typing import Any, cast

from sqlalchemy import CursorResult, func, insert, select, update
from sqlalchemy.orm import Session

from berth.store.tables import UsageRow
from berth.vocab.records import UsageRecord

_COUNTERS = (
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "estimated_requests",
    "estimated_tokens",
    "cached_tokens",
)


class UsageMethods:
    """Store methods for the usage ledger (see the module doc)."""

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def add_usage(self, batch: Iterable[UsageRecord]) -> int:
        """Add every record's counters to its ledger row (created when missing), all in one
        transaction; return how many records were added.  Counters must not be negative
        (``ValueError``): the ledger only grows."""
        records = list(batch)
        for record in records:
            if any(getattr(record, name) < 0 for name in _COUNTERS):
                raise ValueError(f"negative usage counter in {record!r}")
        if not records:
            return 0
        with self._write() as session:
            for record in records:
                where = (
                    (UsageRow.day == record.day)
                    & (UsageRow.key_id == record.key_id)
                    & (UsageRow.model == record.model)
                    & (UsageRow.node_id == record.node_id)
                )
                increments = {
                    name: getattr(UsageRow, name) + getattr(record, name) for name in _COUNTERS
                }
                result = cast(
                    CursorResult[Any],
                    session.execute(
                        update(UsageRow)
                        .where(where)
                        .values(**increments)
                        .execution_options(synchronize_session=False)
                    ),
                )
                if result.rowcount == 0:
                    values = {name: getattr(record, name) for name in _COUNTERS}
                    session.execute(
                        insert(UsageRow).values(
                            day=record.day,
                            key_id=record.key_id,
                            model=record.model,
                            node_id=record.node_id,
                            **values,
                        )
                    )
        return len(records)

    def list_usage(
        self,
        *,
        since: date,
        until: date | None = None,
        key_id: str | None = None,
        model: str | None = None,
    ) -> list[UsageRecord]:
        """Ledger rows from day ``since`` to ``until`` (both included; ``None``: no end),
        of one key and/or one model when given, by day, key, model and node."""
        query = select(UsageRow).where(UsageRow.day >= since)
        if until is not None:
            query = query.where(UsageRow.day <= until)
        if key_id is not None:
            query = query.where(UsageRow.key_id == key_id)
        if model is not None:
            query = query.where(UsageRow.model == model)
        query = query.order_by(UsageRow.day, UsageRow.key_id, UsageRow.model, UsageRow.node_id)
        with self._read() as session:
            return [_usage_record(row) for row in session.scalars(query)]

    def token_totals(self, *, day: date, month_start: date) -> dict[str, tuple[int, int]]:
        """``{key id: (tokens on day, tokens from month_start on)}`` for every key with
        usage since ``month_start``: what the leader's token budgets start from."""
        tokens = func.sum(UsageRow.prompt_tokens + UsageRow.completion_tokens)
        month = (
            select(UsageRow.key_id, tokens)
            .where(UsageRow.day >= month_start)
            .group_by(UsageRow.key_id)
        )
        today = select(UsageRow.key_id, tokens).where(UsageRow.day == day).group_by(UsageRow.key_id)
        with self._read() as session:
            in_month = {key: int(total or 0) for key, total in session.execute(month)}
            on_day = {key: int(total or 0) for key, total in session.execute(today)}
        return {key: (on_day.get(key, 0), total) for key, total in in_month.items()}


def _usage_record(row: UsageRow) -> UsageRecord:
    return UsageRecord(
        day=row.day,
        key_id=row.key_id,
        model=row.model,
        node_id=row.node_id,
        requests=row.requests,
        errors=row.errors,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens,
        estimated_requests=row.estimated_requests,
        estimated_tokens=row.estimated_tokens,
        cached_tokens=row.cached_tokens,
    )
