"""The receive side's per-event path, sans I/O: ``LinkSession.receive_data`` hands a
``STREAM_DATA`` frame's payload to a sink with no frame or event object, and must do exactly
what ``receive_message`` does with the same bytes (the same payloads, the same refusals with
the same codes and words, the same state after), which these tests check side by side."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from berth.cluster.protocol.errors import CloseCode, ProtocolError
from berth.cluster.protocol.events import DataReceived
from berth.cluster.protocol.frames import (
    HEADER_BYTES,
    STREAM_DATA_PREFIX,
    FrameType,
    Hello,
    StreamData,
    StreamHead,
    StreamOpen,
    decode_data,
    decode_frame,
    encode_frame,
)
from berth.cluster.protocol.handshake import WelcomeTerms
from berth.cluster.protocol.limits import LinkLimits
from berth.cluster.protocol.payloads import Inventory
from berth.cluster.protocol.session import LinkSession, Role

LIMITS = LinkLimits(stream_window_bytes=64 * 1024)
WINDOW = LIMITS.stream_window_bytes
Outcome = tuple[int, bytes, bool] | tuple[str, str, int | None]


def _greeted() -> tuple[LinkSession, LinkSession]:
    leader, agent = LinkSession(Role.LEADER, LIMITS), LinkSession(Role.AGENT, LIMITS)
    inventory = Inventory(hostname="gpu-a")
    agent.send_hello(Hello(protocol_min=1, protocol_max=1, agent_version="0", inventory=inventory))
    for message in agent.data_to_send():
        leader.receive_message(message)
    leader.accept(WelcomeTerms(node_id="n-1", leader_version="0"), server_time=1.0)
    for message in leader.data_to_send():
        agent.receive_message(message)
    return leader, agent


def _answering_leader() -> LinkSession:
    """A leader with stream 1 open (its request sent whole) and the answer's head taken."""
    leader, _agent = _greeted()
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id="d", end=True))
    leader.data_to_send()
    leader.receive_message(encode_frame(StreamHead(id=stream, status=200)))
    return leader


def _fast(session: LinkSession, messages: list[bytes]) -> list[Outcome]:
    """Each message through ``receive_data``: what reached the sink, or what was raised."""
    outcomes: list[Outcome] = []

    def sink(stream_id: int, payload: bytes, end: bool) -> None:
        outcomes.append((stream_id, payload, end))

    for message in messages:
        assert message[:1] == STREAM_DATA_PREFIX
        try:
            session.receive_data(message, sink)
        except ProtocolError as exc:
            outcomes.append(("raised", str(exc), exc.code))
            break
    return outcomes


def _generic(session: LinkSession, messages: list[bytes]) -> list[Outcome]:
    """The same through ``receive_message``."""
    outcomes: list[Outcome] = []
    for message in messages:
        try:
            event = session.receive_message(message)
        except ProtocolError as exc:
            outcomes.append(("raised", str(exc), exc.code))
            break
        if event is not None:
            assert isinstance(event, DataReceived)
            outcomes.append((event.stream_id, event.data, event.end))
    return outcomes


def _data(stream_id: int, payload: bytes, end: bool = False) -> bytes:
    return encode_frame(StreamData(id=stream_id, payload=payload, end=end))


def _with_body(stream_id: int) -> bytes:
    header = bytes([int(FrameType.STREAM_DATA), 0]) + stream_id.to_bytes(4, "big")
    return header + (2).to_bytes(4, "big") + b"{}"


CASES: dict[str, list[bytes]] = {
    "events then the end": [
        _data(1, b"data: a\n\n"),
        _data(1, b"data: b\n\n"),
        _data(1, b"", True),
    ],
    "a stream already forgotten": [_data(7, b"late")],
    "data after the end": [_data(1, b"last", True), _data(1, b"more")],
    "the whole window, then a byte over it": [_data(1, b"x" * WINDOW), _data(1, b"x")],
    "larger than a frame may be": [_data(1, b"x" * LIMITS.max_frame_bytes)],
    "shorter than a header": [STREAM_DATA_PREFIX + b"\x00\x00"],
    "a data frame with a JSON body": [_with_body(1)],
}


@pytest.mark.parametrize("messages", list(CASES.values()), ids=list(CASES))
def test_the_data_path_does_what_the_generic_path_does(messages: list[bytes]) -> None:
    fast_session, generic_session = _answering_leader(), _answering_leader()

    fast = _fast(fast_session, messages)
    generic = _generic(generic_session, messages)

    assert fast == generic
    assert fast_session.has_stream(1) == generic_session.has_stream(1)
    assert fast_session.open_streams == generic_session.open_streams


def test_data_frames_reach_the_sink_in_order_and_the_end_forgets_the_stream() -> None:
    leader = _answering_leader()

    outcomes = _fast(leader, CASES["events then the end"])

    assert outcomes == [(1, b"data: a\n\n", False), (1, b"data: b\n\n", False), (1, b"", True)]
    assert not leader.has_stream(1)  # ended both ways
    assert leader.data_to_send() == []  # taking data sends nothing


def test_refusals_carry_the_generic_codes() -> None:
    too_large = _fast(_answering_leader(), CASES["larger than a frame may be"])
    over = _fast(_answering_leader(), CASES["the whole window, then a byte over it"])

    assert too_large[-1][2] == CloseCode.FRAME_TOO_LARGE
    assert over[-1] == ("raised", "1 bytes on stream 1 exceed the 0 granted",
                        CloseCode.PROTOCOL_ERROR)  # fmt: skip


def test_a_closed_session_takes_data_and_hands_nothing_on() -> None:
    leader = _answering_leader()
    leader.close()

    assert _fast(leader, [_data(1, b"x")]) == []


def test_data_during_the_handshake_is_refused_as_the_generic_path_refuses_it() -> None:
    fresh: Callable[[], LinkSession] = lambda: LinkSession(Role.LEADER, LIMITS)  # noqa: E731

    assert _fast(fresh(), [_data(1, b"x")]) == _generic(fresh(), [_data(1, b"x")])
    assert _fast(fresh(), [_data(1, b"x")])[0][0] == "raised"


def test_decode_data_reads_what_decode_frame_reads() -> None:
    message = _data(5, b"payload", end=True)

    assert decode_data(message) == (5, b"payload", True)
    assert decode_frame(message) == StreamData(id=5, payload=b"payload", end=True)
    assert len(message) == HEADER_BYTES + len(b"payload")


def test_consume_says_whether_it_queued_a_grant() -> None:
    leader, agent = _greeted()
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id="d"))
    for message in leader.data_to_send():
        agent.receive_message(message)
    agent.receive_message(_data(stream, b"x" * WINDOW))

    assert agent.consume(stream, WINDOW // 2 - 1) is False
    assert agent.data_to_send() == []
    assert agent.consume(stream, 1) is True
    assert len(agent.data_to_send()) == 1
