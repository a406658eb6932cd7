"""The frames of the agent link and their one bounded, validating codec (no I/O).

Each WebSocket binary message (RFC 6455 section 5.6) carries exactly one frame::

    0      1      2          6          10
    +------+------+----------+----------+----------------------+---------------------+
    | type | flags|  id u32  | len u32  | JSON body (len bytes)| payload (the rest)  |
    +------+------+----------+----------+----------------------+---------------------+

All integers are big-endian. ``id`` is the request id of ``REQUEST``/``RESPONSE``/``PROGRESS``
and the stream id of the ``STREAM_*`` frames (0 otherwise). The JSON body holds the frame's
typed fields; ``payload`` is raw bytes (tunneled HTTP bodies, log output), never base64.
HTTP headers are byte pairs in memory on both sides (as the HTTP parsers give them and the
sockets take them); on the wire they are JSON strings, each byte one character (latin-1),
converted here and nowhere else.
``flags`` bit 0 (``END``) closes the sender's side of a stream. ``docs/protocol.md`` is the
specification; this module is its only encoder and decoder.

Compatibility rules: unknown JSON fields are ignored (a newer peer may add fields); a frame of
an unknown type, or a ``PROGRESS`` of an unknown event, decodes to ``None`` so the session skips
it; a ``REQUEST`` for an unknown op decodes to :class:`UnknownRequest` so the session can answer
it ``unsupported``; an unknown reset or error code reads as ``internal``.
"""

from __future__ import annotations

import struct
from enum import IntEnum, StrEnum
from typing import Any, Literal, NoReturn, TypeGuard, assert_never, get_args

import msgspec

from berth.cluster.protocol.errors import CloseCode, ProtocolError
from berth.cluster.protocol.payloads import (
    AdoptedState,
    DeploymentLoad,
    EngineEnded,
    EngineState,
    ErrorInfo,
    GpuState,
    Inventory,
    LoopLag,
    PolicyState,
)

#: Protocol versions this code speaks; see ``docs/protocol.md`` for what each adds.
PROTOCOL_MIN = 1
PROTOCOL_MAX = 1

_HEADER = struct.Struct(">BBII")
HEADER_BYTES = _HEADER.size
FLAG_END = 0x01
#: Largest frame (header + body + payload) either side accepts by default, in bytes.
DEFAULT_MAX_FRAME_BYTES = 1024 * 1024
#: Largest JSON body, in bytes; bounds the request head of a tunneled exchange too.
MAX_JSON_BYTES = 256 * 1024


class FrameType(IntEnum):
    HELLO = 1
    WELCOME = 2
    REQUEST = 3
    RESPONSE = 4
    PROGRESS = 5
    HEARTBEAT = 6
    STREAM_OPEN = 7
    STREAM_HEAD = 8
    STREAM_DATA = 9
    STREAM_RESET = 10
    STREAM_CREDIT = 11


# -- closed sets -------------------------------------------------------------------------------

#: The control operations (``ops.py`` ties each to its argument and result types): those
#: the agent serves, and ``renew``, which the leader serves.
OpName = Literal[
    "start",
    "stop",
    "probe",
    "inventory",
    "engines",
    "pull",
    "load_adapter",
    "unload_adapter",
    "ingress",
    "model_shape",
    "renew",
]
OP_NAMES: frozenset[str] = frozenset(get_args(OpName))
#: The events a running request reports in ``PROGRESS`` (v1: those of ``start``).
ProgressEvent = Literal["spawned", "preparing"]
PROGRESS_EVENTS: frozenset[str] = frozenset(get_args(ProgressEvent))


def is_op_name(name: str) -> TypeGuard[OpName]:
    """Whether ``name`` is an op this code knows."""
    return name in OP_NAMES


def is_progress_event(name: str) -> TypeGuard[ProgressEvent]:
    """Whether ``name`` is a progress event this code knows."""
    return name in PROGRESS_EVENTS


