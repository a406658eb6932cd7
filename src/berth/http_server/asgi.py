"""Serving an ASGI app (the admin API's FastAPI app) on berth's HTTP server: an HTTP-only
adapter from the server's handler shape to ASGI 3 (:class:`AsgiHandler`).

The scope is ASGI's ``http`` scope (spec version 2.3); ``receive`` gives the body as
``http.request`` messages and, once the body is read and the answer complete or the client
gone, ``http.disconnect`` (as uvicorn does, which is what Starlette's streaming answers
watch for); ``send`` takes ``http.response.start`` and ``http.response.body``. There is no
lifespan and no WebSocket here: the listeners that use this serve neither.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from berth.http_server.errors import HttpServerError
from berth.http_server.request import Request
from berth.http_server.writer import ResponseWriter

Message = MutableMapping[str, Any]
AsgiApp = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[Message]],
        Callable[[Message], Awaitable[None]],
    ],
    Awaitable[None],
]

# Header names are RFC 9110 tokens; values carry no control characters but tab.
_BAD_NAME = re.compile(rb'[\x00-\x20\x7f()<>@,;:\\"/\[\]?={}]')
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_SERVER_HEADERS = frozenset({b"transfer-encoding"})


class AsgiHandler:
    """Runs ``app`` (an ASGI 3 app) for each request of berth's HTTP server."""

    def __init__(self, app: AsgiApp) -> None:
        self._app = app

    async def __call__(
        self, request: Request, writer: ResponseWriter, *, state: dict[str, Any] | None = None
    ) -> None:
        """Run the app for ``request``; ``state`` starts the scope's ``state`` (what the
        app reads as ``request.state``: the caller the listener authenticated)."""
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version,
            "method": request.method,
            "scheme": request.scheme,
            "path": request.path,
            "raw_path": request.raw_path,
            "query_string": request.query,
            "root_path": "",
            "headers": request.headers,
            "client": request.client,
            "server": request.server,
            "state": dict(state) if state is not None else {},
        }
        exchange = _Exchange(request, writer)
        await self._app(scope, exchange.receive, exchange.send)


class _Exchange:
    """One request's ``receive`` and ``send``."""

    def __init__(self, request: Request, writer: ResponseWriter) -> None:
        self._request = request
        self._writer = writer
        self._body_done = False
        self._gone = asyncio.Event()
        request.watch_disconnect(self._gone.set)

    async def receive(self) -> Message:
        if not self._body_done and not self._gone.is_set():
            try:
                chunk = await self._request.read_chunk()
            except HttpServerError:
                self._gone.set()
                return {"type": "http.disconnect"}
            if chunk:
                return {"type": "http.request", "body": chunk, "more_body": True}
            self._body_done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        # The body is read: the next event is the end of the exchange.
        if not self._writer.complete:
            await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        writer = self._writer
        if kind == "http.response.start":
            headers = []
            for name, value in message.get("headers", ()):
                name = bytes(name).lower()
                value = bytes(value)
                if _BAD_NAME.search(name) or _BAD_VALUE.search(value):
                    raise RuntimeError(f"invalid header in the answer: {name!r}")
                if name not in _SERVER_HEADERS:
                    headers.append((name, value))
            await writer.start(int(message["status"]), headers)
        elif kind == "http.response.body":
            if not writer.started:
                raise RuntimeError("http.response.body before http.response.start")
            body = bytes(message.get("body", b""))
            if message.get("more_body", False):
                await writer.write(body)
            else:
                await writer.end(body)
                self._gone.set()  # the exchange is over: receive() ends with disconnect
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
