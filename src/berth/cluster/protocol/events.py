"""What a :class:`~berth.cluster.protocol.session.LinkSession` hands up for each frame it takes.

:meth:`LinkSession.receive_message` turns one received WebSocket message into at most one
event; frames the session deals with itself (credit bookkeeping aside, an unknown frame type,
data for a stream already forgotten, a stream refused for being over the limit, an unknown
op, which it answers ``unsupported``) produce none. The I/O adapter
(:class:`berth.cluster.link.connection.LinkConnection`) dispatches each event once, over the closed
union :data:`LinkEvent`, ending in ``assert_never``.

Events carry the frame when its fields are what the receiver acts on (a request, a stream's
opening or head) and flat fields on the hot path (stream data, credit).
"""

from __future__ import annotations

import msgspec

from berth.cluster.protocol.frames import (
    Heartbeat,
    Hello,
    Progress,
    Request,
    ResetCode,
    Response,
    StreamHead,
    StreamOpen,
    Welcome,
)


class _Event(msgspec.Struct, frozen=True):
    """Base of the session's events: immutable, cheap to make (one per received frame)."""


class HelloReceived(_Event, frozen=True):
    """Leader: the agent's Hello arrived (the handshake's first half)."""

    hello: Hello


class WelcomeReceived(_Event, frozen=True):
    """Agent: the leader's Welcome arrived; the link is open at ``welcome.protocol_version``."""

    welcome: Welcome


class RequestReceived(_Event, frozen=True):
    """The peer asks for a control operation of a known op; answer it with its id."""

    request: Request


class ResponseReceived(_Event, frozen=True):
    """The answer to a request this side sent (``response.id``)."""

    response: Response


class ProgressReceived(_Event, frozen=True):
    """An intermediate event of a request this side sent (``progress.id``)."""

    progress: Progress


class HeartbeatReceived(_Event, frozen=True):
    """Leader: the agent's periodic report of its GPUs, load and adopted endpoints."""

    heartbeat: Heartbeat


class StreamOpened(_Event, frozen=True):
    """Agent: the leader opened stream ``opening.id``; ``opening.payload`` is the first body
    bytes, and ``opening.end`` says whether the leader's side is already done."""

    opening: StreamOpen


class HeadReceived(_Event, frozen=True):
    """Leader: the answer's status and headers on stream ``head.id``, with its first body
    bytes (``head.payload``) and ``head.end`` when that is all of it."""

    head: StreamHead


class DataReceived(_Event, frozen=True):
    """Payload bytes on stream ``stream_id``; ``end`` when the peer's side is done."""

    stream_id: int
    data: bytes
    end: bool


class CreditGranted(_Event, frozen=True):
    """The peer lets this side send ``increment`` more payload bytes on ``stream_id``."""

    stream_id: int
    increment: int


class StreamResetReceived(_Event, frozen=True):
    """The peer abandoned stream ``stream_id``; the session has forgotten it."""

    stream_id: int
    code: ResetCode
    message: str


#: The events of the handshake (each side gets exactly one, first).
HandshakeEvent = HelloReceived | WelcomeReceived

#: Every event a session hands up.
LinkEvent = (
    HelloReceived
    | WelcomeReceived
    | RequestReceived
    | ResponseReceived
    | ProgressReceived
    | HeartbeatReceived
    | StreamOpened
    | HeadReceived
    | DataReceived
    | CreditGranted
    | StreamResetReceived
)
