"""Per-key admission counters: the in-process kind (the key's own fields are the count) and
the shared kind (one row per key in the host's state file).

:class:`~berth.admission.quotas.Admission` decides on a key's fields (:class:`CountedKey`):
requests in flight, body bytes held, tokens reserved for budgets, the minute buckets' levels
and the UTC day's and month's tokens. Around every decision it calls :meth:`load` (bring the
host's values into the key's fields, the key's row locked) and :meth:`store` (write what the
decision changed back, unlock), so that the check and the take are one step for the whole
host. In process both are nothing: the key's fields are the only count.

A shared row (:class:`SharedKeyCounters`)::

    digest 16s | flags u32 | pad | rpm level, at | tpm level, at (f64) |
    day index, day tokens, month index, month tokens (i64) |
    in flight, reserved, body bytes: the host's (i64) |
    (in flight, reserved, body bytes)[workers]: each worker's own (i64)

(the host's three are the sums of the columns, kept beside them under the row's lock so
that a load reads one record.)

What a process holds (requests in flight, budget reservations, body bytes) is in its own
column, so that :meth:`SharedKeyCounters.reclaim` gives back all a dead worker held. What
was spent (tokens settled, the minute buckets' levels) is the key's, whoever spent it; a
dead worker's requests never settle, so the tokens they reserved from the minute bucket stay
taken and come back with the refill. The bucket times are ``CLOCK_MONOTONIC`` seconds, one
clock for every process of the host.

A full table (no row in a key's probe of :data:`~berth.host.region.MAX_PROBE`): the key is
counted in each process alone, as with one worker (its limits then hold per worker), and
:attr:`SharedKeyCounters.overflowed` counts such keys for ``/metrics`` and the log.
"""

from __future__ import annotations

import struct
from fcntl import LOCK_EX, LOCK_UN, lockf
from typing import Protocol

from berth.host.region import Region, Table, digest_of

FIXED = struct.Struct("<16sIIddddqqqqqqq")
#: one worker's cells: in flight, reserved, body bytes
CELLS = struct.Struct("<qqq")
_HAS_RPM = 1
_HAS_TPM = 2
_HAS_CALENDAR = 4


class Bucket(Protocol):
    """A minute bucket's level and when it was last refilled (monotonic seconds)."""

    level: float
    updated_at: float
    capacity: float


class CountedKey(Protocol):
    """The fields of a key the counters bring in and write back (``host_row``: its row in
    a shared table, -1 before the first look, -2 when the table had no room)."""

    key_id: str
    host_row: int
    in_flight: int
    reserved_tokens: int
    body_bytes: int
    day_index: int
    day_tokens: int
    month_index: int
    month_tokens: int

    @property
    def requests(self) -> Bucket | None: ...

    @property
    def tokens(self) -> Bucket | None: ...


class KeyCounters(Protocol):
    """Where a key's counts live (see the module doc). ``shared`` is False when
    :meth:`load` and :meth:`store` do nothing (the caller may skip them)."""

    shared: bool

    def load(self, key: CountedKey) -> bool:
        """Bring the host's counts into ``key`` and lock them; ``False`` when ``key`` is
        counted in this process alone (nothing locked, :meth:`store` not to be called)."""
        ...

    def store(self, key: CountedKey) -> None:
        """Write back what changed in ``key`` since :meth:`load`, and unlock."""
        ...

    def seed(self, key: CountedKey) -> None:
        """Start the host's day and month tokens of ``key`` from its fields, unless the host
        already counts them (another process started first)."""
        ...


class LocalKeyCounters:
    """The in-process kind: the key's fields are the count (the default)."""

    shared = False

    def load(self, key: CountedKey) -> bool:
        return False

    def store(self, key: CountedKey) -> None:
        return None

    def seed(self, key: CountedKey) -> None:
        return None


#: The one in-process instance (it holds nothing).
LOCAL_KEYS = LocalKeyCounters()


def key_row_bytes(workers: int) -> int:
    return FIXED.size + 3 * 8 * workers


