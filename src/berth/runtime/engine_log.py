"""Engine log files: the last lines of one (carried by every engine error) and following
one as it grows, like ``tail -f``.

Each engine's stdout and stderr are appended to its deployment's log file by the runtime
that starts it (:mod:`berth.runtime.process`); the agent serves these files to ``berth logs``.
Reads are bounded, so one huge line cannot exhaust memory.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator
from pathlib import Path

#: Lines of engine output carried by an :class:`~berth.errors.EngineError`.
DEFAULT_LOG_TAIL_LINES = 40

# Bounds on how far back a tail read goes, so one huge line cannot exhaust memory.
_TAIL_BLOCK_BYTES = 8192
_TAIL_MAX_BYTES = 1 << 20
_FOLLOW_CHUNK_BYTES = 64 * 1024


def read_log_tail(path: Path, lines: int = DEFAULT_LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``path`` as text (undecodable bytes replaced).

    Returns ``""`` when the file does not exist.  Reads at most 1 MiB from the end.
    """
    data, _ = _tail_bytes(path, lines)
    return data.decode("utf-8", errors="replace")


async def follow_log(
    path: Path, *, from_start_lines: int = DEFAULT_LOG_TAIL_LINES, poll_interval_s: float = 0.25
) -> AsyncGenerator[bytes, None]:
    """Yield what ``path`` holds and then what is appended to it, like ``tail -f``.

    The first chunk is the last ``from_start_lines`` lines already in the file (none when
    0); later chunks are new bytes, checked every ``poll_interval_s`` seconds.  A file that
    does not exist yet is waited for; one that shrinks (truncated or replaced) is read again
    from its start.  The generator never ends by itself: the consumer stops it with
    ``aclose()`` (or by leaving ``async for`` and letting it be collected).
    """
    head, offset = await asyncio.to_thread(_tail_bytes, path, from_start_lines)
    if head:
        yield head
    while True:
        chunk, offset = await asyncio.to_thread(_read_from, path, offset)
        if chunk:
            yield chunk
        else:
            await asyncio.sleep(poll_interval_s)


def _tail_bytes(path: Path, lines: int) -> tuple[bytes, int]:
    """The last ``lines`` lines of ``path`` and the file offset they end at."""
    try:
        with path.open("rb") as handle:
            end = handle.seek(0, os.SEEK_END)
            if lines <= 0:
                return b"", end
            position = end
            data = b""
            # One newline more than ``lines`` is needed to know the first line is whole.
            while position > 0 and data.count(b"\n") <= lines and len(data) < _TAIL_MAX_BYTES:
                step = min(_TAIL_BLOCK_BYTES, position)
                position -= step
                handle.seek(position)
                data = handle.read(step) + data
            return b"".join(data.splitlines(keepends=True)[-lines:]), end
    except FileNotFoundError:
        return b"", 0


def _read_from(path: Path, offset: int) -> tuple[bytes, int]:
    """Bytes of ``path`` from ``offset`` (from 0 when the file shrank) and the new offset."""
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < offset:
                offset = 0
            handle.seek(offset)
            data = handle.read(_FOLLOW_CHUNK_BYTES)
    except FileNotFoundError:
        return b"", 0
    return data, offset + len(data)
