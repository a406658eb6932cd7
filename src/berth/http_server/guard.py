"""Connection bounds around another server's protocol: for the cluster listener, which is
aiohttp's (it needs the client certificate and a WebSocket; see ``cluster/leader/listener.py``).

aiohttp bounds a head's lines itself (``max_line_size``, ``max_field_size``,
``max_headers``, given from :class:`~berth.http_server.limits.ListenerLimits`) and closes an
idle keep-alive connection, but it neither caps connections nor times the first head. A
:class:`GuardedProtocol` wraps each connection's aiohttp protocol and adds both: the
listener's :class:`~berth.http_server.limits.ConnectionGate` admits or refuses the
connection (429 or 503 in the OpenAI error shape, then closed), and a connection whose first
request has not reached the app within ``head_timeout_s`` is closed. The app says that a
request reached it with :func:`request_began` (a middleware calls it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from berth.http_server.limits import ConnectionGate, ListenerLimits
from berth.openai_errors import error_from_exception

log = logging.getLogger(__name__)


class GuardedProtocol(asyncio.Protocol):
    """Forwards every protocol call to ``inner`` once the gate has admitted the connection."""

    def __init__(
        self, inner: asyncio.Protocol, gate: ConnectionGate, limits: ListenerLimits, name: str
    ) -> None:
        self._inner = inner
        self._gate = gate
        self._limits = limits
        self._name = name
        self._address: str | None = None
        self._admitted = False
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self._address = str(peer[0])
        refusal = self._gate.admit(self._address)
        if refusal is not None:
            log.warning("%s listener: %s", self._name, refusal)
            reply = error_from_exception(refusal)
            reason = b"Too Many Requests" if reply.status == 429 else b"Service Unavailable"
            head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n" % (reply.status, reason)
            head += b"content-length: %d\r\nconnection: close\r\n" % len(reply.body)
            head += b"".join(
                b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in reply.headers.items()
            )
            self._transport.write(head + b"\r\n" + reply.body)
            self._transport.close()
            return
        self._admitted = True
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._limits.head_timeout_s, self._head_timed_out)
        self._inner.connection_made(transport)

    def request_began(self) -> None:
        """A request has reached the app: the connection is no longer waiting for a head."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            log.info("%s listener: no request from %s within %g s; closing", self._name,
                     self._address, self._limits.head_timeout_s)  # fmt: skip
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._admitted else None

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.request_began()
        if self._admitted:
            self._admitted = False
            self._gate.release(self._address)
            self._inner.connection_lost(exc)


def request_began(transport: asyncio.BaseTransport | None) -> None:
    """Tell the guard of ``transport``'s connection (if it has one) that a request reached
    the app."""
    if transport is None:
        return
    protocol = transport.get_protocol()
    if isinstance(protocol, GuardedProtocol):
        protocol.request_began()
