"""The I/O half of the agent link: pumps WebSocket messages through a :class:`LinkSession`.

Both ends use :class:`LinkConnection`: the leader's ``/cluster/agent`` endpoint
(:mod:`berth.cluster.hub`) and the agent's dial loop (:mod:`berth.agent.dialer`). It owns one
reader loop and one writer task; control requests are futures keyed by id and streams are
:class:`TunnelStream` objects, so a slow engine start or a slow stream reader never blocks the
link's other traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import msgspec

from berth.cluster.protocol.errors import CloseCode, LinkError, ProtocolError
from berth.cluster.protocol.frames import (
    ErrorInfo,
    Frame,
    Progress,
    Request,
    Response,
    StreamCredit,
    StreamData,
    StreamHead,
    StreamOpen,
    StreamReset,
)
from berth.cluster.protocol.session import LinkSession
from berth.cluster.tunnel_stream import StreamResetError, TunnelStream

log = logging.getLogger(__name__)

#: Bytes queued for the socket above which stream writers wait for the writer to catch up.
WRITE_HIGH_WATER_BYTES = 4 * 1024 * 1024
#: Bytes queued for the socket at which the link is closed: stream data waits at the high
#: water mark, so only a peer that sends requests but never reads its answers gets here.
MAX_QUEUED_BYTES = 64 * 1024 * 1024


class WebSocketLike(Protocol):
    """What the link needs of a WebSocket: aiohttp's server and client sockets both fit."""

    @property
    def close_code(self) -> int | None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    async def receive(self, timeout: float | None = None) -> aiohttp.WSMessage: ...

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool: ...


class RemoteOpError(LinkError):
    """The peer answered a control request with an error (``info`` says which)."""

    def __init__(self, op: str, info: ErrorInfo) -> None:
        super().__init__(f"{op} failed on the agent: {info.message}")
        self.op = op
        self.info = info


ProgressListener = Callable[[Progress], Awaitable[None]]


class LinkHandler(Protocol):
    """What one side does with frames the session hands up."""

    async def on_request(self, conn: LinkConnection, request: Request) -> None: ...

    async def on_stream(self, conn: LinkConnection, stream: TunnelStream) -> None: ...

    def on_frame(self, conn: LinkConnection, frame: Frame) -> None: ...


