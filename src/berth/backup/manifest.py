"""The backup archive's format: its member names, the manifest and its checks.

An archive is a ``tar.gz`` whose first member is ``manifest.json`` (:class:`BackupManifest`):
the format, the berth version, the database's schema version, when it was made, and each
file's size, SHA-256 and mode.  Only the names a backup writes are accepted as members
(:func:`member_refusal`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from berth.cluster.pki.ca import CA_CERT_FILE, CA_KEY_FILE
from berth.errors import ConfigError

#: Version of the archive layout; a reader refuses a newer one.
FORMAT_VERSION: Final = 1
MANIFEST_NAME: Final = "manifest.json"
DATABASE_NAME: Final = "berth.db"
#: The database of a leader on PostgreSQL: ``pg_dump``'s custom format (backup/postgres.py).
PG_DUMP_NAME: Final = "berth.pgdump"
PEPPER_NAME: Final = "key_pepper"
#: Files of the home copied when present, besides the database, ``ca/`` and the pepper.
OPTIONAL_FILES: Final = ("config.toml", "adopted.yaml")
#: The largest manifest read (it lists a handful of files).
MAX_MANIFEST_BYTES: Final = 1024 * 1024
#: Bytes read at a time when hashing or copying a file.
COPY_CHUNK_BYTES = 1024 * 1024
#: The mode of every file a backup or restore writes (certificates too: the home and ``ca/``
#: are 0700, so nobody else could read them anyway).
PRIVATE_MODE: Final = 0o600
_CA_MEMBER = re.compile(r"ca/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_TOP_MEMBERS = frozenset({DATABASE_NAME, PG_DUMP_NAME, PEPPER_NAME, *OPTIONAL_FILES})
_REQUIRED = (f"ca/{CA_CERT_FILE}", f"ca/{CA_KEY_FILE}")


@dataclass(frozen=True)
class BackupFile:
    """One file in a backup: its member name (``ca/ca.key``), size, SHA-256 (hex) and its
    permission bits in the archive (0600; a restore writes 0600 whatever they say)."""

    name: str
    size_bytes: int
    sha256: str
    mode: int


@dataclass(frozen=True)
class BackupManifest:
    """What ``manifest.json`` says: ``created_at`` is ISO 8601 in UTC; ``secrets`` names
    each secret the archive carries (:func:`berth.backup.secrets.carried_secrets`; empty in
    archives of berth before it was recorded)."""

    format_version: int
    berth_version: str
    schema_version: int
    created_at: str
    files: tuple[BackupFile, ...]
    secrets: tuple[str, ...] = ()

    @property
    def database_member(self) -> str:
        """``berth.db`` (SQLite) or ``berth.pgdump`` (PostgreSQL): the one it holds."""
        names = {f.name for f in self.files}
        return PG_DUMP_NAME if PG_DUMP_NAME in names else DATABASE_NAME

    @property
    def size_bytes(self) -> int:
        """The files' total size, uncompressed."""
        return sum(f.size_bytes for f in self.files)

    def to_json(self) -> bytes:
        data = asdict(self)
        data["files"] = [asdict(f) for f in self.files]
        data["secrets"] = list(self.secrets)
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
                secrets=tuple(str(item) for item in raw.get("secrets", [])),
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
        databases = [name for name in (DATABASE_NAME, PG_DUMP_NAME) if name in names]
        if len(databases) > 1:
            raise bad(f"it holds two databases ({', '.join(databases)})")
        missing = [] if databases else [f"{DATABASE_NAME} (or {PG_DUMP_NAME})"]
        missing += [name for name in _REQUIRED if name not in names]
        if missing:
            raise bad(f"it lacks {', '.join(missing)}")
        return manifest


def member_refusal(name: str) -> str | None:
    """Why an archive member named ``name`` may not be restored, or ``None`` when it may.

    Only the files a backup writes are accepted: ``berth.db`` or ``berth.pgdump``, ``key_pepper``,
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
