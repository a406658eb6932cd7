"""The agent link's session state machine: handshake, streams and credit, with no I/O.

A :class:`LinkSession` is fed each received WebSocket message with :meth:`receive_message`
and returns the typed event the caller should act on (:mod:`berth.cluster.protocol.events`),
or ``None`` when the session dealt with the frame itself; what it wants sent, answers included,
piles up in :meth:`data_to_send`. The I/O adapter
(:class:`berth.cluster.link.connection.LinkConnection`, on both ends) owns a session the way
python-websockets' ``Connection`` owns its ``Protocol``: it pumps messages through it and sends
what it queues, so all of the protocol's rules are tested with bytes alone.

The per-event frames, ``STREAM_DATA`` (one per token of a tunneled stream), may instead go
through :meth:`LinkSession.receive_data`, which checks them by the same rules and hands
each payload straight to a sink, with no frame or event object in between (the adapter
picks them out by their first byte, ``frames.STREAM_DATA_PREFIX``).

Rules enforced here (``docs/protocol.md`` is the specification):

- the agent's first frame is Hello, the leader's is Welcome, each exactly once; the version
  is the highest both ranges share (what each must hold: :mod:`~berth.cluster.protocol.handshake`);
- a request for an op this code does not know is answered ``unsupported`` here;
- only the leader opens streams, ids strictly increasing; at most ``max_streams`` are open
  (:class:`~berth.cluster.protocol.limits.LinkLimits`);
- each side may send at most the credit the other granted on a stream (initially
  ``stream_window_bytes``); the receiver grants more as its reader consumes (:meth:`consume`),
  so a slow reader slows the sender instead of filling memory; data beyond the credit is a
  protocol error;
- a stream ends when both sides have sent ``END`` or either resets it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import assert_never

import msgspec

from berth.cluster.protocol.errors import LinkError, ProtocolError
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
    PROTOCOL_MAX,
    PROTOCOL_MIN,
    Frame,
    Heartbeat,
    Hello,
    OpName,
    Progress,
    ProgressEvent,
    Request,
    ResetCode,
    Response,
    StreamCredit,
    StreamData,
    StreamHead,
    StreamOpen,
    StreamReset,
    UnknownRequest,
    Welcome,
    decode_data,
    decode_frame,
    encode_frame,
)
from berth.cluster.protocol.handshake import WelcomeTerms, read_hello, read_welcome, welcome_for
from berth.cluster.protocol.limits import LinkLimits
from berth.cluster.protocol.payloads import ErrorCode, ErrorInfo

#: Where :meth:`LinkSession.receive_data` hands a stream's payload: ``(stream id, payload,
#: end)``, ``end`` when the peer's side of the stream is done.
DataSink = Callable[[int, bytes, bool], None]


class Role(enum.Enum):
    LEADER = "leader"
    AGENT = "agent"


class SessionState(enum.Enum):
    HANDSHAKE = "handshake"
    OPEN = "open"
    CLOSED = "closed"


# Per frame, the session compares its state with these: on CPython 3.11 reading an enum
# member through its class (``SessionState.OPEN``) costs about 0.3 us, a global a tenth of it.
_OPEN = SessionState.OPEN
_CLOSED = SessionState.CLOSED


class _Stream:
    __slots__ = ("local_end", "recv_room", "recv_unacked", "remote_end", "send_credit")

    def __init__(self, window: int) -> None:
        self.send_credit = window
        self.recv_room = window  # bytes the peer may still send before it needs credit
        self.recv_unacked = 0  # bytes consumed but not yet granted back
        self.local_end = False
        self.remote_end = False


_MAX_CREDIT = 2**31 - 1


class LinkSession:
    """One side of one agent link. Not thread-safe; use from one event loop."""

    def __init__(
        self,
        role: Role,
        limits: LinkLimits | None = None,
        versions: tuple[int, int] = (PROTOCOL_MIN, PROTOCOL_MAX),
    ) -> None:
        self.role = role
        self.limits = limits or LinkLimits()
        self.versions = versions
        self.state = SessionState.HANDSHAKE
        #: the negotiated protocol version, once the handshake is done
        self.protocol_version: int | None = None
        self.hello: Hello | None = None
        self._hello_seen = False
        self._streams: dict[int, _Stream] = {}
        self._last_stream_id = 0
        self._last_request_id = 0
        self._out: list[bytes] = []

    # -- plumbing -----------------------------------------------------------------------------

    def data_to_send(self) -> list[bytes]:
        """The messages to send, in order; each is one WebSocket binary message."""
        out, self._out = self._out, []
        return out

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def has_stream(self, stream_id: int) -> bool:
        return stream_id in self._streams

    def send_credit(self, stream_id: int) -> int:
        """Payload bytes this side may send on ``stream_id`` now (0 for an unknown stream)."""
        stream = self._streams.get(stream_id)
        return stream.send_credit if stream is not None else 0

    def send_room(self, stream_id: int) -> int | None:
        """Payload bytes the next frame on ``stream_id`` may carry: the credit, at most
        ``max_payload_bytes``; ``None`` once the stream is gone (ended or reset)."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return None
        return min(stream.send_credit, self.limits.max_payload_bytes)

    def close(self) -> None:
        """Forget every stream; the session takes no more frames."""
        self.state = SessionState.CLOSED
        self._streams.clear()

    def _send(self, frame: Frame) -> None:
        if self.state is _CLOSED:
            raise LinkError("the agent link is closed")
        self._out.append(encode_frame(frame))

    # -- handshake ----------------------------------------------------------------------------

    def send_hello(self, hello: Hello) -> None:
        """Agent: send the first frame."""
        self._require_role(Role.AGENT, "Hello")
        if self._hello_seen:
            raise LinkError("Hello was already sent")
        self._hello_seen = True
        self._send(hello)

    def accept(self, terms: WelcomeTerms, *, server_time: float) -> Welcome:
        """Leader: answer the agent's Hello with Welcome and open the session.

        ``server_time`` is the leader's clock (epoch seconds). Raises :class:`ProtocolError`
        (``UNSUPPORTED_VERSION``) when the agent's protocol range and ours do not meet; the
        caller closes the link with that code.
        """
        self._require_role(Role.LEADER, "Welcome")
        hello = self.hello
        if hello is None or self.state is not SessionState.HANDSHAKE:
            raise LinkError("Welcome is sent once, after Hello")
        frame = welcome_for(hello, terms, self.versions, server_time=server_time)
        self._send(frame)
        self.protocol_version = frame.protocol_version
        self.state = SessionState.OPEN
        return frame

    def receive_hello(self, message: bytes) -> Hello:
        """Leader: take the agent's first message, which must be Hello; :meth:`accept` it next.

        Raises :class:`ProtocolError` for anything else (an unknown frame type included).
        """
        self._require_greeting(Role.LEADER, "Hello")
        hello = read_hello(message, self.limits.max_frame_bytes)
        self.hello = hello
        return hello

    def receive_welcome(self, message: bytes) -> Welcome:
        """Agent: take the leader's first message, which must be Welcome at a version this
        side speaks; the session is then open.

        Raises :class:`ProtocolError` for anything else (``UNSUPPORTED_VERSION`` for a
        version outside our range).
        """
        self._require_greeting(Role.AGENT, "Welcome")
        frame = read_welcome(message, self.limits.max_frame_bytes, self.versions)
        self.protocol_version = frame.protocol_version
        self.state = SessionState.OPEN
        return frame

    def _require_greeting(self, receiver: Role, what: str) -> None:
        if self.role is not receiver:
            raise LinkError(f"only the {receiver.value} receives {what}")
        if self.state is not SessionState.HANDSHAKE or self.hello is not None:
            raise LinkError("the handshake's first frame was already taken")

    # -- receiving ----------------------------------------------------------------------------

    def receive_message(self, message: bytes) -> LinkEvent | None:
        """Take one received WebSocket message; return the event to act on, or ``None``.

        ``None`` means the session dealt with the frame itself: an unknown frame type or
        progress event, data or credit for a stream already forgotten, a stream refused for
        being over ``max_streams``, a request for an unknown op (answered ``unsupported``).
        Only then may it have queued an answer for :meth:`data_to_send` (taking a frame
        that yields an event sends nothing, so the hot path needs no flush).
        Raises :class:`ProtocolError`; the link must then close with its ``code``.
        """
        state = self.state
        if state is not _OPEN:
            if state is _CLOSED:
                return None
            if self.role is Role.AGENT:
                return WelcomeReceived(self.receive_welcome(message))
            if self.hello is not None:  # Hello taken, Welcome not yet sent
                raise ProtocolError("the agent sent more before the leader's Welcome")
            return HelloReceived(self.receive_hello(message))
        frame = decode_frame(message, self.limits.max_frame_bytes)
        if frame is None:
            return None
        # The most frequent first (cases are tried in order): data and credit, then each
        # stream's head or opening.
        match frame:
            case StreamData():
                return self._receive_data(frame)
            case StreamCredit():
                return self._receive_credit(frame)
            case StreamHead():
                return self._receive_head(frame)
            case StreamOpen():
                return self._receive_open(frame)
            case Response():
                return ResponseReceived(frame)
            case StreamReset():
                if self._streams.pop(frame.id, None) is None:
                    return None
                return StreamResetReceived(frame.id, frame.code, frame.message)
            case Request():
                return RequestReceived(frame)
            case Progress():
                return ProgressReceived(frame)
            case Heartbeat():
                if self.role is not Role.LEADER:
                    raise ProtocolError("only agents send Heartbeat")
                return HeartbeatReceived(frame)
            case UnknownRequest():
                what = f"operation {frame.op[:40]!r} is not supported by this {self.role.value}"
                error = ErrorInfo(code=ErrorCode.UNSUPPORTED, message=what)
                self._send(Response(id=frame.id, ok=False, error=error))
                return None
            case Hello() | Welcome():
                raise ProtocolError(f"{type(frame).__name__} after the handshake")
            case _:
                assert_never(frame)

    def receive_data(self, message: bytes, on_data: DataSink) -> None:
        """Take one received ``STREAM_DATA`` message (it starts with
        :data:`~berth.cluster.protocol.frames.STREAM_DATA_PREFIX`) and hand its payload to
        ``on_data`` instead of returning a :class:`DataReceived`: the per-event path, with no
        frame or event object made. The rules and errors are :meth:`receive_message`'s for
        the same bytes: nothing is handed on for a stream already forgotten (or a closed
        session), and data past the credit or after the stream's end raises
        :class:`ProtocolError`. Taking a data frame never queues anything to send.
        """
        if self.state is not _OPEN:
            self.receive_message(message)  # closed: ignored; in the handshake: refused
            return
        stream_id, payload, end = decode_data(message, self.limits.max_frame_bytes)
        if self._take_data(stream_id, len(payload), end):
            on_data(stream_id, payload, end)

    def _receive_open(self, frame: StreamOpen) -> StreamOpened | None:
        if self.role is not Role.AGENT:
            raise ProtocolError("only the leader opens streams")
        if frame.id <= self._last_stream_id:
            raise ProtocolError(f"stream id {frame.id} is not above {self._last_stream_id}")
        self._last_stream_id = frame.id
        if len(self._streams) >= self.limits.max_streams:
            reset = StreamReset(
                id=frame.id, code=ResetCode.REFUSED, message="too many open streams"
            )
            self._send(reset)
            return None
        stream = _Stream(self.limits.stream_window_bytes)
        self._take(stream, len(frame.payload), frame.id)
        stream.remote_end = frame.end
        self._streams[frame.id] = stream
        return StreamOpened(frame)

    def _receive_head(self, frame: StreamHead) -> HeadReceived | None:
        if self.role is not Role.LEADER:
            raise ProtocolError("only agents answer streams")
        stream = self._streams.get(frame.id)
        if stream is None:
            return None
        self._take(stream, len(frame.payload), frame.id)
        if frame.end:
            self._end_remote(frame.id, stream)
        return HeadReceived(frame)

    def _receive_data(self, frame: StreamData) -> DataReceived | None:
        if not self._take_data(frame.id, len(frame.payload), frame.end):
            return None
        return DataReceived(frame.id, frame.payload, frame.end)

    def _take_data(self, stream_id: int, size: int, end: bool) -> bool:
        """Account for ``size`` payload bytes on ``stream_id`` (``end``: the last); whether
        the stream is open, so that they go to its reader."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return False
        if stream.remote_end:
            raise ProtocolError(f"data on stream {stream_id} after its end")
        if size > stream.recv_room:
            self._take(stream, size, stream_id)  # raises
        stream.recv_room -= size
        if end:
            self._end_remote(stream_id, stream)
        return True

    def _receive_credit(self, frame: StreamCredit) -> CreditGranted | None:
        stream = self._streams.get(frame.id)
        if stream is None:
            return None
        if frame.increment <= 0 or stream.send_credit + frame.increment > _MAX_CREDIT:
            raise ProtocolError(f"invalid credit {frame.increment} on stream {frame.id}")
        stream.send_credit += frame.increment
        return CreditGranted(frame.id, frame.increment)

    def _take(self, stream: _Stream, size: int, stream_id: int) -> None:
        if size > stream.recv_room:
            raise ProtocolError(
                f"{size} bytes on stream {stream_id} exceed the {stream.recv_room} granted"
            )
        stream.recv_room -= size

    def _end_remote(self, stream_id: int, stream: _Stream) -> None:
        stream.remote_end = True
        if stream.local_end:
            del self._streams[stream_id]

    # -- sending ------------------------------------------------------------------------------

    def send_request(self, op: OpName, args: msgspec.Raw, timeout_s: float) -> int:
        """Send a control request (``args``: raw JSON of ``op``'s argument type, ``ops.py``);
        returns its id, which the answer and progress events carry."""
        self._require_open()
        self._last_request_id += 1
        self._send(Request(id=self._last_request_id, op=op, args=args, timeout_s=timeout_s))
        return self._last_request_id

    def send_response(
        self, request_id: int, result: msgspec.Raw | None = None, error: ErrorInfo | None = None
    ) -> None:
        """Answer request ``request_id``: ``result`` (raw JSON) on success, else ``error``."""
        self._require_open()
        if error is not None:
            self._send(Response(id=request_id, ok=False, error=error))
        else:
            self._send(Response(id=request_id, ok=True, result=result or msgspec.Raw(b"null")))

    def send_progress(self, request_id: int, event: ProgressEvent, data: msgspec.Raw) -> None:
        """Report ``event`` (with raw JSON ``data``) of the running request ``request_id``."""
        self._require_open()
        self._send(Progress(id=request_id, event=event, data=data))

    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        self._require_role(Role.AGENT, "Heartbeat")
        self._require_open()
        self._send(heartbeat)

    def open_stream(self, frame: StreamOpen) -> int:
        """Leader: open a stream (its first payload must fit the initial credit); returns its id.

        Raises :class:`LinkError` when ``max_streams`` are already open.
        """
        self._require_role(Role.LEADER, "StreamOpen")
        self._require_open()
        if len(self._streams) >= self.limits.max_streams:
            raise LinkError(f"{len(self._streams)} streams are open on this link, the maximum")
        stream = _Stream(self.limits.stream_window_bytes)
        self._spend(stream, len(frame.payload))
        self._last_stream_id += 1
        frame.id = self._last_stream_id
        stream.local_end = frame.end
        self._streams[frame.id] = stream
        self._send(frame)
        return frame.id

    def send_head(self, frame: StreamHead) -> None:
        """Agent: the answer's head (and first payload, within the credit) on ``frame.id``."""
        self._require_role(Role.AGENT, "StreamHead")
        stream = self._streams.get(frame.id)
        if stream is None:
            return
        self._spend(stream, len(frame.payload))
        self._send(frame)
        if frame.end:
            self._end_local(frame.id, stream)

    def send_data(self, stream_id: int, payload: bytes, end: bool = False) -> None:
        """Send ``payload`` on a stream; it must fit :meth:`send_credit` and
        ``max_payload_bytes``. Data for a stream already forgotten (reset) is dropped."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if len(payload) > self.limits.max_payload_bytes:
            raise LinkError(f"{len(payload)} bytes exceed the largest frame payload")
        self._spend(stream, len(payload))
        self._send(StreamData(id=stream_id, payload=payload, end=end))
        if end:
            self._end_local(stream_id, stream)

    def consume(self, stream_id: int, size: int) -> bool:
        """The reader of ``stream_id`` has taken ``size`` bytes; grant the sender more credit
        once half the window is free again. Returns whether it queued a grant (only then is
        there anything to send)."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.remote_end:
            return False
        stream.recv_unacked += size
        if stream.recv_unacked * 2 >= self.limits.stream_window_bytes:
            increment, stream.recv_unacked = stream.recv_unacked, 0
            stream.recv_room += increment
            self._send(StreamCredit(id=stream_id, increment=increment))
            return True
        return False

    def reset_stream(self, stream_id: int, code: ResetCode, message: str = "") -> None:
        """Abandon a stream from this side (e.g. the client went away); idempotent."""
        if self._streams.pop(stream_id, None) is not None and self.state is _OPEN:
            self._send(StreamReset(id=stream_id, code=code, message=message))

    def _spend(self, stream: _Stream, size: int) -> None:
        if size > stream.send_credit:
            raise LinkError(f"{size} bytes exceed the stream's credit of {stream.send_credit}")
        stream.send_credit -= size

    def _end_local(self, stream_id: int, stream: _Stream) -> None:
        stream.local_end = True
        if stream.remote_end:
            del self._streams[stream_id]

    # -- checks -------------------------------------------------------------------------------

    def _require_role(self, role: Role, what: str) -> None:
        if self.role is not role:
            raise LinkError(f"the {self.role.value} does not send {what}")

    def _require_open(self) -> None:
        if self.state is not _OPEN:
            raise LinkError(f"the agent link is {self.state.value}, not open")
