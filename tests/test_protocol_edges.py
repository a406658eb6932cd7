"""The link protocol at its edges, sans I/O: frame limits and what a frame may not carry,
the header's flags and the JSON body's fields, the handshake's refusals, request and stream
ids, credit arithmetic, error answers and heartbeats. Written to kill the mutants that
``mutmut run`` (docs/testing.md) found surviving ``test_protocol.py`` and ``test_link.py``."""

from __future__ import annotations

import json

import msgspec
import pytest

from berth.cluster.protocol.errors import CloseCode, LinkError, ProtocolError
from berth.cluster.protocol.frames import (
    HEADER_BYTES,
    MAX_JSON_BYTES,
    Heartbeat,
    Hello,
    Request,
    Response,
    StreamCredit,
    StreamData,
    StreamHead,
    StreamOpen,
    StreamReset,
    Welcome,
    decode_frame,
    encode_frame,
)
from berth.cluster.protocol.handshake import WelcomeTerms
from berth.cluster.protocol.limits import LinkLimits
from berth.cluster.protocol.payloads import ErrorInfo, Inventory
from berth.cluster.protocol.session import LinkSession, Role

TERMS = WelcomeTerms(node_id="n-1", leader_version="0.1.0")


def _hello() -> Hello:
    inventory = Inventory(hostname="gpu-a", cpu_count=8, memory_total_mb=32000)
    return Hello(protocol_min=1, protocol_max=1, agent_version="0.1.0", inventory=inventory)


def _pump(src: LinkSession, dst: LinkSession) -> list[object]:
    return [f for m in src.data_to_send() if (f := dst.receive_message(m)) is not None]


def _pair(limits: LinkLimits | None = None) -> tuple[LinkSession, LinkSession]:
    leader, agent = LinkSession(Role.LEADER, limits), LinkSession(Role.AGENT, limits)
    agent.send_hello(_hello())
    _pump(agent, leader)
    leader.accept(TERMS, server_time=1.0)
    _pump(leader, agent)
    return leader, agent


def _sent(session: LinkSession) -> list[object]:
    return [decode_frame(message) for message in session.data_to_send()]


def _header(kind: int, body_len: int, frame_id: int = 0, flags: int = 0) -> bytes:
    return bytes([kind, flags]) + frame_id.to_bytes(4, "big") + body_len.to_bytes(4, "big")


# -- frames ----------------------------------------------------------------------------------------


def test_a_frame_of_exactly_the_limit_is_taken() -> None:
    message = encode_frame(StreamData(id=1, payload=b"x" * 100))
    assert decode_frame(message, max_frame_bytes=len(message)) is not None
    with pytest.raises(ProtocolError, match=f"frame of {len(message)} bytes exceeds the") as big:
        decode_frame(message, max_frame_bytes=len(message) - 1)
    assert big.value.code == CloseCode.FRAME_TOO_LARGE


def test_a_json_body_of_exactly_the_limit_is_taken_and_one_byte_more_is_refused() -> None:
    body = b'{"sent_at": 1.0}'.ljust(MAX_JSON_BYTES)
    assert decode_frame(_header(6, len(body)) + body) == Heartbeat(sent_at=1.0)
    longer = body + b" "
    with pytest.raises(ProtocolError, match=f"declares a {len(longer)}-byte body it cannot"):
        decode_frame(_header(6, len(longer)) + longer)


def test_a_body_longer_than_the_message_is_refused_as_such() -> None:
    body = b'{"sent_at": 1.0}'
    with pytest.raises(ProtocolError, match=f"declares a {len(body) + 1}-byte body") as caught:
        decode_frame(_header(6, len(body) + 1) + body)
    assert caught.value.code == CloseCode.PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("message", "complaint"),
    [
        (_header(9, 2) + b"{}", r"^STREAM_DATA frame with a JSON body$"),
        (_header(6, 16, frame_id=5) + b'{"sent_at": 1.0}', r"^HEARTBEAT frame carries an id$"),
        (_header(6, 16) + b'{"sent_at": 1.0}tail', r"^HEARTBEAT frame carries a payload$"),
        (b"\x06\x00\x00", r"^frame of 3 bytes is shorter than its 10-byte header$"),
    ],
    ids=["data-with-json", "heartbeat-with-id", "heartbeat-with-payload", "short-header"],
)
def test_what_a_frame_may_not_carry_is_named(message: bytes, complaint: str) -> None:
    with pytest.raises(ProtocolError, match=complaint):
        decode_frame(message)


