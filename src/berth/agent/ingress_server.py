"""The HTTP server under the agent's direct ingress (:mod:`berth.agent.ingress`): the seam.

The ingress is written against two small interfaces, :class:`IngressRequest` and
:class:`IngressReply`, the shape of the request and response writer of berth's own bounded
HTTP/1.1 server for the public listener (``berth.http_server``: head size and count limits,
head, idle and body timeouts, connection caps), which the ingress is meant to run on. Until
that server is in this tree, :class:`IngressServer` serves the ingress on aiohttp's low-level
server, which bounds request lines and header fields (8 KiB each) and closes idle
connections after 75 s, but has no head or body timeout and no connection cap. Only the
leader can complete the TLS handshake (the ingress's context requires its certificate), so
only the leader reaches this code.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from aiohttp import web

log = logging.getLogger(__name__)


class IngressRequest(Protocol):
    """One request: ``method`` (``"POST"``), ``raw_path`` (as sent, without the query),
    ``query`` (the bytes after ``?``), ``headers`` (lower-case names, in order)."""

    method: str
    raw_path: bytes
    query: bytes
    headers: list[tuple[bytes, bytes]]

    async def read_body(self, limit_bytes: int) -> bytes | None:
        """The whole body, or ``None`` as soon as it grows past ``limit_bytes``."""
        ...

    def watch_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` once if the client goes away before the answer ends."""
        ...


class IngressReply(Protocol):
    """The answer to one request: :meth:`start` once, :meth:`write` any number of times,
    :meth:`end` once; without a ``content-length`` header the body is sent chunked."""

    async def start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self, data: bytes = b"") -> None: ...

    def abort(self) -> None:
        """Cut the connection off mid-answer, so the client sees the answer broke off."""
        ...


#: Serves one request: reads the body if it wants it, answers through the reply.
IngressHandler = Callable[[IngressRequest, IngressReply], Coroutine[Any, Any, None]]


class IngressServer:
    """Serves ``handler`` over TLS (``ssl_context``) on a socket berth has bound."""

    def __init__(self, handler: IngressHandler, ssl_context: ssl.SSLContext) -> None:
        self._handler = handler
        self._ssl = ssl_context
        self._server: asyncio.Server | None = None
        self._web = web.Server(self._handle, handler_cancellation=True, access_log=None)

    async def start(self, sock: socket.socket) -> None:
        """Start accepting on ``sock`` (bound and listening); closing the server closes it."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._web, sock=sock, ssl=self._ssl, ssl_handshake_timeout=10.0
        )

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop accepting, then close the open connections (requests still answering are
        cut off after ``grace_s``)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        await self._web.shutdown(grace_s)
        await server.wait_closed()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        reply = _Reply(request)
        await self._handler(_Request(request), reply)
        if reply.response is None:
            raise RuntimeError("the ingress handler returned without answering")
        # An aborted answer's transport is closed: aiohttp's final write_eof then fails
        # with a ConnectionError, which it takes quietly as a client gone.
        return reply.response


class _Request:
    def __init__(self, request: web.BaseRequest) -> None:
        self._request = request
        self.method = request.method
        raw = request.raw_path.encode("latin-1")
        self.raw_path, _, self.query = raw.partition(b"?")
        self.headers = [(name.lower(), value) for name, value in request.raw_headers]

    async def read_body(self, limit_bytes: int) -> bytes | None:
        parts: list[bytes] = []
        size = 0
        while chunk := await self._request.content.readany():
            size += len(chunk)
            if size > limit_bytes:
                return None
            parts.append(chunk)
        return b"".join(parts)

    def watch_disconnect(self, callback: Callable[[], None] | None) -> None:
        pass  # aiohttp cancels the handler when the client goes away (handler_cancellation)


class _Reply:
    def __init__(self, request: web.BaseRequest) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    async def start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        response = web.StreamResponse(status=status)
        length: int | None = None
        for name, value in headers:
            if name == b"content-length":
                length = int(value)
            else:
                response.headers.add(name.decode("latin-1"), value.decode("latin-1"))
        if length is not None:
            response.content_length = length
        else:
            response.enable_chunked_encoding()
        self.response = response
        await response.prepare(self._request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None, "write before start"
        if data:
            await self.response.write(data)

    async def end(self, data: bytes = b"") -> None:
        assert self.response is not None, "end before start"
        await self.response.write_eof(data)

    def abort(self) -> None:
        if self._request.transport is not None:
            self._request.transport.abort()
