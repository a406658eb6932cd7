"""The proxy served as an ASGI app: ``receive`` and ``send`` seen as the proxy's
:class:`~berth.gateway.exchange.ClientRequest` and
:class:`~berth.gateway.exchange.ClientWriter` (:mod:`berth.gateway.proxy`).

The leader serves ``/v1`` on berth's own HTTP server, without these; they are for serving
:class:`~berth.gateway.proxy.OpenAIProxy` under any ASGI server (the benchmarks serve it with
uvicorn, and the tests check that both ways answer alike).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from berth.gateway.exchange import Receive, Scope, Send
from berth.http_server.errors import ClientDisconnectedError


class AsgiClientRequest:
    """An ASGI request: its scope's method, path, query and headers; ``receive``'s body.

    :meth:`watch_disconnect` watches for ``http.disconnect`` in a task of its own.
    """

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: bytes = scope.get("query_string", b"")
        self.headers: list[tuple[bytes, bytes]] = scope["headers"]
        self._receive = receive
        self._callback: Callable[[], None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._body_done = False
        self.answered = False

    def watch_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Start (or, with ``None``, stop) a task that waits for ``http.disconnect`` (an ASGI
        server sends it when the client leaves, or once the answer is complete)."""
        self._callback = callback
        if callback is None:
            if self._watcher is not None and not self.answered:
                # After a complete answer the watcher ends by itself: the server answers
                # its receive() with "http.disconnect".
                self._watcher.cancel()
            return
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                callback = self._callback
                if callback is not None and not self.answered:
                    callback()
                return

    async def read_chunk(self) -> bytes:
        while not self._body_done:
            message = await self._receive()
            if message["type"] != "http.request":
                raise ClientDisconnectedError("the client closed the connection")
            body: bytes = message.get("body", b"")
            self._body_done = not message.get("more_body", False)
            if body:
                return body
        return b""


class AsgiClientWriter:
    """An ASGI ``send`` as a :class:`~berth.gateway.exchange.ClientWriter`."""

    buffers_writes = False

    def __init__(self, send: Send, request: AsgiClientRequest) -> None:
        self._send = send
        self._request = request

    async def start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        self._request.answered = True
        await self._send({"type": "http.response.body", "body": data})
