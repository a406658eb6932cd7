"""One request as the server hands it to its handler: the head, parsed, and its body as it
arrives (:class:`Request`).

The connection (:class:`berth.http_server.protocol.HttpConnection`) fills the body in from the
parser's callbacks; the handler reads it with :meth:`Request.read_chunk`. Reading from the
socket pauses while more than :data:`BODY_HIGH_WATER_BYTES` of the body wait unread, so a
large upload is held at most that far ahead of its reader.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Protocol

from berth.http_server.errors import ClientDisconnectedError, HttpServerError

#: Unread body bytes at which the connection stops reading its socket (and resumes below).
BODY_HIGH_WATER_BYTES = 64 * 1024

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class BodyOwner(Protocol):
    """What a request needs of its connection: to pause and resume reading the socket, to
    send ``100 Continue`` (RFC 9110 section 10.1.1) before the answer has begun, and its
    transport (for :meth:`Request.transport_info`)."""

    transport: asyncio.Transport

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def send_interim(self, request: Request, data: bytes) -> None: ...


class Request:
    """One parsed request head and its body.

    ``method`` (``"GET"``), ``path`` (percent-decoded, as ASGI's ``path``), ``raw_path``
    (as sent, without the query), ``query`` (bytes after ``?``), ``headers`` (names
    lower-cased, in order), ``http_version`` (``"1.1"``), ``keep_alive`` (the client allows
    another request on the connection), ``client`` and ``server`` (``(host, port)``, or
    ``None`` on a Unix socket), ``scheme`` (``"http"`` or ``"https"``).

    :meth:`watch_disconnect` asks to be told if the client goes away before the answer
    ends.
    """

    __slots__ = (
        "_chunks",
        "_complete",
        "_error",
        "_expect_continue",
        "_gone",
        "_on_disconnect",
        "_owner",
        "_size",
        "_waiter",
        "client",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "path",
        "query",
        "raw_path",
        "scheme",
        "server",
    )

    def __init__(
        self,
        owner: BodyOwner,
        *,
        method: str,
        path: str,
        raw_path: bytes,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        http_version: str,
        keep_alive: bool,
        client: tuple[str, int] | None,
        server: tuple[str, int] | None,
        scheme: str,
        expect_continue: bool,
    ) -> None:
        self._owner = owner
        self.method = method
        self.path = path
        self.raw_path = raw_path
        self.query = query
        self.headers = headers
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.client = client
        self.server = server
        self.scheme = scheme
        self._on_disconnect: Callable[[], None] | None = None
        self._gone = False
        self._expect_continue = expect_continue
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._complete = False
        self._error: HttpServerError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def header(self, name: bytes) -> bytes | None:
        """The value of the first header called ``name`` (lower-case bytes), or ``None``."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def transport_info(self, name: str) -> object:
        """The connection's ``transport.get_extra_info(name)``: ``"ssl_object"`` (its
        ``getpeercert(binary_form=True)`` is a verified client certificate, when the server's
        TLS context asks for one), ``"peername"``, ``"socket"``..."""
        return self._owner.transport.get_extra_info(name)

    def watch_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (once) if the client goes away before the answer has ended, at
        once if it already has; ``None`` stops watching."""
        self._on_disconnect = callback
        if callback is not None and self._gone:
            self._on_disconnect = None
            callback()

    @property
    def body_complete(self) -> bool:
        """True once the whole body has arrived (it may not all have been read)."""
        return self._complete

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some if none did;
        ``b""`` once the body has ended and been read.

        Raises :class:`ClientDisconnectedError` when the client went away (or the body timed
        out, which the connection has answered itself) before the body ended.
        """
        if self._expect_continue:
            self._expect_continue = False
            self._owner.send_interim(self, _CONTINUE)
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._size > BODY_HIGH_WATER_BYTES:
            self._owner.resume_reading()
        self._size = 0
        return data

    async def read_body(self, limit_bytes: int) -> bytes | None:
        """The whole body, or ``None`` as soon as it grows past ``limit_bytes`` (the rest is
        not read). Raises as :meth:`read_chunk` does."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.read_chunk():
            size += len(chunk)
            if size > limit_bytes:
                return None
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # -- called by the connection -------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > BODY_HIGH_WATER_BYTES:
            self._owner.pause_reading()
        self._wake()

    def end(self) -> None:
        self._complete = True
        self._wake()

    def fail(self, error: HttpServerError) -> None:
        """The body will not arrive: readers get ``error``."""
        if self._error is None:
            self._error = error
            self._wake()

    def disconnected(self) -> None:
        """The client went away before the answer ended."""
        self.fail(ClientDisconnectedError("the client closed the connection"))
        self._gone = True
        callback, self._on_disconnect = self._on_disconnect, None
        if callback is not None:
            callback()

    def no_continue(self) -> None:
        """The answer began before the body was asked for: no ``100 Continue`` any more."""
        self._expect_continue = False

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
