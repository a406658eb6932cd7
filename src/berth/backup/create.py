"""``berth backup create``: a leader's home (the database copied consistently, the CA, the
pepper, ``config.toml`` and ``adopted.yaml``) into one archive."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from berth import __version__
from berth.backup.archive import write_archive
from berth.backup.database import snapshot_database, sqlite_database_path
from berth.backup.manifest import (
    COPY_CHUNK_BYTES,
    DATABASE_NAME,
    FORMAT_VERSION,
    OPTIONAL_FILES,
    PEPPER_NAME,
    PG_DUMP_NAME,
    PRIVATE_MODE,
    BackupFile,
    BackupManifest,
    member_refusal,
)
from berth.backup.postgres import dump_database, is_postgresql_url
from berth.backup.secrets import carried_secrets
from berth.cluster.pki.ca import CA_KEY_FILE
from berth.errors import ConfigError, ConflictError
from berth.paths import BerthHome


def create_backup(
    home: BerthHome,
    database_url: str,
    dest: Path,
    *,
    force: bool = False,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> BackupManifest:
    """Write a backup of the leader ``home`` (database at ``database_url``) to ``dest``.

    Safe while the daemon runs: a SQLite database is copied with SQLite's online backup API
    in one step (a single read transaction; in WAL mode the daemon keeps writing meanwhile);
    a PostgreSQL one is dumped with ``pg_dump`` (:mod:`berth.backup.postgres`).
    ``dest`` is written beside itself first and renamed into place, mode 0600, as is every
    file written on the way (the database's copy, in a private folder beside ``dest``).
    The manifest names the secrets it carries (:mod:`berth.backup.secrets`).

    Raises :class:`ConfigError` for a database that is neither SQLite nor PostgreSQL (or
    PostgreSQL without ``pg_dump``), a home that is not a
    leader's (no ``ca/ca.key``) or has no database, or a missing destination folder;
    :class:`ConflictError` when ``dest`` exists and ``force`` is false; :class:`StoreError`
    when the database cannot be copied or the copy fails its integrity check.
    """
    postgres = is_postgresql_url(database_url)
    db_path = None if postgres else sqlite_database_path(database_url)
    _require_leader_home(home)
    dest = dest.expanduser().absolute()
    if dest.is_dir():
        raise ConfigError(f"{dest} is a folder; name the archive file to write")
    if dest.exists() and not force:
        raise ConflictError(f"{dest} already exists; pass --force to replace it")
    if not dest.parent.is_dir():
        raise ConfigError(f"the folder {dest.parent} does not exist")
    if db_path is not None and not db_path.is_file():
        raise ConfigError(f"no database at {db_path}: has this leader ever started?")

    staging = Path(tempfile.mkdtemp(prefix=".berth-backup-", dir=dest.parent))
    try:
        member = DATABASE_NAME if db_path is not None else PG_DUMP_NAME
        snapshot = staging / member
        if db_path is not None:
            schema_version = snapshot_database(db_path, snapshot)
        else:
            schema_version = dump_database(database_url, snapshot)
        sources = [(member, snapshot, PRIVATE_MODE), *_home_files(home)]
        files = tuple(_describe(name, path, mode) for name, path, mode in sources)
        manifest = BackupManifest(
            format_version=FORMAT_VERSION,
            berth_version=__version__,
            schema_version=schema_version,
            created_at=now().astimezone(UTC).isoformat(timespec="seconds"),
            files=files,
            secrets=carried_secrets((f.name for f in files), home.config_file),
        )
        write_archive(dest, manifest, {name: path for name, path, _mode in sources})
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _require_leader_home(home: BerthHome) -> None:
    if (home.ca_dir / CA_KEY_FILE).is_file():
        return
    what = "an agent's home" if home.agent_config.exists() else "not a leader's home"
    raise ConfigError(
        f"{home.root} is {what}: it has no {home.ca_dir / CA_KEY_FILE} "
        "(run berth backup on the leader, or pass --home)"
    )


def _home_files(home: BerthHome) -> list[tuple[str, Path, int]]:
    found: list[tuple[str, Path, int]] = []
    for path in sorted(home.ca_dir.iterdir()):
        name = f"ca/{path.name}"
        if path.is_file() and not path.is_symlink() and member_refusal(name) is None:
            found.append((name, path, PRIVATE_MODE))
    for name in (PEPPER_NAME, *OPTIONAL_FILES):
        path = home.root / name
        if path.is_file():
            found.append((name, path, PRIVATE_MODE))
    return found


def _describe(name: str, path: Path, mode: int) -> BackupFile:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(COPY_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return BackupFile(name=name, size_bytes=size, sha256=digest.hexdigest(), mode=mode)
