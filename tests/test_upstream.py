"""berth's HTTP/1.1 client to engines, against raw asyncio servers on loopback: keep-alive
reuse, message framing, flow control, abandoned answers and the errors it raises."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from berth.engine_http.errors import (
    UpstreamConnectError,
    UpstreamDisconnectError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
)
from berth.engine_http.origin import Origin, parse_origin
from berth.engine_http.pool import UpstreamPool

JSON = b'{"ok": true}'
HEADERS = [(b"content-type", b"application/json")]


@dataclass
class RawRequest:
    """One request as the server read it; ``connection`` numbers the TCP connection from 0."""

    connection: int
    index_on_connection: int
    head: bytes
    body: bytes

    @property
    def request_line(self) -> bytes:
        return self.head.split(b"\r\n", 1)[0]

    def header(self, name: bytes) -> bytes | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name:
                return value.strip()
        return None


Handler = Callable[[RawRequest, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class RawServer:
    """An HTTP/1.1 server that reads requests itself and lets each test write the answer."""

    handler: Handler
    origin: Origin = field(default_factory=lambda: Origin("127.0.0.1", 0))
    connections: int = 0
    requests: list[RawRequest] = field(default_factory=list)
    closed_by_client: list[asyncio.Event] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        gone = asyncio.Event()
        self.closed_by_client.append(gone)
        index = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    gone.set()  # the client closed the connection
                    return
                request = RawRequest(number, index, head, b"")
                request.body = await reader.readexactly(int(request.header(b"content-length") or 0))
                self.requests.append(request)
                index += 1
                await self.handler(request, reader, writer)
                if writer.is_closing():
                    return
        except ConnectionError:
            gone.set()
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[RawServer]:
    state = RawServer(handler)
    server = await asyncio.start_server(state.serve, "127.0.0.1", 0)
    state.origin = Origin("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def upstream_pool(**options: Any) -> AsyncIterator[UpstreamPool]:
    pool = UpstreamPool(**options)
    try:
        yield pool
    finally:
        await pool.close()


def answer(body: bytes = JSON, *, status: int = 200, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status,
        len(body),
        extra,
        body,
    )


async def json_answer(
    request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter
) -> None:
    w.write(answer())
    await w.drain()


async def get(pool: UpstreamPool, origin: Origin, body: bytes = b"{}") -> bytes:
    response = await pool.request(origin, b"POST", b"/v1/chat/completions", HEADERS, body)
    try:
        return await response.read()
    finally:
        response.close()


async def until(condition: Callable[[], bool], timeout_s: float = 1.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


# -- engines for the read and the push tests alike ---------------------------------------------


async def half_then_silent(
    request: RawRequest, reader: asyncio.StreamReader, w: asyncio.StreamWriter
) -> None:
    """Five bytes of ten, then nothing until the client goes."""
    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345")
    await w.drain()
    await reader.read()
    raise ConnectionResetError


async def half_then_closed(
    request: RawRequest, reader: asyncio.StreamReader, w: asyncio.StreamWriter
) -> None:
    """Five bytes of ten, then the connection closed."""
    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345")
    await w.drain()
    w.close()


class Flood:
    """An engine writing 32 MiB (far more than the socket buffers hold) as fast as it is
    read; ``written`` counts what it got rid of."""

    piece = b"y" * 65536
    count = 512

    def __init__(self) -> None:
        self.written = 0

    async def __call__(
        self, request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(self.piece) * self.count))
        for _number in range(self.count):
            w.write(self.piece)
            await w.drain()
            self.written += len(self.piece)


# -- requests and keep-alive -------------------------------------------------------------------


async def test_a_request_arrives_as_given_with_host_and_content_length() -> None:
    big = b"x" * 200_000  # written after the head, not joined to it
    async with raw_server(json_answer) as server, upstream_pool() as pool:
        headers = [(b"content-type", b"application/json"), (b"x-request-id", b"abc")]
        response = await pool.request(server.origin, b"POST", b"/v1/embeddings?a=1", headers, big)
        assert (response.status, await response.read()) == (200, JSON)
        assert response.header(b"content-type") == b"application/json"
        assert response.content_length == len(JSON)
        response.close()
    request = server.requests[0]
    assert request.request_line == b"POST /v1/embeddings?a=1 HTTP/1.1"
    assert request.header(b"host") == b"127.0.0.1:%d" % server.origin.port
    assert request.header(b"x-request-id") == b"abc"
    assert request.header(b"content-length") == b"200000"
    assert request.body == big


async def test_sequential_requests_share_one_connection() -> None:
    async with raw_server(json_answer) as server, upstream_pool() as pool:
        for _ in range(5):
            assert await get(pool, server.origin) == JSON
        assert (pool.open_connections, pool.idle_connections) == (1, 1)
    assert server.connections == 1
    assert [r.index_on_connection for r in server.requests] == [0, 1, 2, 3, 4]


async def test_concurrent_requests_each_get_a_connection_then_reuse_them() -> None:
    async with raw_server(json_answer) as server, upstream_pool() as pool:
        for _ in range(3):
            results = await asyncio.gather(*(get(pool, server.origin) for _ in range(8)))
            assert results == [JSON] * 8
    assert server.connections == 8
    assert len(server.requests) == 24


async def test_a_connection_idle_past_the_idle_timeout_is_closed_and_not_reused() -> None:
    async with raw_server(json_answer) as server, upstream_pool(idle_timeout_s=0.05) as pool:
        assert await get(pool, server.origin) == JSON
        await asyncio.wait_for(server.closed_by_client[0].wait(), 10.0)  # the pool closed it
        assert pool.idle_connections == 0

        assert await get(pool, server.origin) == JSON
    assert [r.connection for r in server.requests] == [0, 1]


async def test_a_connection_reused_within_the_idle_timeout_stays_open() -> None:
    async with raw_server(json_answer) as server, upstream_pool(idle_timeout_s=3600.0) as pool:
        for _ in range(3):
            assert await get(pool, server.origin) == JSON
        assert pool.idle_connections == 1
    assert server.connections == 1


async def test_close_idle_closes_idle_connections_and_the_next_request_makes_one() -> None:
    async with raw_server(json_answer) as server, upstream_pool() as pool:
        assert await get(pool, server.origin) == JSON
        assert pool.close_idle() == 1
        assert pool.idle_connections == 0

        assert await get(pool, server.origin) == JSON
    assert server.connections == 2


async def test_max_connections_makes_requests_wait_for_a_free_one() -> None:
    async with raw_server(json_answer) as server, upstream_pool(max_connections=1) as pool:
        results = await asyncio.gather(*(get(pool, server.origin) for _ in range(4)))
        assert results == [JSON] * 4
    assert server.connections == 1


@pytest.mark.parametrize("extra", [b"connection: close\r\n", b"Connection: Close\r\n"])
async def test_connection_close_is_honoured(extra: bytes) -> None:
    async def close_after(
        request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        w.write(answer(extra=extra))
        await w.drain()

    async with raw_server(close_after) as server, upstream_pool() as pool:
        assert await get(pool, server.origin) == JSON
        assert await get(pool, server.origin) == JSON
        await until(lambda: pool.open_connections == 0)
    assert server.connections == 2


async def test_an_http_1_0_answer_without_keep_alive_is_not_reused() -> None:
    async def old(request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(answer().replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        await w.drain()

    async with raw_server(old) as server, upstream_pool() as pool:
        assert await get(pool, server.origin) == JSON
        assert await get(pool, server.origin) == JSON
    assert server.connections == 2


# -- framing -----------------------------------------------------------------------------------


async def test_a_chunked_body_is_relayed_chunk_by_chunk_as_it_arrives() -> None:
    go_on = asyncio.Event()

    async def chunked(
        request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n7\r\ndata: 1\r\n")
        await w.drain()
        await go_on.wait()
        w.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await w.drain()

    async with raw_server(chunked) as server, upstream_pool() as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        assert response.content_length is None
        assert await response.read_chunk() == b"data: 1"  # before the engine wrote the rest
        assert not response.at_eof
        go_on.set()
        assert await response.read_chunk() == b"data: 2"
        assert await response.read_chunk() == b""
        assert response.at_eof
        response.close()
        assert await get(pool, server.origin) == b"data: 1data: 2"
    assert server.connections == 1


async def test_a_close_delimited_body_ends_when_the_engine_closes() -> None:
    async def until_close(
        request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        w.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"a": ')
        await w.drain()
        await asyncio.sleep(0.02)
        w.write(b"1}")
        await w.drain()
        w.close()

    async with raw_server(until_close) as server, upstream_pool() as pool:
        assert await get(pool, server.origin) == b'{"a": 1}'
        assert await get(pool, server.origin) == b'{"a": 1}'
        assert pool.open_connections == 0
    assert server.connections == 2


async def test_an_answer_split_into_many_reads_is_parsed_whole() -> None:
    data = answer(b'{"text": "d\xc3\xa9j\xc3\xa0 vu"}', extra=b"x-trace: 1\r\n")

    async def dribble(
        request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        for i in range(0, len(data), 7):
            w.write(data[i : i + 7])
            await w.drain()
            await asyncio.sleep(0.001)

    async with raw_server(dribble) as server, upstream_pool() as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        assert response.header(b"x-trace") == b"1"
        assert (await response.read()).decode() == '{"text": "déjà vu"}'
        response.close()
        assert await get(pool, server.origin) == b'{"text": "d\xc3\xa9j\xc3\xa0 vu"}'
    assert server.connections == 1


async def test_interim_answers_are_skipped_and_bodyless_statuses_end_at_once() -> None:
    async def early_hints(
        request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        if request.index_on_connection == 0:
            w.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + answer())
        else:
            w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await w.drain()

    async with raw_server(early_hints) as server, upstream_pool() as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        assert response.status == 200 and response.header(b"link") is None
        assert await response.read() == JSON
        response.close()
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        assert (response.status, await response.read()) == (204, b"")
        response.close()
    assert server.connections == 1


async def test_read_stops_at_its_limit_and_closes_the_rest() -> None:
    async def long(request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(answer(b"e" * 100_000, status=500))
        await w.drain()

    async with raw_server(long) as server, upstream_pool() as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        assert response.status == 500
        assert await response.read(1000) == b"e" * 1000
        response.close()


# -- flow control ------------------------------------------------------------------------------


async def test_an_unread_body_stops_the_reading_from_the_engine() -> None:
    flood = Flood()
    piece, count = flood.piece, flood.count

    async with raw_server(flood) as server, upstream_pool(high_water_bytes=65536) as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        await asyncio.sleep(0.5)  # nothing is read meanwhile
        stalled_at = flood.written
        assert stalled_at < 16 * 1024 * 1024
        await asyncio.sleep(0.2)
        assert flood.written - stalled_at <= 4 * len(piece)  # it really stopped

        received = 0
        largest = 0
        while chunk := await response.read_chunk():
            received += len(chunk)
            largest = max(largest, len(chunk))
        assert received == len(piece) * count
        assert largest <= 2 * 1024 * 1024  # what is held is bounded too
        response.close()
        assert pool.idle_connections == 1


# -- abandoned answers -------------------------------------------------------------------------


async def test_an_answer_abandoned_mid_body_closes_its_connection() -> None:
    async def endless(
        request: RawRequest, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n7\r\ndata: 1\r\n")
        await w.drain()
        await reader.read()  # until the client goes
        raise ConnectionResetError

    async with raw_server(endless) as server, upstream_pool() as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        assert await response.read_chunk() == b"data: 1"
        response.close()
        await asyncio.wait_for(server.closed_by_client[0].wait(), 1.0)
        assert pool.open_connections == 0


async def test_a_request_cancelled_before_the_answer_closes_its_connection() -> None:
    async def stall(
        request: RawRequest, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        await reader.read()
        raise ConnectionResetError

    async with raw_server(stall) as server, upstream_pool() as pool:
        task = asyncio.create_task(get(pool, server.origin))
        await until(lambda: bool(server.requests))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.closed_by_client[0].wait(), 1.0)
        assert pool.open_connections == 0


# -- errors ------------------------------------------------------------------------------------


async def test_a_stale_pooled_connection_is_replaced_and_the_request_sent_again() -> None:
    async def close_idle(
        request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        if request.index_on_connection == 1:
            w.close()  # as an engine's keep-alive timeout does, just as the request arrives
        else:
            w.write(answer())
            await w.drain()

    async with raw_server(close_idle) as server, upstream_pool() as pool:
        assert await get(pool, server.origin) == JSON
        assert await get(pool, server.origin) == JSON
    assert server.connections == 2
    assert [(r.connection, r.index_on_connection) for r in server.requests] == [
        (0, 0),
        (0, 1),
        (1, 0),
    ]


async def test_a_new_connection_closed_before_answering_is_not_retried() -> None:
    async def close(request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    async with raw_server(close) as server, upstream_pool() as pool:
        with pytest.raises(UpstreamDisconnectError) as caught:
            await get(pool, server.origin)
    assert not caught.value.answered
    assert server.connections == 1


async def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = Origin("127.0.0.1", sock.getsockname()[1])  # nothing listens once closed
    async with upstream_pool() as pool:
        with pytest.raises(UpstreamConnectError, match="refused the connection") as caught:
            await get(pool, dead)
        assert not caught.value.timed_out
        assert pool.open_connections == 0


async def test_no_head_within_the_read_timeout_is_a_timeout_and_closes_the_connection() -> None:
    async def stall(
        request: RawRequest, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        await reader.read()
        raise ConnectionResetError

    async with raw_server(stall) as server, upstream_pool(read_timeout_s=0.1) as pool:
        with pytest.raises(UpstreamTimeoutError):
            await get(pool, server.origin)
        await asyncio.wait_for(server.closed_by_client[0].wait(), 1.0)
        assert pool.open_connections == 0


async def test_a_pause_mid_body_past_the_read_timeout_is_a_timeout() -> None:
    async with raw_server(half_then_silent) as server, upstream_pool(read_timeout_s=0.1) as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        assert await response.read_chunk() == b"12345"
        with pytest.raises(UpstreamTimeoutError):
            await response.read_chunk()
        response.close()
        await asyncio.wait_for(server.closed_by_client[0].wait(), 1.0)


async def test_a_connection_dropped_mid_body_is_a_disconnect_after_the_bytes_that_came() -> None:
    async with raw_server(half_then_closed) as server, upstream_pool() as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        chunks = []
        with pytest.raises(UpstreamDisconnectError) as caught:
            while True:
                chunks.append(await response.read_chunk())
        response.close()
    assert b"".join(chunks) == b"12345"
    assert caught.value.answered


async def test_a_malformed_answer_is_a_protocol_error() -> None:
    async def garbage(
        request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        w.write(b"SMTP ready\r\n\r\n")
        await w.drain()

    async with raw_server(garbage) as server, upstream_pool() as pool:
        with pytest.raises(UpstreamProtocolError):
            await get(pool, server.origin)
        assert pool.open_connections == 0


async def test_a_header_that_would_split_the_request_is_refused() -> None:
    async with raw_server(json_answer) as server, upstream_pool() as pool:
        with pytest.raises(ValueError, match="CR or LF"):
            await pool.request(server.origin, b"POST", b"/", [(b"x-a", b"1\r\nx-b: 2")], b"")
    assert server.connections == 0


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        ("http://127.0.0.1:8080", Origin("127.0.0.1", 8080)),
        ("http://engine.local/", Origin("engine.local", 80)),
        ("http://[::1]:9000/prefix", Origin("::1", 9000)),
    ],
)
def test_parse_origin(url: str, origin: Origin) -> None:
    assert parse_origin(url) == origin


@pytest.mark.parametrize("url", ["https://h:1", "unix:///tmp/s", "http://:80"])
def test_parse_origin_refuses_what_it_cannot_reach(url: str) -> None:
    with pytest.raises(ValueError):
        parse_origin(url)


# -- pushed bodies -----------------------------------------------------------------------------


@dataclass
class Collected:
    """A :class:`~berth.engine_http.answer.BodySink` that keeps what it is handed."""

    pieces: list[bytes] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    failure: Exception | None = None

    @property
    def body(self) -> bytes:
        return b"".join(self.pieces)

    def body_received(self, data: bytes, end: bool) -> None:
        self.pieces.append(data)
        if end:
            self.ended.set()

    def body_failed(self, error: Exception) -> None:
        self.failure = error
        self.ended.set()


async def test_a_pushed_body_arrives_piece_by_piece_with_its_end_and_pools_the_connection() -> None:
    async def events(request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(b"9\r\ndata: 2\n\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(b"0\r\n\r\n")
        await w.drain()

    async with raw_server(events) as server, upstream_pool() as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        sink = Collected()
        response.push_body(sink)
        await asyncio.wait_for(sink.ended.wait(), 5.0)
        assert sink.failure is None
        assert sink.body == b"data: 1\n\ndata: 2\n\n"
        assert len(sink.pieces) >= 3  # as the engine wrote them, the last with the end
        response.close()
        assert pool.idle_connections == 1


async def test_a_paused_push_stops_the_reading_from_the_engine_and_resumes() -> None:
    flood = Flood()
    piece, count = flood.piece, flood.count

    async with raw_server(flood) as server, upstream_pool() as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        sink = Collected()
        response.push_body(sink)
        response.pause_body()
        await asyncio.sleep(0.5)  # paused meanwhile
        stalled_at = flood.written
        assert stalled_at < 16 * 1024 * 1024
        await asyncio.sleep(0.2)
        assert flood.written - stalled_at <= 4 * len(piece)  # it really stopped

        response.resume_body()
        await asyncio.wait_for(sink.ended.wait(), 10.0)
        assert sink.failure is None
        assert len(sink.body) == len(piece) * count
        response.close()


async def test_a_pushed_body_silent_past_the_read_timeout_fails_unless_paused() -> None:
    async with raw_server(half_then_silent) as server, upstream_pool(read_timeout_s=0.1) as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        sink = Collected()
        response.push_body(sink)
        await until(lambda: sink.body == b"12345")
        response.pause_body()  # a slow client: the engine's silence does not count
        await asyncio.sleep(0.3)
        assert sink.failure is None

        response.resume_body()
        await asyncio.wait_for(sink.ended.wait(), 2.0)
        assert isinstance(sink.failure, UpstreamTimeoutError)
        response.close()
        await asyncio.wait_for(server.closed_by_client[0].wait(), 1.0)


async def test_a_connection_dropped_mid_push_fails_it_after_the_bytes_that_came() -> None:
    async with raw_server(half_then_closed) as server, upstream_pool() as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        sink = Collected()
        response.push_body(sink)
        await asyncio.wait_for(sink.ended.wait(), 2.0)
        assert sink.body == b"12345"
        assert isinstance(sink.failure, UpstreamDisconnectError)
        response.close()


async def test_a_closed_answer_pushes_nothing_more_and_closes_its_connection() -> None:
    async def endless(
        request: RawRequest, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(200):
                w.write(b"7\r\ndata: 1\r\n")
                await w.drain()
                await asyncio.sleep(0.01)
        raise ConnectionResetError

    async with raw_server(endless) as server, upstream_pool() as pool:
        response = await pool.request(server.origin, b"POST", b"/", HEADERS, b"{}")
        sink = Collected()
        response.push_body(sink)
        await until(lambda: len(sink.pieces) >= 2)
        response.close()
        count = len(sink.pieces)
        await asyncio.wait_for(server.closed_by_client[0].wait(), 2.0)
        await asyncio.sleep(0.05)
        assert len(sink.pieces) == count
        assert sink.failure is None
        assert pool.open_connections == 0
