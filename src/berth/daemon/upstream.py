"""berth's HTTP/1.1 client to engines: keep-alive connections, answers streamed as they arrive.

The proxy sends every ``/v1`` request through one :class:`UpstreamPool`. It is built for that
path and nothing else: plain HTTP over TCP, a request whose body is already in memory, an
answer whose body is relayed chunk by chunk. An ``asyncio.Protocol`` per connection feeds the
bytes to ``httptools`` (llhttp, the parser uvicorn uses) and keeps what it parsed for the
task that reads the answer::

    UpstreamPool.request(origin, method, target, headers, body)
      -> an idle connection to origin, or a new one (at most max_connections in all)
      -> one write: request line, headers, Content-Length, body
      -> UpstreamResponse once the status line and headers are in
           .read_chunk() / .read() / .at_eof      the body, as the engine sends it
           .close()                               done with it; mid-answer, closes the socket

Message framing follows RFC 9112: the body of an answer ends where its ``Content-Length`` says
(section 6.3, rule 6), with the last chunk of a chunked transfer coding (section 7.1, decoded
by the parser), or, with neither, when the engine closes the connection (section 6.3, rule 8);
1xx interim answers are skipped (RFC 9110 section 15.2). A connection goes back to the pool
only when its answer ended cleanly and persistence was not declined (``Connection: close``, or
HTTP/1.0 without ``keep-alive``: RFC 9112 section 9.3); a close-delimited answer can never
leave it reusable. A connection whose answer was abandoned, failed or timed out is closed,
which is also how an engine learns that nobody waits for its answer any more.

Errors, all :class:`UpstreamError`::

    UpstreamError
    ├── UpstreamConnectError      the connection was refused, failed or not made in time
    ├── UpstreamTimeoutError      the engine sent nothing for read_timeout_s
    ├── UpstreamDisconnectError   the engine closed the connection before the answer ended
    └── UpstreamProtocolError     the engine's bytes are not an HTTP/1.1 answer
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools

from berth.errors import BerthError

# Flow control: past this many unread body bytes the connection stops reading from its
# socket until the reader has taken them all, so a slow reader slows the engine instead of
# filling memory. One socket read may still add up to the event loop's read size on top.
DEFAULT_HIGH_WATER_BYTES = 64 * 1024
# A body at most this long is written together with the head, in one system call.
_JOIN_BODY_BYTES = 64 * 1024


class UpstreamError(BerthError):
    """The engine could not be asked, or did not answer properly; ``origin`` names it."""

    def __init__(self, origin: Origin, why: str) -> None:
        self.origin = origin
        self.why = why
        super().__init__(f"http://{origin.host}:{origin.port} {why}")


class UpstreamConnectError(UpstreamError):
    """No connection: refused, unreachable, or not accepted within the connect timeout
    (``timed_out``). Nothing was sent."""

    def __init__(self, origin: Origin, why: str, *, timed_out: bool = False) -> None:
        self.timed_out = timed_out
        super().__init__(origin, why)


class UpstreamTimeoutError(UpstreamError):
    """The engine sent nothing for ``timeout_s``: before its headers, or between two pieces of
    its body. The connection has been closed."""

    def __init__(self, origin: Origin, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        super().__init__(origin, f"sent nothing for {timeout_s} s")


class UpstreamDisconnectError(UpstreamError):
    """The engine closed or reset the connection before its answer was complete;
    ``answered`` says whether some of the answer had arrived."""

    def __init__(self, origin: Origin, why: str, *, answered: bool) -> None:
        self.answered = answered
        super().__init__(origin, why)


class UpstreamProtocolError(UpstreamError):
    """The engine's bytes could not be parsed as an HTTP/1.1 answer (or came unasked)."""


class Origin(NamedTuple):
    """Where requests go: a host name or address and a TCP port (plain HTTP)."""

    host: str
    port: int


def parse_origin(base_url: str) -> Origin:
    """The :class:`Origin` of an ``http://host[:port][/...]`` URL (port 80 when absent).

    Raises :class:`ValueError` for another scheme or a URL without a host.
    """
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not a plain http:// URL with a host: {base_url!r}")
    return Origin(parts.hostname, parts.port or 80)


