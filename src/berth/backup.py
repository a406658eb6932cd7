"""Backups of a leader's home: one ``tar.gz`` that brings a stopped leader back as it was.

A backup holds what the leader cannot rebuild and its agents and clients depend on:

- ``berth.db``: the state database (nodes and their certificate fingerprints, API key hashes,
  models, deployments), copied with SQLite's online backup API, so it is one consistent
  snapshot even while the daemon runs and writes;
- ``ca/``: the CA certificate and key, and the server certificates it issued (agents pin the
  CA's fingerprint; a new CA would make every agent re-enroll);
- ``key_pepper``: without it no stored API key or enrollment token hash matches;
- ``config.toml`` and ``adopted.yaml``, when present;
- ``manifest.json``, the first member: the format, the berth version, the database's schema
  version, when it was made, and each file's size, SHA-256 and mode.

Model files, logs and the daemon's runtime files are not included.  Archives are written with
mode 0600 (they hold the CA key and the pepper).  Reading one checks every member against the
manifest and refuses, with the reason, an archive that is truncated, corrupt, has a member the
manifest does not list or a path that is absolute or climbs out with ``..``.  Only SQLite
databases can be backed up for now.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import socket
import sqlite3
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import IO, Final

from berth import __version__
from berth.cluster.ca import CA_CERT_FILE, CA_KEY_FILE
from berth.config import Settings
from berth.errors import BerthError, ConfigError, ConflictError, DaemonError, StoreError
from berth.paths import BerthHome
from berth.runtime.process import pid_running
from berth.store import LATEST_VERSION
from berth.store.db import SQLITE_BUSY_TIMEOUT_S, is_sqlite, parse_database_url
from berth.store.nodes import LOCAL_NODE_ID

#: Version of the archive layout; a reader refuses a newer one.
FORMAT_VERSION: Final = 1
MANIFEST_NAME: Final = "manifest.json"
DATABASE_NAME: Final = "berth.db"
PEPPER_NAME: Final = "key_pepper"
#: Files of the home copied when present, besides the database, ``ca/`` and the pepper.
OPTIONAL_FILES: Final = ("config.toml", "adopted.yaml")
#: The largest manifest read (it lists a handful of files).
MAX_MANIFEST_BYTES: Final = 1024 * 1024
_COPY_CHUNK_BYTES = 1024 * 1024
_CA_MEMBER = re.compile(r"ca/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_TOP_MEMBERS = frozenset({DATABASE_NAME, PEPPER_NAME, *OPTIONAL_FILES})
_REQUIRED = (DATABASE_NAME, f"ca/{CA_CERT_FILE}", f"ca/{CA_KEY_FILE}")
_PRIVATE, _PUBLIC = 0o600, 0o644


@dataclass(frozen=True)
class BackupFile:
    """One file in a backup: its member name (``ca/ca.key``), size, SHA-256 (hex) and the
    permission bits it is restored with (0600, or 0644 for certificates)."""

    name: str
    size_bytes: int
    sha256: str
    mode: int


@dataclass(frozen=True)
class BackupManifest:
    """What ``manifest.json`` says: ``created_at`` is ISO 8601 in UTC."""

    format_version: int
    berth_version: str
    schema_version: int
    created_at: str
    files: tuple[BackupFile, ...]

    @property
    def size_bytes(self) -> int:
        """The files' total size, uncompressed."""
        return sum(f.size_bytes for f in self.files)

    def to_json(self) -> bytes:
        data = asdict(self)
        data["files"] = [asdict(f) for f in self.files]
        return json.dumps(data, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, source: Path) -> BackupManifest:
        """Parse and check a manifest; :class:`ConfigError` naming ``source`` if invalid."""

        def bad(reason: str) -> ConfigError:
            return ConfigError(f"not a valid berth backup: {reason}", path=source)

        try:
            raw = json.loads(data)
            version = raw["format_version"]
            if not isinstance(version, int) or version > FORMAT_VERSION:
                raise bad(f"archive format {version!r}; this berth reads up to {FORMAT_VERSION}")
            files = tuple(
                BackupFile(
                    name=str(f["name"]),
                    size_bytes=int(f["size_bytes"]),
                    sha256=str(f["sha256"]).lower(),
                    mode=int(f["mode"]),
                )
                for f in raw["files"]
            )
            manifest = cls(
                format_version=version,
                berth_version=str(raw["berth_version"]),
                schema_version=int(raw["schema_version"]),
                created_at=str(raw["created_at"]),
                files=files,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise bad(
                f"its {MANIFEST_NAME} is malformed ({exc.__class__.__name__}: {exc})"
            ) from None
        names = [f.name for f in files]
        for name in names:
            refusal = member_refusal(name)
            if refusal is not None:
                raise bad(f"its {MANIFEST_NAME} lists {refusal}")
        if len(set(names)) != len(names):
            raise bad(f"its {MANIFEST_NAME} lists a file twice")
        missing = [name for name in _REQUIRED if name not in names]
        if missing:
            raise bad(f"it lacks {', '.join(missing)}")
        return manifest


def member_refusal(name: str) -> str | None:
    """Why an archive member named ``name`` may not be restored, or ``None`` when it may.

    Only the files a backup writes are accepted: ``berth.db``, ``key_pepper``,
    ``config.toml``, ``adopted.yaml`` and plain names under ``ca/``.
    """
    path = PurePosixPath(name)
    if name.startswith("/") or path.is_absolute() or re.match(r"[A-Za-z]:", name):
        return f"member {name!r} with an absolute path"
    if ".." in path.parts or "\\" in name:
        return f"member {name!r} whose path leaves the home (..)"
    if name in _TOP_MEMBERS or _CA_MEMBER.fullmatch(name):
        return None
    return f"unexpected member {name!r}"


def sqlite_database_path(database_url: str) -> Path:
    """The file of a SQLite ``database_url``.

    Raises :class:`ConfigError` for another database (only SQLite is supported for now) or
    an in-memory one.
    """
    url = parse_database_url(database_url)
    if not is_sqlite(url):
        raise ConfigError(
            f"database_url uses {url.get_backend_name()}: only SQLite databases can be backed "
            "up and restored by berth for now (back that database up with its own tools)"
        )
    if url.database in (None, "", ":memory:") or url.query.get("mode") == "memory":
        raise ConfigError("database_url names an in-memory SQLite database: nothing to back up")
    return Path(url.database).expanduser().absolute()


# --- daemon detection ---------------------------------------------------------------------------


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


# --- create -------------------------------------------------------------------------------------


def create_backup(
    home: BerthHome,
    database_url: str,
    dest: Path,
    *,
    force: bool = False,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> BackupManifest:
    """Write a backup of the leader ``home`` (database at ``database_url``) to ``dest``.

    Safe while the daemon runs: the database is copied with SQLite's online backup API in
    one step (a single read transaction; in WAL mode the daemon keeps writing meanwhile).
    ``dest`` is written beside itself first and renamed into place, mode 0600.

    Raises :class:`ConfigError` for a database that is not SQLite, a home that is not a
    leader's (no ``ca/ca.key``) or has no database, or a missing destination folder;
    :class:`ConflictError` when ``dest`` exists and ``force`` is false; :class:`StoreError`
    when the database cannot be copied or the copy fails its integrity check.
    """
    db_path = sqlite_database_path(database_url)
    _require_leader_home(home)
    dest = dest.expanduser().absolute()
    if dest.is_dir():
        raise ConfigError(f"{dest} is a folder; name the archive file to write")
    if dest.exists() and not force:
        raise ConflictError(f"{dest} already exists; pass --force to replace it")
    if not dest.parent.is_dir():
        raise ConfigError(f"the folder {dest.parent} does not exist")
    if not db_path.is_file():
        raise ConfigError(f"no database at {db_path}: has this leader ever started?")

    staging = Path(tempfile.mkdtemp(prefix=".berth-backup-", dir=dest.parent))
    try:
        snapshot = staging / DATABASE_NAME
        schema_version = snapshot_database(db_path, snapshot)
        sources = [(DATABASE_NAME, snapshot, _PRIVATE), *_home_files(home)]
        files = tuple(_describe(name, path, mode) for name, path, mode in sources)
        manifest = BackupManifest(
            format_version=FORMAT_VERSION,
            berth_version=__version__,
            schema_version=schema_version,
            created_at=now().astimezone(UTC).isoformat(timespec="seconds"),
            files=files,
        )
        _write_archive(dest, manifest, {name: path for name, path, _mode in sources})
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
            found.append((name, path, _PRIVATE if path.suffix == ".key" else _file_mode(path)))
    for name in (PEPPER_NAME, *OPTIONAL_FILES):
        path = home.root / name
        if path.is_file():
            found.append((name, path, _PRIVATE))
    return found


def _file_mode(path: Path) -> int:
    """0644 for a file others may read (certificates), else 0600: never more."""
    return _PUBLIC if path.stat().st_mode & 0o044 else _PRIVATE


def _describe(name: str, path: Path, mode: int) -> BackupFile:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_COPY_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return BackupFile(name=name, size_bytes=size, sha256=digest.hexdigest(), mode=mode)


def snapshot_database(source: Path, target: Path) -> int:
    """Copy the SQLite database ``source`` to ``target`` consistently; its schema version.

    Uses the ``sqlite3`` module's :meth:`~sqlite3.Connection.backup` (SQLite's online backup
    API, all pages in one step).  The copy is switched out of WAL mode (one self-contained
    file), its agents are marked ``unreachable`` (none is connected to a restored leader until
    it redials), and it must pass ``PRAGMA quick_check``.  Raises :class:`StoreError`
    otherwise.
    """
    try:
        src = sqlite3.connect(source, timeout=SQLITE_BUSY_TIMEOUT_S)
        try:
            dst = sqlite3.connect(target)
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


def _write_archive(dest: Path, manifest: BackupManifest, paths: Mapping[str, Path]) -> None:
    mtime = time.time()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)  # mode 0600
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            manifest_bytes = manifest.to_json()
            tar.addfile(_tar_info(MANIFEST_NAME, len(manifest_bytes), _PRIVATE, mtime),
                        io.BytesIO(manifest_bytes))  # fmt: skip
            for entry in manifest.files:
                with paths[entry.name].open("rb") as handle:
                    info = _tar_info(entry.name, entry.size_bytes, entry.mode, mtime)
                    tar.addfile(info, handle)
            tar.close()
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, _PRIVATE)
        os.replace(tmp, dest)
    except OSError as exc:
        raise ConfigError(f"cannot write the backup: {exc.strerror or exc}", path=dest) from None
    finally:
        tmp.unlink(missing_ok=True)


