"""The tunnel protocol's codec and session, exercised with bytes alone."""

from __future__ import annotations

import msgspec
import pytest

from berth.cluster.protocol.errors import CloseCode, LinkError, ProtocolError, agent_should_redial
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
    HEADER_BYTES,
    Heartbeat,
    Hello,
    Progress,
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
    decode_frame,
    encode_frame,
)
from berth.cluster.protocol.handshake import WelcomeTerms, negotiate_version
from berth.cluster.protocol.limits import LinkLimits
from berth.cluster.protocol.ops import START, StartArgs, decode_payload, encode_payload
from berth.cluster.protocol.payloads import ErrorCode, ErrorInfo, Inventory
from berth.cluster.protocol.session import LinkSession, Role


def _hello(low: int = 1, high: int = 1) -> Hello:
    return Hello(
        protocol_min=low,
        protocol_max=high,
        agent_version="0.1.0",
        capabilities=["op.start"],
        inventory=Inventory(hostname="gpu-a", cpu_count=8, memory_total_mb=32000),
    )


def _pair(limits: LinkLimits | None = None) -> tuple[LinkSession, LinkSession]:
    leader = LinkSession(Role.LEADER, limits)
    agent = LinkSession(Role.AGENT, limits)
    agent.send_hello(_hello())
    _pump(agent, leader)
    leader.accept(WelcomeTerms(node_id="n-1", leader_version="0.1.0"), server_time=1.0)
    _pump(leader, agent)
    return leader, agent


def _pump(src: LinkSession, dst: LinkSession) -> list[object]:
    return [f for m in src.data_to_send() if (f := dst.receive_message(m)) is not None]


@pytest.mark.parametrize(
    "frame",
    [
        _hello(),
        Welcome(protocol_version=1, leader_version="x", node_id="n-1", server_time=2.5),
        Request(id=7, op="start", args=encode_payload({"a": 1}), timeout_s=3.0),
        Response(id=7, ok=True, result=msgspec.Raw(b'{"pid":1}')),
        Heartbeat(sent_at=1.0),
        StreamOpen(id=3, kind="http", deployment_id="d-1", method="POST", target="/v1/x",
                   headers=[(b"content-type", b"application/json")], payload=b"\x00{}", end=True),
        StreamHead(id=3, status=200, headers=[(b"a", b"\xe9")], payload=b"bin\xff"),
        StreamData(id=3, payload=b"\x00" * 100, end=True),
        StreamReset(id=3, code="cancelled"),
        StreamCredit(id=3, increment=4096),
    ],
)  # fmt: skip
def test_frames_round_trip(frame: object) -> None:
    assert decode_frame(encode_frame(frame)) == frame  # type: ignore[arg-type]


def test_headers_are_bytes_in_memory_and_latin1_text_on_the_wire() -> None:
    """The JSON body keeps the form a 0.1 agent reads (strings, one character a byte)."""
    opening = StreamOpen(kind="http", deployment_id="d-1", method="POST", target="/v1/x",
                         headers=[(b"x-name", b"caf\xe9")])  # fmt: skip
    message = encode_frame(opening)
    assert b'"headers":[["x-name","caf\xc3\xa9"]]' in message  # JSON's UTF-8 of U+00E9
    decoded = decode_frame(message)
    assert isinstance(decoded, StreamOpen) and decoded.headers == [(b"x-name", b"caf\xe9")]
    head = decode_frame(encode_frame(StreamHead(id=1, status=200, headers=[(b"a", b"\xff")])))
    assert isinstance(head, StreamHead) and head.headers == [(b"a", b"\xff")]


def test_payload_travels_raw_not_base64() -> None:
    message = encode_frame(StreamData(id=1, payload=b"\xff" * 10))
    assert message == message[:HEADER_BYTES] + b"\xff" * 10