class UpstreamResponse:
    """One answer: ``status``, ``headers`` (names lower-cased, in order) and the body.

    The body is read with :meth:`read_chunk` (whatever has arrived, as one ``bytes``) or
    :meth:`read` (up to its end). ``content_length`` is the announced length, ``None`` for a
    chunked or close-delimited body. Call :meth:`close` when done, also after an error:
    an answer not received in full closes its connection.
    """

    __slots__ = (
        "_chunks",
        "_complete",
        "_conn",
        "_error",
        "_size",
        "_waiter",
        "content_length",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self._conn: _Connection | None = conn  # None once the answer is complete or closed
        self._chunks: list[bytes] = []
        self._size = 0
        self._complete = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

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
        parts: list[bytes] = []
        size = 0
        while limit_bytes is None or size < limit_bytes:
            chunk = await self.read_chunk()
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        data = b"".join(parts)
        return data if limit_bytes is None else data[:limit_bytes]

    def close(self) -> None:
        """Done with this answer. One not yet received in full closes its connection (the
        engine sees the client leave); a complete one's connection is already back in the
        pool. Idempotent."""
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

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _StaleConnectionError(UpstreamError):
    """A reused connection was closed before any byte of the answer: the engine had ended it
    while it was idle. Nothing was answered, so the request may be sent again."""


class _Connection(asyncio.Protocol):
    """One TCP connection to an engine and its parser: the protocol side of the client."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self._loop = pool.loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self.gone = False  # closed, or closing: never used again
        self.reused = False  # has carried a complete answer before
        self.reading_paused = False
        # The exchange in flight, if any.
        self._busy = False
        self._head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None  # None once complete or abandoned
        self._headers_done = False
        self._received = False  # some byte of the answer has arrived
        self._keep_alive = False
        self._close_delimited = False
        self._interim = False  # parsing a 1xx answer
        self._finished = False  # the answer ended during the current feed_data
        self._unexpected = False  # bytes nobody asked for

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Requests are written in one piece; never let Nagle hold back the next one.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            # An idle connection has nothing to say; whatever it is, it is not to be trusted.
            self._discard()
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(self.origin, f"sent a malformed answer ({exc})"))
            return
        if self._unexpected:
            self._fail(UpstreamProtocolError(self.origin, "sent bytes after its answer"))
        elif self._finished:
            self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self._pool.forget(self)
        if not self._busy:
            return
        if self._headers_done and self._close_delimited and exc is None:
            self._complete()  # RFC 9112 section 6.3, rule 8: the close ends the body
            self._busy = False
            return
        error: UpstreamError
        if not self._received and self.reused:
            error = _StaleConnectionError(self.origin, "closed an idle connection")
        elif not self._headers_done:
            why = "closed the connection before answering"
            error = UpstreamDisconnectError(self.origin, why, answered=self._received)
        else:
            why = "closed the connection before the answer ended"
            error = UpstreamDisconnectError(self.origin, why, answered=True)
        self._fail(error)

    # -- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        if response is not None:
            response.headers.append((name.lower(), value))
        else:
            self._unexpected = True

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None:
            self._unexpected = True
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim answer (e.g. 103 Early Hints): the final one follows.
            self._interim = True
            response.headers.clear()
            return
        response.status = status
        # Read now: llhttp resets its flags once the message is complete.
        self._keep_alive = self._parser.should_keep_alive()
        length: bytes | None = None
        chunked = False
        for key, value in response.headers:
            if key == b"content-length":
                length = value
            elif key == b"transfer-encoding":
                chunked = True
        if length is not None and not chunked:
            response.content_length = int(length)  # llhttp has checked that it is a number
        bodyless = status == 204 or status == 304
        self._close_delimited = not chunked and length is None and not bodyless
        self._headers_done = True
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def on_body(self, body: bytes) -> None:
        response = self._response
        if response is None:
            self._unexpected = True
            return
        response._chunks.append(body)
        response._size += len(body)
        if response._size > self._pool.high_water_bytes and not self.reading_paused:
            self.pause()
        response._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self._response is None or not self._headers_done:
            self._unexpected = True
            return
        self._complete()
        self._finished = True

    # -- the exchange -------------------------------------------------------------------------

    async def exchange(
        self, data: bytes, body: bytes, read_timeout_s: float | None
    ) -> UpstreamResponse:
        """Send one request (``data``: its head, with the body unless ``body`` holds it) and
        wait for the head of its answer."""
        transport = self._transport
        assert transport is not None and not self._busy
        self._busy = True
        self._received = False
        self._headers_done = False
        self._close_delimited = False
        self._finished = False
        self._response = UpstreamResponse(self)
        waiter: asyncio.Future[UpstreamResponse] = self._loop.create_future()
        self._head_waiter = waiter
        transport.write(data)
        if body:
            transport.write(body)
        timer = (
            self._loop.call_later(read_timeout_s, self._head_timed_out, waiter, read_timeout_s)
            if read_timeout_s is not None
            else None
        )
        try:
            return await waiter
        except asyncio.CancelledError:
            # The client left. The connection may already carry another exchange: an answer
            # that arrived whole as this task was cancelled has put it back in the pool.
            if waiter.cancelled():
                # No head yet: the request is out, so the connection cannot be used again.
                self._response = None
                self._discard()
            elif waiter.exception() is None:
                waiter.result().close()
            raise
        finally:
            if self._head_waiter is waiter:
                self._head_waiter = None
            if timer is not None:
                timer.cancel()

    async def wait_for_body(self, response: UpstreamResponse) -> None:
        """Wait until ``response`` has new body bytes, has ended or has failed."""
        if self.reading_paused:
            self.resume()
        waiter = response._waiter = self._loop.create_future()
        timeout_s = self._pool.read_timeout_s
        timer = (
            self._loop.call_later(timeout_s, self._body_timed_out, response, timeout_s)
            if timeout_s is not None
            else None
        )
        try:
            await waiter
        finally:
            response._waiter = None
            if timer is not None:
                timer.cancel()

    def abandon(self) -> None:
        """The reader gave up on the answer in flight: close the connection."""
        self._response = None
        self._discard()

    def pause(self) -> None:
        self.reading_paused = True
        if self._transport is not None and not self.gone:
            self._transport.pause_reading()

    def resume(self) -> None:
        self.reading_paused = False
        if self._transport is not None and not self.gone:
            self._transport.resume_reading()

    def close(self) -> None:
        """Close the connection (idle or not)."""
        self._discard()

    # -- internals ----------------------------------------------------------------------------

    def _complete(self) -> None:
        """The answer in flight has all arrived: it no longer needs this connection."""
        response = self._response
        if response is not None:
            self._response = None
            response._complete = True
            response._conn = None
            response._wake()

    def _finish(self) -> None:
        """After the answer ended cleanly: pool the connection, or close it."""
        self._busy = False
        self._finished = False
        if self.reading_paused:
            self.resume()
        if self._keep_alive and not self._close_delimited and not self.gone:
            self.reused = True
            self._pool.release(self)
        else:
            self._discard()

    def _fail(self, error: UpstreamError) -> None:
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        response = self._response
        if response is not None:
            self._response = None
            response._error = error
            response._conn = None
            response._wake()
        self._busy = False
        self._discard()

    def _head_timed_out(self, waiter: asyncio.Future[UpstreamResponse], timeout_s: float) -> None:
        if self._head_waiter is waiter and not waiter.done():
            self._fail(UpstreamTimeoutError(self.origin, timeout_s))

    def _body_timed_out(self, response: UpstreamResponse, timeout_s: float) -> None:
        if self._response is response:
            self._fail(UpstreamTimeoutError(self.origin, timeout_s))

    def _discard(self) -> None:
        if not self.gone:
            self.gone = True
            if self._transport is not None:
                self._transport.close()
            self._pool.forget(self)


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to engines, at most ``max_connections`` open in all
    (busy or idle) and ``max_idle_per_host`` idle per origin; a request beyond the first limit
    waits for a connection to come free.

    ``connect_timeout_s`` bounds making a connection; ``read_timeout_s`` (``None``: no limit)
    bounds every wait for the engine: for the head of an answer (its prefill, for an LLM) and
    for each piece of its body. ``high_water_bytes`` is how much unread body one answer may
    hold before its connection stops reading from the socket. Create it on the event loop it
    is used on; :meth:`close` closes every connection.
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = 600.0,
        max_connections: int = 1024,
        max_idle_per_host: int = 256,
        high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES,
    ) -> None:
        if max_connections < 1 or max_idle_per_host < 0 or high_water_bytes < 1:
            raise ValueError("UpstreamPool limits must be positive")
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.high_water_bytes = high_water_bytes
        self._max_connections = max_connections
        self._max_idle_per_host = max_idle_per_host
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._connecting = 0
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._host_headers: dict[Origin, bytes] = {}
        self._closed = False

    @property
    def open_connections(self) -> int:
        """Connections open now, busy or idle (and ones being made)."""
        return len(self._open) + self._connecting

    @property
    def idle_connections(self) -> int:
        """Connections open and waiting in the pool for a request."""
        return sum(len(idle) for idle in self._idle.values())

    async def request(
        self,
        origin: Origin,
        method: bytes,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes = b"",
    ) -> UpstreamResponse:
        """Send a request and return its answer once the status line and headers are in.

        ``target`` is the origin-form request target, path and query (RFC 9112 section 3.2.1),
        e.g. ``b"/v1/chat/completions"``. ``headers`` are sent as given, after ``Host`` (which
        the pool writes, RFC 9112 section 3.2) and before ``Content-Length``, which the pool
        writes for ``body`` (section 6.2); neither may be in ``headers``. Not for ``HEAD`` or
        ``CONNECT``, whose answers are framed differently (section 6.3, rules 1-2).

        A reused connection that the engine had closed while idle, found out because it
        closes before any byte of the answer, is replaced by a new one and the request sent
        once more: nothing was answered, so nothing is done twice.

        Raises :class:`ValueError` when a header contains CR or LF (it would split the
        message), :class:`UpstreamConnectError` when no connection could be made,
        :class:`UpstreamTimeoutError` when the head of the answer did not arrive within
        ``read_timeout_s``, :class:`UpstreamDisconnectError` when the engine closed the
        connection before answering and :class:`UpstreamProtocolError` for an answer that
        is not HTTP/1.1. The caller must :meth:`UpstreamResponse.close` the answer.
        """
        if self._closed:
            raise RuntimeError("UpstreamPool is closed")
        data, rest = self._request_bytes(origin, method, target, headers, body)
        conn = await self._acquire(origin, fresh=False)
        if conn.reused:
            try:
                return await conn.exchange(data, rest, self.read_timeout_s)
            except _StaleConnectionError:
                # The engine closed it while it was idle: ask again on a new connection.
                conn = await self._acquire(origin, fresh=True)
        # A new connection is never stale: closed before answering, it raises
        # UpstreamDisconnectError.
        return await conn.exchange(data, rest, self.read_timeout_s)

    async def close(self) -> None:
        """Close every connection, busy or idle; the pool takes no more requests."""
        self._closed = True
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # -- for _Connection ----------------------------------------------------------------------

    def release(self, conn: _Connection) -> None:
        """``conn`` finished an answer and may carry another."""
        idle = self._idle.get(conn.origin)
        if idle is None:
            idle = self._idle[conn.origin] = []
        if self._closed or len(idle) >= self._max_idle_per_host:
            conn.close()
            return
        idle.append(conn)
        if self._slot_waiters:
            self._wake_one()

    def forget(self, conn: _Connection) -> None:
        """``conn`` is closed or closing: never hand it out again."""
        if conn in self._open:
            self._open.discard(conn)
            idle = self._idle.get(conn.origin)
            if idle and conn in idle:
                idle.remove(conn)
            if self._slot_waiters:
                self._wake_one()

    # -- internals ----------------------------------------------------------------------------

    def _take_idle(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have timed out
            if not conn.gone:
                return conn
        return None

    async def _acquire(self, origin: Origin, *, fresh: bool) -> _Connection:
        """An idle connection to ``origin`` (unless ``fresh``) or a new one, once there is
        room for it under ``max_connections``."""
        while True:
            if not fresh:
                conn = self._take_idle(origin)
                if conn is not None:
                    return conn
            if (
                len(self._open) + self._connecting < self._max_connections
                or self._close_an_idle_connection()
            ):
                return await self._connect(origin)
            waiter: asyncio.Future[None] = self.loop.create_future()
            self._slot_waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # pass on the wake-up this task will not use
                raise
            if self._closed:
                raise RuntimeError("UpstreamPool is closed")

    async def _connect(self, origin: Origin) -> _Connection:
        self._connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await self.loop.create_connection(
                    lambda: _Connection(self, origin), origin.host, origin.port
                )
        except TimeoutError:
            why = f"did not accept a connection within {self.connect_timeout_s} s"
            raise UpstreamConnectError(origin, why, timed_out=True) from None
        except OSError as exc:
            why = (
                "refused the connection"
                if isinstance(exc, ConnectionRefusedError)
                else f"could not be connected to ({exc.strerror or exc})"
            )
            raise UpstreamConnectError(origin, why) from exc
        finally:
            self._connecting -= 1
            if self._slot_waiters:
                self._wake_one()  # if it failed, its room is free again
        conn = protocol
        if conn.gone:  # closed between connecting and now
            why = "closed the connection before answering"
            raise UpstreamDisconnectError(origin, why, answered=False)
        self._open.add(conn)
        if self._closed:
            conn.close()
            raise RuntimeError("UpstreamPool is closed")
        return conn

    def _request_bytes(
        self,
        origin: Origin,
        method: bytes,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
    ) -> tuple[bytes, bytes]:
        """The request's head (with the body when small) and what remains to write after it."""
        host = self._host_headers.get(origin)
        if host is None:
            name = f"[{origin.host}]" if ":" in origin.host else origin.host  # IPv6 literal
            host = self._host_headers[origin] = b"%s:%d" % (
                name.encode("ascii" if name.isascii() else "idna"),
                origin.port,
            )
        parts = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
        for name_bytes, value in headers:
            if b"\r" in value or b"\n" in value or b"\r" in name_bytes or b"\n" in name_bytes:
                raise ValueError(f"header {name_bytes!r} contains CR or LF")
            parts += (name_bytes, b": ", value, b"\r\n")
        parts.append(b"content-length: %d\r\n\r\n" % len(body))
        if len(body) <= _JOIN_BODY_BYTES:
            parts.append(body)
            return b"".join(parts), b""
        return b"".join(parts), body

    def _close_an_idle_connection(self) -> bool:
        for idle in self._idle.values():
            if idle:
                idle[0].close()  # the least recently used of some origin
                return True
        return False

    def _wake_one(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
