"""The answer to one request, written straight to the transport (:class:`ResponseWriter`).

The head is built once; each body piece becomes one ``transport.write`` (a chunk of the
chunked transfer coding, RFC 9112 section 7.1, unless the head gave a ``Content-Length``), so
an SSE event reaches the socket as soon as it is written. A head is held back until the end
of the current pass of the event loop, so that a head and a body written together leave in
one write (one TLS record, one system call).

Flow control: when the transport's buffer passes its high-water mark it calls the
connection's ``pause_writing``; the next :meth:`ResponseWriter.write` then waits until the
buffer has drained below the low-water mark (``resume_writing``), so a slow client slows its
writer instead of filling memory. A writer that is no task (the proxy's relay pushed from an
engine connection's callback) uses :meth:`ResponseWriter.write_now` and
:meth:`~ResponseWriter.end_now`, watches :attr:`~ResponseWriter.write_paused` and has a task
:meth:`~ResponseWriter.drain`.
"""

from __future__ import annotations

import asyncio
import http
from collections.abc import Sequence
from typing import Protocol

from berth.http_server.request import Request
from berth.openai_errors import error_from_exception


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("ascii")


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}
_LAST_CHUNK = b"0\r\n\r\n"


def error_answer(error: BaseException) -> bytes:
    """The whole answer (head and OpenAI-shaped JSON body) for ``error``, with
    ``connection: close``: what a connection sends when it ends on an error."""
    reply = error_from_exception(error)
    head = [
        _STATUS_LINES.get(reply.status) or _status_line(reply.status),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(reply.body),
        b"connection: close\r\n",
    ]
    head += [b"%s: %s\r\n" % (k.lower().encode(), v.encode()) for k, v in reply.headers.items()]
    return b"".join(head) + b"\r\n" + reply.body


class WriterOwner(Protocol):
    """What a writer needs of its connection
    (:class:`berth.http_server.protocol.HttpConnection`)."""

    transport: asyncio.Transport
    write_paused: bool
    lost: bool
    loop: asyncio.AbstractEventLoop

    @property
    def keeps_alive(self) -> bool: ...

    async def drain(self) -> None: ...

    def response_done(self, writer: ResponseWriter, keep_alive: bool) -> None: ...


class ResponseWriter:
    """Writes the answer to ``request``: :meth:`start` once, then :meth:`write` any number of
    times, then :meth:`end` once.

    Without a ``content-length`` header the body is sent chunked (HTTP/1.1) or ended by
    closing the connection (HTTP/1.0). ``HEAD`` answers, 1xx, 204 and 304 carry no body
    (what is written is dropped). After the client has gone, writes are dropped silently
    (``disconnected`` says so); the handler learns of it from ``Request.watch_disconnect``.
    """

    __slots__ = (
        "_bodyless",
        "_chunked",
        "_conn",
        "_flush_handle",
        "_head",
        "_keep_alive",
        "_remaining",
        "complete",
        "extra_headers",
        "request",
        "started",
        "status",
    )

    #: ``write`` waits only while the client is slow (the transport buffers the rest).
    buffers_writes = True

    def __init__(self, conn: WriterOwner, request: Request) -> None:
        self._conn = conn
        self.request = request
        self._head: bytes | None = None
        self._flush_handle: asyncio.Handle | None = None
        self._chunked = False
        self._bodyless = False
        self._keep_alive = False
        self._remaining: int | None = None
        #: Sent with the head, whatever the handler's headers are (e.g. CORS headers).
        self.extra_headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.started = False
        self.complete = False

    @property
    def disconnected(self) -> bool:
        """True once the connection is gone."""
        return self._conn.lost

    async def start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        """Begin the answer: ``status`` and ``headers`` (lower-case names; the caller
        vouches that names and values hold no CR or LF). ``transfer-encoding``
        is the server's to set, ``connection: close`` ends the connection after the answer,
        and a ``content-length`` fixes the body's length. Raises ``RuntimeError`` when
        called twice."""
        if self.started:
            raise RuntimeError("the answer has already begun")
        self.started = True
        self.status = status
        request = self.request
        request.no_continue()
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
        length: int | None = None
        keep_alive = request.keep_alive and self._conn.keeps_alive
        for name, value in headers:
            if name == b"content-length":
                length = int(value)
            elif name == b"connection":
                keep_alive = keep_alive and b"close" not in value.lower()
                continue
            parts += (name, b": ", value, b"\r\n")
        for name, value in self.extra_headers:
            parts += (name, b": ", value, b"\r\n")
        self._bodyless = request.method == "HEAD" or status < 200 or status in (204, 304)
        if length is not None:
            self._remaining = 0 if self._bodyless else length
        elif not self._bodyless:
            if request.http_version == "1.1":
                self._chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                keep_alive = False  # HTTP/1.0: the close ends the body (RFC 9112 section 6.3)
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self._keep_alive = keep_alive
        self._head = b"".join(parts)
        self._flush_handle = self._conn.loop.call_soon(self._flush_head)

    async def write(self, data: bytes) -> None:
        """Send ``data`` as the next piece of the body; waits while the client is slow."""
        self.write_now(data)
        if self._conn.write_paused:
            await self._conn.drain()

    async def end(self, data: bytes = b"") -> None:
        """Send the last piece of the body (may be empty) and finish the answer."""
        self.end_now(data)

    @property
    def write_paused(self) -> bool:
        """The client is slow: its transport's buffer is above the high-water mark (until
        :meth:`drain` returns)."""
        return self._conn.write_paused

    async def drain(self) -> None:
        """Wait until the client has taken enough of what was written (or is gone)."""
        await self._conn.drain()

    def write_now(self, data: bytes) -> None:
        """:meth:`write` without waiting: for a caller that watches :attr:`write_paused`
        itself (a relay pushed from the engine connection's callback). Never raises for a
        client that left (dropped, as :meth:`write`)."""
        conn = self._conn
        if self.complete or conn.lost:
            return
        out = self._frame(data)
        head = self._head
        if head is not None:
            self._head = None
            out = head + out
        if out:
            conn.transport.write(out)

    def end_now(self, data: bytes = b"") -> None:
        """:meth:`end`, which never waits, as a plain call."""
        if self.complete:
            return
        self.complete = True
        conn = self._conn
        if conn.lost:
            return
        out = self._frame(data)
        if self._chunked:
            out += _LAST_CHUNK
        head = self._head
        if head is not None:
            self._head = None
            out = head + out
        if out:
            conn.transport.write(out)
        keep_alive = self._keep_alive
        if self._remaining:  # shorter than its Content-Length: the client must not wait
            keep_alive = False
        conn.response_done(self, keep_alive)

    def _frame(self, data: bytes) -> bytes:
        if not data or self._bodyless:
            return b""
        if self._chunked:
            return b"%x\r\n%b\r\n" % (len(data), data)
        remaining = self._remaining
        if remaining is not None:
            if len(data) > remaining:
                raise RuntimeError("the body is longer than its Content-Length")
            self._remaining = remaining - len(data)
        return data

    def _flush_head(self) -> None:
        head = self._head
        if head is not None and not self._conn.lost:
            self._head = None
            self._conn.transport.write(head)
