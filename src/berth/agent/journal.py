"""The engine journal: the engines an agent runs, kept on disk so a restarted agent takes them
back (``$BERTH_HOME/agent-engines.json``).

The file is one JSON object, deployment id to entry::

    {
     "d-1a2b3c4d": {"pid": 4242, "port": 41234, "health_path": "/health", "runtime": "process",
                    "api_key": "berth-ek-...", "cgroup": "/berth/d-1a2b3c4d"}
    }

``runtime`` may be missing (journals from before the docker runtime: ``process``), and so may
``api_key`` and ``cgroup`` (journals from before engines had keys and cgroups: none); fields a
newer berth adds are ignored.  The file holds the engines' API keys, so it is written with
mode 0600: only the user berth runs as can read it.  :func:`decode_journal` is the one
reader: anything else is a :class:`~berth.errors.ConfigError` naming the file, never a
journal silently taken as empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import msgspec

from berth.atomic import write_atomic
from berth.errors import ConfigError
from berth.vocab.engines import RuntimeName

#: The journal's permission bits: it holds the engines' API keys.
JOURNAL_MODE = 0o600


class JournalEntry(msgspec.Struct, frozen=True):
    """One engine: its process (a container's main process as the host sees it; 0 when not
    known yet), the host port it answers on, its health path, the runtime that runs it, its
    API key (``None``: it has none) and its cgroup (``None``: none of its own)."""

    pid: Annotated[int, msgspec.Meta(ge=0)]
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    health_path: str
    runtime: RuntimeName = "process"
    api_key: str | None = None
    cgroup: str | None = None

    def __repr__(self) -> str:  # the key never reaches a log through a repr
        return (
            f"JournalEntry(pid={self.pid}, port={self.port}, runtime={self.runtime!r}, "
            f"cgroup={self.cgroup!r})"
        )


_decoder = msgspec.json.Decoder(dict[str, JournalEntry])
_encoder = msgspec.json.Encoder()


def decode_journal(data: bytes, path: Path) -> dict[str, JournalEntry]:
    """The entries of a journal's bytes, by deployment id.

    Raises :class:`ConfigError` naming ``path`` when ``data`` is not JSON, not an object of
    entries, or an entry lacks a field or has one of the wrong type or out of range (a
    negative pid, a port above 65535, an unknown runtime).
    """
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"malformed engine journal: {exc}", path=path) from None


def encode_journal(entries: Mapping[str, JournalEntry]) -> bytes:
    """The journal's bytes: ``entries`` as an indented JSON object (readable by hand)."""
    return msgspec.json.format(_encoder.encode(dict(entries)), indent=1)


class EngineJournal:
    """The journal file at ``path``; each method blocks on the disk (call it off the event
    loop)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, JournalEntry]:
        """The entries saved last; none when there is no journal yet.

        Raises :class:`ConfigError` naming the file when it is malformed
        (:func:`decode_journal`) or cannot be read.
        """
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ConfigError(
                f"cannot read the engine journal: {exc.strerror}", path=self.path
            ) from None
        return decode_journal(data, self.path)

    def save(self, entries: Mapping[str, JournalEntry]) -> None:
        """Replace the journal with ``entries``, atomically and synced to the disk (a crash
        leaves the previous journal or this one, whole).  Raises :class:`OSError`."""
        write_atomic(self.path, encode_journal(entries), mode=JOURNAL_MODE)
