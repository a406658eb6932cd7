"""Writing a backup archive, and reading one back with every member checked against its
manifest (optionally extracting it)."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import tarfile
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

from berth.atomic import atomic_writer
from berth.backup.manifest import (
    COPY_CHUNK_BYTES,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    PRIVATE_MODE,
    BackupManifest,
    member_refusal,
)
from berth.errors import ConfigError


def write_archive(dest: Path, manifest: BackupManifest, paths: Mapping[str, Path]) -> None:
    """Write the archive of ``manifest`` (member name -> file in ``paths``) to ``dest``.

    ``dest`` is replaced atomically, mode 0600 (it holds the CA key and the pepper), and
    synced to the disk.  Raises :class:`ConfigError` naming ``dest`` when it cannot be written.
    """
    mtime = time.time()
    try:
        with (
            atomic_writer(dest, mode=PRIVATE_MODE) as raw,
            tarfile.open(fileobj=raw, mode="w:gz") as tar,
        ):
            manifest_bytes = manifest.to_json()
            tar.addfile(_tar_info(MANIFEST_NAME, len(manifest_bytes), PRIVATE_MODE, mtime),
                        io.BytesIO(manifest_bytes))  # fmt: skip
            for entry in manifest.files:
                with paths[entry.name].open("rb") as handle:
                    info = _tar_info(entry.name, entry.size_bytes, entry.mode, mtime)
                    tar.addfile(info, handle)
    except OSError as exc:
        raise ConfigError(f"cannot write the backup: {exc.strerror or exc}", path=dest) from None


def _tar_info(name: str, size: int, mode: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = mode
    info.mtime = int(mtime)
    return info  # owner and group stay 0 and empty: a restore never chowns


def verify_backup(source: Path) -> BackupManifest:
    """Read the whole archive at ``source`` and check it against its manifest.

    Raises :class:`ConfigError` naming ``source`` and the reason for a missing file, an
    archive that is not a berth backup, truncated or corrupt, a member the manifest does not
    list, a file whose size or SHA-256 differs, or a member with an absolute path or ``..``.
    """
    return read_archive(source, extract_to=None)


def read_archive(source: Path, extract_to: Path | None) -> BackupManifest:
    """Read and check the archive at ``source`` (see :func:`verify_backup`), extracting each
    member under ``extract_to`` (created 0600) when given; its manifest."""
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
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE)
            out = stack.enter_context(os.fdopen(fd, "wb"))
        while chunk := handle.read(COPY_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
            if out is not None:
                out.write(chunk)
    return size, digest.hexdigest()