class ResetCode(StrEnum):
    """Why a stream was reset (``STREAM_RESET.code``, ``docs/protocol.md``, Streams).

    A code this side does not know (a newer peer's) reads as :attr:`INTERNAL`: the stream
    failed, for a reason its ``message`` names.
    """

    #: the client went away, or a timeout gave up on the stream
    CANCELLED = "cancelled"
    #: the receiver does not take the stream (over ``max_streams``, or agents opening streams)
    REFUSED = "refused"
    #: no such deployment, engine or log on the agent
    NOT_FOUND = "not_found"
    #: the agent could not reach the engine, or it failed before answering
    ENGINE_UNREACHABLE = "engine_unreachable"
    #: the engine did not answer in time
    ENGINE_TIMEOUT = "engine_timeout"
    #: the engine broke off an answer it had begun
    ENGINE_DISCONNECT = "engine_disconnect"
    #: an unexpected failure; the agent's log has the traceback
    INTERNAL = "internal"

    @classmethod
    def _missing_(cls, value: object) -> ResetCode:
        return cls.INTERNAL


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of every JSON body; defaults are left out on the wire."""


# -- frames ------------------------------------------------------------------------------------


class Hello(_Body, kw_only=True):
    """The agent's first frame."""

    protocol_min: int
    protocol_max: int
    agent_version: str
    capabilities: list[str] = []
    inventory: Inventory
    engines: list[EngineState] = []
    adopted: list[AdoptedState] = []
    #: HOST:PORT of the agent's direct ingress (docs/protocol.md); "": none (older agents)
    advertise: str = ""
    #: what the agent's policy lets the leader start there; absent from older agents
    policy: PolicyState | None = None


class Welcome(_Body, kw_only=True):
    """The leader's answer to Hello: the version both speak and the node's identity."""

    protocol_version: int
    leader_version: str
    node_id: str
    server_time: float
    heartbeat_interval_s: float = 5.0
    capabilities: list[str] = []
    #: seconds with nothing received after which either end closes the link as dead; the
    #: agent pings every third of it (absent from older leaders: the agent's default)
    link_timeout_s: float = 6.0
    #: the cluster URLs of every leader sharing this one's database (``leader_ha``), which
    #: the agent dials in turn when its link dies; empty from a lone or older leader
    leaders: list[str] = []


class Request(_Body, kw_only=True):
    """A control operation; the receiver decodes ``args`` with ``op``'s argument type, and the
    sender the answer's ``result`` with its result type (``ops.py``)."""

    id: int = 0
    op: OpName
    args: msgspec.Raw = msgspec.Raw(b"{}")
    timeout_s: float = 30.0


class UnknownRequest(_Body, kw_only=True):
    """A ``REQUEST`` for an op this code does not know (a newer peer's); the session answers
    it ``unsupported`` and the link lives on."""

    id: int = 0
    op: str


class Response(_Body, kw_only=True):
    """The answer to :class:`Request` ``id``: ``result`` when ``ok``, else ``error``."""

    id: int = 0
    ok: bool
    result: msgspec.Raw = msgspec.Raw(b"null")
    error: ErrorInfo | None = None


class Progress(_Body, kw_only=True):
    """An intermediate event of a running request, e.g. ``spawned`` during a start."""

    id: int = 0
    event: ProgressEvent
    data: msgspec.Raw = msgspec.Raw(b"null")


class _AnyRequest(_Body, kw_only=True):
    """How a ``REQUEST`` body is read: with any op name, so an unknown one can be answered."""

    op: str
    args: msgspec.Raw = msgspec.Raw(b"{}")
    timeout_s: float = 30.0


class _AnyProgress(_Body, kw_only=True):
    """How a ``PROGRESS`` body is read: with any event name, so an unknown one is skipped."""

    event: str
    data: msgspec.Raw = msgspec.Raw(b"null")


class Heartbeat(_Body, kw_only=True):
    """Sent by the agent every heartbeat interval: GPUs, per-deployment load, the adopted
    endpoints with their liveness and, optionally, its event loop's lag histogram; sent at
    once, with ``ended``, when an engine ends by itself (older leaders ignore the field and
    find the end at their next probe)."""

    sent_at: float
    gpus: list[GpuState] = []
    deployments: list[DeploymentLoad] = []
    adopted: list[AdoptedState] = []
    loop_lag: LoopLag | None = None
    ended: list[EngineEnded] = []


StreamKind = Literal["http", "logs"]


class StreamOpen(_Body, kw_only=True):
    """Opens stream ``id`` (leader to agent only).

    ``kind="http"``: a tunneled HTTP exchange with the deployment's engine (``method``,
    ``target``, ``headers``: lower-case byte pairs; the request body follows as payload).
    ``kind="logs"``: the engine's log, ``tail_lines`` lines then more while ``follow``.
    """

    id: int = 0
    kind: StreamKind
    deployment_id: str
    method: str = ""
    target: str = ""
    headers: list[tuple[bytes, bytes]] = []
    tail_lines: int = 0
    follow: bool = False
    payload: bytes = b""
    end: bool = False


class StreamHead(_Body, kw_only=True):
    """The answer's status and headers on stream ``id`` (agent to leader); ``headers`` are
    lower-case byte pairs, as in :class:`StreamOpen`."""

    id: int = 0
    status: int
    headers: list[tuple[bytes, bytes]] = []
    payload: bytes = b""
    end: bool = False


