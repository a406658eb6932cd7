"""The database in a backup when ``database_url`` is PostgreSQL: ``pg_dump`` and
``pg_restore``.

A backup holds ``berth.pgdump``, ``pg_dump``'s custom format (compressed, one consistent
snapshot: ``pg_dump`` reads in one repeatable-read transaction while the leaders go on
writing), of the database only: no roles, no ownership, no grants, so it restores into any
database the restoring login may write.  Restoring runs ``pg_restore --clean --if-exists
--no-owner --single-transaction`` into the database ``database_url`` names: berth's tables
are replaced whole, or nothing changes.  Agents connected when the dump was taken count as
``unreachable`` in the restored database until they say Hello again, as after a SQLite
restore.

The tools are Debian's ``postgresql-client`` (``/usr/bin/pg_dump`` picks the version that
matches the server), else the newest ``/usr/lib/postgresql/N/bin``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Final

from sqlalchemy import text

from berth.backup.manifest import PRIVATE_MODE
from berth.errors import ConfigError, StoreError
from berth.store import Store
from berth.store.changes import libpq_url
from berth.store.db import is_postgresql, parse_database_url
from berth.store.nodes import LOCAL_NODE_ID

#: Seconds a dump or restore may take before it is given up.
TOOL_TIMEOUT_S: Final = 3600.0
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


def holds_state(database_url: str) -> bool:
    """Whether the database at ``database_url`` holds berth's tables (a schema version)."""
    with Store(database_url) as store:
        return store.schema_version() > 0


def restore_dump(database_url: str, dump: Path) -> None:
    """Replace berth's tables in ``database_url`` with those of ``dump``, in one
    transaction, then mark the agents that were connected ``unreachable``.  Raises
    :class:`StoreError` when ``pg_restore`` fails (the database is then as it was)."""
    url, env = _libpq(database_url)
    _run(
        "pg_restore", "--clean", "--if-exists", "--no-owner", "--no-privileges",
        "--single-transaction", f"--dbname={url}", str(dump), env=env,
    )  # fmt: skip
    with Store(database_url) as store, store.engine.begin() as conn:
        conn.execute(
            text("UPDATE nodes SET status = 'unreachable' WHERE status = 'ready' AND id != :local"),
            {"local": LOCAL_NODE_ID},
        )
