"""``berth backup restore``: a stopped leader's home brought back from an archive, the state
it replaces moved aside, never deleted."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from berth.backup.archive import read_archive
from berth.backup.database import raise_copy_epoch, read_sqlite_target, sqlite_database_path
from berth.backup.manifest import (
    DATABASE_NAME,
    OPTIONAL_FILES,
    PG_DUMP_NAME,
    PRIVATE_MODE,
    BackupManifest,
)
from berth.backup.postgres import dump_database, is_postgresql_url, restore_dump, write_lock
from berth.backup.target import (
    TargetDatabase,
    has_lease_table,
    live_refusal,
    read_target,
)
from berth.config import Settings
from berth.errors import BerthError, ConfigError, ConflictError, DaemonError, StoreError
from berth.paths import BerthHome
from berth.runtime.proc import pid_running
from berth.store import LATEST_VERSION
from berth.store.db import parse_database_url


def running_daemon(home: BerthHome) -> str | None:
    """How we know a daemon of ``home`` runs (``"answering on <socket>"``, ``"pid N"``), or
    ``None`` when none does."""
    if home.socket_file.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2.0)
        try:
            probe.connect(str(home.socket_file))
        except OSError:
            pass  # a stale socket left by a daemon that died
        else:
            return f"answering on {home.socket_file}"
        finally:
            probe.close()
    try:
        pid = int(home.pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if pid_running(pid) and _is_berth_daemon(pid):
        return f"pid {pid}"
    return None


def _is_berth_daemon(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"daemon" in argv and any(b"berth" in arg for arg in argv)


@dataclass(frozen=True)
class RestoreReport:
    """What a restore did: the manifest, where the database went (a SQLite file, or a
    PostgreSQL database), where the files it replaced were moved (``None`` when nothing
    was replaced; a replaced PostgreSQL database is dumped there too), and the lease's
    epoch before and after (:mod:`berth.backup.target`)."""

    manifest: BackupManifest
    database_path: Path | None
    replaced_dir: Path | None
    #: the PostgreSQL database restored into (password masked); ``None`` for SQLite
    database_url: str | None = None
    #: the lease epoch the restored database holds (expired: the next leader takes one
    #: more); ``None`` when neither the backup nor the database it replaced had a lease
    lease_epoch: int | None = None
    #: the highest epoch the replaced database had seen (0: none)
    previous_epoch: int = 0


def restore_backup(
    home: BerthHome,
    source: Path,
    *,
    force: bool = False,
    env: Mapping[str, str] | None = None,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> RestoreReport:
    """Bring the leader ``home`` back from the backup at ``source``.

    The archive is verified whole (see :func:`verify_backup`) into a private folder first, so
    nothing in the home changes unless it is intact.  The database goes where the restored
    ``config.toml`` (with ``env``, default ``os.environ``) puts ``database_url``, normally
    ``$BERTH_HOME/berth.db``; a PostgreSQL dump is restored into the database that
    ``database_url`` names (:mod:`berth.backup.postgres`), whose current tables, with
    ``force``, are first dumped beside the replaced files.  With ``force``, the state it
    replaces (the database and its ``-wal``/``-shm`` files, the whole ``ca/`` folder, the
    pepper, ``config.toml``, ``adopted.yaml``) is moved to
    ``$BERTH_HOME/replaced-<UTC time>/``, never deleted.
    Every file it writes is 0600 (certificates too; a replaced database's dump as well),
    the home and ``ca/`` 0700.

    The database it would overwrite is looked at first (:mod:`berth.backup.target`): while
    a leader holds its lease or used it within the last three leases the restore is
    refused, ``force`` or not, naming that database and the leaders; otherwise the
    restored lease's epoch ends above every epoch either database had, expired, so the next
    leader takes it one higher.  ``now`` is also the clock of that check.

    Raises :class:`DaemonError` when a daemon of ``home`` runs; :class:`ConflictError` when
    the database is in use by a live cluster, or when the home or the database holds a
    leader's state and ``force`` is false; :class:`ConfigError` for an
    archive that fails verification, a backup's ``config.toml`` this berth cannot read, or a
    ``database_url`` of another kind than the backup's database; :class:`StoreError` for a
    schema newer than this berth's, or a dump or restore PostgreSQL's tools refused.
    """
    running = running_daemon(home)
    if running is not None:
        raise DaemonError(
            f"the berth daemon of {home.root} is running ({running}); stop it first with "
            "berth daemon stop"
        )
    home.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".restore-", dir=home.root))
    try:
        manifest = read_archive(source, extract_to=staging)
        if manifest.schema_version > LATEST_VERSION:
            raise StoreError(
                f"the backup's database is at schema version {manifest.schema_version}, "
                f"newer than this berth knows ({LATEST_VERSION}); restore it with berth "
                f"{manifest.berth_version} or newer"
            )
        settings = _restored_settings(staging, env)
        postgres_url = _postgres_target(manifest, settings)
        db_path = None if postgres_url else _restored_database_path(home, settings)
        # The manifest's own modes are not trusted (anyone can rewrite a manifest): every
        # file is private.  A PostgreSQL dump is not placed: pg_restore reads it.
        placements = [
            (
                staging / f.name,
                db_path if f.name == DATABASE_NAME and db_path else home.root / f.name,
                PRIVATE_MODE,
            )
            for f in manifest.files
            if f.name != PG_DUMP_NAME
        ]
        with contextlib.ExitStack() as held:
            # On PostgreSQL no leader writes (no renewal, no takeover, no migration) from
            # before the lease is read until the restored epoch is in place.
            lock = None if postgres_url is None else held.enter_context(write_lock(postgres_url))
            target = _read_target(postgres_url, db_path)
            refusal = live_refusal(target, now().timestamp(), settings.leader_lease_s)
            if refusal is not None:
                raise ConflictError(refusal)
            replaced = _existing_state(home, db_path)
            replaced_dir: Path | None = None
            if replaced or target.holds_state:
                if not force:
                    raise ConflictError(_overwrite_refusal(home, replaced, db_path, target))
                stamp = now().astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
                replaced_dir = _move_aside(home, replaced, home.root / f"replaced-{stamp}")
                if postgres_url is not None and target.holds_state:  # kept as a dump
                    dump_database(postgres_url, replaced_dir / PG_DUMP_NAME)
            with_lease = has_lease_table(manifest.schema_version)
            epoch: int | None = None
            if postgres_url is not None and lock is not None:
                epoch = restore_dump(
                    postgres_url, staging / PG_DUMP_NAME, lock,
                    target_epoch=target.epoch if with_lease else None,
                    now_s=now().timestamp(),
                )  # fmt: skip
            elif with_lease:
                epoch = raise_copy_epoch(staging / DATABASE_NAME, target.epoch, now().timestamp())
            _install(home, placements)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return RestoreReport(
        manifest=manifest,
        database_path=db_path,
        replaced_dir=replaced_dir,
        database_url=None if postgres_url is None else target.shown,
        lease_epoch=epoch,
        previous_epoch=target.epoch,
    )


def _read_target(postgres_url: str | None, db_path: Path | None) -> TargetDatabase:
    """The database the restore would overwrite (none yet: schema version 0)."""
    if postgres_url is not None:
        shown = parse_database_url(postgres_url).render_as_string(hide_password=True)
        return read_target(postgres_url, shown)
    assert db_path is not None
    if not db_path.exists():
        return TargetDatabase(str(db_path), 0)
    return read_sqlite_target(db_path)


def _overwrite_refusal(
    home: BerthHome, replaced: list[Path], db_path: Path | None, target: TargetDatabase
) -> str:
    """What ``--force`` would replace: the home's files, and the database by its own name
    (it may be shared by several leaders, and live outside the home)."""
    databases = [] if db_path is None else [db_path]
    files = [_shown(home, p) for p in replaced if not any(p.name.startswith(d.name)
             for d in databases)]  # fmt: skip
    parts = []
    if files:
        parts.append(f"{home.root} already holds a leader's state ({', '.join(files)})")
    if target.holds_state or (db_path is not None and db_path.exists()):
        lease = target.lease
        held = (
            f"; lease epoch {lease.epoch}, last renewed by {lease.address or lease.holder}"
            if lease is not None
            else ""
        )
        parts.append(
            f"the database {target.shown} holds a cluster's state (schema version "
            f"{target.schema_version}{held})"
        )
    kept = (
        "moved to a replaced-<time> folder"
        if db_path is not None
        else "the database dumped into a replaced-<time> folder first"
    )
    return f"{'; '.join(parts)}; pass --force to replace it ({kept}, not deleted)"


def database_elsewhere_note(restored_url: str | None, home_url: str) -> str | None:
    """A line for the user when a PostgreSQL restore went into ``restored_url`` (masked, as
    in :class:`RestoreReport`) but the home's own settings (``config.toml`` and defaults,
    no environment) name ``home_url``: a start without ``BERTH_DATABASE_URL`` would open
    that other database (the one the backup came from, or an empty SQLite file).  ``None``
    when they agree, or for a SQLite restore."""
    if restored_url is None:
        return None
    home_masked = parse_database_url(home_url).render_as_string(hide_password=True)
    if home_masked == restored_url:
        return None
    return (
        f"note: this home's config names the database {home_masked}, not {restored_url}: "
        "keep BERTH_DATABASE_URL set for its commands, or set database_url under [store] "
        "in its config.toml"
    )


def _restored_settings(staging: Path, env: Mapping[str, str] | None) -> Settings:
    try:
        return Settings.load(BerthHome(staging), env=env)
    except ConfigError as exc:
        raise ConfigError(f"the backup's config.toml cannot be used by this berth: {exc}") from None


def _postgres_target(manifest: BackupManifest, settings: Settings) -> str | None:
    """The PostgreSQL URL a dump is restored into, ``None`` for a SQLite backup; a backup
    and a ``database_url`` of different kinds are refused (:class:`ConfigError`)."""
    dump = manifest.database_member == PG_DUMP_NAME
    postgres = is_postgresql_url(settings.database_url)
    if dump and not postgres:
        raise ConfigError(
            "the backup holds a PostgreSQL dump but database_url is not PostgreSQL: set "
            "BERTH_DATABASE_URL=postgresql+psycopg://... to the database to restore it into"
        )
    if postgres and not dump:
        raise ConfigError(
            "the backup holds a SQLite database but database_url is PostgreSQL: restore it "
            "with a SQLite database_url (BERTH_DATABASE_URL=sqlite:///...)"
        )
    return settings.database_url if dump else None


def _restored_database_path(home: BerthHome, settings: Settings) -> Path:
    """Where a SQLite database goes, per the backup's ``config.toml`` and the environment."""
    if settings.source("database_url") == "default":
        return home.db_file
    path = sqlite_database_path(settings.database_url)
    if settings.source("database_url") == "env":
        return path  # the restoring operator chose it
    # From the archive's config.toml: only inside the home, never anywhere it names.
    if not path.is_absolute() or not path.resolve().is_relative_to(home.root.resolve()):
        raise ConfigError(
            f"the backup's config.toml puts the database at {path}, outside {home.root}: set "
            "BERTH_DATABASE_URL to restore it there"
        )
    return path


