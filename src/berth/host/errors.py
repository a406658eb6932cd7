"""Errors of the host's shared state.

::

    HostStateError          the shared state file cannot be used (path)
    └── HostFileError       it is not one this berth made, or of another shape (path, reason)

A full table is not an error: what it does instead is told by each table (see
:mod:`berth.host`).
"""

from __future__ import annotations

from pathlib import Path

from berth.errors import BerthError


class HostStateError(BerthError):
    """The host's shared state at ``path`` cannot be used."""

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path


class HostFileError(HostStateError):
    """The file at ``path`` is not a shared state file of this shape: ``reason`` says how."""

    def __init__(self, message: str, *, path: Path, reason: str) -> None:
        super().__init__(message, path=path)
        self.reason = reason
