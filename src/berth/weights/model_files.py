"""What a model path on this host holds: a GGUF file, or a folder of a model's files.

:func:`inspect_model_path` is what ``POST /admin/models`` (and a finished pull) checks before
a path is registered. It is blocking (it reads the file system) and bounded, so the leader
runs it in a worker thread:

- only a regular file or a folder is a model; a character or block device (``/dev/zero``),
  a FIFO or a socket is refused before it is opened (opening a FIFO blocks until a writer
  comes), and a file is opened with ``O_NONBLOCK`` and checked again on its descriptor;
- a file must start with the GGUF magic ``b"GGUF"`` (the GGUF specification's header);
- a folder is walked without following links to folders (a link to a file is followed: the
  Hugging Face cache's snapshot folders are links to blobs), over at most
  :data:`MAX_FOLDER_ENTRIES` entries and :data:`MAX_WALK_S` seconds, so ``/`` is refused in
  a moment instead of walked for minutes; only regular files count towards its size;
- a path that cannot be read (permissions, a link loop) is refused naming that path.

A path that does not exist is a :class:`~berth.errors.NotFoundError` (404 at the admin
API, as an unknown name is); every other refusal a :class:`~berth.errors.ConfigError`
(400). :func:`checked_path` is the first step, shared with the adapter checks.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from berth.errors import ConfigError, NotFoundError

#: The GGUF specification's magic, the first four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"
#: The most entries (files and folders, at any depth) a model folder may hold. A Hugging
#: Face model repository holds tens of files; 10,000 leaves room for odd ones and refuses
#: a home or root folder after a few milliseconds of reading.
MAX_FOLDER_ENTRIES = 10_000
#: The longest a folder walk may take, in seconds (a slow network file system).
MAX_WALK_S = 5.0


@dataclass(frozen=True)
class ModelFiles:
    """A model path as checked: ``path`` resolved (links followed), ``is_folder``, and the
    size of its regular files in bytes."""

    path: Path
    is_folder: bool
    size_bytes: int


def _kind(mode: int) -> str:
    """What a file that is neither regular nor a folder is, in words."""
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _article(word: str) -> str:
    return f"an {word}" if word[:1] in "aeiou" else f"a {word}"


def _unreadable(path: Path | str, exc: OSError) -> ConfigError:
    reason = exc.strerror or type(exc).__name__
    return ConfigError(f"cannot read {path}: {reason.lower()}")


def _gguf_file_size(path: Path) -> int:
    """The size of the GGUF file at ``path``; ``ConfigError`` when it is not one."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _unreadable(path, exc) from None
    with os.fdopen(descriptor, "rb") as handle:
        # Checked again on the descriptor: the path may have been swapped since the stat.
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise ConfigError(f"{path} is {_kind(status.st_mode)}, not a model file")
        try:
            magic = handle.read(len(GGUF_MAGIC))
        except OSError as exc:
            raise _unreadable(path, exc) from None
    if magic != GGUF_MAGIC:
        raise ConfigError(f"{path} is not a GGUF file; register a .gguf file or a model folder")
    return status.st_size


def _folder_size(
    root: Path,
    *,
    max_entries: int,
    max_walk_s: float,
    clock: Callable[[], float],
) -> int:
    """The bytes of the regular files under ``root``, walked depth first without following
    links to folders; ``ConfigError`` past ``max_entries`` entries or ``max_walk_s``."""
    deadline = clock() + max_walk_s
    entries = 0
    total = 0
    pending = [root]
    while pending:
        folder = pending.pop()
        try:
            with os.scandir(folder) as listing:
                for entry in listing:
                    entries += 1
                    if entries > max_entries:
                        raise ConfigError(
                            f"{root} holds more than {max_entries} files and folders: a model "
                            "folder holds one model's files (config.json, weights, tokenizer)"
                        )
                    if entries % 256 == 0 and clock() > deadline:
                        raise ConfigError(
                            f"{root} took more than {max_walk_s:g} s to read: a model folder "
                            "holds one model's files (config.json, weights, tokenizer)"
                        )
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(Path(entry.path))
                        continue
                    try:
                        status = entry.stat(follow_symlinks=True)
                    except FileNotFoundError:
                        continue  # a dangling link holds nothing
                    except OSError as exc:
                        raise _unreadable(entry.path, exc) from None
                    if stat.S_ISREG(status.st_mode):
                        total += status.st_size
        except OSError as exc:
            raise _unreadable(folder, exc) from None
    return total


def checked_path(path: Path, *, what: str) -> tuple[Path, os.stat_result]:
    """``path`` resolved (links followed) and its status, when it is a regular file or a
    folder that can be read. ``what`` names it in refusals (``model``, ``adapter``).

    Raises :class:`~berth.errors.NotFoundError` when it does not exist (404: as a name that
    does not exist), :class:`~berth.errors.ConfigError` when it cannot be read (naming the
    path) or is a device, a FIFO or a socket. Blocking, but only a ``stat``.
    """
    try:
        resolved = path.resolve(strict=True)
        status = resolved.stat()
    except FileNotFoundError:
        message = f"{what} path does not exist: {path}"
        raise NotFoundError(f"{what} path", str(path), message=message) from None
    except OSError as exc:
        raise _unreadable(path, exc) from None
    except RuntimeError:  # a link loop, before Python 3.13
        raise ConfigError(f"cannot read {path}: too many levels of symbolic links") from None
    if not (stat.S_ISDIR(status.st_mode) or stat.S_ISREG(status.st_mode)):
        raise ConfigError(
            f"{resolved} is {_kind(status.st_mode)}, not {_article(what)}: register a .gguf "
            f"file or {_article(what)} folder"
        )
    return resolved, status


def inspect_model_path(
    path: Path,
    *,
    max_entries: int = MAX_FOLDER_ENTRIES,
    max_walk_s: float = MAX_WALK_S,
    clock: Callable[[], float] = time.monotonic,
) -> ModelFiles:
    """Check the model at ``path`` (absolute) on this host; see the module docstring.

    Returns its :class:`ModelFiles`. Raises :class:`~berth.errors.NotFoundError` when it
    does not exist, :class:`~berth.errors.ConfigError` when it cannot be read (naming the
    path that could not), is neither a regular file nor a folder, is a file that is not
    GGUF, or is a folder past the bounds.
    """
    resolved, status = checked_path(path, what="model")
    if stat.S_ISDIR(status.st_mode):
        size = _folder_size(resolved, max_entries=max_entries, max_walk_s=max_walk_s, clock=clock)
        return ModelFiles(resolved, True, size)
    return ModelFiles(resolved, False, _gguf_file_size(resolved))
