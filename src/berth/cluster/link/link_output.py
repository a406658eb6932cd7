"""The agent link's output: what the session wants sent, reaching the socket in order.

:class:`LinkOutput` is the half of :class:`~berth.cluster.link.connection.LinkConnection` that
writes. Messages queue behind each other (one writer task sends them), except that a sender
finding nothing queued or being sent writes its own message from its task
(:meth:`LinkOutput.send_queued`), or, for a caller that is no task, straight into the socket
with aiohttp's frame writer (:meth:`LinkOutput.write_now`). Past ``WRITE_HIGH_WATER_BYTES``
queued, stream writers wait in :meth:`LinkOutput.drain`; past ``MAX_QUEUED_BYTES`` the peer
is not reading and the connection is told (``on_overflow``) to close the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import aiohttp

from berth.cluster.link.write_batch import FrameWriter, coalesce_writes, frame_writer

log = logging.getLogger(__name__)

#: Bytes queued for the socket above which stream writers wait for the writer to catch up.
WRITE_HIGH_WATER_BYTES = 4 * 1024 * 1024
#: Bytes queued for the socket at which the link is closed: stream data waits at the high
#: water mark, so only a peer that sends requests but never reads its answers gets here.
MAX_QUEUED_BYTES = 64 * 1024 * 1024
#: Seconds a link that is already over (declared dead, or its reader ended) may spend on its
#: close handshake before the socket is simply dropped: a black-holed peer never answers.
CLOSE_TIMEOUT_S = 1.0
# What closing a WebSocket whose socket is gone or going raises: the transport's errors
# (ConnectionError and the close's TimeoutError are OSErrors), aiohttp's, and RuntimeError
# for a WebSocket that was never prepared or is already closed by its other side.
_CLOSE_ERRORS = (OSError, aiohttp.ClientError, RuntimeError)


class WebSocketLike(Protocol):
    """What the link needs of a WebSocket: aiohttp's server and client sockets both fit."""

    @property
    def close_code(self) -> int | None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    async def ping(self, message: bytes = b"") -> None: ...

    async def pong(self, message: bytes = b"") -> None: ...

    async def receive(self, timeout: float | None = None) -> aiohttp.WSMessage: ...

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool: ...


