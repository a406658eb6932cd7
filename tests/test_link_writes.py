"""The link's per-event shortcuts: writes coalesced per pass of the loop
(``cluster/link/write_batch.py``), a tunnel stream's one read timer, and stream data sent from the
relaying task in order with what the writer task has queued."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from berth.cluster.link.connection import LinkConnection
from berth.cluster.link.tunnel_stream import StreamResetError, TunnelStream
from berth.cluster.link.write_batch import (
    FLUSH_AT_BYTES,
    BatchingTransport,
    coalesce_writes,
    frame_writer,
)
from berth.cluster.protocol.frames import StreamOpen, decode_frame
from berth.cluster.protocol.session import Role, SessionState


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def _batched() -> tuple[_Transport, BatchingTransport]:
    transport = _Transport()
    ws = SimpleNamespace(_writer=SimpleNamespace(transport=transport))
    batching = coalesce_writes(ws)
    assert batching is not None and ws._writer.transport is batching
    return transport, batching


async def test_writes_of_one_pass_leave_as_one_in_order() -> None:
    transport, batching = _batched()
    batching.write(b"one")
    batching.write(bytearray(b"two"))
    batching.write(b"three")
    assert transport.writes == []
    await asyncio.sleep(0)
    assert transport.writes == [b"onetwothree"]
    batching.write(b"four")
    await asyncio.sleep(0)
    assert transport.writes == [b"onetwothree", b"four"]


async def test_a_large_write_goes_at_once_after_what_is_held() -> None:
    transport, batching = _batched()
    batching.write(b"small")
    big = b"x" * FLUSH_AT_BYTES
    batching.write(big)
    assert transport.writes == [b"small" + big]
    await asyncio.sleep(0)
    assert transport.writes == [b"small" + big]


async def test_close_writes_what_is_held_and_the_rest_is_the_transports() -> None:
    transport, batching = _batched()
    batching.write(b"close frame")
    batching.close()
    assert transport.writes == [b"close frame"] and transport.closed
    assert batching.is_closing()
    assert batching.get_extra_info("peername") == "info:peername"
    batching.write(b"late")
    await asyncio.sleep(0)
    assert transport.writes == [b"close frame"]  # a closing transport gets nothing more


class _FakeWsWriter:
    """aiohttp's ``WebSocketWriter`` as ``frame_writer`` sees it."""

    def __init__(self) -> None:
        self.protocol = SimpleNamespace(writing_paused=False)
        self.transport = _Transport()
        self.compress = 0
        self._closing = False
        self.frames: list[tuple[bytes, int, int]] = []

    def _write_websocket_frame(self, message: bytes, opcode: int, rsv: int) -> None:
        self.frames.append((message, opcode, rsv))


async def test_a_frame_writer_writes_binary_frames_with_aiohttps_writer_when_ready() -> None:
    writer = _FakeWsWriter()
    frames = frame_writer(SimpleNamespace(_writer=writer))
    assert frames is not None and frames.ready
    frames.write(b"payload")
    assert writer.frames == [(b"payload", 0x2, 0)]  # RFC 6455: opcode 2, no RSV bits
    writer.protocol.writing_paused = True
    assert not frames.ready  # the socket is behind: the link leaves it to send_bytes
    writer.protocol.writing_paused = False
    writer._closing = True
    assert not frames.ready

    compressing = _FakeWsWriter()
    compressing.compress = 15
    assert frame_writer(SimpleNamespace(_writer=compressing)) is None
    assert frame_writer(SimpleNamespace(_writer=SimpleNamespace(transport=_Transport()))) is None
    assert frame_writer(object()) is None


async def test_other_websockets_are_left_alone() -> None:
    assert coalesce_writes(object()) is None
    assert coalesce_writes(SimpleNamespace(_writer=None)) is None
    _, batching = _batched()
    ws = SimpleNamespace(_writer=SimpleNamespace(transport=batching))
    assert coalesce_writes(ws) is None  # not wrapped twice


def _reader_stream() -> TunnelStream:
    carrier: Any = SimpleNamespace(consume=lambda stream_id, size: None)
    return TunnelStream(carrier, 1, None)


async def test_read_timeout_is_per_wait_with_one_timer() -> None:
    stream = _reader_stream()
    loop = asyncio.get_running_loop()
    # Events closer together than the timeout: no read times out, however long it all takes.
    for i in range(6):
        loop.call_later(0.03, stream.data_received, b"event %d" % i, False)
        assert await stream.read(0.08) == b"event %d" % i
    with pytest.raises(TimeoutError):
        await stream.read(0.05)
    stream.data_received(b"late", True)
    assert await stream.read(0.05) == b"late"
    assert await stream.read(0.05) == b""


async def test_a_reset_ends_a_timed_read_and_release_stops_the_timer() -> None:
    stream = _reader_stream()
    reading = asyncio.create_task(stream.read(5.0))
    await asyncio.sleep(0.01)
    stream.abort(StreamResetError("reset", None))
    with pytest.raises(StreamResetError):
        await reading
    assert stream._read_timer is not None
    stream.conn = SimpleNamespace(  # type: ignore[assignment]
        has_stream=lambda stream_id: False, forget_stream=lambda stream_id: None
    )
    stream.release()
    assert stream._read_timer is None


class _SlowSocket:
    """A WebSocket whose sends wait for ``gate`` (a socket that is full)."""

    close_code = None

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.gate = asyncio.Event()

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)
        await self.gate.wait()


async def test_direct_and_queued_sends_keep_their_order() -> None:
    ws = _SlowSocket()
    conn = LinkConnection(Role.LEADER, ws, handler=None, peer="agent")  # type: ignore[arg-type]
    conn._session.state = SessionState.OPEN  # no handshake needed to send frames
    conn._output.start()
    streams = [conn.open_stream(StreamOpen(id=0, kind="http", deployment_id="d")) for _ in range(3)]
    ws.gate.set()
    await asyncio.sleep(0.01)  # the writer task sends the opening frames
    a, b, c = (stream.id for stream in streams)
    ws.gate.clear()
    first = asyncio.create_task(streams[0].write(b"a"))  # nothing queued: sent directly
    await asyncio.sleep(0.01)
    second = asyncio.create_task(streams[1].write(b"b"))  # behind the send that waits
    await asyncio.sleep(0.01)
    assert len(ws.sent) == 4
    ws.gate.set()
    await asyncio.gather(first, second)
    await asyncio.sleep(0.01)
    await streams[2].write(b"c", end=True)
    ids = [(type(frame).__name__, frame.id) for frame in map(decode_frame, ws.sent) if frame]
    assert ids == [("StreamOpen", a), ("StreamOpen", b), ("StreamOpen", c),
                   ("StreamData", a), ("StreamData", b), ("StreamData", c)]  # fmt: skip
    conn._output.writer.cancel()  # type: ignore[union-attr]
