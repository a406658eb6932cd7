"""Leadership through the store: one lease row with an epoch, and the fence on writes.

Several leaders may share one database (PostgreSQL, or one SQLite file on one host); one
of them is *active* and the others are *standby*.  The active holds the ``leader_lease``
row: its ``holder`` id, the ``address`` clients and agents should use, an ``epoch`` and an
``expires_at`` (Unix seconds).  It renews the row well before it expires; a standby takes
it over once it has expired, with the epoch one higher.  Each take, by anyone, raises the
epoch; a renewal keeps it.  Times are the leaders' wall clocks, so their hosts' clocks must
agree to well within the lease (NTP does).

The *fence*: a store whose :meth:`LeaseMethods.fence` was given an epoch refuses the
writes that act on the cluster's state (deployments started, moved, stopped or placed;
services and routes changed; see :mod:`berth.store.store`) unless the lease row holds that
same epoch and has not expired, raising :class:`~berth.store.errors.FencedError`.  The
check reads the row inside the write's own transaction, after the write lock
(:mod:`berth.store.db`), so a takeover cannot slip between the check and the write.  A
store never given an epoch (one leader, no leadership) is not fenced.

:func:`decide` is the pure rule; :class:`LeaseMethods` applies it in one write each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Final, Literal

from sqlalchemy.orm import Session

from berth.store.errors import FencedError
from berth.store.tables import LeaderLeaseRow

#: The lease row's key (one leadership per database).
LEASE_NAME: Final = "leader"

Role = Literal["active", "standby"]
Action = Literal["take", "renew", "wait"]


@dataclass(frozen=True)
class LeaseRecord:
    """The lease row: ``holder`` (a leader's id), its ``address``, ``epoch`` (1 upwards)
    and its times in Unix seconds."""

    holder: str
    address: str
    epoch: int
    acquired_at: float
    renewed_at: float
    expires_at: float

    def live(self, now: float) -> bool:
        """Whether the lease still holds at ``now``."""
        return now < self.expires_at


@dataclass(frozen=True)
class LeaseDecision:
    """What a leader does about the lease: ``take`` it (a new epoch), ``renew`` its own,
    or ``wait`` as a standby while ``active`` (another leader's id) holds it."""

    action: Action
    epoch: int
    active: str | None


def decide(now: float, lease: LeaseRecord | None, me: str) -> LeaseDecision:
    """Who is active at ``now`` given the ``lease`` row (``None``: never taken) and this
    leader's id ``me``.

    - no row, or a row that has expired (anyone's, this leader's own included): take it,
      epoch one higher (1 for the first);
    - a live row of this leader: renew it, same epoch;
    - a live row of another: wait; that leader is active.

    Taking again after one's own lease expired raises the epoch on purpose: whatever this
    leader did under the old epoch while it was stalled is behind the fence.
    """
    if lease is None:
        return LeaseDecision("take", 1, me)
    if not lease.live(now):
        return LeaseDecision("take", lease.epoch + 1, me)
    if lease.holder == me:
        return LeaseDecision("renew", lease.epoch, me)
    return LeaseDecision("wait", lease.epoch, lease.holder)


@dataclass(frozen=True)
class LeaseState:
    """Where a leader stands after a lease call: its ``role``, the lease's ``epoch``, the
    active leader's id and address (``None`` when nobody holds a live lease) and when the
    lease expires."""

    role: Role
    epoch: int
    active: str | None
    active_address: str | None
    expires_at: float


def _record(row: LeaderLeaseRow) -> LeaseRecord:
    return LeaseRecord(
        holder=row.holder,
        address=row.address,
        epoch=row.epoch,
        acquired_at=row.acquired_at,
        renewed_at=row.renewed_at,
        expires_at=row.expires_at,
    )


def _state(me: str, row: LeaderLeaseRow | None, now: float) -> LeaseState:
    if row is None:
        return LeaseState("standby", 0, None, None, 0.0)
    live = now < row.expires_at
    return LeaseState(
        role="active" if live and row.holder == me else "standby",
        epoch=row.epoch,
        active=row.holder if live else None,
        active_address=row.address if live else None,
        expires_at=row.expires_at,
    )


class LeaseMethods:
    """Store methods for the leadership lease and the write fence (see the module doc)."""

    _clock: Callable[[], datetime]
    _fence_epoch: int | None

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _now_s(self) -> float:
        return self._clock().timestamp()

    def read_lease(self) -> LeaseRecord | None:
        """The lease row, or ``None`` when no leader ever took it."""
        with self._read() as session:
            row = session.get(LeaderLeaseRow, LEASE_NAME)
            return None if row is None else _record(row)

    def lease_state(self, me: str) -> LeaseState:
        """Where ``me`` stands now, read without writing."""
        with self._read() as session:
            return _state(me, session.get(LeaderLeaseRow, LEASE_NAME), self._now_s())

    def acquire_lease(self, me: str, address: str, lease_s: float) -> LeaseState:
        """Apply :func:`decide` for ``me`` in one write: take the lease (new epoch, expiring
        ``lease_s`` from now, ``address`` recorded), renew it, or leave it to its holder.
        ``lease_s`` must be positive (``ValueError``)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        with self._write() as session:
            now = self._now_s()
            row = session.get(LeaderLeaseRow, LEASE_NAME)
            decision = decide(now, None if row is None else _record(row), me)
            if decision.action == "take":
                if row is None:
                    row = LeaderLeaseRow(name=LEASE_NAME)
                    session.add(row)
                row.holder = me
                row.address = address
                row.epoch = decision.epoch
                row.acquired_at = now
            if decision.action != "wait":
                assert row is not None
                row.address = address
                row.renewed_at = now
                row.expires_at = now + lease_s
            session.flush()
            return _state(me, row, now)

    def renew_lease(self, me: str, epoch: int, lease_s: float) -> LeaseState:
        """Extend ``me``'s lease under ``epoch`` by ``lease_s`` from now, only while it is
        still live and still ``me``'s at that epoch; otherwise change nothing and report
        standby (the caller steps down before it may :meth:`acquire_lease` again)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        with self._write() as session:
            now = self._now_s()
            row = session.get(LeaderLeaseRow, LEASE_NAME)
            if row is None or row.holder != me or row.epoch != epoch or now >= row.expires_at:
                return replace(_state(me, row, now), role="standby")
            row.renewed_at = now
            row.expires_at = now + lease_s
            session.flush()
            return _state(me, row, now)

    def release_lease(self, me: str, epoch: int) -> bool:
        """End ``me``'s lease under ``epoch`` now (a clean stop or a step-down), so a standby
        takes over at once; whether it was ``me``'s to end.  The epoch stays: the next take
        raises it."""
        with self._write() as session:
            now = self._now_s()
            row = session.get(LeaderLeaseRow, LEASE_NAME)
            if row is None or row.holder != me or row.epoch != epoch:
                return False
            row.expires_at = min(row.expires_at, now)
            return True

    def fence(self, epoch: int | None) -> None:
        """Fence this store's cluster-state writes with ``epoch`` (``None``: unfenced);
        the leadership loop sets it when it becomes active and keeps the old one when it
        steps down, so a stale leader's writes are refused."""
        self._fence_epoch = epoch

    @property
    def fence_epoch(self) -> int | None:
        """The epoch this store's writes are fenced with, or ``None``."""
        return self._fence_epoch

    @contextmanager
    def _fenced_write(self) -> Iterator[Session]:
        """A write transaction that first checks the fence (see the module doc)."""
        with self._write() as session:
            epoch = self._fence_epoch
            if epoch is not None:
                check_fence(session, epoch, self._now_s())
            yield session


def check_fence(session: Session, epoch: int, now: float) -> None:
    """Raise :class:`FencedError` unless the lease row holds ``epoch`` and is live at
    ``now`` (Unix seconds)."""
    row = session.get(LeaderLeaseRow, LEASE_NAME)
    if row is None:
        raise FencedError(epoch, 0, None)
    if row.epoch != epoch or now >= row.expires_at:
        live = now < row.expires_at
        raise FencedError(epoch, row.epoch, row.address if live else None)
