"""The I/O half of the agent link: a WebSocket adapter that owns a sans-I/O :class:`LinkSession`.

Both ends use :class:`LinkConnection`: the leader's ``/cluster/agent`` endpoint
(:mod:`berth.cluster.leader.hub`) and the agent's dial loop (:mod:`berth.agent.dialer`). It owns the
session the way python-websockets' asyncio ``Connection`` owns its ``Protocol``: every
received message goes through the session, whose typed event is dispatched once (one
``match``); every send is a session call followed by queueing what the session wants sent, so
no caller touches the session or flushes. :meth:`LinkConnection.handshake` is the Hello/Welcome
exchange of both ends.

Its parts: :mod:`berth.cluster.link.link_output` writes (the queue, the one writer task, the direct
writes, the high water mark); :mod:`berth.cluster.link.liveness` keeps the link alive (pings every
third of the :class:`~berth.cluster.link.liveness.Liveness` timeout, pongs, the dead-link watch);
:class:`PendingCalls` (here) keeps control requests as futures keyed by id,
:mod:`berth.cluster.link.link_streams` the open :class:`TunnelStream` objects, and
:class:`LinkTasks` (here) the reader task and a task per request and stream it hands on, so
a slow engine start or a slow stream reader never blocks the link's other traffic. A handler
task is kept referenced until it is done and a failure is logged (it has no caller to raise
to); when the link ends they are cancelled and waited for, within a bound. A
link found dead ends at once, closed with ``HEARTBEAT_TIMEOUT`` without waiting for a close
handshake the peer would never answer: pending requests fail, streams are aborted and
``on_closed`` runs, so the leader stops routing to the node (and moves the requests waiting on
it) and the agent redials.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, assert_never, overload

import aiohttp
import msgspec

from berth.cluster.link.link_output import CLOSE_TIMEOUT_S, LinkOutput, WebSocketLike
from berth.cluster.link.link_streams import LinkStreams
from berth.cluster.link.liveness import KeepAlive, Liveness
from berth.cluster.link.tunnel_stream import TunnelStream
from berth.cluster.protocol.errors import CloseCode, LinkError, ProtocolError
from berth.cluster.protocol.events import (
    CreditGranted,
    DataReceived,
    HeadReceived,
    HeartbeatReceived,
    HelloReceived,
    LinkEvent,
    ProgressReceived,
    RequestReceived,
    ResponseReceived,
    StreamOpened,
    StreamResetReceived,
    WelcomeReceived,
)
from berth.cluster.protocol.frames import (
    STREAM_DATA_PREFIX,
    Heartbeat,
    Hello,
    Progress,
    ProgressEvent,
    Request,
    Response,
    StreamOpen,
    Welcome,
)
from berth.cluster.protocol.handshake import WelcomeTerms
from berth.cluster.protocol.limits import LinkLimits
from berth.cluster.protocol.ops import Op
from berth.cluster.protocol.payloads import ErrorCode, ErrorInfo
from berth.cluster.protocol.session import LinkSession, Role, SessionState

log = logging.getLogger(__name__)

# Compared per message: on CPython 3.11 an enum member read through its class costs ~0.3 us.
_BINARY = aiohttp.WSMsgType.BINARY
_TEXT = aiohttp.WSMsgType.TEXT
_PING = aiohttp.WSMsgType.PING
_PONG = aiohttp.WSMsgType.PONG


# -- the requests waiting for answers, and the link's tasks ---------------------------------

A = TypeVar("A", bound=msgspec.Struct)
R = TypeVar("R")

#: Hears a running request's progress events (e.g. a pull's bytes).
ProgressListener = Callable[[Progress], Awaitable[None]]


class RemoteOpError(LinkError):
    """The peer answered a control request with an error (``info`` says which)."""

    def __init__(self, op: str, info: ErrorInfo) -> None:
        super().__init__(f"{op} failed on the agent: {info.message}")
        self.op = op
        self.info = info


class PendingCalls:
    """The requests waiting for an answer, by request id, each with its progress listener."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[asyncio.Future[Response], ProgressListener | None]] = {}

    def expect(
        self, request_id: int, on_progress: ProgressListener | None
    ) -> asyncio.Future[Response]:
        """Wait for the answer to ``request_id`` (sent, or about to be)."""
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, on_progress)
        return future

    async def result(
        self,
        op: Op[A, R],
        request_id: int,
        answer: asyncio.Future[Response],
        timeout_s: float,
        peer: str,
    ) -> R:
        """The result of ``op`` once ``answer`` arrives, decoded as the op's result type.

        Raises :class:`RemoteOpError` for an error answer, ``ProtocolError`` for a result
        not of the op's shape, and :class:`LinkError` when nothing comes within
        ``timeout_s`` seconds (or the link is lost: :meth:`fail`).
        """
        try:
            async with asyncio.timeout(timeout_s):
                response = await answer
        except TimeoutError:
            raise LinkError(f"{op.name} on {peer} got no answer within {timeout_s} s") from None
        finally:
            self._pending.pop(request_id, None)
        if not response.ok:
            error = response.error or ErrorInfo(code=ErrorCode.INTERNAL, message="?")
            raise RemoteOpError(op.name, error)
        return op.decode_result(response.result)

    def answered(self, response: Response) -> None:
        """``response`` arrived: its waiting request (if still waiting) has it."""
        pending = self._pending.get(response.id)
        if pending is not None and not pending[0].done():
            pending[0].set_result(response)

    def listener(self, request_id: int) -> ProgressListener | None:
        """Who hears the progress of request ``request_id`` (``None``: nobody, or no such
        request)."""
        pending = self._pending.get(request_id)
        return pending[1] if pending is not None else None

    def fail(self, error: LinkError) -> None:
        """The link is lost: every request still waiting fails with ``error``."""
        for future, _listener in self._pending.values():
            if not future.done():
                future.set_exception(error)