def test_unknown_frame_type_and_fields_are_ignored() -> None:
    assert decode_frame(bytes([200, 0, 0, 0, 0, 0, 0, 0, 0, 0])) is None
    body = b'{"sent_at": 1.0, "from_the_future": [1, 2]}'
    message = bytes([6, 0, 0, 0, 0, 0]) + len(body).to_bytes(4, "big") + body
    assert decode_frame(message) == Heartbeat(sent_at=1.0)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (b"\x01\x00", CloseCode.PROTOCOL_ERROR),  # short header
        (bytes([1, 0, 0, 0, 0, 0, 0, 0, 0, 2]) + b"{x", CloseCode.PROTOCOL_ERROR),  # not JSON
        (bytes([1, 0, 0, 0, 0, 0, 0, 0, 0, 2]) + b"{}", CloseCode.PROTOCOL_ERROR),  # not Hello
        (bytes([1, 0, 0, 0, 0, 0, 0, 0, 0, 99]) + b"{}", CloseCode.PROTOCOL_ERROR),  # bad length
        (bytes([6, 0, 0, 0, 0, 0, 0, 0, 0, 2]) + b"{}", CloseCode.PROTOCOL_ERROR),  # no sent_at
        (b"\x09" + b"\x00" * 2000, CloseCode.FRAME_TOO_LARGE),
    ],
)
def test_bad_frames_are_protocol_errors(message: bytes, code: CloseCode) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_frame(message, max_frame_bytes=1024)
    assert caught.value.code is code


def test_handshake_negotiates_the_highest_shared_version() -> None:
    assert negotiate_version(1, 3, (2, 5)) == 3
    assert negotiate_version(4, 6, (1, 3)) is None
    leader, agent = _pair()
    assert leader.protocol_version == agent.protocol_version == 1
    assert leader.hello is not None and leader.hello.inventory.hostname == "gpu-a"


def test_leader_refuses_a_first_frame_that_is_not_hello() -> None:
    leader = LinkSession(Role.LEADER)
    with pytest.raises(ProtocolError) as caught:
        leader.receive_message(encode_frame(Heartbeat(sent_at=1.0)))
    assert caught.value.code is CloseCode.PROTOCOL_ERROR


def test_no_common_version_is_refused_with_its_code() -> None:
    leader = LinkSession(Role.LEADER)
    leader.receive_message(encode_frame(_hello(7, 9)))
    with pytest.raises(ProtocolError) as caught:
        leader.accept(WelcomeTerms(node_id="n-1", leader_version="x"), server_time=0.0)
    assert caught.value.code is CloseCode.UNSUPPORTED_VERSION


def test_a_second_hello_is_a_protocol_error() -> None:
    leader, _agent = _pair()
    with pytest.raises(ProtocolError):
        leader.receive_message(encode_frame(_hello()))


def test_credit_bounds_what_the_sender_may_send() -> None:
    limits = LinkLimits(stream_window_bytes=1000)
    leader, agent = _pair(limits)
    sid = leader.open_stream(StreamOpen(kind="http", deployment_id="d", payload=b"x", end=True))
    assert [type(e) for e in _pump(leader, agent)] == [StreamOpened]
    agent.send_head(StreamHead(id=sid, status=200, payload=b"a" * 400))
    agent.send_data(sid, b"b" * 600)
    assert agent.send_credit(sid) == 0
    with pytest.raises(LinkError):
        agent.send_data(sid, b"c")
    _pump(agent, leader)
    leader.consume(sid, 400)  # less than half the window: no credit yet
    assert leader.data_to_send() == []
    leader.consume(sid, 200)
    assert [type(e) for e in _pump(leader, agent)] == [CreditGranted]
    assert agent.send_credit(sid) == 600
    agent.send_data(sid, b"d" * 10, end=True)
    _pump(agent, leader)
    assert leader.open_streams == 0 and agent.open_streams == 0


def test_data_beyond_credit_is_a_protocol_error() -> None:
    limits = LinkLimits(stream_window_bytes=100)
    leader, agent = _pair(limits)
    sid = leader.open_stream(StreamOpen(kind="http", deployment_id="d"))
    _pump(leader, agent)
    with pytest.raises(ProtocolError):
        leader.receive_message(encode_frame(StreamHead(id=sid, status=200, payload=b"x" * 101)))


def test_streams_over_the_limit_are_refused_not_fatal() -> None:
    leader, agent = _pair(LinkLimits(max_streams=1))
    leader.open_stream(StreamOpen(kind="logs", deployment_id="d"))
    with pytest.raises(LinkError):
        leader.open_stream(StreamOpen(kind="logs", deployment_id="d"))
    # A leader that ignores its own limit gets the extra stream reset, and the link lives on.
    forged = StreamOpen(id=2, kind="logs", deployment_id="d")
    _pump(leader, agent)
    assert agent.receive_message(encode_frame(forged)) is None
    assert [type(f) for f in _pump(agent, leader)] == []  # reset of a stream it never opened


