"""The database in a backup: which file a SQLite URL names, and a consistent copy of it."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Mapping
from pathlib import Path

from berth.backup.manifest import PRIVATE_MODE
from berth.backup.target import TargetDatabase, has_lease_table, raise_epoch
from berth.errors import ConfigError, StoreError
from berth.store.db import SQLITE_BUSY_TIMEOUT_S, is_sqlite, parse_database_url
from berth.store.lease import LEASE_NAME, LeaseRecord
from berth.store.members import LeaderMember
from berth.store.nodes import LOCAL_NODE_ID


def sqlite_database_path(database_url: str) -> Path:
    """The file of a SQLite ``database_url``.

    Raises :class:`ConfigError` for another database (PostgreSQL has
    :mod:`berth.backup.postgres`) or an in-memory one.
    """
    url = parse_database_url(database_url)
    if not is_sqlite(url):
        raise ConfigError(
            f"database_url uses {url.get_backend_name()}: berth backs up and restores SQLite "
            "and PostgreSQL databases (back that one up with its own tools)"
        )
    if url.database in (None, "", ":memory:") or url.query.get("mode") == "memory":
        raise ConfigError("database_url names an in-memory SQLite database: nothing to back up")
    return Path(url.database).expanduser().absolute()


def snapshot_database(source: Path, target: Path) -> int:
    """Copy the SQLite database ``source`` to ``target`` (made here, mode 0600: it must not
    exist) consistently; its schema version.

    Uses the ``sqlite3`` module's :meth:`~sqlite3.Connection.backup` (SQLite's online backup
    API, all pages in one step).  The copy is switched out of WAL mode (one self-contained
    file), its agents are marked ``unreachable`` (none is connected to a restored leader until
    it redials), and it must pass ``PRAGMA quick_check``.  Raises :class:`StoreError`
    otherwise.
    """
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE))
    except OSError as exc:
        raise StoreError(f"cannot create the copy {target}: {exc.strerror}") from None
    try:
        src = sqlite3.connect(source, timeout=SQLITE_BUSY_TIMEOUT_S)
        try:
            dst = sqlite3.connect(target)  # the file made 0600 above; SQLite keeps its mode
            try:
                src.backup(dst)
                dst.execute("PRAGMA journal_mode=DELETE")
                _no_live_links(dst)
                check = dst.execute("PRAGMA quick_check").fetchone()
                if check is None or check[0] != "ok":
                    raise StoreError(f"the copy of {source} fails its integrity check: {check}")
                return _schema_version(dst)
            finally:
                dst.close()
        finally:
            src.close()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot copy the database {source}: {exc}") from None


def _no_live_links(conn: sqlite3.Connection) -> None:
    """Agents connected when the snapshot was taken are not connected to a leader restored
    from it: they count as ``unreachable`` until they say Hello again."""
    try:
        with conn:
            conn.execute(
                "UPDATE nodes SET status = 'unreachable' WHERE status = 'ready' AND id != ?",
                (LOCAL_NODE_ID,),
            )
    except sqlite3.OperationalError:
        pass  # a database from before nodes existed (schema version 1)


def _schema_version(conn: sqlite3.Connection) -> int:
    try:
        row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    except sqlite3.OperationalError:
        return 0  # never migrated
    return int(row[0]) if row and row[0] is not None else 0


def raise_copy_epoch(copy: Path, target_epoch: int, now_s: float) -> int | None:
    """Raise the lease epoch of the restored SQLite ``copy`` (not yet in place) above its
    own and ``target_epoch`` (:func:`berth.backup.target.raise_epoch`); the new epoch, or
    ``None``.  Raises :class:`StoreError` when the copy cannot be changed."""
    try:
        conn = sqlite3.connect(copy)
        try:
            with conn:

                def execute(sql: str, params: Mapping[str, object]) -> list[tuple[object, ...]]:
                    return [tuple(row) for row in conn.execute(sql, dict(params)).fetchall()]

                return raise_epoch(execute, target_epoch, now_s)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot raise the lease epoch of {copy}: {exc}") from None


def read_sqlite_target(path: Path) -> TargetDatabase:
    """What the SQLite database at ``path`` holds (:class:`TargetDatabase`), read through a
    read-only connection: a leader may still have it open, and a stale ``-wal`` beside it
    must reach the ``replaced-<time>`` folder as it was.  A file SQLite cannot read holds
    no lease anyone could be using: schema version 0."""
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=SQLITE_BUSY_TIMEOUT_S)
    except sqlite3.Error:
        return TargetDatabase(str(path), 0)
    try:
        version = _schema_version(conn)
        lease = None
        members: tuple[LeaderMember, ...] = ()
        if has_lease_table(version):
            row = conn.execute(
                "SELECT holder, address, epoch, acquired_at, renewed_at, expires_at "
                "FROM leader_lease WHERE name = ?",
                (LEASE_NAME,),
            ).fetchone()
            if row is not None:
                lease = LeaseRecord(str(row[0]), str(row[1]), int(row[2]), *map(float, row[3:]))
            with contextlib.suppress(sqlite3.OperationalError):  # before leader_members
                members = tuple(
                    LeaderMember(str(url), str(holder), float(seen))
                    for url, holder, seen in conn.execute(
                        "SELECT cluster_url, holder, seen_at FROM leader_members"
                    )
                )
        return TargetDatabase(str(path), version, lease, members)
    except sqlite3.Error:
        return TargetDatabase(str(path), 0)
    finally:
        conn.close()