class _StreamOpenText(StreamOpen, kw_only=True):
    """:class:`StreamOpen` as its JSON body is decoded: headers as the wire's text."""

    headers: list[tuple[str, str]] = []  # type: ignore[assignment]


class _StreamHeadText(StreamHead, kw_only=True):
    """:class:`StreamHead` as its JSON body is decoded: headers as the wire's text."""

    headers: list[tuple[str, str]] = []  # type: ignore[assignment]


def _text_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers]


def _byte_headers(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]


class StreamData(_Body, kw_only=True):
    """_Body bytes on stream ``id``; no JSON body on the wire."""

    id: int = 0
    payload: bytes = b""
    end: bool = False


class StreamReset(_Body, kw_only=True):
    """Abandons stream ``id`` from either side, saying why."""

    id: int = 0
    code: ResetCode
    message: str = ""


class StreamCredit(_Body, kw_only=True):
    """Lets the peer send ``increment`` more payload bytes on stream ``id``."""

    id: int = 0
    increment: int


Frame = (
    Hello
    | Welcome
    | Request
    | UnknownRequest
    | Response
    | Progress
    | Heartbeat
    | StreamOpen
    | StreamHead
    | StreamData
    | StreamReset
    | StreamCredit
)

_TYPE_OF: dict[type[Any], FrameType] = {
    Hello: FrameType.HELLO,
    Welcome: FrameType.WELCOME,
    Request: FrameType.REQUEST,
    UnknownRequest: FrameType.REQUEST,
    Response: FrameType.RESPONSE,
    Progress: FrameType.PROGRESS,
    Heartbeat: FrameType.HEARTBEAT,
    StreamOpen: FrameType.STREAM_OPEN,
    StreamHead: FrameType.STREAM_HEAD,
    StreamData: FrameType.STREAM_DATA,
    StreamReset: FrameType.STREAM_RESET,
    StreamCredit: FrameType.STREAM_CREDIT,
}
#: What each frame type's JSON body is read as (``STREAM_DATA`` has none).
_Decoded = (
    Hello
    | Welcome
    | _AnyRequest
    | Response
    | _AnyProgress
    | Heartbeat
    | _StreamOpenText
    | _StreamHeadText
    | StreamReset
    | StreamCredit
)
_BODY_OF: dict[FrameType, type[_Decoded]] = {
    FrameType.HELLO: Hello,
    FrameType.WELCOME: Welcome,
    FrameType.REQUEST: _AnyRequest,
    FrameType.RESPONSE: Response,
    FrameType.PROGRESS: _AnyProgress,
    FrameType.HEARTBEAT: Heartbeat,
    FrameType.STREAM_OPEN: _StreamOpenText,
    FrameType.STREAM_HEAD: _StreamHeadText,
    FrameType.STREAM_RESET: StreamReset,
    FrameType.STREAM_CREDIT: StreamCredit,
}
_DECODERS: dict[int, msgspec.json.Decoder[Any]] = {
    int(kind): msgspec.json.Decoder(cls) for kind, cls in _BODY_OF.items()
}
_ENCODER = msgspec.json.Encoder()
# Per data frame: on CPython 3.11 an enum member read through its class costs ~0.3 us.
_STREAM_DATA = int(FrameType.STREAM_DATA)
#: The first byte of every ``STREAM_DATA`` message: ``message[:1] == STREAM_DATA_PREFIX``
#: picks the per-event frames out for :func:`decode_data` without the generic decoder.
STREAM_DATA_PREFIX = bytes((_STREAM_DATA,))


def encode_frame(frame: Frame) -> bytes:
    """The WebSocket message that carries ``frame``.

    The id, payload and end flag travel in the binary header and tail, not in the JSON.
    """
    if type(frame) is StreamData:
        flags = FLAG_END if frame.end else 0
        return _HEADER.pack(_STREAM_DATA, flags, frame.id, 0) + frame.payload
    payload = b""
    flags = 0
    frame_id = 0
    match frame:
        case StreamOpen() | StreamHead():
            frame_id, payload = frame.id, frame.payload
            flags = FLAG_END if frame.end else 0
            text = _text_headers(frame.headers)  # the wire's form (see the module docstring)
            body = _ENCODER.encode(
                msgspec.structs.replace(frame, id=0, headers=text, payload=b"", end=False)
            )
        case (
            Request() | UnknownRequest() | Response() | Progress() | StreamReset() | StreamCredit()
        ):
            frame_id = frame.id
            body = _ENCODER.encode(msgspec.structs.replace(frame, id=0) if frame_id else frame)
        case Hello() | Welcome() | Heartbeat() | StreamData():
            body = _ENCODER.encode(frame)
        case _:
            assert_never(frame)
    return _HEADER.pack(_TYPE_OF[type(frame)], flags, frame_id, len(body)) + body + payload


