"""The database a restore would overwrite: what it holds, whether a live cluster runs on it,
and the lease epoch the restored state must be left above.

Fencing (:mod:`berth.store.lease`) relies on the lease's epoch only ever rising: a leader
that was active under epoch 7 writes nothing once the row says 8.  A restore puts back a
database as it was, lease row and all, so without care it takes the epoch back (7 to 3) and
opens the fence to leaders that it had shut out.  So a restore:

- **refuses** while a leader holds the target's lease, or renewed it, or was noted in
  ``leader_members``, within the last :data:`LIVE_LEASES` leases (:func:`live_refusal`),
  naming the database and each leader it saw.  ``--force`` does not change this: it only
  overrides what the *home* holds.  The lease's length is the larger of the ``leader_lease_s``
  the restore runs with and the one the row shows (``expires_at - renewed_at``).
- **raises the epoch**: the restored row gets an epoch one above both the backup's and the
  one the target held (:func:`restored_epoch`), expired at once, so the next leader to start
  takes it (one higher again) and nothing that held an older epoch passes the fence.

Times are Unix seconds of this host's clock, which must agree with the leaders' (NTP), as
the lease itself requires.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from berth.humanize import age
from berth.store import Store
from berth.store.lease import LEASE_NAME, LeaseRecord
from berth.store.members import LeaderMember

#: A leader seen within this many leases counts as live: a renewal is due every third of a
#: lease, so three leases without one is nine missed renewals.
LIVE_LEASES: Final = 3
#: The ``holder`` of a lease row a restore wrote (no leader process has this id).
RESTORE_HOLDER: Final = "berth-backup-restore"
#: The schema version that added ``leader_lease`` and ``leader_members``.
_LEASE_VERSION, _MEMBERS_VERSION = 10, 14


@dataclass(frozen=True)
class TargetDatabase:
    """What the database a restore would overwrite holds now: ``shown`` is its URL with
    the password masked (or its file), ``schema_version`` 0 when it holds no berth tables,
    ``lease`` its lease row, ``members`` its ``leader_members``."""

    shown: str
    schema_version: int
    lease: LeaseRecord | None = None
    members: tuple[LeaderMember, ...] = ()

    @property
    def holds_state(self) -> bool:
        """Whether it holds berth's tables."""
        return self.schema_version > 0

    @property
    def epoch(self) -> int:
        """The highest lease epoch it has seen (0: none)."""
        return 0 if self.lease is None else self.lease.epoch


def read_target(database_url: str, shown: str) -> TargetDatabase:
    """Read the lease and the leaders of the database at ``database_url`` (``shown`` names
    it in messages).  Raises :class:`~berth.errors.StoreError` when it cannot be read."""
    with Store(database_url) as store:
        version = store.schema_version()
        lease = store.read_lease() if version >= _LEASE_VERSION else None
        members = tuple(store.leader_members()) if version >= _MEMBERS_VERSION else ()
    return TargetDatabase(shown, version, lease, members)


def live_refusal(target: TargetDatabase, now: float, lease_s: float) -> str | None:
    """Why a restore must not overwrite ``target`` at ``now``: a sentence naming it and the
    live leaders, or ``None`` when none was seen within :data:`LIVE_LEASES` leases.

    ``lease_s`` is the ``leader_lease_s`` the restore runs with; the row's own lease
    (``expires_at - renewed_at``) is used where it is longer.  Pure.
    """
    lease = target.lease
    if lease is not None:
        lease_s = max(lease_s, lease.expires_at - lease.renewed_at)
    window_s = LIVE_LEASES * lease_s
    seen: list[str] = []
    quiet_at = 0.0  # when the last sign of life is window_s old
    if lease is not None and lease.holder != RESTORE_HOLDER:
        held = lease.live(now)
        if held or now - lease.renewed_at < window_s:
            verb = "holds its lease" if held else "held its lease"
            seen.append(
                f"leader {lease.holder} ({lease.address or 'no address'}) {verb} "
                f"(epoch {lease.epoch}, renewed {_ago(now - lease.renewed_at)})"
            )
            quiet_at = max(quiet_at, lease.renewed_at + window_s, lease.expires_at)
    for member in target.members:
        if now - member.seen_at < window_s and (lease is None or member.holder != lease.holder):
            seen.append(f"leader {member.cluster_url} was seen {_ago(now - member.seen_at)}")
            quiet_at = max(quiet_at, member.seen_at + window_s)
    if not seen:
        return None
    wait_s = max(quiet_at - now, 0.0)
    return (
        f"refused: the database {target.shown} is in use by a live cluster: "
        f"{'; '.join(seen)}. A restore would overwrite the state those leaders run on and "
        "take its lease's epoch back, and --force does not change that. Stop every leader "
        f"on it (berth daemon stop) and restore once it has been quiet for {LIVE_LEASES} "
        f"leases ({window_s:g} s; about {wait_s:.0f} s from now), or restore into another "
        "database (BERTH_DATABASE_URL)"
    )


def restored_epoch(backup_epoch: int | None, target_epoch: int) -> int | None:
    """The epoch the restored lease row gets: one above both the backup's (``None``: it has
    no lease row) and the target's (0: none); ``None`` when neither had one (the first
    leader takes epoch 1 as on a new database)."""
    if backup_epoch is None and target_epoch == 0:
        return None
    return max(backup_epoch or 0, target_epoch) + 1


#: Runs one SQL statement with named parameters (``:name``) and returns its rows (none for a
#: statement that returns none): a ``sqlite3`` connection's or a SQLAlchemy one's, wrapped.
Execute = Callable[[str, Mapping[str, object]], list[tuple[object, ...]]]

_EPOCH_SQL = "SELECT epoch FROM leader_lease WHERE name = :name"
_UPDATE_SQL = (
    "UPDATE leader_lease SET holder = :holder, address = '', epoch = :epoch, "
    "acquired_at = :now, renewed_at = :now, expires_at = :now WHERE name = :name"
)
_INSERT_SQL = (
    "INSERT INTO leader_lease (name, holder, address, epoch, acquired_at, renewed_at, "
    "expires_at) VALUES (:name, :holder, '', :epoch, :now, :now, :now)"
)


def raise_epoch(execute: Execute, target_epoch: int, now: float) -> int | None:
    """Give the restored database's lease row :func:`restored_epoch` (held by
    :data:`RESTORE_HOLDER`, expired at ``now``), through ``execute`` inside the caller's
    transaction; the new epoch, or ``None`` when neither database had a lease.  The
    restored database must have ``leader_lease`` (schema version 10 or newer)."""
    rows = execute(_EPOCH_SQL, {"name": LEASE_NAME})
    backup_epoch = int(str(rows[0][0])) if rows else None
    epoch = restored_epoch(backup_epoch, target_epoch)
    if epoch is None:
        return None
    values = {"name": LEASE_NAME, "holder": RESTORE_HOLDER, "epoch": epoch, "now": now}
    execute(_UPDATE_SQL if rows else _INSERT_SQL, values)
    return epoch


def has_lease_table(schema_version: int) -> bool:
    """Whether a database at ``schema_version`` has ``leader_lease``."""
    return schema_version >= _LEASE_VERSION


def _ago(seconds: float) -> str:
    if seconds < 0:
        return "in the future by this host's clock"
    return f"{seconds:.1f} s ago" if seconds < 60 else f"{age(seconds)} ago"