class LinkTasks:
    """The reader and handler tasks of the link to ``peer`` (which names them in logs)."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[Any] | None = None
        #: set when the keepalive found the link dead (then it cancels the reader)
        self.dead = False

    def hold_reader(self) -> None:
        """The calling task is the link's reader (what :meth:`kill_reader` cancels)."""
        self._reader = asyncio.current_task()

    def kill_reader(self) -> None:
        """The link is dead: mark it so and cancel the reader (if one is running)."""
        self.dead = True
        if self._reader is not None:
            self._reader.cancel()

    def reader_killed(self) -> bool:
        """On the reader's ``CancelledError``: whether it came from :meth:`kill_reader`
        alone (then the reader ends the link itself), not from whoever runs the link."""
        reader = self._reader
        return self.dead and reader is not None and reader.uncancel() == 0

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[None]:
        """Run ``coro`` as the task ``link-<peer>-<name>``, kept until done; a failure is
        logged."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(f"link-{self._peer}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("link %s task %s failed", self._peer, task.get_name(),
                      exc_info=task.exception())  # fmt: skip

    def cancel(self) -> None:
        """The link ended: cancel every handler task still running."""
        for task in list(self._tasks):
            task.cancel()

    async def wait(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` seconds) for the handler tasks still running."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)


# -- the connection ------------------------------------------------------------------------

#: The leader's admission of an agent that said Hello, before Welcome goes out: it records the
#: node and makes the link the node's, or refuses by raising :class:`LinkError` with a code.
Admission = Callable[[Hello], Awaitable[None]]


class LinkHandler(Protocol):
    """What one side does with what the peer asks of it."""

    async def on_request(self, conn: LinkConnection, request: Request) -> None:
        """Serve ``request`` (in a task of its own) and answer it with :meth:`respond`."""

    async def on_stream(self, conn: LinkConnection, stream: TunnelStream) -> None:
        """Agent: serve a stream the leader opened (in a task of its own)."""

    def on_heartbeat(self, conn: LinkConnection, heartbeat: Heartbeat) -> None:
        """Leader: take the agent's heartbeat (on the reader loop: do not block)."""