def _tar_info(name: str, size: int, mode: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = mode
    info.mtime = int(mtime)
    return info  # owner and group stay 0 and empty: a restore never chowns


# --- read and verify ----------------------------------------------------------------------------


def verify_backup(source: Path) -> BackupManifest:
    """Read the whole archive at ``source`` and check it against its manifest.

    Raises :class:`ConfigError` naming ``source`` and the reason for a missing file, an
    archive that is not a berth backup, truncated or corrupt, a member the manifest does not
    list, a file whose size or SHA-256 differs, or a member with an absolute path or ``..``.
    """
    return _read_archive(source, extract_to=None)


def _read_archive(source: Path, extract_to: Path | None) -> BackupManifest:
    source = source.expanduser().absolute()
    if not source.is_file():
        raise ConfigError(f"{source} does not exist or is not a file")
    try:
        with source.open("rb") as handle:
            magic = handle.read(2)
    except OSError as exc:
        raise ConfigError(f"cannot read the archive: {exc.strerror}", path=source) from None
    if magic != b"\x1f\x8b":  # RFC 1952 section 2.3.1: ID1, ID2
        raise ConfigError("not a berth backup: not a gzip file", path=source)
    try:
        with tarfile.open(source, mode="r:gz") as tar:
            return _read_members(tar, source, extract_to)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ConfigError(f"the archive is truncated or corrupt ({exc})", path=source) from None
    except OSError as exc:
        raise ConfigError(f"cannot unpack the archive: {exc}", path=source) from None


def _read_members(tar: tarfile.TarFile, source: Path, extract_to: Path | None) -> BackupManifest:
    def bad(reason: str) -> ConfigError:
        return ConfigError(f"refused: the archive has {reason}", path=source)

    first = tar.next()
    if first is None or first.name != MANIFEST_NAME:
        found = "nothing" if first is None else repr(first.name)
        raise ConfigError(
            f"not a berth backup: its first member is {found}, not {MANIFEST_NAME}", path=source
        )
    if not first.isfile() or first.size > MAX_MANIFEST_BYTES:
        raise bad(f"a {MANIFEST_NAME} that is not a small file")
    manifest = BackupManifest.from_json(_read_all(tar, first), source)
    expected = {f.name: f for f in manifest.files}
    seen: set[str] = set()
    for member in _members(tar):
        refusal = member_refusal(member.name)
        if refusal is not None:
            raise bad(refusal)
        if not member.isfile():
            raise bad(f"member {member.name!r} that is not a regular file")
        entry = expected.get(member.name)
        if entry is None or member.name in seen:
            raise bad(f"member {member.name!r} its manifest does not list (or lists once)")
        seen.add(member.name)
        target = None if extract_to is None else extract_to / member.name
        size, digest = _copy_member(tar, member, target)
        if size != entry.size_bytes or digest != entry.sha256:
            raise ConfigError(
                f"refused: {member.name} does not match its checksum in the manifest "
                f"({size} bytes, sha256 {digest[:12]}…; expected {entry.size_bytes} bytes, "
                f"sha256 {entry.sha256[:12]}…): the archive is damaged",
                path=source,
            )
    missing = [name for name in expected if name not in seen]
    if missing:
        raise ConfigError(
            f"refused: the archive is truncated: {', '.join(missing)} missing", path=source
        )
    return manifest


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while (member := tar.next()) is not None:
        yield member


def _read_all(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    assert handle is not None  # a regular file
    with handle:
        return handle.read()


def _copy_member(
    tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path | None
) -> tuple[int, str]:
    """Stream one member, into ``target`` (created 0600) when given; its size and SHA-256."""
    handle = tar.extractfile(member)
    assert handle is not None
    digest = hashlib.sha256()
    size = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(handle)
        out: IO[bytes] | None = None
        if target is not None:
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _PRIVATE)
            out = stack.enter_context(os.fdopen(fd, "wb"))
        while chunk := handle.read(_COPY_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
            if out is not None:
                out.write(chunk)
    return size, digest.hexdigest()


# --- restore ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestoreReport:
    """What a restore did: the manifest, where the database went, and where the files it
    replaced were moved (``None`` when nothing was replaced)."""

    manifest: BackupManifest
    database_path: Path
    replaced_dir: Path | None


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
    ``$BERTH_HOME/berth.db``.  With ``force``, the state it replaces (the database and its
    ``-wal``/``-shm`` files, the whole ``ca/`` folder, the pepper, ``config.toml``,
    ``adopted.yaml``) is moved to ``$BERTH_HOME/replaced-<UTC time>/``, never deleted.
    Files are restored 0600 (certificates 0644), the home and ``ca/`` 0700.

    Raises :class:`DaemonError` when a daemon of ``home`` runs; :class:`ConflictError` when
    the home holds a leader's state and ``force`` is false; :class:`ConfigError` for an
    archive that fails verification, a backup's ``config.toml`` this berth cannot read, or a
    database that is not SQLite; :class:`StoreError` for a schema newer than this berth's.
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
        manifest = _read_archive(source, extract_to=staging)
        if manifest.schema_version > LATEST_VERSION:
            raise StoreError(
                f"the backup's database is at schema version {manifest.schema_version}, "
                f"newer than this berth knows ({LATEST_VERSION}); restore it with berth "
                f"{manifest.berth_version} or newer"
            )
        db_path = _restored_database_path(home, staging, env)
        # The manifest's own modes are not trusted (anyone can rewrite a manifest): private,
        # except certificates.
        placements = [
            (
                staging / f.name,
                db_path if f.name == DATABASE_NAME else home.root / f.name,
                _PUBLIC if f.name.startswith("ca/") and f.name.endswith(".pem") else _PRIVATE,
            )
            for f in manifest.files
        ]
        replaced = _existing_state(home, db_path)
        replaced_dir: Path | None = None
        if replaced:
            if not force:
                names = ", ".join(_shown(home, p) for p in replaced)
                raise ConflictError(
                    f"{home.root} already holds a leader's state ({names}); pass --force to "
                    "replace it (the replaced files are kept in a replaced-<time> folder)"
                )
            stamp = now().astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
            replaced_dir = _move_aside(home, replaced, home.root / f"replaced-{stamp}")
        _install(home, placements)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return RestoreReport(manifest=manifest, database_path=db_path, replaced_dir=replaced_dir)


def _restored_database_path(home: BerthHome, staging: Path, env: Mapping[str, str] | None) -> Path:
    """Where the database goes, per the backup's ``config.toml`` and the environment."""
    try:
        settings = Settings.load(BerthHome(staging), env=env)
    except ConfigError as exc:
        raise ConfigError(f"the backup's config.toml cannot be used by this berth: {exc}") from None
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


def _existing_state(home: BerthHome, db_path: Path) -> list[Path]:
    candidates = [
        db_path,
        *(db_path.with_name(db_path.name + suffix) for suffix in ("-wal", "-shm", "-journal")),
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
