"""The usage ledger's buffer: requests and tokens summed in memory, written in batches.

The request path only adds to a dict (:meth:`UsageLedger.record`); :meth:`UsageLedger.run`
writes what gathered to the store every ``flush_interval_s`` seconds, off the event loop, in
one transaction (:meth:`berth.store.Store.add_usage`), and the daemon calls
:meth:`UsageLedger.flush` once more when it stops. A batch the store refused goes back into
the buffer and is tried again at the next flush.

What a crash can lose: a leader killed without a clean stop (``kill -9``, power loss) loses
what it gathered since the last flush, at most ``flush_interval_s`` seconds of usage (and
the token budgets, which start from the ledger at the next start, forget that much).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Protocol

from berth.admission.calendar import day_of
from berth.errors import BerthError
from berth.vocab.records import UsageRecord

_log = logging.getLogger(__name__)

#: Seconds between two writes of the buffer to the store.
DEFAULT_FLUSH_INTERVAL_S = 5.0

# The counters of one ledger row, in this order.
_REQUESTS, _ERRORS, _PROMPT, _COMPLETION, _EST_REQUESTS, _EST_TOKENS, _CACHED = range(7)
_Slot = list[int]
_RowKey = tuple[int, str, str, str]  # (day index, key id, model, node id)


class UsageSink(Protocol):
    """Where batches go: :meth:`berth.store.Store.add_usage` (may block; run in a thread)."""

    def add_usage(self, batch: Iterable[UsageRecord]) -> int: ...


class UsageLedger:
    """Gathers usage per (UTC day, key, model, node) and writes it to ``sink`` in batches.

    Counts since this leader started, flushed or not, are what :meth:`totals` returns (the
    Prometheus series are built from them).
    """

    def __init__(
        self, sink: UsageSink, *, flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    ) -> None:
        if flush_interval_s <= 0:
            raise ValueError("flush_interval_s must be positive")
        self._sink = sink
        self.flush_interval_s = flush_interval_s
        self._pending: dict[_RowKey, _Slot] = {}
        self._writing: dict[_RowKey, _Slot] = {}
        # What was written, summed per (key, model): all the metrics need of it.
        self._written: dict[tuple[str, str], list[int]] = {}
        self._lock = asyncio.Lock()
        self._stopping = asyncio.Event()

    # -- the request path ---------------------------------------------------------------------

    def record(
        self,
        day_index: int,
        key_id: str,
        model: str,
        node_id: str,
        *,
        error: bool,
        prompt_tokens: int,
        completion_tokens: int,
        estimated: bool,
        cached_tokens: int = 0,
    ) -> None:
        """Count one request (``estimated``: its token counts are berth's estimate;
        ``cached_tokens``: the part of ``prompt_tokens`` the engine read from its cache)."""
        row = (day_index, key_id, model, node_id)
        slot = self._pending.get(row)
        if slot is None:
            slot = self._pending[row] = [0, 0, 0, 0, 0, 0, 0]
        slot[_REQUESTS] += 1
        if error:
            slot[_ERRORS] += 1
        slot[_PROMPT] += prompt_tokens
        slot[_COMPLETION] += completion_tokens
        slot[_CACHED] += cached_tokens
        if estimated:
            slot[_EST_REQUESTS] += 1
            slot[_EST_TOKENS] += prompt_tokens + completion_tokens

    # -- writing ------------------------------------------------------------------------------

    @property
    def pending(self) -> list[UsageRecord]:
        """What the next flush will write."""
        return [_usage_record(row, slot) for row, slot in self._pending.items()]

    async def flush(self) -> int:
        """Write everything gathered so far; return how many ledger rows were added to.

        Raises the sink's :class:`~berth.errors.BerthError` (a :class:`StoreError`) when the
        write fails; the batch then stays in the buffer for the next flush.
        """
        async with self._lock:
            if not self._pending:
                return 0
            self._writing, self._pending = self._pending, {}
            batch = [_usage_record(row, slot) for row, slot in self._writing.items()]
            try:
                await asyncio.to_thread(self._sink.add_usage, batch)
            except BaseException:
                _merge(self._pending, self._writing)
                raise
            finally:
                writing, self._writing = self._writing, {}
            _add_totals(self._written, writing)
            return len(batch)

    async def run(self) -> None:
        """Flush every ``flush_interval_s`` seconds until :meth:`stop`, then once more and
        return. A failed write is logged and tried again at the next flush. (Stopped, not
        cancelled: a write cut off half-way could not tell whether it happened.)"""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.flush_interval_s)
            last = self._stopping.is_set()  # set during this flush: one more pass
            try:
                await self.flush()
            except BerthError as exc:
                level = logging.ERROR if last else logging.WARNING
                kept = len(self._pending)
                _log.log(level, "usage ledger: write failed (%d rows kept): %s", kept, exc)
            except Exception:  # a bug: the loop must go on writing, so log it and go on
                _log.exception("usage ledger: flush failed (%d rows kept)", len(self._pending))
            if last:
                return

    def stop(self) -> None:
        """Make :meth:`run` write what is left and return."""
        self._stopping.set()

    # -- totals -------------------------------------------------------------------------------

    def totals(self) -> Iterator[tuple[str, str, tuple[int, int, int, int]]]:
        """``(key id, model, (requests, errors, prompt, completion tokens))`` since this
        leader started, summed over days and nodes (each (key, model) once)."""
        summed = {pair: list(counts) for pair, counts in self._written.items()}
        _add_totals(summed, self._writing)
        _add_totals(summed, self._pending)
        for (key_id, model), counts in summed.items():
            yield key_id, model, (counts[0], counts[1], counts[2], counts[3])


def _merge(into: dict[_RowKey, _Slot], source: dict[_RowKey, _Slot]) -> None:
    for row, slot in source.items():
        existing = into.get(row)
        if existing is None:
            into[row] = list(slot)
        else:
            for i, value in enumerate(slot):
                existing[i] += value


def _add_totals(into: dict[tuple[str, str], list[int]], source: dict[_RowKey, _Slot]) -> None:
    for (_day, key_id, model, _node), slot in source.items():
        counts = into.get((key_id, model))
        if counts is None:
            counts = into[(key_id, model)] = [0, 0, 0, 0]
        counts[0] += slot[_REQUESTS]
        counts[1] += slot[_ERRORS]
        counts[2] += slot[_PROMPT]
        counts[3] += slot[_COMPLETION]


def _usage_record(row: _RowKey, slot: _Slot) -> UsageRecord:
    day_index, key_id, model, node_id = row
    return UsageRecord(
        day=day_of(day_index),
        key_id=key_id,
        model=model,
        node_id=node_id,
        requests=slot[_REQUESTS],
        errors=slot[_ERRORS],
        prompt_tokens=slot[_PROMPT],
        completion_tokens=slot[_COMPLETION],
        estimated_requests=slot[_EST_REQUESTS],
        estimated_tokens=slot[_EST_TOKENS],
        cached_tokens=slot[_CACHED],
    )
