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

The answer is an :class:`UpstreamResponse` (:mod:`berth.engine_http.response`), filled in
by the connection's protocol (:mod:`berth.engine_http.connection`, which also describes
the message framing); the errors are in :mod:`berth.engine_http.errors`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Sequence

from berth.engine_http.connection import StaleConnectionError, UpstreamConnection
from berth.engine_http.errors import UpstreamConnectError, UpstreamDisconnectError
from berth.engine_http.origin import Origin
from berth.engine_http.response import UpstreamResponse

# Flow control: past this many unread body bytes the connection stops reading from its
# socket until the reader has taken them all, so a slow reader slows the engine instead of
# filling memory. One socket read may still add up to the event loop's read size on top.
DEFAULT_HIGH_WATER_BYTES = 64 * 1024
# A body at most this long is written together with the head, in one system call.
_JOIN_BODY_BYTES = 64 * 1024


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to engines, at most ``max_connections`` open in all
    (busy or idle) and ``max_idle_per_host`` idle per origin; a request beyond the first limit
    waits for a connection to come free. ``idle_timeout_s`` (``None``: none) closes a
    connection left idle that long: set it below the server's keep-alive timeout, so that
    the pool, not the server, ends an idle connection and a request never meets one the
    server is closing.

    ``connect_timeout_s`` bounds making a connection; ``read_timeout_s`` (``None``: no limit)
    bounds every wait for the engine: for the head of an answer (its prefill, for an LLM) and
    for each piece of its body. ``high_water_bytes`` is how much unread body one answer may
    hold before its connection stops reading from the socket. ``ssl_context`` makes every
    connection HTTPS, the TLS handshake checked against ``server_hostname`` (``None``: each
    origin's host) and counted in the connect timeout: the leader's pools to agents'
    ingresses (``cluster/leader/direct_path.py``). Create it on the event loop it is used on;
    :meth:`close` closes every connection.
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = 600.0,
        max_connections: int = 1024,
        max_idle_per_host: int = 256,
        high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        if max_connections < 1 or max_idle_per_host < 0 or high_water_bytes < 1:
            raise ValueError("UpstreamPool limits must be positive")
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ValueError("UpstreamPool idle_timeout_s must be positive")
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.high_water_bytes = high_water_bytes
        self._max_connections = max_connections
        self._max_idle_per_host = max_idle_per_host
        self._idle: dict[Origin, list[UpstreamConnection]] = {}
        self._open: set[UpstreamConnection] = set()
        self._connecting = 0
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._host_headers: dict[Origin, bytes] = {}
        self._closed = False
        self._ssl = ssl_context
        self._server_hostname = server_hostname
        self._idle_timeout_s = idle_timeout_s
        self._sweep: asyncio.TimerHandle | None = None  # closes expired idle connections

    @property
    def open_connections(self) -> int:
        """Connections open now, busy or idle (and ones being made)."""
        return len(self._open) + self._connecting

    @property
    def idle_connections(self) -> int:
        """Connections open and waiting in the pool for a request."""
        return sum(len(idle) for idle in self._idle.values())

    @property
    def connecting(self) -> int:
        """Connections being made now (TCP, and TLS with ``ssl_context``)."""
        return self._connecting

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
            except StaleConnectionError:
                # The engine closed it while it was idle: ask again on a new connection.
                conn = await self._acquire(origin, fresh=True)
        # A new connection is never stale: closed before answering, it raises
        # UpstreamDisconnectError.
        return await conn.exchange(data, rest, self.read_timeout_s)

    def fail_unanswered(self, why: str) -> int:
        """Give up on every request still waiting for the head of its answer (it raises
        :class:`UpstreamDisconnectError` with ``answered=False``, so it may be sent
        elsewhere) and close idle connections; answers already streaming go on. Returns how
        many requests were given up. For a path found dead while requests wait on it."""
        given_up = 0
        for conn in list(self._open):
            if conn.awaiting_head:
                conn.give_up(why)
                given_up += 1
            elif not conn.busy:
                conn.close()
        return given_up

    def fail_all(self, why: str) -> int:
        """Give up on every exchange in flight, answered or not (its reader raises
        :class:`UpstreamDisconnectError` at once, without waiting for the connection to
        close), and close idle connections. Returns how many were given up. For a path found
        dead with answers still streaming over it."""
        given_up = 0
        for conn in list(self._open):
            if conn.busy:
                conn.give_up(why)
                given_up += 1
            else:
                conn.close()
        return given_up

    def close_idle(self) -> int:
        """Close every idle connection now (busy ones go on, and are pooled again when their
        answer ends); how many were closed. For a path whose certificates changed: the next
        request makes a connection with the new ones."""
        idle = [conn for conns in self._idle.values() for conn in conns]
        for conn in idle:
            conn.close()
        return len(idle)

    async def close(self) -> None:
        """Close every connection, busy or idle; the pool takes no more requests."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # -- for UpstreamConnection ---------------------------------------------------------------

    def release(self, conn: UpstreamConnection) -> None:
        """``conn`` finished an answer and may carry another."""
        idle = self._idle.get(conn.origin)
        if idle is None:
            idle = self._idle[conn.origin] = []
        if self._closed or len(idle) >= self._max_idle_per_host:
            conn.close()
            return
        idle.append(conn)
        if self._idle_timeout_s is not None:
            conn.idle_since = self.loop.time()
            if self._sweep is None:
                self._sweep = self.loop.call_later(self._idle_timeout_s, self._close_expired)
        if self._slot_waiters:
            self._wake_one()

    def forget(self, conn: UpstreamConnection) -> None:
        """``conn`` is closed or closing: never hand it out again."""
        if conn in self._open:
            self._open.discard(conn)
            idle = self._idle.get(conn.origin)
            if idle and conn in idle:
                idle.remove(conn)
            if self._slot_waiters:
                self._wake_one()

    # -- internals ----------------------------------------------------------------------------

    def _take_idle(self, origin: Origin) -> UpstreamConnection | None:
        idle = self._idle.get(origin)
        timeout_s = self._idle_timeout_s
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have timed out
            if conn.gone:
                continue
            if timeout_s is not None and self.loop.time() - conn.idle_since >= timeout_s:
                conn.close()  # due for the sweep, which has not run yet
                continue
            return conn
        return None

    def _close_expired(self) -> None:
        """The sweep: close the connections idle for ``idle_timeout_s``, and come back when
        the next one is due."""
        self._sweep = None
        timeout_s = self._idle_timeout_s
        assert timeout_s is not None
        now = self.loop.time()
        expired = [
            conn
            for conns in self._idle.values()
            for conn in conns
            if now - conn.idle_since >= timeout_s
        ]
        for conn in expired:
            conn.close()
        oldest = min((c.idle_since for conns in self._idle.values() for c in conns), default=None)
        if oldest is not None and not self._closed:
            self._sweep = self.loop.call_at(oldest + timeout_s, self._close_expired)

    async def _acquire(self, origin: Origin, *, fresh: bool) -> UpstreamConnection:
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

    async def _connect(self, origin: Origin) -> UpstreamConnection:
        self._connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await self.loop.create_connection(
                    lambda: UpstreamConnection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=self._ssl,
                    server_hostname=(self._server_hostname or origin.host) if self._ssl else None,
                )
        except TimeoutError:
            why = f"did not accept a connection within {self.connect_timeout_s} s"
            raise UpstreamConnectError(origin, why, timed_out=True) from None
        except OSError as exc:
            refused = isinstance(exc, ConnectionRefusedError)
            why = (
                "refused the connection"
                if refused
                else f"could not be connected to ({exc.strerror or exc})"
            )
            raise UpstreamConnectError(origin, why, engine_side=refused) from exc
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