def test_the_header_carries_the_flags_and_id_and_the_body_carries_neither() -> None:
    opened = encode_frame(StreamOpen(id=3, kind="http", deployment_id="d", payload=b"{}", end=True))
    assert (opened[1], int.from_bytes(opened[2:6], "big")) == (1, 3)  # END, id 3
    body = json.loads(opened[HEADER_BYTES : HEADER_BYTES + int.from_bytes(opened[6:10], "big")])
    assert {"id", "payload", "end"}.isdisjoint(body)
    assert opened.endswith(b"{}")  # the payload travels after the body
    asked = encode_frame(Request(id=9, op="probe", args=msgspec.Raw(b"{}"), timeout_s=2.0))
    assert (asked[1], int.from_bytes(asked[2:6], "big")) == (0, 9)
    assert "id" not in json.loads(asked[HEADER_BYTES:])
    assert encode_frame(Heartbeat(sent_at=1.0))[1] == 0


def test_errors_carry_their_codes() -> None:
    assert ProtocolError("bad").code == CloseCode.PROTOCOL_ERROR
    lost = LinkError("gone", code=CloseCode.NODE_REMOVED, node_id="n-1")
    assert (lost.code, lost.node_id) == (CloseCode.NODE_REMOVED, "n-1")


def test_limits_must_leave_room_for_a_window_and_a_json_body_in_one_frame() -> None:
    fits = 64 * 1024
    LinkLimits(stream_window_bytes=fits, max_frame_bytes=fits + MAX_JSON_BYTES + HEADER_BYTES)
    with pytest.raises(ValueError, match=r"^stream_window_bytes \+ the JSON limit must fit max_"):
        LinkLimits(
            stream_window_bytes=fits + 1, max_frame_bytes=fits + MAX_JSON_BYTES + HEADER_BYTES
        )


# -- the handshake ---------------------------------------------------------------------------------


def test_each_end_sends_only_its_own_greeting_once() -> None:
    leader, agent = LinkSession(Role.LEADER), LinkSession(Role.AGENT)
    with pytest.raises(LinkError, match=r"^the leader does not send Hello$"):
        leader.send_hello(_hello())
    with pytest.raises(LinkError, match=r"^the agent does not send Welcome$"):
        agent.accept(TERMS, server_time=1.0)
    with pytest.raises(LinkError, match=r"^Welcome is sent once, after Hello$"):
        leader.accept(TERMS, server_time=1.0)  # no Hello yet
    agent.send_hello(_hello())
    with pytest.raises(LinkError, match=r"^Hello was already sent$"):
        agent.send_hello(_hello())
    _pump(agent, leader)
    leader.accept(TERMS, server_time=1.0)
    with pytest.raises(LinkError, match=r"^Welcome is sent once, after Hello$"):
        leader.accept(TERMS, server_time=1.0)


def test_a_closed_session_sends_nothing() -> None:
    leader, _agent = _pair()
    leader.close()
    with pytest.raises(LinkError, match=r"^the agent link is closed"):
        leader.send_request("probe", msgspec.Raw(b"{}"), 1.0)


# -- requests, answers, heartbeats -----------------------------------------------------------------


def test_requests_are_numbered_from_one_and_carry_their_timeout() -> None:
    leader, _agent = _pair()
    assert leader.send_request("probe", msgspec.Raw(b"{}"), 2.5) == 1
    assert leader.send_request("engines", msgspec.Raw(b"{}"), 1.0) == 2
    first, second = _sent(leader)
    assert isinstance(first, Request) and (first.id, first.timeout_s) == (1, 2.5)
    assert isinstance(second, Request) and second.id == 2


def test_an_error_answer_and_an_empty_success() -> None:
    _leader, agent = _pair()
    error = ErrorInfo(code="not_found", message="no engine d-1")
    agent.send_response(7, error=error)
    agent.send_response(8)
    assert _sent(agent) == [
        Response(id=7, ok=False, error=error),
        Response(id=8, ok=True, result=msgspec.Raw(b"null")),
    ]


def test_only_the_agent_sends_heartbeats() -> None:
    leader, agent = _pair()
    agent.send_heartbeat(Heartbeat(sent_at=3.0))
    assert _sent(agent) == [Heartbeat(sent_at=3.0)]
    with pytest.raises(LinkError, match=r"^the leader does not send Heartbeat$"):
        leader.send_heartbeat(Heartbeat(sent_at=3.0))


# -- streams ---------------------------------------------------------------------------------------


def test_stream_ids_count_up_and_a_reused_id_is_refused() -> None:
    leader, agent = _pair()
    assert leader.open_stream(StreamOpen(kind="http", deployment_id="d")) == 1
    assert leader.open_stream(StreamOpen(kind="http", deployment_id="d")) == 2
    _pump(leader, agent)
    with pytest.raises(ProtocolError):
        agent.receive_message(encode_frame(StreamOpen(id=2, kind="http", deployment_id="d")))


