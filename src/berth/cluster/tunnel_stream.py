"""One stream of an agent link, as its two ends use it (``docs/protocol.md``, Streams).

:class:`TunnelStream` turns the session's stream bookkeeping into an async reader of the
peer's payload (reading grants the peer more credit) and a writer that waits for credit, so a
slow reader slows the writer. :class:`~berth.cluster.connection.LinkConnection` feeds it the
frames that arrive for it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from berth.cluster.protocol.errors import LinkError
from berth.cluster.protocol.frames import StreamHead, StreamOpen
from berth.cluster.protocol.session import LinkSession


class StreamCarrier(Protocol):
    """What a stream needs of the link that carries it
    (:class:`berth.cluster.connection.LinkConnection`): the session's stream bookkeeping,
    sending what it queued, waiting for the socket to drain, and forgetting the stream."""

    session: LinkSession
    peer: str

    @property
    def closed(self) -> bool: ...

    def flush(self) -> None: ...

    async def drain(self) -> None: ...

    def forget_stream(self, stream_id: int) -> None: ...


class StreamResetError(LinkError):
    """The stream was reset by the peer (``reset_code``) or lost with its link."""

    def __init__(self, message: str, reset_code: str) -> None:
        super().__init__(message)
        self.reset_code = reset_code


class TunnelStream:
    """One stream of a link: the received payload as an async reader, and a writer that
    waits for credit. ``opening`` is the StreamOpen frame (agent side), ``head`` the answer's
    head once it arrives (leader side)."""

    def __init__(self, conn: StreamCarrier, stream_id: int, opening: StreamOpen | None) -> None:
        self.conn = conn
        self.id = stream_id
        self.opening = opening
        self.head: StreamHead | None = None
        self._chunks: deque[bytes] = deque()
        self._ended = False
        self._reset: StreamResetError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._credit_waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def ended(self) -> bool:
        """True once the peer's side has ended and every received byte was read."""
        return self._ended and not self._chunks

    # -- fed by the connection ----------------------------------------------------------

    def _feed(self, payload: bytes, end: bool) -> None:
        if payload:
            self._chunks.append(payload)
        if end:
            self._ended = True
        self._wake()

    def _fail(self, error: StreamResetError) -> None:
        self._reset = error
        self._wake()
        waiter = self._credit_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _credit(self) -> None:
        waiter = self._credit_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- reading -------------------------------------------------------------------------

    async def wait_head(self, timeout_s: float | None) -> StreamHead:
        """Leader: wait for the answer's head. Raises ``StreamResetError`` or
        ``TimeoutError``."""
        async with asyncio.timeout(timeout_s):
            while self.head is None:
                if self._reset is not None:
                    raise self._reset
                await self._wait()
        return self.head

    async def read(self, timeout_s: float | None = None) -> bytes:
        """The payload that arrived since the last read (``b""`` at the end).

        Reading grants the sender credit for more. Raises ``StreamResetError`` when the
        stream was reset and ``TimeoutError`` when nothing arrives for ``timeout_s``.
        """
        async with asyncio.timeout(timeout_s):
            while not self._chunks:
                if self._reset is not None:
                    raise self._reset
                if self._ended:
                    return b""
                await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.conn.session.consume(self.id, len(data))
        self.conn.flush()
        return data

    async def read_all(self, limit_bytes: int) -> bytes:
        """Everything until the peer's end; ``LinkError`` past ``limit_bytes``."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.read():
            size += len(chunk)
            if size > limit_bytes:
                raise LinkError(f"stream {self.id} body exceeds {limit_bytes} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- writing -------------------------------------------------------------------------

    async def write(self, data: bytes, end: bool = False) -> None:
        """Send ``data`` in frames no larger than the link allows, waiting for credit.

        Raises ``StreamResetError`` when the peer resets the stream or the link is lost.
        """
        session = self.conn.session
        view = memoryview(data)
        max_payload = session.limits.max_payload_bytes
        while True:
            if self._reset is not None:
                raise self._reset
            if self.conn.closed:
                raise StreamResetError(f"the link to {self.conn.peer} was lost", "link_lost")
            credit = session.send_credit(self.id)
            if not session.has_stream(self.id):
                return  # ended or reset under us: nothing more to send
            size = min(len(view), credit, max_payload)
            if size < len(view) and size == 0:
                await self._wait_credit()
                continue
            last = size == len(view)
            session.send_data(self.id, bytes(view[:size]), end and last)
            view = view[size:]
            self.conn.flush()
            await self.conn.drain()
            if last:
                return

    async def _wait_credit(self) -> None:
        self._credit_waiter = asyncio.get_running_loop().create_future()
        try:
            await self._credit_waiter
        finally:
            self._credit_waiter = None

    def release(self) -> None:
        """Done with the stream: reset it if it is still open on either side, then forget it."""
        if self.conn.session.has_stream(self.id):
            self.reset("cancelled")
        self.conn.forget_stream(self.id)

    def reset(self, code: str = "cancelled", message: str = "") -> None:
        """Abandon the stream; the peer stops sending (and, agent side, stops the engine)."""
        if self.conn.session.has_stream(self.id):
            self.conn.session.reset_stream(self.id, code, message)
            self.conn.flush()
        self.conn.forget_stream(self.id)
        if self._reset is None:
            self._fail(StreamResetError(f"stream {self.id} was reset here", code))