def test_reset_forgets_the_stream_on_both_sides() -> None:
    leader, agent = _pair()
    sid = leader.open_stream(StreamOpen(kind="http", deployment_id="d"))
    _pump(leader, agent)
    leader.reset_stream(sid, "cancelled")
    events = _pump(leader, agent)
    assert isinstance(events[0], StreamResetReceived) and events[0].code == "cancelled"
    assert not agent.has_stream(sid) and not leader.has_stream(sid)
    agent.send_data(sid, b"late")  # dropped, not an error
    assert agent.data_to_send() == []


def test_only_the_leader_opens_streams() -> None:
    leader, _agent = _pair()
    with pytest.raises(ProtocolError):
        leader.receive_message(encode_frame(StreamOpen(id=1, kind="logs", deployment_id="d")))


def test_op_args_decode_with_a_protocol_error_when_malformed() -> None:
    raw = encode_payload(StartArgs(deployment_id="d", model_name="m", model_path="/p",
                                   engine="llamacpp"))  # fmt: skip
    assert decode_payload(raw, StartArgs, "start args").engine == "llamacpp"
    with pytest.raises(ProtocolError):
        decode_payload(b'{"deployment_id": 3}', StartArgs, "start args")


@pytest.mark.parametrize(
    ("code", "redial"),
    [
        (CloseCode.NODE_REMOVED, False),
        (CloseCode.BAD_CERTIFICATE, False),
        (CloseCode.SUPERSEDED, False),
        (CloseCode.LEADER_SHUTTING_DOWN, True),
        (CloseCode.PROTOCOL_ERROR, True),
        (None, True),
    ],
)
def test_which_close_codes_an_agent_redials_after(code: CloseCode | None, redial: bool) -> None:
    assert agent_should_redial(code) is redial


def test_an_unknown_first_frame_is_a_protocol_error() -> None:
    leader = LinkSession(Role.LEADER)
    with pytest.raises(ProtocolError):
        leader.receive_message(bytes([200, 0, 0, 0, 0, 0, 0, 0, 0, 0]))


def test_limits_must_leave_room_for_a_full_window_and_its_json() -> None:
    with pytest.raises(ValueError):
        LinkLimits(max_frame_bytes=256 * 1024, stream_window_bytes=256 * 1024)


# -- events: bytes in, one typed event out ------------------------------------------------------

HEAD = StreamHead(id=1, status=200, headers=[(b"content-type", b"text/plain")], payload=b"ab")
OPENING = StreamOpen(id=1, kind="http", deployment_id="d", method="GET", target="/v1/models")
WELCOME = Welcome(protocol_version=1, leader_version="0.1.0", node_id="n-1", server_time=1.0)
START_REQUEST = Request(id=4, op="start", args=encode_payload({"deployment_id": "d"}))
STARTED = Response(id=4, ok=True, result=msgspec.Raw(b'{"pid":1,"port":2}'))
SPAWNED = Progress(id=4, event="spawned", data=msgspec.Raw(b'{"pid":1,"port":2}'))
GONE = StreamReset(id=1, code=ResetCode.ENGINE_DISCONNECT, message="gone")
CANCELLED = ResetCode.CANCELLED


def _with_stream() -> tuple[LinkSession, LinkSession]:
    """A leader and an agent with stream 1 open on both sides."""
    leader, agent = _pair()
    leader.open_stream(StreamOpen(kind="http", deployment_id="d"))
    _pump(leader, agent)
    return leader, agent


@pytest.mark.parametrize(
    ("receiver", "frame", "event"),
    [
        ("leader", HEAD, HeadReceived(HEAD)),
        ("leader", StreamData(id=1, payload=b"\xff", end=True), DataReceived(1, b"\xff", True)),
        ("agent", StreamData(id=1, payload=b"body"), DataReceived(1, b"body", False)),
        ("leader", StreamCredit(id=1, increment=4096), CreditGranted(1, 4096)),
        ("agent", StreamCredit(id=1, increment=1), CreditGranted(1, 1)),
        ("leader", GONE, StreamResetReceived(1, ResetCode.ENGINE_DISCONNECT, "gone")),
        ("agent", StreamReset(id=1, code=CANCELLED), StreamResetReceived(1, CANCELLED, "")),
        ("agent", START_REQUEST, RequestReceived(START_REQUEST)),
        ("leader", STARTED, ResponseReceived(STARTED)),
        ("leader", SPAWNED, ProgressReceived(SPAWNED)),
        ("leader", Heartbeat(sent_at=2.0), HeartbeatReceived(Heartbeat(sent_at=2.0))),
    ],
    ids=lambda value: type(value).__name__ if not isinstance(value, str) else value,
)  # fmt: skip
def test_each_frame_becomes_its_event(receiver: str, frame: object, event: LinkEvent) -> None:
    leader, agent = _with_stream()
    session = leader if receiver == "leader" else agent
    assert session.receive_message(encode_frame(frame)) == event  # type: ignore[arg-type]
    assert session.data_to_send() == []  # an event is handed up, not answered here