class SharedKeyCounters:
    """Key rows in the host's state file, as seen by worker ``worker`` (see the module
    doc)."""

    shared = True

    def __init__(self, region: Region, table: Table, worker: int) -> None:
        self._region = region
        self._table = table
        self._worker = worker
        self._workers = region.shape.workers
        #: the column sums at the last load: in flight, reserved, body bytes
        self._base = (0, 0, 0)
        self._row = -1
        #: keys counted in-process for want of a row
        self.overflowed = 0

    def _row_of(self, key: CountedKey) -> int:
        row = key.host_row
        if row == -1:
            row = key.host_row = self._table.find_or_add(digest_of(key.key_id))
            if row < 0:
                key.host_row = row = -2
                self.overflowed += 1
        return row

    def load(self, key: CountedKey) -> bool:
        row = self._row_of(key)
        if row < 0:
            return False
        table = self._table
        lockf(table.fd, LOCK_EX, 1, table.lock_base + row)
        self._row = row
        mapped = table.region.map
        at = table.at(row)
        (
            _,
            flags,
            _,
            r_level,
            r_at,
            t_level,
            t_at,
            day_i,
            day_t,
            month_i,
            month_t,
            in_flight,
            reserved,
            body,
        ) = FIXED.unpack_from(mapped, at)
        self._base = (in_flight, reserved, body)
        key.in_flight, key.reserved_tokens, key.body_bytes = in_flight, reserved, body
        requests, tokens = key.requests, key.tokens
        if requests is not None and flags & _HAS_RPM:
            requests.level = min(r_level, requests.capacity)
            requests.updated_at = r_at
        if tokens is not None and flags & _HAS_TPM:
            tokens.level = min(t_level, tokens.capacity)
            tokens.updated_at = t_at
        if flags & _HAS_CALENDAR:
            key.day_index, key.day_tokens = day_i, day_t
            key.month_index, key.month_tokens = month_i, month_t
        return True

    def store(self, key: CountedKey) -> None:
        row = self._row
        table = self._table
        try:
            self._write(key, table.at(row))
        finally:
            self._row = -1
            lockf(table.fd, LOCK_UN, 1, table.lock_base + row)

    def _write(self, key: CountedKey, at: int) -> None:
        mapped = self._table.region.map
        requests, tokens = key.requests, key.tokens
        flags = _HAS_CALENDAR
        r_level = r_at = t_level = t_at = 0.0
        if requests is not None:
            flags |= _HAS_RPM
            r_level, r_at = requests.level, requests.updated_at
        if tokens is not None:
            flags |= _HAS_TPM
            t_level, t_at = tokens.level, tokens.updated_at
        digest = mapped[at : at + 16]
        FIXED.pack_into(
            mapped,
            at,
            digest,
            flags,
            0,
            r_level,
            r_at,
            t_level,
            t_at,
            key.day_index,
            key.day_tokens,
            key.month_index,
            key.month_tokens,
            key.in_flight,
            key.reserved_tokens,
            key.body_bytes,
        )
        in_flight, reserved, body = self._base
        if key.in_flight != in_flight or key.reserved_tokens != reserved or key.body_bytes != body:
            mine = at + FIXED.size + 24 * self._worker
            my_in_flight, my_reserved, my_body = CELLS.unpack_from(mapped, mine)
            CELLS.pack_into(
                mapped,
                mine,
                my_in_flight + key.in_flight - in_flight,
                my_reserved + key.reserved_tokens - reserved,
                my_body + key.body_bytes - body,
            )

    def seed(self, key: CountedKey) -> None:
        row = self._row_of(key)
        if row < 0:
            return
        table = self._table
        self._region.lock(table.number, row)
        try:
            flags = FIXED.unpack_from(table.region.map, table.at(row))[1]
            if flags & _HAS_CALENDAR:
                return  # another process seeded it: the host's count wins
            self._base = (0, 0, 0)
            saved = key.in_flight, key.reserved_tokens, key.body_bytes
            key.in_flight = key.reserved_tokens = key.body_bytes = 0
            self._write(key, table.at(row))
            key.in_flight, key.reserved_tokens, key.body_bytes = saved
        finally:
            self._region.unlock(table.number, row)

    def reclaim(self, worker: int) -> None:
        """Zero worker ``worker``'s columns in every key row (it died: what it held is
        given back). Call it before that worker's index serves again."""
        table = self._table
        region = self._region
        for row in range(table.rows):
            at = table.at(row)
            if table.region.map[at : at + 16] == bytes(16):
                continue
            region.lock(table.number, row)
            try:
                mine = at + FIXED.size + 24 * worker
                held = CELLS.unpack_from(region.map, mine)
                totals = CELLS.unpack_from(region.map, at + FIXED.size - 24)
                CELLS.pack_into(
                    region.map,
                    at + FIXED.size - 24,
                    *(t - h for t, h in zip(totals, held, strict=True)),
                )
                CELLS.pack_into(region.map, mine, 0, 0, 0)
            finally:
                region.unlock(table.number, row)