def test_credit_is_added_up_to_the_limit_and_nothing_else() -> None:
    limits = LinkLimits(stream_window_bytes=64 * 1024)
    leader, agent = _pair(limits)
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id="d"))
    _pump(leader, agent)
    agent.receive_message(encode_frame(StreamCredit(id=stream, increment=10)))
    assert agent.send_credit(stream) == limits.stream_window_bytes + 10
    assert agent.send_credit(99) == 0  # an unknown stream has none
    top = 2**31 - 1 - agent.send_credit(stream)
    agent.receive_message(encode_frame(StreamCredit(id=stream, increment=top)))
    assert agent.send_credit(stream) == 2**31 - 1  # exactly the largest credit
    for increment in (0, 1, 2**31 - 1):
        with pytest.raises(ProtocolError, match=f"invalid credit {increment}"):
            agent.receive_message(encode_frame(StreamCredit(id=stream, increment=increment)))


def test_data_beyond_the_window_is_refused_even_across_frames() -> None:
    limits = LinkLimits(stream_window_bytes=64 * 1024)
    leader, agent = _pair(limits)
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id="d"))
    _pump(leader, agent)
    half = limits.stream_window_bytes // 2
    agent.receive_message(encode_frame(StreamData(id=stream, payload=b"x" * half)))
    agent.receive_message(encode_frame(StreamData(id=stream, payload=b"x" * half)))
    with pytest.raises(ProtocolError, match=rf"^1 bytes on stream {stream} exceed the 0 granted$"):
        agent.receive_message(encode_frame(StreamData(id=stream, payload=b"x")))


def test_credit_goes_back_once_half_the_window_is_read() -> None:
    limits = LinkLimits(stream_window_bytes=64 * 1024)
    leader, agent = _pair(limits)
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id="d"))
    _pump(leader, agent)
    window = limits.stream_window_bytes
    agent.receive_message(encode_frame(StreamData(id=stream, payload=b"x" * window)))
    agent.consume(stream, window // 2 - 1)
    assert agent.data_to_send() == []  # under half: nothing yet
    agent.consume(stream, 1)  # exactly half
    assert _sent(agent) == [StreamCredit(id=stream, increment=window // 2)]
    agent.consume(stream, window // 2)
    assert _sent(agent) == [StreamCredit(id=stream, increment=window // 2)]
    # All of it was given back: a whole window more is taken, and not a byte beyond it.
    agent.receive_message(encode_frame(StreamData(id=stream, payload=b"x" * window)))
    with pytest.raises(ProtocolError, match="exceed the 0 granted"):
        agent.receive_message(encode_frame(StreamData(id=stream, payload=b"x")))


def test_a_stream_ended_both_ways_is_forgotten() -> None:
    leader, agent = _pair()
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id="d", end=True))
    _pump(leader, agent)
    assert agent.has_stream(stream)
    agent.send_data(stream, b"", end=True)
    assert not agent.has_stream(stream)
    _pump(agent, leader)
    assert not leader.has_stream(stream)


def test_a_reset_names_its_reason_and_an_unknown_stream_needs_none() -> None:
    leader, agent = _pair()
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id="d"))
    _pump(leader, agent)
    leader.reset_stream(99, "cancelled")
    assert leader.data_to_send() == []
    leader.reset_stream(stream, "cancelled", "client went away")
    assert _sent(leader) == [StreamReset(id=stream, code="cancelled", message="client went away")]


def test_a_stream_is_forgotten_whichever_end_finishes_first() -> None:
    leader, agent = _pair()
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id="d"))
    _pump(leader, agent)
    agent.send_head(StreamHead(id=stream, status=200, end=True))  # the agent ends first
    assert agent.has_stream(stream)  # its request body may still come
    _pump(agent, leader)
    assert leader.has_stream(stream)
    leader.send_data(stream, b"", end=True)
    assert not leader.has_stream(stream)  # the remote end came first, then the local one
    _pump(leader, agent)
    assert not agent.has_stream(stream)  # the local end came first, then the remote one


def test_a_reset_without_a_reason_says_nothing() -> None:
    leader, agent = _pair()
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id="d"))
    _pump(leader, agent)
    leader.reset_stream(stream, "cancelled")
    assert _sent(leader) == [StreamReset(id=stream, code="cancelled", message="")]