@pytest.mark.parametrize(
    ("role", "frame", "event"),
    [
        (Role.LEADER, _hello(), HelloReceived(_hello())),
        (Role.AGENT, WELCOME, WelcomeReceived(WELCOME)),
    ],
    ids=["leader-hears-hello", "agent-hears-welcome"],
)
def test_the_first_frame_becomes_a_handshake_event(
    role: Role, frame: object, event: LinkEvent
) -> None:
    session = LinkSession(role)  # a new one per run: a session hears the first frame once
    assert session.receive_message(encode_frame(frame)) == event  # type: ignore[arg-type]


def test_a_stream_opened_by_the_leader_is_an_event_at_the_agent() -> None:
    _leader, agent = _pair()
    assert agent.receive_message(encode_frame(OPENING)) == StreamOpened(OPENING)
    assert agent.has_stream(1)


@pytest.mark.parametrize(
    "frame",
    [
        StreamData(id=9, payload=b"late"),  # a stream already forgotten
        StreamCredit(id=9, increment=10),
        StreamReset(id=9, code=ResetCode.CANCELLED),
        StreamHead(id=9, status=200),
        Progress(id=4, event="warming_up"),  # type: ignore[arg-type]  # a newer agent's event
    ],
    ids=["data", "credit", "reset", "head", "unknown-progress-event"],
)
def test_frames_the_session_swallows_give_no_event(frame: object) -> None:
    leader, _agent = _pair()
    assert leader.receive_message(encode_frame(frame)) is None  # type: ignore[arg-type]
    assert leader.data_to_send() == []


def test_an_unknown_op_is_answered_unsupported_by_the_session() -> None:
    _leader, agent = _pair()
    assert agent.receive_message(encode_frame(UnknownRequest(id=7, op="defragment"))) is None
    [answer] = [decode_frame(m) for m in agent.data_to_send()]
    assert isinstance(answer, Response) and answer.id == 7 and not answer.ok
    assert answer.error is not None and answer.error.code is ErrorCode.UNSUPPORTED
    assert "defragment" in answer.error.message


def test_a_request_decodes_to_its_op_or_to_unknown_request() -> None:
    known = decode_frame(encode_frame(Request(id=1, op="probe")))
    assert isinstance(known, Request) and known.op == "probe"
    unknown = decode_frame(encode_frame(UnknownRequest(id=2, op="defragment")))
    assert unknown == UnknownRequest(id=2, op="defragment")


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        ("engine_disconnect", ResetCode.ENGINE_DISCONNECT),
        ("engine_timeout", ResetCode.ENGINE_TIMEOUT),
        ("refused", ResetCode.REFUSED),
        ("exploded", ResetCode.INTERNAL),  # a newer peer's code: the stream failed, link lives
    ],
)
def test_reset_codes_decode_to_the_closed_set(wire: str, code: ResetCode) -> None:
    leader, _agent = _with_stream()
    message = encode_frame(StreamReset(id=1, code=wire, message="why"))  # type: ignore[arg-type]
    assert leader.receive_message(message) == StreamResetReceived(1, code, "why")


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        ("not_found", ErrorCode.NOT_FOUND),
        ("engine_error", ErrorCode.ENGINE_ERROR),
        ("quota_exceeded", ErrorCode.INTERNAL),  # a newer agent's code
    ],
)
def test_error_codes_decode_to_the_closed_set(wire: str, code: ErrorCode) -> None:
    error = ErrorInfo(code=wire, message="m")  # type: ignore[arg-type]
    frame = decode_frame(encode_frame(Response(id=1, ok=False, error=error)))
    assert isinstance(frame, Response) and frame.error is not None
    assert frame.error.code is code and frame.error.message == "m"


def test_an_engine_name_outside_the_closed_set_is_invalid_args() -> None:
    raw = encode_payload({"deployment_id": "d", "model_name": "m", "model_path": "/p",
                          "engine": "tensorrt"})  # fmt: skip
    with pytest.raises(ProtocolError, match="start args"):
        START.decode_args(raw)
