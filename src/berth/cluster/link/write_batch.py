"""Coalescing a link's WebSocket writes: the frames written during one pass of the event loop
leave in one transport write (:func:`coalesce_writes`).

A token stream through an agent is many small frames, and with many streams open several
are written in the same pass of the loop. Each transport write over TLS costs a TLS record
and a system call of its own (and, on loopback, the receiver's wake-up); joined, they cost
one of each. The frames themselves are unchanged: each is still one WebSocket message, in
the order it was written; only their grouping into writes differs.

aiohttp's WebSocket writer (``ClientWebSocketResponse._writer``,
``WebSocketResponse._writer``) writes each frame with ``transport.write`` and asks
``transport.is_closing()``; nothing else. :func:`coalesce_writes` puts a
:class:`BatchingTransport` in front of its transport when it has that shape, and leaves any
other WebSocket (the tests' in-memory ones, another aiohttp) as it is.

:func:`frame_writer` gives the link a way to write one binary message without a coroutine,
for a stream's data sent from an engine connection's callback: aiohttp's own frame writer
(``WebSocketWriter._write_websocket_frame``: the header, the client's mask of RFC 6455
section 5.3, the transport write), the one ``send_bytes`` calls when nothing is compressed,
so the frames on the wire are the ones ``send_bytes`` would write.

Both reach into aiohttp's private writer, so ``pyproject.toml`` caps aiohttp at the minor
``tests/test_link_writes_aiohttp.py`` was run against: that test fails, on a real WebSocket,
when either function would fall back on the installed aiohttp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

#: RFC 6455 section 5.2: the opcode of a binary frame.
_BINARY_OPCODE = 0x2

#: A write at least this long, or a batch grown this long, is written at once (after what
#: is queued before it): batching pays for small frames only.
FLUSH_AT_BYTES = 64 * 1024


class BatchingTransport:
    """Holds the writes of one pass of the event loop and writes them to ``transport`` as
    one, at the end of the pass (``loop.call_soon``) or at :data:`FLUSH_AT_BYTES`.
    Anything else is the wrapped transport's; :meth:`close` and :meth:`abort` write what is
    held first."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._parts: list[bytes] = []
        self._size = 0
        self._scheduled = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._parts.append(bytes(data) if not isinstance(data, bytes) else data)
        self._size += len(data)
        if self._size >= FLUSH_AT_BYTES:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._scheduled_flush)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def flush(self) -> None:
        """Write what is held now, as one write."""
        parts = self._parts
        if not parts:
            return
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self._parts = []
        self._size = 0
        if not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def abort(self) -> None:
        self.flush()
        self.transport.abort()

    def _scheduled_flush(self) -> None:
        self._scheduled = False
        self.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def coalesce_writes(ws: object) -> BatchingTransport | None:
    """Batch the frame writes of aiohttp WebSocket ``ws`` (see the module docstring); returns
    the batching transport, or ``None`` when ``ws`` is not of that shape (then nothing
    changes). Call it on the loop that runs ``ws``, once its handshake is done."""
    writer = getattr(ws, "_writer", None)
    transport = getattr(writer, "transport", None)
    if writer is None or transport is None or isinstance(transport, BatchingTransport):
        return None
    if not callable(getattr(transport, "write", None)) or not callable(
        getattr(transport, "is_closing", None)
    ):
        return None
    batching = BatchingTransport(transport, asyncio.get_running_loop())
    writer.transport = batching
    return batching


class FrameWriter:
    """Writes one binary WebSocket message at once, as aiohttp's ``send_bytes`` would (see
    the module docstring), when :attr:`ready`: the transport is not paused by its high-water
    mark and not closing (otherwise the caller leaves the message to ``send_bytes``, which
    waits). :meth:`write` raises what aiohttp raises for a closing transport
    (``ClientConnectionResetError``, a ``ConnectionError``)."""

    __slots__ = ("_protocol", "_write_frame", "_writer")

    def __init__(self, writer: Any, write_frame: Callable[[bytes, int, int], None]) -> None:
        self._writer = writer
        self._protocol = writer.protocol
        self._write_frame = write_frame

    @property
    def ready(self) -> bool:
        writer = self._writer
        return (
            not self._protocol.writing_paused
            and not writer._closing
            and not writer.transport.is_closing()
        )

    def write(self, message: bytes) -> None:
        self._write_frame(message, _BINARY_OPCODE, 0)


def frame_writer(ws: object) -> FrameWriter | None:
    """A :class:`FrameWriter` for aiohttp WebSocket ``ws``, or ``None`` when ``ws`` is not of
    that shape or compresses its messages (then the link sends with ``send_bytes`` only)."""
    writer = getattr(ws, "_writer", None)
    write_frame = getattr(writer, "_write_websocket_frame", None)
    protocol = getattr(writer, "protocol", None)
    if writer is None or not callable(write_frame) or protocol is None:
        return None
    if getattr(writer, "compress", 0) or not hasattr(protocol, "writing_paused"):
        return None
    if not hasattr(writer, "_closing") or getattr(writer, "transport", None) is None:
        return None
    return FrameWriter(writer, write_frame)