class LinkConnection:
    """One live link: the session, the socket, pending requests and open streams."""

    def __init__(
        self,
        session: LinkSession,
        ws: WebSocketLike,
        handler: LinkHandler,
        *,
        peer: str,
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        self.session = session
        self.ws = ws
        self.peer = peer
        self._handler = handler
        self._pending: dict[int, tuple[asyncio.Future[Response], ProgressListener | None]] = {}
        self._streams: dict[int, TunnelStream] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._out: deque[bytes] = deque()
        self._out_bytes = 0
        self._out_wakeup = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._writer: asyncio.Task[None] | None = None
        self._closer: asyncio.Future[bool] | None = None
        self._on_closed = on_closed
        self._closed = False
        self.close_code: int | None = None
        self.close_reason = ""
        #: ``time.monotonic()`` when the last message arrived (the hub's liveness watchdog)
        self.last_received_at = time.monotonic()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # -- output --------------------------------------------------------------------------

    def flush(self) -> None:
        """Queue what the session wants sent; the writer task sends it in order."""
        messages = self.session.data_to_send()
        if not messages or self._closed:
            return
        self._out.extend(messages)
        self._out_bytes += sum(map(len, messages))
        if self._out_bytes > WRITE_HIGH_WATER_BYTES:
            if self._out_bytes > MAX_QUEUED_BYTES and self.close_code is None:
                log.warning("link to %s: %d bytes queued, the peer does not read; closing",
                            self.peer, self._out_bytes)  # fmt: skip
                self.close_code = CloseCode.PROTOCOL_ERROR
                self.close_reason = "the peer does not read what it asked for"
                self._closer = asyncio.ensure_future(
                    self.ws.close(code=CloseCode.PROTOCOL_ERROR, message=b"not reading")
                )
            self._drained.clear()
        self._out_wakeup.set()

    async def drain(self) -> None:
        """Wait while more than ``WRITE_HIGH_WATER_BYTES`` wait to be written."""
        if not self._drained.is_set():
            await self._drained.wait()

    async def _write_loop(self) -> None:
        out = self._out
        while True:
            await self._out_wakeup.wait()
            self._out_wakeup.clear()
            while out:
                message = out.popleft()
                self._out_bytes -= len(message)
                try:
                    await self.ws.send_bytes(message)
                except (ConnectionError, aiohttp.ClientError) as exc:
                    # The socket is going away; the reader loop sees the close and ends.
                    log.debug("link to %s: write failed: %s", self.peer, exc)
                    out.clear()
                    self._out_bytes = 0
                    self._drained.set()
                    return
                if self._out_bytes <= WRITE_HIGH_WATER_BYTES:
                    self._drained.set()

    # -- requests ------------------------------------------------------------------------

    async def request(
        self,
        op: str,
        args: msgspec.Raw,
        timeout_s: float,
        on_progress: ProgressListener | None = None,
    ) -> msgspec.Raw:
        """Send a control request and wait for its result (raw JSON).

        Raises :class:`RemoteOpError` when the peer answers with an error, and
        :class:`LinkError` when no answer comes within ``timeout_s`` or the link closes.
        """
        if self._closed:
            raise LinkError(f"the link to {self.peer} is closed", code=self._code())
        request_id = self.session.send_request(op, args, timeout_s)
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, on_progress)
        self.flush()
        try:
            async with asyncio.timeout(timeout_s):
                response = await future
        except TimeoutError:
            raise LinkError(f"{op} on {self.peer} got no answer within {timeout_s} s") from None
        finally:
            self._pending.pop(request_id, None)
        if not response.ok:
            raise RemoteOpError(op, response.error or ErrorInfo(code="internal", message="?"))
        return response.result

    def respond(
        self, request_id: int, result: msgspec.Raw | None = None, error: ErrorInfo | None = None
    ) -> None:
        if self._closed:
            return
        self.session.send_response(request_id, result, error)
        self.flush()

    def progress(self, request_id: int, event: str, data: msgspec.Raw) -> None:
        if self._closed:
            return
        self.session.send_progress(request_id, event, data)
        self.flush()

    # -- streams -------------------------------------------------------------------------

    def open_stream(self, frame: StreamOpen) -> TunnelStream:
        """Leader: open a stream; its first payload must fit the initial credit."""
        if self._closed:
            raise LinkError(f"the link to {self.peer} is closed", code=self._code())
        stream_id = self.session.open_stream(frame)
        stream = TunnelStream(self, stream_id, frame)
        self._streams[stream_id] = stream
        self.flush()
        return stream

    def forget_stream(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    # -- the reader loop -----------------------------------------------------------------

    async def run(self) -> None:
        """Read until the socket closes or the peer breaks the protocol, then clean up.

        A :class:`ProtocolError` closes the socket with its code. Returns normally in every
        case; :attr:`close_code` says how the link ended.
        """
        self._writer = asyncio.create_task(self._write_loop(), name=f"link-writer-{self.peer}")
        try:
            while True:
                message = await self.ws.receive()
                self.last_received_at = time.monotonic()
                if message.type is aiohttp.WSMsgType.BINARY:
                    frame = self.session.receive_message(message.data)
                    if frame is not None:
                        self._dispatch(frame)
                elif message.type is aiohttp.WSMsgType.TEXT:
                    raise ProtocolError("text message on the agent link")
                else:  # CLOSE, CLOSING, CLOSED or ERROR
                    if message.type is aiohttp.WSMsgType.CLOSE and self.close_code is None:
                        self.close_code = int(message.data)
                        self.close_reason = str(message.extra or "")
                    break
        except ProtocolError as exc:
            log.warning("link to %s: protocol error: %s", self.peer, exc)
            await self.close(exc.code, str(exc))
        finally:
            await self._finish()

    async def close(self, code: int, reason: str) -> None:
        """Close the link with a close code (RFC 6455 section 7.4) and a reason."""
        if self.close_code is None:
            self.close_code = code
            self.close_reason = reason
        with contextlib.suppress(Exception):  # the socket may already be gone
            await self.ws.close(code=code, message=reason.encode()[:120])

    def _dispatch(self, frame: Frame) -> None:
        kind = type(frame)
        if kind is StreamData:
            stream = self._streams.get(frame.id)  # type: ignore[union-attr]
            if stream is not None:
                stream._feed(frame.payload, frame.end)  # type: ignore[union-attr]
        elif kind is StreamCredit:
            stream = self._streams.get(frame.id)  # type: ignore[union-attr]
            if stream is not None:
                stream._credit()
        elif kind is Response:
            pending = self._pending.get(frame.id)  # type: ignore[union-attr]
            if pending is not None and not pending[0].done():
                pending[0].set_result(frame)  # type: ignore[arg-type]
        elif kind is StreamHead:
            stream = self._streams.get(frame.id)  # type: ignore[union-attr]
            if stream is not None:
                stream.head = frame  # type: ignore[assignment]
                stream._feed(frame.payload, frame.end)  # type: ignore[union-attr]
        elif kind is StreamReset:
            stream = self._streams.pop(frame.id, None)  # type: ignore[union-attr]
            if stream is not None:
                code = frame.code  # type: ignore[union-attr]
                why = frame.message or code  # type: ignore[union-attr]
                stream._fail(StreamResetError(f"stream reset by {self.peer}: {why}", code))
                if stream.task is not None:
                    stream.task.cancel()  # cancelling reaches the engine
        elif kind is StreamOpen:
            opening: StreamOpen = frame  # type: ignore[assignment]
            stream = TunnelStream(self, opening.id, opening)
            stream._feed(opening.payload, opening.end)
            self._streams[opening.id] = stream
            stream.task = self._spawn(self._handler.on_stream(self, stream), f"stream-{opening.id}")
        elif kind is Request:
            self._spawn(self._handler.on_request(self, frame), "request")  # type: ignore[arg-type]
        elif kind is Progress:
            pending = self._pending.get(frame.id)  # type: ignore[union-attr]
            if pending is not None and pending[1] is not None:
                self._spawn(pending[1](frame), "progress")  # type: ignore[arg-type]
        else:
            self._handler.on_frame(self, frame)

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(f"link-{self.peer}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("link %s task %s failed", self.peer, task.get_name(),
                      exc_info=task.exception())  # fmt: skip

    async def _finish(self) -> None:
        self._closed = True
        if self._on_closed is not None:
            self._on_closed()  # first: the link stops getting new work at once
        self._drained.set()  # writers waiting for room see the closed link
        if self.close_code is None:
            self.close_code = self.ws.close_code
        self.session.close()
        lost = LinkError(f"the link to {self.peer} was lost", code=self._code())
        for future, _listener in self._pending.values():
            if not future.done():
                future.set_exception(lost)
        for stream in list(self._streams.values()):
            stream._fail(StreamResetError(f"the link to {self.peer} was lost", "link_lost"))
        self._streams.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=30)
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        with contextlib.suppress(Exception):
            await self.ws.close(code=self.close_code or CloseCode.NORMAL)

    def _code(self) -> CloseCode | None:
        code = self.close_code
        try:
            return CloseCode(code) if code is not None else None
        except ValueError:
            return None