def _existing_state(home: BerthHome, db_path: Path | None) -> list[Path]:
    databases = [] if db_path is None else [db_path]
    candidates = [
        *databases,
        *(
            p.with_name(p.name + suffix)
            for p in databases
            for suffix in ("-wal", "-shm", "-journal")
        ),
        home.ca_dir,
        home.pepper_file,
        *(home.root / name for name in OPTIONAL_FILES),
    ]
    return [p for p in candidates if p.exists() or p.is_symlink()]


def _shown(home: BerthHome, path: Path) -> str:
    return str(path.relative_to(home.root)) if path.is_relative_to(home.root) else str(path)


def _move_aside(home: BerthHome, paths: list[Path], folder: Path) -> Path:
    """Move ``paths`` into ``folder`` (``folder-2``, ``-3``… when it exists); the folder used."""
    chosen, attempt = folder, 1
    while True:
        try:
            chosen.mkdir(mode=0o700)
            break
        except FileExistsError:
            attempt += 1
            chosen = folder.with_name(f"{folder.name}-{attempt}")
    try:
        for path in paths:
            # A database outside the home keeps its own name in the folder.
            name = _shown(home, path) if path.is_relative_to(home.root) else path.name
            shutil.move(path, chosen / name)
    except OSError as exc:
        raise BerthError(f"moving the old state of {home.root} aside failed: {exc}") from None
    return chosen


def _install(home: BerthHome, placements: list[tuple[Path, Path, int]]) -> None:
    home.ca_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(home.root, 0o700)
    os.chmod(home.ca_dir, 0o700)
    # The database last: until it is in place, the home holds no leader that could start.
    ordered = sorted(placements, key=lambda p: p[0].name == DATABASE_NAME)
    try:
        for staged, final, mode in ordered:
            os.chmod(staged, mode)
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(staged, final)
    except OSError as exc:
        raise BerthError(f"restoring {home.root} failed midway: {exc}") from None