class LinkOutput:
    """The queue of binary messages for ``ws`` and the task that writes them.

    ``peer`` names the other end in logs; ``on_overflow(queued_bytes)`` is called whenever
    more than ``MAX_QUEUED_BYTES`` are queued (the connection closes the link once).
    """

    def __init__(self, ws: WebSocketLike, peer: str, on_overflow: Callable[[int], None]) -> None:
        self._ws = ws
        self._peer = peer
        self._on_overflow = on_overflow
        self._out: deque[bytes] = deque()
        self._out_bytes = 0
        self._wakeup = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        #: the writer task, once :meth:`start` made it
        self.writer: asyncio.Task[None] | None = None
        #: a ``ws.send_bytes`` is under way (the writer's or a direct one): later messages
        #: queue behind it, so that they reach the socket in order
        self._sending = False
        #: writes a message without a coroutine (aiohttp's WebSockets, once
        #: :meth:`use_frame_writer` ran); ``None``: every message goes through ``ws.send_bytes``
        self._frames: FrameWriter | None = None

    @property
    def backlogged(self) -> bool:
        """More than ``WRITE_HIGH_WATER_BYTES`` wait to be written."""
        return not self._drained.is_set()

    @property
    def idle(self) -> bool:
        """Nothing queued or being sent, and the writer started: a sender may write itself."""
        return not self._out and not self._sending and self.writer is not None

    def start(self) -> None:
        """Start the writer task (once; later calls do nothing)."""
        if self.writer is None:
            self.writer = asyncio.create_task(self._write_loop(), name=f"link-writer-{self._peer}")

    def use_frame_writer(self) -> None:
        """Write through aiohttp's frame writer from now on, the frames of one pass of the
        loop (e.g. events of many streams) in one write (:mod:`berth.cluster.link.write_batch`)."""
        coalesce_writes(self._ws)
        self._frames = frame_writer(self._ws)

    def queue(self, messages: Sequence[bytes], wake: bool = True) -> None:
        """Queue ``messages``; the writer task sends them in order (``wake``: wake it up;
        :meth:`send_queued` is about to send them itself instead)."""
        self._out.extend(messages)
        self._out_bytes += sum(map(len, messages))
        if self._out_bytes > WRITE_HIGH_WATER_BYTES:
            if self._out_bytes > MAX_QUEUED_BYTES:
                self._on_overflow(self._out_bytes)
            self._drained.clear()
        if wake:
            self._wakeup.set()

    async def drain(self) -> None:
        """Wait while more than ``WRITE_HIGH_WATER_BYTES`` wait to be written."""
        if not self._drained.is_set():
            await self._drained.wait()

    async def send_queued(self) -> None:
        """Send what is queued from the calling task (the caller saw :attr:`idle`), saving
        the writer's wake-up per message, in the same order. What others queue meanwhile,
        and what a cancelled caller has not sent, is left to the writer."""
        out = self._out
        if not out:
            return
        self._sending = True
        try:
            for _ in range(len(out)):
                message = out.popleft()
                self._out_bytes -= len(message)
                await self._ws.send_bytes(message)
        except (ConnectionError, aiohttp.ClientError) as exc:
            self.failed(exc)
        finally:
            self._sending = False
            if out:  # queued by others while this task waited for the socket
                self._wakeup.set()
        if self._out_bytes <= WRITE_HIGH_WATER_BYTES:
            self._drained.set()

    @property
    def can_write_now(self) -> bool:
        """Whether :meth:`write_now` may write: the frame writer is in use and ready, and
        nothing is queued or being sent ahead."""
        frames = self._frames
        return frames is not None and not self._out and not self._sending and frames.ready

    def write_now(self, messages: Sequence[bytes]) -> None:
        """Write ``messages`` into the socket at once (the caller saw :attr:`can_write_now`)."""
        frames = self._frames
        assert frames is not None
        try:
            for message in messages:
                frames.write(message)
        except (ConnectionError, aiohttp.ClientError) as exc:
            self.failed(exc)

    def failed(self, exc: BaseException) -> None:
        """A write failed: the socket is going away (the reader loop sees the close and
        ends), so what is queued is dropped and waiting writers are let go."""
        log.debug("link to %s: write failed: %s", self._peer, exc)
        self._out.clear()
        self._out_bytes = 0
        self._drained.set()

    def release(self) -> None:
        """The link closed: writers waiting for room see it."""
        self._drained.set()

    async def stop(self) -> None:
        """Cancel the writer task and wait for it to end."""
        if self.writer is not None:
            self.writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.writer

    async def close_socket(
        self, code: int, message: bytes, *, timeout_s: float | None = None
    ) -> None:
        """Close the WebSocket with ``code`` and ``message`` (RFC 6455 section 7.4), waiting
        at most ``timeout_s`` seconds for the peer's close (``None``: aiohttp's own bound);
        a socket already gone is no error."""
        with contextlib.suppress(*_CLOSE_ERRORS):  # TimeoutError is an OSError
            async with asyncio.timeout(timeout_s):
                await self._ws.close(code=code, message=message)

    async def _write_loop(self) -> None:
        out = self._out
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while out and not self._sending:
                message = out.popleft()
                self._out_bytes -= len(message)
                self._sending = True
                try:
                    await self._ws.send_bytes(message)
                except (ConnectionError, aiohttp.ClientError) as exc:
                    self.failed(exc)
                    return
                finally:
                    self._sending = False
                if self._out_bytes <= WRITE_HIGH_WATER_BYTES:
                    self._drained.set()
