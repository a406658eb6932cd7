"""The placement package's errors.

::

    ConfigError (berth.errors)
    └── ModelFileError   a model's files say nothing berth can estimate from (``path``)

Placement decisions themselves never raise: they return a :class:`~berth.placement.Refusal`.
Only reading a model's files (:mod:`berth.placement.gguf`, :mod:`berth.placement.hf_config`)
raises, and the lifecycle manager turns that into "no estimate" with the message as the
reason.
"""

from __future__ import annotations

from pathlib import Path

from berth.errors import ConfigError


class ModelFileError(ConfigError):
    """A GGUF header or an HF ``config.json`` that cannot be read, is malformed, or lacks a
    value the estimate needs; ``path`` names the file."""

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message, path=path)