def decode_data(
    message: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> tuple[int, bytes, bool]:
    """``(stream id, payload, end)`` of a ``STREAM_DATA`` message (one that starts with
    :data:`STREAM_DATA_PREFIX`), with no frame object: the receive side's per-event path.
    It checks what :func:`decode_frame` checks of such a frame and raises the same
    :class:`ProtocolError`: ``FRAME_TOO_LARGE`` past ``max_frame_bytes``, ``PROTOCOL_ERROR``
    for a short header or a JSON body."""
    size = len(message)
    if size > max_frame_bytes or size < HEADER_BYTES:
        _refuse_size(size, max_frame_bytes)
    _kind, flags, frame_id, body_len = _HEADER.unpack_from(message)
    if body_len:
        raise ProtocolError("STREAM_DATA frame with a JSON body")
    return frame_id, message[HEADER_BYTES:], bool(flags & FLAG_END)


def _refuse_size(size: int, max_frame_bytes: int) -> NoReturn:
    """Raise for a message of ``size`` bytes, longer than ``max_frame_bytes`` or shorter
    than a header."""
    if size > max_frame_bytes:
        raise ProtocolError(
            f"frame of {size} bytes exceeds the {max_frame_bytes}-byte limit",
            CloseCode.FRAME_TOO_LARGE,
        )
    raise ProtocolError(f"frame of {size} bytes is shorter than its {HEADER_BYTES}-byte header")


def decode_frame(message: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame | None:
    """Decode one WebSocket message into its frame.

    Returns ``None`` for a frame of an unknown type and for a ``PROGRESS`` of an unknown event,
    and :class:`UnknownRequest` for a ``REQUEST`` of an unknown op (a newer peer's). Raises
    :class:`ProtocolError` with ``FRAME_TOO_LARGE`` when ``message`` is longer than
    ``max_frame_bytes``, and with ``PROTOCOL_ERROR`` for a short header, a JSON body that is
    too long, not JSON or not the frame's shape, or a payload or id on a frame that takes none.
    """
    size = len(message)
    if size > max_frame_bytes or size < HEADER_BYTES:
        _refuse_size(size, max_frame_bytes)
    kind, flags, frame_id, body_len = _HEADER.unpack_from(message)
    end = bool(flags & FLAG_END)
    if kind == _STREAM_DATA:
        if body_len:
            raise ProtocolError("STREAM_DATA frame with a JSON body")
        return StreamData(id=frame_id, payload=message[HEADER_BYTES:], end=end)
    decoder = _DECODERS.get(kind)
    if decoder is None:
        return None
    if body_len > MAX_JSON_BYTES or HEADER_BYTES + body_len > size:
        raise ProtocolError(f"frame type {kind} declares a {body_len}-byte body it cannot have")
    body_end = HEADER_BYTES + body_len
    try:
        decoded: _Decoded = decoder.decode(message[HEADER_BYTES:body_end])
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed {FrameType(kind).name} frame: {exc}") from None
    payload = message[body_end:]
    if isinstance(decoded, _StreamOpenText):
        return StreamOpen(
            id=frame_id, kind=decoded.kind, deployment_id=decoded.deployment_id,
            method=decoded.method, target=decoded.target,
            headers=_byte_headers(decoded.headers), tail_lines=decoded.tail_lines,
            follow=decoded.follow, payload=payload, end=end,
        )  # fmt: skip
    if isinstance(decoded, _StreamHeadText):
        return StreamHead(
            id=frame_id, status=decoded.status, headers=_byte_headers(decoded.headers),
            payload=payload, end=end,
        )  # fmt: skip
    if body_end != size:
        raise ProtocolError(f"{FrameType(kind).name} frame carries a payload")
    match decoded:
        case _AnyRequest():
            if is_op_name(decoded.op):
                args, timeout_s = decoded.args, decoded.timeout_s
                return Request(id=frame_id, op=decoded.op, args=args, timeout_s=timeout_s)
            return UnknownRequest(id=frame_id, op=decoded.op)
        case _AnyProgress():
            if is_progress_event(decoded.event):
                return Progress(id=frame_id, event=decoded.event, data=decoded.data)
            return None  # a newer peer's event: skipped like an unknown frame type
        case Response() | StreamReset() | StreamCredit():
            decoded.id = frame_id  # the header's id is the one that counts
            return decoded
        case Hello() | Welcome() | Heartbeat():
            if frame_id:
                raise ProtocolError(f"{FrameType(kind).name} frame carries an id")
            return decoded
        case _:
            assert_never(decoded)
