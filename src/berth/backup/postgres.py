"""The database in a backup when ``database_url`` is PostgreSQL: ``pg_dump`` and
``pg_restore``.

A backup holds ``berth.pgdump``, ``pg_dump``'s custom format (compressed, one consistent
snapshot: ``pg_dump`` reads in one repeatable-read transaction while the leaders go on
writing), of the database only: no roles, no ownership, no grants, so it restores into any
database the restoring login may write.  Restoring runs ``pg_restore --clean --if-exists
--no-owner --single-transaction`` into the database ``database_url`` names: berth's tables
are replaced whole, or nothing changes.  Agents connected when the dump was taken count as
``unreachable`` in the restored database until they say Hello again, as after a SQLite
restore.  The restore holds the store's write lock (:func:`write_lock`) from before it reads
the target's lease until the restored epoch is in place (:mod:`berth.backup.target`).

The tools are Debian's ``postgresql-client`` (``/usr/bin/pg_dump`` picks the version that
matches the server), else the newest ``/usr/lib/postgresql/N/bin``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from sqlalchemy import Connection, text
from sqlalchemy.exc import SQLAlchemyError

from berth.backup.manifest import PRIVATE_MODE
from berth.backup.target import raise_epoch
from berth.errors import ConfigError, StoreError
from berth.store import Store
from berth.store.changes import libpq_url
from berth.store.db import WRITE_LOCK_KEY, is_postgresql, parse_database_url
from berth.store.nodes import LOCAL_NODE_ID

#: Seconds a dump or restore may take before it is given up.
TOOL_TIMEOUT_S: Final = 3600.0
#: Seconds a restore waits for the store's write lock (a leader's write holds it for
#: milliseconds; another restore for as long as it runs).
LOCK_WAIT_S: Final = 30.0
_DEBIAN_ROOT = Path("/usr/lib/postgresql")


def is_postgresql_url(database_url: str) -> bool:
    """Whether ``database_url`` names a PostgreSQL database."""
    return is_postgresql(parse_database_url(database_url))


def pg_tool(name: str) -> str:
    """The path of ``pg_dump`` or ``pg_restore``; :class:`ConfigError` when neither ``PATH``
    nor ``/usr/lib/postgresql/*/bin`` has it."""
    found = shutil.which(name)
    if found is not None:
        return found
    versions = sorted(
        (int(d.name), d / "bin" / name)
        for d in (_DEBIAN_ROOT.iterdir() if _DEBIAN_ROOT.is_dir() else ())
        if d.name.isdigit() and (d / "bin" / name).exists()
    )
    if not versions:
        raise ConfigError(f"{name} is not installed (apt-get install postgresql-client)")
    return str(versions[-1][1])


def _libpq(database_url: str) -> tuple[str, dict[str, str]]:
    """The URL the tools connect to, without its password, and the environment that gives
    them the password (``PGPASSWORD``: never on a command line others can read)."""
    url = parse_database_url(database_url)
    env = dict(os.environ)
    if url.password is not None:
        env["PGPASSWORD"] = str(url.password)
    return libpq_url(url.set(password=None)), env


def _run(tool: str, *args: str, env: dict[str, str]) -> None:
    try:
        result = subprocess.run(
            [pg_tool(tool), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
            check=False,
            umask=0o077,  # a dump pg_dump writes is 0600, as every file of a backup
        )
    except subprocess.TimeoutExpired:
        raise StoreError(f"{tool} took longer than {TOOL_TIMEOUT_S:.0f} s") from None
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise StoreError(f"{tool} failed: {detail[-1] if detail else result.returncode}")


def dump_database(database_url: str, target: Path) -> int:
    """Write ``pg_dump``'s custom-format dump of ``database_url`` to ``target`` (mode
    0600); the database's schema version.  Raises :class:`StoreError` when the database
    cannot be read or the dump fails, :class:`ConfigError` without ``pg_dump``."""
    with Store(database_url) as store:
        version = store.schema_version()
    url, env = _libpq(database_url)
    _run(
        "pg_dump", "--format=custom", "--no-owner", "--no-privileges", f"--file={target}", url,
        env=env,
    )  # fmt: skip
    os.chmod(target, PRIVATE_MODE)  # an existing file keeps its mode through the umask
    return version


@contextmanager
def write_lock(database_url: str) -> Iterator[Connection]:
    """Hold the store's write lock on ``database_url`` (:data:`~berth.store.db.WRITE_LOCK_KEY`,
    session-level) on a connection of its own until the block ends: no leader writes
    meanwhile (every write transaction, lease renewals and takeovers and migrations
    included, waits for it), while reads and ``pg_dump``/``pg_restore`` go on.  Waits up to
    :data:`LOCK_WAIT_S` for a writer to finish; raises :class:`StoreError` after that or
    when the database cannot be reached."""
    with Store(database_url) as store:
        try:
            conn = store.engine.connect()
            conn.execute(text(f"SET lock_timeout = '{int(LOCK_WAIT_S * 1000)}ms'"))
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": WRITE_LOCK_KEY})
            conn.commit()
        except SQLAlchemyError as exc:
            raise StoreError(
                f"cannot take the store's write lock within {LOCK_WAIT_S:g} s (a leader or "
                f"another restore holds it): {exc.__class__.__name__}"
            ) from None
        try:
            yield conn
        finally:
            with contextlib.suppress(SQLAlchemyError):  # the session's end releases it too
                conn.rollback()
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": WRITE_LOCK_KEY})
                conn.commit()
            conn.close()


def restore_dump(
    database_url: str,
    dump: Path,
    lock: Connection,
    *,
    target_epoch: int | None,
    now_s: float,
) -> int | None:
    """Replace berth's tables in ``database_url`` with those of ``dump``, in one
    transaction, then, on ``lock`` (the connection of :func:`write_lock`, held by the
    caller), mark the agents that were connected ``unreachable`` and, unless
    ``target_epoch`` is ``None`` (the backup has no lease table), raise the lease's epoch
    above ``target_epoch`` and the backup's (:func:`berth.backup.target.raise_epoch`).
    The restored epoch, or ``None``.  Raises :class:`StoreError` when ``pg_restore``
    fails (the database is then as it was)."""
    url, env = _libpq(database_url)
    _run(
        "pg_restore", "--clean", "--if-exists", "--no-owner", "--no-privileges",
        "--single-transaction", f"--dbname={url}", str(dump), env=env,
    )  # fmt: skip

    def execute(sql: str, params: Mapping[str, object]) -> list[tuple[object, ...]]:
        result = lock.execute(text(sql), dict(params))
        return [tuple(row) for row in result] if result.returns_rows else []

    with _translated():
        try:
            lock.execute(
                text(
                    "UPDATE nodes SET status = 'unreachable' "
                    "WHERE status = 'ready' AND id != :local"
                ),
                {"local": LOCAL_NODE_ID},
            )
            epoch = None if target_epoch is None else raise_epoch(execute, target_epoch, now_s)
            lock.commit()
        except BaseException:
            lock.rollback()
            raise
    return epoch


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except SQLAlchemyError as exc:
        raise StoreError(f"the database did not take the restore's changes: {exc}") from None
