"""How the agent link notices a silent peer (``docs/protocol.md``, Liveness).

With a :class:`Liveness`, each end sends a WebSocket ping (RFC 6455 section 5.5.2) every
third of ``timeout_s`` and answers the peer's pings itself; a link on which nothing at all
(frame, ping or pong) arrived for ``timeout_s`` is dead. :class:`KeepAlive` does the pinging,
the ponging and the watch for one :class:`~berth.cluster.link.connection.LinkConnection`, which
ends the link when told it is dead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from berth.cluster.link.link_output import WebSocketLike
from berth.cluster.protocol.errors import ProtocolError

log = logging.getLogger(__name__)

#: Seconds of silence after which a link is dead, by default (the ``link_timeout_s`` setting).
LINK_TIMEOUT_S = 6.0


@dataclass(frozen=True)
class Liveness:
    """How a link notices a silent peer: dead after ``timeout_s`` seconds with nothing
    received; a ping every ``timeout_s / 3`` keeps a healthy but idle link talking."""

    timeout_s: float = LINK_TIMEOUT_S

    @property
    def ping_interval_s(self) -> float:
        return self.timeout_s / 3


class KeepAlive:
    """The pings, pongs and dead-link watch of one link over ``ws``.

    ``last_received()`` is ``time.monotonic()`` when anything last arrived; ``closed()``
    whether the link has ended; ``on_dead(silent_s)`` is called once the link has been
    silent for the timeout. ``peer`` names the other end in logs.
    """

    def __init__(
        self,
        ws: WebSocketLike,
        peer: str,
        *,
        last_received: Callable[[], float],
        closed: Callable[[], bool],
        on_dead: Callable[[float], None],
    ) -> None:
        self._ws = ws
        self._peer = peer
        self._last_received = last_received
        self._closed = closed
        self._on_dead = on_dead
        self._keeper: asyncio.Task[None] | None = None
        self._pinger: asyncio.Task[None] | None = None
        self._ponger: asyncio.Task[None] | None = None

    def start(self, liveness: Liveness) -> None:
        """Start pinging and watching as ``liveness`` says."""
        name = f"link-keepalive-{self._peer}"
        self._keeper = asyncio.create_task(self._keep_alive(liveness), name=name)

    def answer_ping(self, message: aiohttp.WSMessage) -> None:
        """Pong (RFC 6455 section 5.5.3), off the reader: a socket slow to take it must not
        stop the link's reading. A ping that comes while the last pong waits is not
        answered again: any pong tells the peer the link lives."""
        if self._ponger is not None and not self._ponger.done():
            return
        data = message.data if isinstance(message.data, bytes) else b""
        self._ponger = asyncio.ensure_future(self._send_control(self._ws.pong(data)))

    async def first_message(
        self, timeout_s: float, silence: str, arrived: Callable[[float, bool], None]
    ) -> aiohttp.WSMessage:
        """The peer's first message that is no ping or pong (the handshake's), answering
        pings meanwhile; ``arrived(now, frame)`` hears of each arrival (``frame``: not a
        ping or pong). Raises ``ProtocolError`` (``"{silence} within N s"``) when none
        comes within ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                message = await self._ws.receive(timeout=max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                raise ProtocolError(f"{silence} within {timeout_s:g} s") from None
            now = time.monotonic()
            if message.type is aiohttp.WSMsgType.PING:
                arrived(now, False)
                self.answer_ping(message)
            elif message.type is not aiohttp.WSMsgType.PONG:
                arrived(now, True)
                return message
            else:
                arrived(now, False)

    def cancel(self) -> None:
        """Stop the watch and any ping or pong in flight (not the calling task itself)."""
        for helper in (self._keeper, self._pinger, self._ponger):
            if helper is not None and helper is not asyncio.current_task():
                helper.cancel()

    async def _keep_alive(self, liveness: Liveness) -> None:
        """Ping the peer every ``ping_interval_s``; declare the link dead once nothing has
        arrived for ``timeout_s``."""
        interval_s = liveness.ping_interval_s
        next_ping = time.monotonic() + interval_s
        while not self._closed():
            now = time.monotonic()
            last = self._last_received()
            silent_s = now - last
            if silent_s >= liveness.timeout_s:
                self._on_dead(silent_s)
                return
            if now >= next_ping:
                self._ping()
                next_ping = now + interval_s
            wake_at = min(next_ping, last + liveness.timeout_s)
            await asyncio.sleep(max(0.0, wake_at - now))

    def _ping(self) -> None:
        if self._pinger is not None and not self._pinger.done():
            return  # the last one is still stuck in the socket: no pile of them
        self._pinger = asyncio.ensure_future(self._send_control(self._ws.ping()))

    async def _send_control(self, sending: Awaitable[None]) -> None:
        try:
            await sending
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            # The socket is going away; the reader sees the close, or the keepalive does.
            log.debug("link to %s: ping or pong not sent: %s", self._peer, exc)
