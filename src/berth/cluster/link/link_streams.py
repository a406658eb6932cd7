"""The tunnel streams of one agent link, and what each sends with.

:class:`LinkStreams` is :class:`~berth.cluster.link.connection.LinkConnection`'s table of open
streams (by id) and the :class:`~berth.cluster.link.tunnel_stream.StreamCarrier` its
:class:`~berth.cluster.link.tunnel_stream.TunnelStream` objects send through: each send is one
call of the link's session, then what the session wants sent goes to the link's output
(:class:`~berth.cluster.link.link_output.LinkOutput`), written from the sending task when
nothing waits ahead of it.
"""

from __future__ import annotations

from collections.abc import Callable

from berth.cluster.link.link_output import LinkOutput
from berth.cluster.link.tunnel_stream import StreamResetError, TunnelStream
from berth.cluster.protocol.events import StreamResetReceived
from berth.cluster.protocol.frames import ResetCode, StreamHead, StreamOpen
from berth.cluster.protocol.session import LinkSession


class LinkStreams:
    """The open streams of a link over ``session`` and ``output``.

    ``flush(wake)`` queues what the session wants sent (``wake``: wake the writer task);
    ``closed()`` says whether the link has ended; ``peer`` names the other end.
    """

    def __init__(
        self,
        session: LinkSession,
        output: LinkOutput,
        *,
        peer: str,
        flush: Callable[[bool], None],
        closed: Callable[[], bool],
    ) -> None:
        self.peer = peer
        self._session = session
        self._output = output
        self._flush = flush
        self._is_closed = closed
        #: the streams events are routed to, by id
        self.open: dict[int, TunnelStream] = {}

    @property
    def closed(self) -> bool:
        return self._is_closed()

    def start(self, frame: StreamOpen) -> TunnelStream:
        """Leader: open a stream (the link is open); its first payload must fit the initial
        credit. Raises :class:`~berth.cluster.protocol.errors.LinkError` when ``max_streams``
        are open."""
        stream_id = self._session.open_stream(frame)
        stream = TunnelStream(self, stream_id, frame)
        self.open[stream_id] = stream
        self._flush(True)
        return stream

    def opened(self, opening: StreamOpen) -> TunnelStream:
        """Agent: the leader opened a stream with ``opening`` (its first payload delivered)."""
        stream = TunnelStream(self, opening.id, opening)
        stream.data_received(opening.payload, opening.end)
        self.open[opening.id] = stream
        return stream

    def data_received(self, stream_id: int, payload: bytes, end: bool) -> None:
        """A stream's payload (also ``LinkSession.receive_data``'s sink): to its reader."""
        stream = self.open.get(stream_id)
        if stream is not None:
            stream.data_received(payload, end)

    def credit_granted(self, stream_id: int) -> None:
        """The peer granted credit on a stream: its waiting writer may go on."""
        stream = self.open.get(stream_id)
        if stream is not None:
            stream.credit_granted()

    def head_received(self, head: StreamHead) -> None:
        """Leader: the answer's head arrived on ``head.id``: to the stream's reader."""
        stream = self.open.get(head.id)
        if stream is not None:
            stream.head_received(head)

    def reset_received(self, event: StreamResetReceived) -> None:
        """The peer reset a stream: its user sees the reset, and its task (serving it) is
        cancelled, which reaches the engine."""
        stream = self.open.pop(event.stream_id, None)
        if stream is not None:
            why = event.message or event.code
            error = StreamResetError(f"stream reset by {self.peer}: {why}", event.code)
            stream.abort(error)
            if stream.task is not None:
                stream.task.cancel()  # cancelling reaches the engine

    def abort_all(self) -> None:
        """The link is lost: every open stream's user sees it, and the table is emptied."""
        for stream in list(self.open.values()):
            stream.abort(StreamResetError(f"the link to {self.peer} was lost", None))
        self.open.clear()

    def forget_stream(self, stream_id: int) -> None:
        """Stop routing events to the stream (its user is done with it)."""
        self.open.pop(stream_id, None)

    async def drain(self) -> None:
        """Wait while more than ``WRITE_HIGH_WATER_BYTES`` wait to be written."""
        await self._output.drain()

    def has_stream(self, stream_id: int) -> bool:
        """Whether the stream is still open on either side."""
        return self._session.has_stream(stream_id)

    def send_room(self, stream_id: int) -> int | None:
        """Payload bytes one frame on ``stream_id`` may carry now (the credit, at most
        ``max_payload_bytes``), or ``None`` when the stream is gone (ended or reset)."""
        return self._session.send_room(stream_id)

    def send_head(self, head: StreamHead) -> None:
        """Agent: the answer's head on ``head.id``; its payload must fit :meth:`send_room`."""
        self._session.send_head(head)
        self._flush(True)

    async def send_data(self, stream_id: int, payload: bytes, end: bool) -> None:
        """Payload on a stream; it must fit :meth:`send_room`. Written from the calling
        task when nothing waits ahead of it (then it may wait for the socket), else queued."""
        self._session.send_data(stream_id, payload, end)
        await self._send_now()

    def send_data_nowait(self, stream_id: int, payload: bytes, end: bool) -> None:
        """:meth:`send_data` without waiting, for a caller that is no task (an engine
        connection's callback): written at once when nothing waits ahead of it and the
        socket takes it, else queued for the writer task. It must fit :meth:`send_room`;
        the caller watches :attr:`backlogged` to slow down."""
        self._session.send_data(stream_id, payload, end)
        if not self._output.can_write_now:
            self._flush(True)
            return
        self._output.write_now(self._session.data_to_send())

    @property
    def backlogged(self) -> bool:
        """More than ``WRITE_HIGH_WATER_BYTES`` wait to be written: stream writers should
        :meth:`drain` before sending more."""
        return self._output.backlogged

    def consume(self, stream_id: int, size: int) -> None:
        """The stream's reader took ``size`` bytes: the peer may get more credit (sent once
        half a window is free; until then, per event, nothing is flushed)."""
        if self._session.consume(stream_id, size):
            self._flush(True)

    def reset_stream(self, stream_id: int, code: ResetCode, message: str = "") -> None:
        """Abandon a stream (idempotent) and forget it."""
        self._session.reset_stream(stream_id, code, message)
        self._flush(True)
        self.open.pop(stream_id, None)

    async def _send_now(self) -> None:
        """Send what the session wants sent from the calling task when nothing is queued or
        being sent (the common case: one stream event), else leave it to the writer task."""
        if not self._output.idle:
            self._flush(True)
            return
        self._flush(False)
        await self._output.send_queued()
