"""Reading a model's shape from its files: the one entry point, by what the path is.

:func:`read_model_shape` reads the shape; :func:`model_stamp` says whether the files changed
since (their size and modification time, :class:`FileStamp`); :func:`read_model_file` is
both at once for a reader on another host (a node's agent answering the leader's
``model_shape``), which reads the header again only when the stamp differs from the one the
caller has a shape for.

Blocking file I/O (a GGUF header is a few MiB at most, a ``config.json`` a few KiB); async
callers run it with ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from berth.errors import ConfigError, NotFoundError
from berth.placement.errors import ModelFileError
from berth.placement.gguf import read_gguf_shape
from berth.placement.hf_config import read_hf_shape
from berth.placement.shape import ModelShape


@dataclass(frozen=True)
class FileStamp:
    """What says a model's files changed: their size in bytes and their newest modification
    time in nanoseconds (a folder: the files directly in it, and the folder itself)."""

    size_bytes: int
    mtime_ns: int


@dataclass(frozen=True)
class ModelFileShape:
    """A model's files as read on their host: their :class:`FileStamp`, and the shape
    (``None``: not read again, the stamp is the one the caller already has a shape for)."""

    stamp: FileStamp
    shape: ModelShape | None


def read_model_shape(path: Path) -> ModelShape:
    """The shape of the model at ``path``: a ``.gguf`` file (its header), or a directory
    with a ``config.json`` (the HF layout vLLM and SGLang load) or with GGUF files (a split
    model: the first part's header, every part's size).

    Raises :class:`ModelFileError` when nothing there can be read.
    """
    if path.is_dir():
        if (path / "config.json").is_file():
            return read_hf_shape(path)
        parts = sorted(path.glob("*.gguf"))
        if parts:
            return read_gguf_shape(parts[0], weights_bytes=sum(p.stat().st_size for p in parts))
        raise ModelFileError("no config.json and no .gguf file in the model folder", path=path)
    if path.is_file():
        return read_gguf_shape(path)
    raise ModelFileError("the model's path does not exist on the leader's host", path=path)


def model_stamp(path: Path) -> FileStamp | None:
    """The :class:`FileStamp` of the model at ``path`` (a file, or a folder's files), or
    ``None`` when nothing is there (or it cannot be listed)."""
    try:
        stat = os.stat(path)
        if not path.is_dir():
            return FileStamp(stat.st_size, stat.st_mtime_ns)
        size, newest = 0, stat.st_mtime_ns
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_file():
                    found = entry.stat()
                    size += found.st_size
                    newest = max(newest, found.st_mtime_ns)
        return FileStamp(size, newest)
    except OSError:
        return None


def read_model_file(path: Path, known: FileStamp | None = None) -> ModelFileShape:
    """The stamp of the model at ``path`` on this host, with its shape unless the stamp is
    ``known`` (the caller's shape is still right).

    Raises ``ConfigError`` for a relative path, ``NotFoundError`` when nothing is at
    ``path``, :class:`ModelFileError` when its files cannot be read as a model.
    """
    if not path.is_absolute():
        raise ConfigError(f"a model path must be absolute, not {str(path)!r}")
    stamp = model_stamp(path)
    if stamp is None:
        raise NotFoundError(
            "model path", str(path), message=f"{path}: no such file or folder on this host"
        )
    if stamp == known:
        return ModelFileShape(stamp, None)
    return ModelFileShape(stamp, read_model_shape(path))
