"""Atomic file writes: a reader sees a file's old content or its new content, never a part.

The data goes to a temporary file with a name of its own in the target's directory (a rename
is atomic only within one file system, and a unique name keeps concurrent writers off each
other's half-written file); its permission bits are set, and when ``durable`` it is flushed to
the disk (``fsync``); then it is renamed over the target and, when ``durable``, the directory
is flushed too, so the rename itself survives a power cut (fsync(2): syncing a file does not
sync the directory entry that names it).  On any failure the temporary file is removed and the
target is left as it was.

:func:`write_atomic` replaces a file with bytes or text, :func:`atomic_writer` streams into the
replacement (a tar archive, say), and :func:`create_atomic` creates a file only where none
exists, so concurrent creators agree on one winner.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_writer", "create_atomic", "write_atomic"]

# Errors that only say the file system cannot sync a directory (some network and FUSE file
# systems): the rename happened, so they are not failures of the write.
_NO_DIRECTORY_SYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EBADF})


def write_atomic(path: Path, data: bytes | str, *, mode: int, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) in one step.

    ``mode`` is the file's permission bits exactly (``0o600``), whatever the umask; they are
    set before the file appears under its name, so a private file is never readable by others.
    ``durable`` syncs the data and the directory to the disk before returning; pass ``False``
    for a file that is only a hint (a status snapshot rewritten often), where losing the last
    write in a power cut is harmless.  The directory must exist.  Raises :class:`OSError`
    when the file cannot be written; ``path`` is unchanged then and no temporary file is left
    (only a failed sync of the directory, after the rename, is raised with the new content in
    place).
    """
    payload = data.encode() if isinstance(data, str) else data
    with atomic_writer(path, mode=mode, durable=durable) as handle:
        handle.write(payload)


@contextlib.contextmanager
def atomic_writer(path: Path, *, mode: int, durable: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; it replaces ``path`` when the
    ``with`` block ends without an error (the rules of :func:`write_atomic`).

    An exception in the block, or a failed write, sync or rename, removes the temporary file
    and leaves ``path`` as it was; the exception propagates.
    """
    handle, temporary = _temporary_beside(path)
    try:
        with handle:
            yield handle
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            if durable:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if durable:
        _sync_directory(path.parent)


def create_atomic(path: Path, data: bytes | str, *, mode: int, durable: bool = True) -> bool:
    """Create ``path`` holding ``data`` unless it exists; whether this call created it.

    The file appears whole or not at all (it is written aside and hard-linked into place, and
    a link never replaces an existing name), so when several processes race to create the
    same file exactly one wins and the others keep its content.  ``mode`` and ``durable`` as
    in :func:`write_atomic`.  Raises :class:`OSError` when the file cannot be written.
    """
    payload = data.encode() if isinstance(data, str) else data
    handle, temporary = _temporary_beside(path)
    try:
        with handle:
            handle.write(payload)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            if durable:
                os.fsync(handle.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False
    finally:
        temporary.unlink(missing_ok=True)
    if durable:
        _sync_directory(path.parent)
    return True


def _temporary_beside(path: Path) -> tuple[BinaryIO, Path]:
    """A new empty file with a unique name next to ``path``, open for writing, mode 0600
    (``mkstemp``: never readable by others before its final mode is set)."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    return os.fdopen(fd, "wb"), Path(name)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIRECTORY_SYNC:
            raise
    finally:
        os.close(fd)