class LinkConnection:
    """One live link: a session of ``role`` over ``ws``, pending requests and open streams.

    Use: :meth:`handshake`, then :meth:`run` until the link ends; meanwhile :meth:`call`,
    :meth:`open_stream`, :meth:`send_heartbeat` and the handler's answers send on it.
    ``peer`` names the other end in logs and errors; ``on_closed`` runs once when the link
    ends, before pending requests and streams fail. ``liveness``, when given, turns on pings
    and the dead-link timeout while :meth:`run` runs; the WebSocket must then hand pings and
    pongs up instead of answering them itself (aiohttp's ``autoping=False``).
    """

    def __init__(
        self,
        role: Role,
        ws: WebSocketLike,
        handler: LinkHandler,
        *,
        peer: str,
        limits: LinkLimits | None = None,
        on_closed: Callable[[], None] | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self._session = LinkSession(role, limits)
        #: pings and the dead-link timeout (may be set until :meth:`run` starts: the agent
        #: learns the leader's timeout from Welcome)
        self.liveness = liveness
        self._keepalive = KeepAlive(
            ws,
            peer,
            last_received=lambda: self.last_received_at,
            closed=lambda: self._closed,
            on_dead=self._declare_dead,
        )
        self.ws = ws
        self.peer = peer
        self._handler = handler
        self._calls = PendingCalls()
        self._tasks = LinkTasks(peer)
        self._output = LinkOutput(ws, peer, self._overflowed)
        self._streams = LinkStreams(
            self._session, self._output, peer=peer, flush=self._flush, closed=lambda: self._closed
        )
        self._closer: asyncio.Future[bool] | None = None
        self._on_closed = on_closed
        self._closed = False
        self.close_code: int | None = None
        self.close_reason = ""
        #: ``time.monotonic()`` when anything last arrived, pings and pongs included (the
        #: dead-link timeout)
        self.last_received_at = time.monotonic()
        #: ``time.monotonic()`` when the last protocol frame arrived (the hub's heartbeat
        #: watchdog)
        self.last_frame_at = self.last_received_at

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def open_streams(self) -> int:
        return len(self._streams.open)

    @property
    def limits(self) -> LinkLimits:
        return self._session.limits

    @property
    def protocol_version(self) -> int | None:
        """The negotiated protocol version, once the handshake has got that far."""
        return self._session.protocol_version

    # -- the handshake -------------------------------------------------------------------

    @overload
    async def handshake(self, greeting: Hello, *, timeout_s: float) -> Welcome: ...

    @overload
    async def handshake(
        self,
        greeting: WelcomeTerms,
        *,
        timeout_s: float,
        admit: Admission | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Hello: ...

    async def handshake(
        self,
        greeting: Hello | WelcomeTerms,
        *,
        timeout_s: float,
        admit: Admission | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Hello | Welcome:
        """Exchange Hello and Welcome (``docs/protocol.md``, Handshake); both ends call it
        first, before :meth:`run`.

        The agent passes its ``Hello`` and gets the leader's ``Welcome``. The leader passes
        its :class:`WelcomeTerms` and gets the agent's ``Hello``: on it, the version is
        negotiated, then ``admit`` runs (the node recorded and the link made the node's),
        then Welcome, stamped with ``clock()``, goes out.

        Raises :class:`ProtocolError` when this side refuses (a malformed or unexpected
        first frame, no common version, nothing within ``timeout_s`` seconds), after
        closing the link with its code; :class:`LinkError` when the peer closed the link
        first (:attr:`close_code` and :attr:`close_reason` say how) or ``admit`` refused
        (the link closed with the error's code). The connection is finished either way.
        """
        self._output.start()
        try:
            if isinstance(greeting, Hello):
                self._session.send_hello(greeting)
                self._flush()
                message = await self._receive_greeting(timeout_s, "the leader did not answer Hello")
                return self._session.receive_welcome(message)
            hello = self._session.receive_hello(await self._receive_greeting(timeout_s, "no Hello"))
            self._session.accept(greeting, server_time=clock())
            if admit is not None:
                await admit(hello)
            self._flush()
            return hello
        except LinkError as exc:
            if self.close_code is None:  # this side refuses: the peer hears why
                log.warning("link to %s: handshake failed: %s", self.peer, exc)
                await self.close(exc.code or CloseCode.PROTOCOL_ERROR, str(exc))
            await self._finish()
            raise
        except BaseException:
            await self._finish()
            raise

    async def _receive_greeting(self, timeout_s: float, silence: str) -> bytes:
        """The peer's first message (binary); what ends the handshake otherwise is raised."""
        message = await self._keepalive.first_message(timeout_s, silence, self._arrived)
        if message.type is aiohttp.WSMsgType.BINARY:
            data: bytes = message.data
            return data
        if message.type is aiohttp.WSMsgType.TEXT:
            raise ProtocolError("text message on the agent link")
        self._closed_by_peer(message)
        raise LinkError(
            f"{self.peer} closed the link during the handshake (code {self.close_code})",
            code=self._code(),
        )

    def _arrived(self, now: float, frame: bool) -> None:
        self.last_received_at = now
        if frame:
            self.last_frame_at = now

    # -- output --------------------------------------------------------------------------

    def _flush(self, wake: bool = True) -> None:
        """Queue what the session wants sent (:class:`LinkOutput`; ``wake``: wake its writer
        task up; a stream's direct send writes itself instead)."""
        messages = self._session.data_to_send()
        if not messages or self._closed:
            return
        self._output.queue(messages, wake)

    def _overflowed(self, queued_bytes: int) -> None:
        if self.close_code is None:
            log.warning("link to %s: %d bytes queued, the peer does not read; closing",
                        self.peer, queued_bytes)  # fmt: skip
            self.close_code = CloseCode.PROTOCOL_ERROR
            self.close_reason = "the peer does not read what it asked for"
            self._closer = asyncio.ensure_future(
                self.ws.close(code=CloseCode.PROTOCOL_ERROR, message=b"not reading")
            )

    async def drain(self) -> None:
        """Wait while more than ``WRITE_HIGH_WATER_BYTES`` wait to be written."""
        await self._output.drain()

    # -- requests ------------------------------------------------------------------------

    async def call(
        self,
        op: Op[A, R],
        args: A,
        timeout_s: float,
        on_progress: ProgressListener | None = None,
    ) -> R:
        """Ask the peer for ``op`` with ``args`` and wait for its result, decoded as the op's
        result type; ``on_progress`` hears the op's progress events meanwhile.

        Raises :class:`RemoteOpError` when the peer answers with an error,
        :class:`ProtocolError` when the result is not the op's shape, and :class:`LinkError`
        when no answer comes within ``timeout_s`` seconds or the link closes.
        """
        if self._closed:
            raise LinkError(f"the link to {self.peer} is closed", code=self._code())
        request_id = self._session.send_request(op.name, op.encode_args(args), timeout_s)
        answer = self._calls.expect(request_id, on_progress)
        self._flush()
        return await self._calls.result(op, request_id, answer, timeout_s, self.peer)

    def respond(
        self, request_id: int, result: msgspec.Raw | None = None, error: ErrorInfo | None = None
    ) -> None:
        """Answer request ``request_id``: ``result`` (raw JSON) on success, else ``error``.
        Nothing is sent once the link is closed."""
        if self._closed:
            return
        self._session.send_response(request_id, result, error)
        self._flush()

    def progress(self, request_id: int, event: ProgressEvent, data: msgspec.Raw) -> None:
        """Report ``event`` of the running request ``request_id`` (nothing once closed)."""
        if self._closed:
            return
        self._session.send_progress(request_id, event, data)
        self._flush()

    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        """Agent: send a heartbeat (nothing once closed)."""
        if self._closed:
            return
        self._session.send_heartbeat(heartbeat)
        self._flush()

    # -- streams -------------------------------------------------------------------------

    def open_stream(self, frame: StreamOpen) -> TunnelStream:
        """Leader: open a stream; its first payload must fit the initial credit.

        Raises :class:`LinkError` when the link is closed or has ``max_streams`` open.
        """
        if self._closed:
            raise LinkError(f"the link to {self.peer} is closed", code=self._code())
        return self._streams.start(frame)

    def forget_stream(self, stream_id: int) -> None:
        """Stop routing events to the stream (its user is done with it)."""
        self._streams.forget_stream(stream_id)

    # -- the reader loop -----------------------------------------------------------------

    async def run(self) -> None:
        """Read until the socket closes or the peer breaks the protocol, then clean up.

        Call it after :meth:`handshake`. A :class:`ProtocolError` closes the socket with its
        code. Returns normally in every case; :attr:`close_code` says how the link ended.
        """
        if self._session.state is not SessionState.OPEN:
            raise LinkError(f"the link to {self.peer} has not finished its handshake")
        self._output.start()
        self._output.use_frame_writer()
        session = self._session
        deliver = self._streams.data_received
        self._tasks.hold_reader()
        if self.liveness is not None:
            self._keepalive.start(self.liveness)
        try:
            while True:
                message = await self.ws.receive()
                self.last_received_at = now = time.monotonic()
                kind = message.type
                if kind is _BINARY:
                    self.last_frame_at = now
                    data = message.data
                    if data[:1] == STREAM_DATA_PREFIX:
                        # The per-event path: no frame or event object, nothing to send.
                        session.receive_data(data, deliver)
                        continue
                    event = session.receive_message(data)
                    if event is not None:
                        self._process(event)
                    else:
                        self._flush()  # what the session answered by itself, if anything
                elif kind is _PING:
                    self._keepalive.answer_ping(message)
                elif kind is _PONG:
                    pass  # its arrival is the news
                elif kind is _TEXT:
                    raise ProtocolError("text message on the agent link")
                else:  # CLOSE, CLOSING, CLOSED or ERROR
                    self._closed_by_peer(message)
                    break
        except ProtocolError as exc:
            log.warning("link to %s: protocol error: %s", self.peer, exc)
            await self.close(exc.code, str(exc))
        except asyncio.CancelledError:
            if not self._tasks.reader_killed():
                raise  # not the keepalive's doing: whoever runs the link is ending it
            # Declared dead by the keepalive: end now, without the peer's help.
        finally:
            await self._finish()

    # -- liveness ------------------------------------------------------------------------

    def _declare_dead(self, silent_s: float) -> None:
        """Nothing arrived for the link timeout: end the link now (see the module docstring)."""
        if self._closed:
            return
        reason = f"nothing received for {silent_s:.1f} s"
        log.warning("link to %s is dead: %s", self.peer, reason)
        if self.close_code is None:
            self.close_code = CloseCode.HEARTBEAT_TIMEOUT
            self.close_reason = reason
        self._tasks.kill_reader()

    def _closed_by_peer(self, message: aiohttp.WSMessage) -> None:
        if message.type is aiohttp.WSMsgType.CLOSE and self.close_code is None:
            self.close_code = int(message.data)
            self.close_reason = str(message.extra or "")

    async def close(self, code: int, reason: str) -> None:
        """Close the link with a close code (RFC 6455 section 7.4) and a reason."""
        if self.close_code is None:
            self.close_code = code
            self.close_reason = reason
        await self._output.close_socket(code, reason.encode()[:120])

    def _process(self, event: LinkEvent) -> None:
        """Act on one event of the session: the one place each kind is dispatched."""
        match event:  # the most frequent first (cases are tried in order)
            case DataReceived():
                self._streams.data_received(event.stream_id, event.data, event.end)
            case CreditGranted():
                self._streams.credit_granted(event.stream_id)
            case HeadReceived():
                self._streams.head_received(event.head)
            case StreamOpened():
                stream = self._streams.opened(event.opening)
                name = f"stream-{stream.id}"
                stream.task = self._tasks.spawn(self._handler.on_stream(self, stream), name)
            case ResponseReceived():
                self._calls.answered(event.response)
            case StreamResetReceived():
                self._streams.reset_received(event)
            case RequestReceived():
                self._tasks.spawn(self._handler.on_request(self, event.request), "request")
            case ProgressReceived():
                listener = self._calls.listener(event.progress.id)
                if listener is not None:
                    self._tasks.spawn(listener(event.progress), "progress")
            case HeartbeatReceived():
                self._handler.on_heartbeat(self, event.heartbeat)
            case HelloReceived() | WelcomeReceived():
                # The session refuses a second greeting; an open link never gets here.
                raise ProtocolError(f"{type(event).__name__} after the handshake")
            case _:
                assert_never(event)

    async def _finish(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._on_closed is not None:
            self._on_closed()  # first: the link stops getting new work at once
        self._output.release()  # writers waiting for room see the closed link
        if self.close_code is None:
            self.close_code = self.ws.close_code
        self._session.close()
        lost = LinkError(f"the link to {self.peer} was lost", code=self._code())
        self._calls.fail(lost)
        self._streams.abort_all()
        self._tasks.cancel()
        self._keepalive.cancel()
        await self._tasks.wait(timeout_s=30)
        await self._output.stop()
        # Bounded: a dead peer never answers the close handshake (its socket is dropped).
        reason = self.close_reason.encode()[:120] if self._tasks.dead else b""
        code = self.close_code or CloseCode.NORMAL
        await self._output.close_socket(code, reason, timeout_s=CLOSE_TIMEOUT_S)

    def _code(self) -> CloseCode | None:
        code = self.close_code
        try:
            return CloseCode(code) if code is not None else None
        except ValueError:
            return None
