"""Per-deployment counters shared by the host's serving processes: requests in flight (the
router's load signal, per deployment and per node) and the fair queue's engine slots.

A row per deployment (and one per node, for its requests in flight)::

    digest 16s | capacity i64 | turn i64 | taken i64 |
    in_flight[workers] | slots[workers] | waiting[workers] | grants[workers] (i64)

(``taken``: the slots taken on the host, the sum of the ``slots`` columns, kept beside them
under the row's lock so that a take reads one number.)

Requests in flight and requests waiting are counted in the process's own column with no
lock (one writer per cell; an aligned 8-byte store is atomic on the host's CPUs), read as
the sum of the columns. Slots are taken and given back under the row's lock, so the slots
taken at a deployment never exceed its capacity, whichever process takes them: the check
and the take are one step for the host.

**Across processes, a slot given back goes round the processes with requests waiting for
it.** Under the row's lock, the process giving a slot back looks for the next worker after
``turn`` with ``waiting > 0`` (itself included): if that is itself, its own fair queue
(priority, then round-robin across keys) picks the request; if another, the slot moves to
that worker's column, its ``grants`` grows by one, and it is woken
(:mod:`berth.host.wake`): it gives the slot to its next request, or, with none any more
(the request left), gives it back the same way. So with ``k`` processes waiting for a
deployment each gets one of every ``k`` slots given back, and within a process the fair
queue's order holds; priority and the key ring are kept per process, not across them (a
high-priority request in one process may wait behind one low-priority slot handed to each
other waiting process). A slot is free only when nobody on the host waits for it, so a new
request taking a free one jumps no queue.

A worker's column is its own: :meth:`SharedDeployments.reclaim` zeroes a dead worker's
columns and hands the slots it held to the waiting processes (the supervisor calls it when
it restarts that worker). A wake that is dropped (the receiver's socket buffer full) leaves
its grant in the row: the receiver takes it with the next wake it gets, for any deployment
(it looks at every row it has waited for).

A full table (no row in a deployment's probe): the deployment is counted in this process
alone, as with one worker (its slots then hold per worker), and :attr:`overflowed` counts
it. :meth:`SharedDeployments.forget` gives a deployment's row up once nothing counts in it.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterable
from fcntl import LOCK_EX, LOCK_UN, lockf
from typing import TypeVar

from berth.host.region import Region, Table, digest_of
from berth.host.wake import WakeBox, WakeSender

FIXED = struct.Struct("<16sqqq")
#: capacity, turn (the worker last handed a slot), slots taken on the host
HEAD = struct.Struct("<qqq")
_IN_FLIGHT, _SLOTS, _WAITING, _GRANTS = range(4)
#: The capacity of a deployment whose slots are unknown (every request passes).
UNBOUNDED = 1 << 62

T = TypeVar("T")


def deployment_row_bytes(workers: int) -> int:
    return FIXED.size + 4 * 8 * workers


class SharedDeployments:
    """Deployment and node rows in the host's state file, as seen by worker ``worker``
    (see the module doc); ``wake`` sends the wakes of slots handed to other workers."""

    def __init__(self, region: Region, table: Table, worker: int, wake: WakeSender) -> None:
        self._region = region
        self._table = table
        self._worker = worker
        self._workers = region.shape.workers
        self._columns = struct.Struct(f"<{4 * self._workers}q")
        self._waiting = struct.Struct(f"<{self._workers}q")
        self._waiting_at = FIXED.size + 8 * _WAITING * self._workers
        self._wake = wake
        self._rows: dict[str, tuple[int, bytes]] = {}
        self._node_rows: dict[str, tuple[int, bytes]] = {}
        self._names: dict[int, str] = {}
        self._local: dict[str, int] = {}  # slots of deployments without a row
        #: deployments and nodes counted in this process alone for want of a row
        self.overflowed = 0

    # -- rows ---------------------------------------------------------------------------------

    def _row(self, deployment_id: str) -> int:
        return self._lookup(self._rows, "deployment\0", deployment_id)

    def _node_row(self, node_id: str) -> int:
        return self._lookup(self._node_rows, "node\0", node_id)

    def _lookup(self, cache: dict[str, tuple[int, bytes]], kind: str, name: str) -> int:
        # The row of ``name``: the one this process found before while its name is still
        # there (a row given up and taken by another is looked up again), else found or
        # made; -1 when the table has no room for it.
        known = cache.get(name)
        if known is not None:
            row, digest = known
            if row < 0:
                return row
            at = self._table.at(row)
            if self._region.map[at : at + 16] == digest:
                return row
        digest = digest_of(kind + name)
        row = self._table.find_or_add(digest)
        if row < 0:
            self.overflowed += 1
        elif kind == "deployment\0":
            self._names[row] = name
        cache[name] = (row, digest)
        return row

    def _cell(self, row: int, kind: int, worker: int) -> int:
        return self._table.at(row) + FIXED.size + 8 * (kind * self._workers + worker)

    def _sum(self, row: int, kind: int) -> int:
        at = self._table.at(row)
        cells = self._columns.unpack_from(self._region.map, at + FIXED.size)
        w = self._workers
        return sum(cells[kind * w : (kind + 1) * w])

    def _add(self, row: int, kind: int, step: int) -> None:
        cell = self._cell(row, kind, self._worker)
        region = self._region
        region.write_cell(cell, region.read_cell(cell) + step)

    # -- requests in flight (the router's signal) ---------------------------------------------

    def started(self, deployment_id: str, node_id: str) -> None:
        """A request was sent to ``deployment_id`` on ``node_id``."""
        row = self._row(deployment_id)
        if row >= 0:
            self._add(row, _IN_FLIGHT, 1)
        node = self._node_row(node_id)
        if node >= 0:
            self._add(node, _IN_FLIGHT, 1)

    def finished(self, deployment_id: str, node_id: str) -> None:
        """The request left ``deployment_id``."""
        row = self._row(deployment_id)
        if row >= 0:
            self._add(row, _IN_FLIGHT, -1)
        node = self._node_row(node_id)
        if node >= 0:
            self._add(node, _IN_FLIGHT, -1)

    def in_flight(self, deployment_id: str) -> int:
        row = self._row(deployment_id)
        return max(0, self._sum(row, _IN_FLIGHT)) if row >= 0 else 0

    def node_in_flight(self, node_id: str) -> int:
        row = self._node_row(node_id)
        return max(0, self._sum(row, _IN_FLIGHT)) if row >= 0 else 0

    # -- slots --------------------------------------------------------------------------------

    def take(self, deployment_id: str, capacity: int) -> bool:
        """Take a slot at ``deployment_id`` (of ``capacity`` slots) if one is free on the
        host."""
        row = self._row(deployment_id)
        if row < 0:
            used = self._local.get(deployment_id, 0)
            if used >= capacity:
                return False
            self._local[deployment_id] = used + 1
            return True
        region, table = self._region, self._table
        head = table.at(row) + 16
        lockf(table.fd, LOCK_EX, 1, table.lock_base + row)
        try:
            _capacity, turn, taken = HEAD.unpack_from(region.map, head)
            if taken >= capacity:
                return False
            HEAD.pack_into(region.map, head, capacity, turn, taken + 1)
            self._add(row, _SLOTS, 1)
            return True
        finally:
            lockf(table.fd, LOCK_UN, 1, table.lock_base + row)

    def take_over(self, deployment_id: str, capacity: int) -> None:
        """Count a slot at ``deployment_id`` even when it is full (a retry moved there)."""
        row = self._row(deployment_id)
        if row < 0:
            self._local[deployment_id] = self._local.get(deployment_id, 0) + 1
            return
        region, table = self._region, self._table
        head = table.at(row) + 16
        region.lock(table.number, row)
        try:
            _capacity, turn, taken = HEAD.unpack_from(region.map, head)
            HEAD.pack_into(region.map, head, capacity, turn, taken + 1)
            self._add(row, _SLOTS, 1)
        finally:
            region.unlock(table.number, row)

    def in_use(self, deployment_id: str) -> int:
        """Slots taken at ``deployment_id`` on the host."""
        row = self._row(deployment_id)
        if row < 0:
            return self._local.get(deployment_id, 0)
        return self._region.read_cell(self._table.at(row) + 32)

    def waiting(self, deployment_ids: Iterable[str], step: int) -> None:
        """``step`` more (or fewer) of this process's requests wait for each of
        ``deployment_ids``."""
        for deployment_id in deployment_ids:
            row = self._row(deployment_id)
            if row >= 0:
                self._add(row, _WAITING, step)

    def release(self, deployment_id: str, pick_local: Callable[[], T | None]) -> T | None:
        """Give back a slot at ``deployment_id``: to this process's request ``pick_local``
        returns when it is this process's turn (returned; the slot stays taken), to another
        waiting process (woken), or free (``None`` both ways)."""
        row = self._row(deployment_id)
        if row < 0:
            picked = pick_local()
            if picked is None:
                self._local[deployment_id] = self._local.get(deployment_id, 1) - 1
            return picked
        region, table = self._region, self._table
        at = table.at(row)
        woken = -1
        lockf(table.fd, LOCK_EX, 1, table.lock_base + row)
        try:
            capacity, _turn, taken = HEAD.unpack_from(region.map, at + 16)
            waiting = self._waiting.unpack_from(region.map, at + self._waiting_at)
            if taken <= capacity and any(waiting):
                picked, woken = self._hand(row, pick_local)
                if picked is not None:
                    return picked
            if woken < 0:  # nobody waits: free
                self._count_taken(row, -1)
                self._add(row, _SLOTS, -1)
        finally:
            lockf(table.fd, LOCK_UN, 1, table.lock_base + row)
        if woken >= 0:
            self._wake.wake(woken, row)
        return None

    def _count_taken(self, row: int, step: int) -> None:
        cell = self._table.at(row) + 32
        region = self._region
        region.write_cell(cell, region.read_cell(cell) + step)

    def _next_waiting(self, row: int, skip: Callable[[int], bool]) -> int:
        # The next worker after ``turn`` with requests waiting at ``row`` (locked) that no
        # slot handed to it covers yet, ``skip`` left out; -1 when none.
        region = self._region
        at = self._table.at(row)
        cells = self._columns.unpack_from(region.map, at + FIXED.size)
        w = self._workers
        turn = region.read_cell(at + 24)
        for step in range(1, w + 1):
            other = (turn + step) % w
            if cells[_WAITING * w + other] - cells[_GRANTS * w + other] > 0 and not skip(other):
                return other
        return -1

    def _hand(self, row: int, pick_local: Callable[[], T | None]) -> tuple[T | None, int]:
        # One slot of ``row`` (locked, counted in this worker's column) to the next worker
        # waiting for it: (this worker's request, -1), (None, the worker it moved to), or
        # (None, -1) when nobody waits.
        region = self._region
        at = self._table.at(row)
        me = self._worker
        declined = False

        def skip(worker: int) -> bool:
            return worker == me and declined

        while True:
            other = self._next_waiting(row, skip)
            if other < 0:
                return None, -1
            if other == me:
                picked = pick_local()
                if picked is None:
                    declined = True  # its waiters left: on to the others
                    continue
                region.write_cell(at + 24, me)
                return picked, -1
            self._add(row, _SLOTS, -1)
            self._give(row, other)
            return None, other

    def _give(self, row: int, other: int) -> None:
        # A slot of ``row`` (locked, already counted in ``taken``) to worker ``other``.
        region = self._region
        for kind in (_SLOTS, _GRANTS):
            cell = self._cell(row, kind, other)
            region.write_cell(cell, region.read_cell(cell) + 1)
        region.write_cell(self._table.at(row) + 24, other)

    def resize(
        self, deployment_id: str, slots: int | None, pick_local: Callable[[], T | None]
    ) -> list[T]:
        """``deployment_id`` has ``slots`` from now on (``None``: unknown, unbounded): its
        new free slots go round the waiting processes; this process's requests that got
        one are returned."""
        capacity = UNBOUNDED if slots is None else slots
        row = self._row(deployment_id)
        granted: list[T] = []
        if row < 0:
            while self._local.get(deployment_id, 0) < capacity:
                picked = pick_local()
                if picked is None:
                    break
                self._local[deployment_id] = self._local.get(deployment_id, 0) + 1
                granted.append(picked)
            return granted
        region, table = self._region, self._table
        at = table.at(row)
        woken: set[int] = set()
        region.lock(table.number, row)
        try:
            _old, turn, taken = HEAD.unpack_from(region.map, at + 16)
            HEAD.pack_into(region.map, at + 16, capacity, turn, taken)
            waiting = sum(self._waiting.unpack_from(region.map, at + self._waiting_at))
            for _ in range(max(0, min(capacity - taken, waiting))):
                self._count_taken(row, 1)  # taken here, then handed on
                self._add(row, _SLOTS, 1)
                picked, other = self._hand(row, pick_local)
                if picked is not None:
                    granted.append(picked)
                elif other >= 0:
                    woken.add(other)
                else:
                    self._count_taken(row, -1)
                    self._add(row, _SLOTS, -1)
                    break
        finally:
            region.unlock(table.number, row)
        for other in woken:
            self._wake.wake(other, row)
        return granted

    def take_grants(
        self, rows: Iterable[int], pick_for: Callable[[str], T | None]
    ) -> list[tuple[str, T]]:
        """The slots other processes handed this one at ``rows`` (the rows of its wakes,
        and every other row of a deployment this process has waited for: a dropped wake's
        grant is taken with the next wake), each given to the request ``pick_for(deployment
        id)`` returns (returned with the deployment's id), or given back when none waits
        any more."""
        granted: list[tuple[str, T]] = []
        region, table = self._region, self._table
        for row in set(rows) | set(self._names):
            deployment_id = self._names.get(row)
            if deployment_id is None or not 0 <= row < table.rows:
                continue
            cell = self._cell(row, _GRANTS, self._worker)
            if region.read_cell(cell) == 0:
                continue
            region.lock(table.number, row)
            try:
                count = region.read_cell(cell)
                region.write_cell(cell, 0)
            finally:
                region.unlock(table.number, row)
            for _ in range(count):
                picked = pick_for(deployment_id)
                if picked is None:  # nobody here wants it any more: on, or free
                    picked = self.release(deployment_id, functools.partial(pick_for, deployment_id))
                if picked is not None:
                    granted.append((deployment_id, picked))
        return granted

    @property
    def wake_box(self) -> WakeBox | None:
        """This worker's wake socket, to watch for slots handed to it (``None``: the
        supervisor's view)."""
        return self._wake if isinstance(self._wake, WakeBox) else None

    def forget(self, deployment_id: str) -> bool:
        """Give up ``deployment_id``'s row when nothing counts in it any more (it is gone);
        whether it was given up."""
        known = self._rows.pop(deployment_id, None)
        if known is None or known[0] < 0:
            return False
        row = known[0]
        self._names.pop(row, None)
        region, table = self._region, self._table
        region.lock(table.number, row)
        try:
            at = table.at(row)
            cells = self._columns.unpack_from(region.map, at + FIXED.size)
            if region.map[at : at + 16] != known[1] or any(cells):
                return False  # another process gave it up already, or it counts
            table.give_up(row)
            return True
        finally:
            region.unlock(table.number, row)

    def reclaim(self, worker: int) -> int:
        """Zero worker ``worker``'s columns (it died) and hand the slots it held to the
        processes waiting for them; how many slots it held."""
        region, table = self._region, self._table
        freed_total = 0
        for row in range(table.rows):
            at = table.at(row)
            if region.map[at : at + 16] == bytes(16):
                continue
            woken: set[int] = set()
            region.lock(table.number, row)
            try:
                freed = max(0, region.read_cell(self._cell(row, _SLOTS, worker)))
                for kind in range(4):
                    region.write_cell(self._cell(row, kind, worker), 0)
                self._count_taken(row, -freed)
                freed_total += freed
                for _ in range(freed):
                    capacity, _turn, taken = HEAD.unpack_from(region.map, at + 16)
                    other = self._next_waiting(row, lambda _worker: False)
                    if taken >= capacity or other < 0:
                        break
                    self._count_taken(row, 1)
                    self._give(row, other)
                    woken.add(other)
            finally:
                region.unlock(table.number, row)
            for other in woken:
                self._wake.wake(other, row)
        return freed_total