def test_greetings_are_taken_by_their_receiver_once_and_must_be_greetings() -> None:
    leader, agent = LinkSession(Role.LEADER), LinkSession(Role.AGENT)
    hello = encode_frame(_hello())
    with pytest.raises(LinkError, match=r"^only the leader receives Hello$"):
        agent.receive_hello(hello)
    with pytest.raises(LinkError, match=r"^only the agent receives Welcome$"):
        leader.receive_welcome(hello)
    beat = encode_frame(Heartbeat(sent_at=1.0))
    with pytest.raises(
        ProtocolError, match=r"^the agent's first frame must be Hello, not Heartbeat$"
    ):
        LinkSession(Role.LEADER).receive_hello(beat)
    with pytest.raises(ProtocolError, match=r"^the leader's first frame must be Welcome, not "):
        LinkSession(Role.AGENT).receive_welcome(beat)
    unknown = bytes([200, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ProtocolError, match=r"^the first frame must be Hello or Welcome, not unk"):
        LinkSession(Role.LEADER).receive_hello(unknown)
    leader.receive_hello(hello)
    with pytest.raises(LinkError, match=r"^the handshake's first frame was already taken$"):
        leader.receive_hello(hello)
    _leader, opened = _pair()
    with pytest.raises(LinkError, match=r"^the handshake's first frame was already taken$"):
        opened.receive_welcome(hello)


def test_frames_out_of_place_are_named() -> None:
    leader = LinkSession(Role.LEADER)
    leader.receive_hello(encode_frame(_hello()))
    with pytest.raises(ProtocolError, match=r"^the agent sent more before the leader's Welcome$"):
        leader.receive_message(encode_frame(Heartbeat(sent_at=1.0)))
    leader, agent = _pair()
    with pytest.raises(ProtocolError, match=r"^only agents send Heartbeat$"):
        agent.receive_message(encode_frame(Heartbeat(sent_at=1.0)))
    with pytest.raises(ProtocolError, match=r"^only the leader opens streams$"):
        leader.receive_message(encode_frame(StreamOpen(id=1, kind="http", deployment_id="d")))
    with pytest.raises(ProtocolError, match=r"^only agents answer streams$"):
        agent.receive_message(encode_frame(StreamHead(id=1, status=200)))


def test_each_end_opens_or_answers_streams_as_its_role_says() -> None:
    leader, agent = _pair()
    with pytest.raises(LinkError, match=r"^the agent does not send StreamOpen$"):
        agent.open_stream(StreamOpen(kind="http", deployment_id="d"))
    with pytest.raises(LinkError, match=r"^the leader does not send StreamHead$"):
        leader.send_head(StreamHead(id=1, status=200))


def test_a_session_applies_its_own_frame_limit() -> None:
    window = 64 * 1024
    limits = LinkLimits(stream_window_bytes=window, max_frame_bytes=window + MAX_JSON_BYTES + 10)
    big = encode_frame(StreamData(id=1, payload=b"x" * (limits.max_frame_bytes + 1)))
    with pytest.raises(ProtocolError) as first:
        LinkSession(Role.LEADER, limits).receive_hello(big)
    assert first.value.code == CloseCode.FRAME_TOO_LARGE
    leader, _agent = _pair(limits)
    with pytest.raises(ProtocolError) as later:
        leader.receive_message(big)
    assert later.value.code == CloseCode.FRAME_TOO_LARGE


def test_an_answer_that_ends_a_finished_request_forgets_the_stream() -> None:
    leader, agent = _pair()
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id="d", end=True))
    _pump(leader, agent)
    agent.send_head(StreamHead(id=stream, status=204, end=True))
    assert not agent.has_stream(stream)


def test_welcome_carries_the_leaders_capabilities_and_a_version_we_do_not_speak_is_named() -> None:
    leader, agent = LinkSession(Role.LEADER), LinkSession(Role.AGENT)
    agent.send_hello(_hello())
    _pump(agent, leader)
    terms = WelcomeTerms(node_id="n-1", leader_version="0.1.0", capabilities=("routing",))
    assert leader.accept(terms, server_time=1.0).capabilities == ["routing"]
    (welcome,) = _sent(leader)
    assert isinstance(welcome, Welcome) and welcome.capabilities == ["routing"]
    future = msgspec.structs.replace(welcome, protocol_version=99)
    with pytest.raises(ProtocolError, match=r"^leader chose protocol 99, outside 1-1$") as caught:
        LinkSession(Role.AGENT).receive_welcome(encode_frame(future))
    assert caught.value.code == CloseCode.UNSUPPORTED_VERSION


def test_an_agent_of_another_protocol_range_is_told_both_ranges() -> None:
    leader = LinkSession(Role.LEADER)
    old = msgspec.structs.replace(_hello(), protocol_min=7, protocol_max=8)
    leader.receive_hello(encode_frame(old))
    with pytest.raises(
        ProtocolError, match=r"^agent speaks protocol 7-8, the leader 1-1$"
    ) as caught:
        leader.accept(TERMS, server_time=1.0)
    assert caught.value.code == CloseCode.UNSUPPORTED_VERSION
