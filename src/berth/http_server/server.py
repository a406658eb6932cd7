"""A listener of berth's HTTP/1.1 server on a socket berth has bound: start, then a graceful
close (:class:`HttpServer`)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

from berth.http_server.limits import ConnectionGate, DiscardBudget, ListenerLimits
from berth.http_server.protocol import Handler, HttpConnection, ListenerState

log = logging.getLogger(__name__)


class HttpServer:
    """Serves ``handler`` on one listening socket, within ``limits``.

    ``name`` labels log lines (``public``, ``socket``). ``ssl_context`` makes it HTTPS; the
    TLS handshake must finish within ``limits.head_timeout_s``.
    """

    def __init__(
        self,
        name: str,
        handler: Handler,
        limits: ListenerLimits | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        limits = limits or ListenerLimits()
        self._state = ListenerState(
            name, handler, limits, ConnectionGate(limits), DiscardBudget(limits.discard_bytes_per_s)
        )
        self._ssl = ssl_context
        self._server: asyncio.Server | None = None

    @property
    def connections(self) -> int:
        """Connections open now (admitted ones)."""
        return len(self._state.connections)

    @property
    def gate(self) -> ConnectionGate:
        return self._state.gate

    @property
    def discard(self) -> DiscardBudget:
        """The pace at which bodies answered unread are read and dropped."""
        return self._state.discard

    async def start(self, sock: socket.socket) -> None:
        """Start accepting on ``sock`` (bound and listening)."""
        loop = asyncio.get_running_loop()
        state = self._state
        self._server = await loop.create_server(
            lambda: HttpConnection(state, loop),
            sock=sock,
            ssl=self._ssl,
            ssl_handshake_timeout=state.limits.head_timeout_s if self._ssl else None,
        )

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop accepting; close idle connections now and busy ones after their answer, at
        most ``grace_s`` later, when whatever is left is cancelled and cut off."""
        state = self._state
        if not state.accepting:
            return  # closed already
        state.accepting = False
        server = self._server
        if server is not None:
            server.close()
        for connection in list(state.connections):
            connection.shutdown()
        if state.tasks:
            _, pending = await asyncio.wait(list(state.tasks), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                log.warning("%s listener: %d requests cut off at shutdown", state.name,
                            len(pending))  # fmt: skip
                await asyncio.wait(pending, timeout=1.0)
        for connection in list(state.connections):
            connection.abort()
        if server is not None:
            await server.wait_closed()
