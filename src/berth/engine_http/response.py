"""One answer from an engine, as berth's HTTP/1.1 client (:mod:`berth.engine_http.pool`) hands
it to its reader: status, headers, and the body as it arrives.

Its connection (:class:`berth.engine_http.connection.UpstreamConnection`) fills it in from
the parser's callbacks and wakes the reader; the reader takes the body with
:meth:`UpstreamResponse.read_chunk` or :meth:`UpstreamResponse.read`, and
:meth:`UpstreamResponse.close` hands an unfinished answer's connection back to be closed.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from berth.engine_http.answer import BodySink, read_body
from berth.engine_http.errors import UpstreamDisconnectError, UpstreamError

if TYPE_CHECKING:
    from berth.engine_http.origin import Origin


class BodySource(Protocol):
    """What an answer needs of the connection it arrives on
    (:class:`berth.engine_http.connection.UpstreamConnection`): its engine's ``origin``, to
    wait for more body, to resume reading once the reader caught up, and to be abandoned."""

    origin: Origin
    reading_paused: bool

    async def wait_for_body(self, response: UpstreamResponse) -> None: ...

    def resume(self) -> None: ...

    def abandon(self) -> None: ...

    def start_push(self, response: UpstreamResponse) -> None: ...

    def pause(self) -> None: ...

    def resume_push(self) -> None: ...

    def set_body_timeout(self, timeout_s: float | None) -> None: ...


class UpstreamResponse:
    """One answer: ``status``, ``headers`` (names lower-cased, in order) and the body.

    The body is read with :meth:`read_chunk` (whatever has arrived, as one ``bytes``) or
    :meth:`read` (up to its end), or pushed to a sink (:meth:`push_body`, a
    :class:`~berth.engine_http.answer.PushedAnswer`: the pieces of one socket read in one
    call, the last one with the end). ``content_length`` is the announced length, ``None`` for a
    chunked or close-delimited body. Call :meth:`close` when done, also after an error:
    an answer not received in full closes its connection.
    """

    __slots__ = (
        "_chunks",
        "_complete",
        "_conn",
        "_error",
        "_sink",
        "_size",
        "_waiter",
        "content_length",
        "headers",
        "status",
    )

    def __init__(self, conn: BodySource) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self._conn: BodySource | None = conn  # None once the answer is complete or closed
        self._chunks: list[bytes] = []
        self._size = 0
        self._complete = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: BodySink | None = None

    def header(self, name: bytes) -> bytes | None:
        """The value of the first header called ``name`` (lower-case bytes), or ``None``."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def at_eof(self) -> bool:
        """True when the whole body has arrived and has all been read."""
        return self._complete and not self._chunks

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some if none did;
        ``b""`` once the body has ended.

        Raises :class:`UpstreamTimeoutError` when the engine sends nothing for the read
        timeout, :class:`UpstreamDisconnectError` when it drops the connection mid-body and
        :class:`UpstreamProtocolError` for a malformed body; bytes that arrived before the
        failure are returned first.
        """
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            conn = self._conn
            assert conn is not None, "an unfinished answer without an error has a connection"
            await conn.wait_for_body(self)
        return self._take()

    async def read(self, limit_bytes: int | None = None) -> bytes:
        """The rest of the body, or its first ``limit_bytes`` bytes (at most) of it.

        Raises as :meth:`read_chunk` does.
        """
        if self._complete and (limit_bytes is None or self._size <= limit_bytes):
            return self._take() if self._chunks else b""
        return await read_body(self, limit_bytes)

    async def wait_for_body(self) -> None:
        """Return once some body bytes have arrived, or the end, or a failure; nothing is
        taken (:meth:`read_chunk` or :meth:`push_body` then has it). Raises nothing of the
        answer's: a failure is raised by the read that follows."""
        while not (self._chunks or self._complete or self._error is not None):
            conn = self._conn
            assert conn is not None, "an unfinished answer without an error has a connection"
            await conn.wait_for_body(self)

    def set_read_timeout(self, timeout_s: float | None) -> None:
        """The longest silence between two pieces of the body from now on (``None``: no
        limit), instead of the pool's read timeout."""
        conn = self._conn
        if conn is not None:
            conn.set_body_timeout(timeout_s)

    def push_body(self, sink: BodySink) -> None:
        """Hand the body to ``sink`` from now on (what arrived already, at once)."""
        conn = self._conn
        if conn is not None:  # unfinished, and not failed
            self._sink = sink
            conn.start_push(self)  # before the first piece, which may pause it again
        if self._chunks or self._complete:
            self._push(sink)
        if self._error is not None:  # after the bytes that came before it
            sink.body_failed(self._error)

    def pause_body(self) -> None:
        """Stop reading the engine's socket until :meth:`resume_body`."""
        conn = self._conn
        if conn is not None and not conn.reading_paused:
            conn.pause()

    def resume_body(self) -> None:
        conn = self._conn
        if conn is not None:
            conn.resume_push()

    def close(self) -> None:
        """Done with this answer. One not yet received in full closes its connection (the
        engine sees the client leave); a complete one's connection is already back in the
        pool. Idempotent."""
        self._sink = None
        conn = self._conn
        if conn is not None:
            self._conn = None
            why = "had its answer abandoned by the reader"
            self._error = UpstreamDisconnectError(conn.origin, why, answered=True)
            conn.abandon()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        conn = self._conn
        if conn is not None and conn.reading_paused:
            conn.resume()
        return data

    def _push(self, sink: BodySink) -> None:
        """Give ``sink`` what has arrived (with the end, once complete)."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        sink.body_received(data, self._complete)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
