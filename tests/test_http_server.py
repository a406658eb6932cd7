"""berth's HTTP/1.1 server on real sockets: its bounds (head size and lines, head, idle and
body timeouts, connection caps), keep-alive, pipelining, ``Expect: 100-continue``, HEAD,
chunked bodies, write flow control and graceful shutdown, plain and over real TLS."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httptools
import httpx
import pytest

from berth.cluster.pki.ca import CertificateAuthority
from berth.http_server.limits import ConnectionGate, DiscardBudget, ListenerLimits
from berth.http_server.request import Request
from berth.http_server.server import HttpServer
from berth.http_server.writer import ResponseWriter

FAST = ListenerLimits(
    max_head_bytes=4096,
    max_header_count=20,
    head_timeout_s=0.3,
    keepalive_timeout_s=0.3,
    body_timeout_s=0.3,
    max_connections=50,
    max_connections_per_address=40,
)


async def echo(request: Request, writer: ResponseWriter) -> None:
    """Answers with what it read: method, path, query, body length, a header."""
    if request.path == "/slow-stream":
        await writer.start(200, [(b"content-type", b"text/event-stream")])
        for _ in range(3):
            await writer.write(b"data: x\n\n")
            await asyncio.sleep(0.05)
        await writer.end()
        return
    if request.path == "/flood":
        await writer.start(200, [(b"content-type", b"application/octet-stream")])
        for _ in range(256):
            await writer.write(b"y" * 65536)  # 16 MiB: waits while the client is slow
        await writer.end()
        return
    body = await request.read_body(1 << 20)
    if request.path == "/wait":
        await asyncio.sleep(0.3)
    payload = json.dumps(
        {
            "method": request.method,
            "path": request.path,
            "query": request.query.decode(),
            "body_bytes": len(body or b""),
            "x": (request.header(b"x-test") or b"").decode(),
            "scheme": request.scheme,
            "tls": request.transport_info("ssl_object") is not None,
        }
    ).encode()
    await writer.start(
        200, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    )
    await writer.end(payload)


@dataclass
class Served:
    server: HttpServer
    port: int
    tls: ssl.SSLContext | None  # the client's context when the server is HTTPS

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(
            "127.0.0.1",
            self.port,
            ssl=self.tls,
            server_hostname="127.0.0.1" if self.tls else None,
        )


@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts: a berth CA and a certificate for 127.0.0.1."""
    ca_dir = tmp_path_factory.mktemp("ca")
    ca = CertificateAuthority.load_or_create(ca_dir)
    cert, key = ca_dir / "server.pem", ca_dir / "server.key"
    ca.ensure_server_certificate(["127.0.0.1"], cert, key)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(cert), str(key))
    client = ssl.create_default_context(cafile=str(ca.cert_path))
    return server, client


@contextlib.asynccontextmanager
async def serving(
    limits: ListenerLimits = FAST,
    tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None,
    handler: object = echo,
) -> AsyncIterator[Served]:
    server = HttpServer("test", handler, limits, ssl_context=tls[0] if tls else None)  # type: ignore[arg-type]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    await server.start(sock)
    try:
        yield Served(server, sock.getsockname()[1], tls[1] if tls else None)
    finally:
        await server.close(1.0)


class Answer:
    """One HTTP answer as read by :func:`read_answers`."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""

    def json(self) -> dict[str, object]:
        value = json.loads(self.body)
        assert isinstance(value, dict)
        return value


class _Answers:
    """httptools callbacks collecting consecutive answers of one connection."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[Answer] = []
        self._current = Answer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._current.body += body

    def on_message_complete(self) -> None:
        self._current.status = self.parser.get_status_code()
        self.done.append(self._current)
        self._current = Answer()


async def read_answers(reader: asyncio.StreamReader, count: int = 1) -> list[Answer]:
    """Read ``count`` answers from ``reader``."""
    answers = _Answers()
    while len(answers.done) < count:
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, f"closed after {len(answers.done)} of {count} answers"
        answers.parser.feed_data(data)
    return answers.done


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b": ")
            headers[name.lower()] = value
    return int(lines[0].split()[1]), headers


async def closed_by_server(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> bytes:
    """Read until the server closes; everything it sent."""
    data = b""
    with contextlib.suppress(ConnectionResetError, ssl.SSLError):
        while chunk := await asyncio.wait_for(reader.read(65536), timeout_s):
            data += chunk
    return data


def error_of(raw: bytes) -> tuple[int, dict[str, object], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body)["error"], head


GET = b"GET /x?q=1 HTTP/1.1\r\nhost: t\r\nx-test: %s\r\n\r\n"


@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
async def test_an_oversized_head_gets_431_and_is_read_no_further(
    use_tls: bool, tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    async with serving(tls=tls_contexts if use_tls else None) as served:
        reader, writer = await served.open()
        writer.write(b"GET / HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 65536)
        raw = await closed_by_server(reader)
        writer.close()
        status, error, head = error_of(raw)
        assert status == 431
        assert error["code"] == "request_header_fields_too_large"
        assert b"connection: close" in head
        assert b"content-type: application/json" in head
        # the server still serves others
        async with httpx.AsyncClient(verify=served.tls or True) as client:
            assert (await client.get(served.url + "/ok")).status_code == 200


async def test_a_request_over_tls_says_so(
    tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    async with serving(tls=tls_contexts) as served, httpx.AsyncClient(verify=served.tls) as c:
        answer = (await c.get(served.url + "/x?q=1")).json()
    assert (answer["scheme"], answer["tls"], answer["query"]) == ("https", True, "q=1")


async def test_more_header_lines_than_allowed_gets_431() -> None:
    async with serving() as served:
        reader, writer = await served.open()
        lines = b"".join(b"x-h%d: v\r\n" % i for i in range(FAST.max_header_count + 1))
        writer.write(b"GET / HTTP/1.1\r\nhost: t\r\n" + lines + b"\r\n")
        status, error, _ = error_of(await closed_by_server(reader))
        writer.close()
        assert status == 431
        assert "header lines" in str(error["message"])
        # one line fewer is served
        reader, writer = await served.open()
        lines = b"".join(b"x-h%d: v\r\n" % i for i in range(FAST.max_header_count - 1))
        writer.write(b"GET / HTTP/1.1\r\nhost: t\r\n" + lines + b"\r\n")
        (answer,) = await read_answers(reader)
        writer.close()
        assert answer.status == 200


@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
async def test_a_slow_head_is_answered_408_and_closed_while_others_are_served(
    use_tls: bool, tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    async with serving(tls=tls_contexts if use_tls else None) as served:
        slow = [await served.open() for _ in range(5)]
        for _, writer in slow:
            writer.write(b"GET / HTTP/1.1\r\nhost: t\r\n")  # and never the rest
        async with httpx.AsyncClient(verify=served.tls or True) as client:
            assert (await client.get(served.url + "/meanwhile")).status_code == 200
        for reader, writer in slow:
            status, error, _ = error_of(await closed_by_server(reader))
            writer.close()
            assert status == 408
            assert error["code"] == "request_timeout"
        # a connection that sends nothing at all is closed without an answer
        reader, writer = await served.open()
        assert await closed_by_server(reader) == b""
        writer.close()
        await _until(lambda: served.server.connections == 0)


async def test_an_idle_keep_alive_connection_is_closed() -> None:
    async with serving() as served:
        reader, writer = await served.open()
        writer.write(GET % b"1")
        (answer,) = await read_answers(reader)
        assert answer.status == 200
        assert b"connection" not in answer.headers  # kept alive
        writer.write(GET % b"2")  # reused at once
        (answer,) = await read_answers(reader)
        assert answer.json()["x"] == "2"
        assert await closed_by_server(reader) == b""  # then idle: closed, nothing said
        writer.close()


async def test_a_body_that_stops_coming_is_answered_408() -> None:
    async with serving() as served:
        reader, writer = await served.open()
        writer.write(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n" + b"b" * 10)
        status, error, _ = error_of(await closed_by_server(reader))
        writer.close()
        assert status == 408
        assert "body" in str(error["message"])


async def test_a_body_that_keeps_coming_slowly_is_read_in_full() -> None:
    async with serving() as served:
        reader, writer = await served.open()
        writer.write(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 6\r\n\r\n")
        for _ in range(6):  # each piece well within the body timeout of the one before
            await asyncio.sleep(FAST.body_timeout_s / 3)
            writer.write(b"b")
        (answer,) = await read_answers(reader)
        writer.close()
        assert answer.json()["body_bytes"] == 6


async def test_connections_over_the_per_address_cap_are_refused_429() -> None:
    limits = ListenerLimits(max_connections=10, max_connections_per_address=2)
    async with serving(limits) as served:
        held = [await served.open() for _ in range(2)]
        for reader, writer in held:  # both admitted and served
            writer.write(GET % b"held")
            (answer,) = await read_answers(reader)
            assert answer.status == 200
        reader, writer = await served.open()
        raw = await closed_by_server(reader)
        writer.close()
        status, error, head = error_of(raw)
        assert status == 429
        assert error["code"] == "too_many_connections"
        assert "127.0.0.1" in str(error["message"])
        assert b"retry-after: 1" in head
        held[0][1].close()  # a slot is given back
        await _until(lambda: served.server.gate.held_by("127.0.0.1") == 1)
        reader, writer = await served.open()
        writer.write(GET % b"again")
        (answer,) = await read_answers(reader)
        writer.close()
        assert answer.status == 200
        held[1][1].close()


async def test_connections_over_the_listener_cap_are_refused_503() -> None:
    gate = ConnectionGate(ListenerLimits(max_connections=1, max_connections_per_address=5))
    assert gate.admit("10.0.0.1") is None
    refusal = gate.admit("10.0.0.2")
    assert refusal is not None and refusal.http_status == 503
    gate.release("10.0.0.1")
    assert gate.admit("10.0.0.2") is None
    assert gate.admit(None) is not None  # a Unix socket counts against the total


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with serving() as served:
        reader, writer = await served.open()
        writer.write(
            b"POST /wait HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\nx-test: a\r\n\r\nabc"
            + GET % b"b"
            + GET % b"c"
        )
        answers = await read_answers(reader, 3)
        writer.close()
        assert [a.json()["x"] for a in answers] == ["a", "b", "c"]
        assert answers[0].json()["body_bytes"] == 3


async def test_expect_100_continue_is_answered_when_the_body_is_read() -> None:
    async with serving() as served:
        reader, writer = await served.open()
        writer.write(
            b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\nexpect: 100-continue\r\n\r\n"
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"abcd")
        (answer,) = await read_answers(reader)
        writer.close()
        assert answer.json()["body_bytes"] == 4


async def test_a_chunked_request_body_is_read() -> None:
    async with serving() as served:
        async with httpx.AsyncClient() as client:

            async def pieces() -> AsyncIterator[bytes]:
                for piece in (b"ab", b"cde", b"f"):
                    yield piece

            answer = await client.post(served.url + "/x", content=pieces())
        assert answer.json()["body_bytes"] == 6


async def test_head_answers_carry_no_body() -> None:
    async with serving() as served:
        reader, writer = await served.open()
        writer.write(b"HEAD /x HTTP/1.1\r\nhost: t\r\n\r\n")
        status, headers = await read_head(reader)
        assert status == 200
        assert headers[b"content-length"] != b"0"  # the length GET would have
        writer.write(GET % b"after")  # the connection is still in step
        (answer,) = await read_answers(reader)
        writer.close()
        assert answer.json()["x"] == "after"


async def test_http_1_0_and_connection_close_end_the_connection() -> None:
    async with serving() as served:
        for request in (
            b"GET /x HTTP/1.0\r\n\r\n",
            b"GET /x HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n",
        ):
            reader, writer = await served.open()
            writer.write(request)
            raw = await closed_by_server(reader)
            writer.close()
            assert raw.startswith(b"HTTP/1.1 200")
            assert b"connection: close" in raw


async def test_a_malformed_request_gets_400_in_the_openai_shape() -> None:
    async with serving() as served:
        reader, writer = await served.open()
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        status, error, _ = error_of(await closed_by_server(reader))
        writer.close()
        assert status == 400
        assert error["type"] == "invalid_request_error"


async def test_a_slow_reader_slows_the_writer() -> None:
    async with serving() as served:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", served.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"GET /flood HTTP/1.1\r\nhost: t\r\n\r\n")
        await asyncio.sleep(0.3)  # read nothing meanwhile
        (conn,) = served.server._state.connections
        assert conn.write_paused  # the writer waits in drain; memory holds one buffer
        buffered = conn.transport.get_write_buffer_size()
        assert buffered < 4 * 1024 * 1024
        received = 0
        while received < 256 * 65536:
            data = await asyncio.wait_for(reader.read(1 << 20), 10)
            assert data
            received += len(data)
        writer.close()


async def test_closing_lets_answers_in_flight_finish_and_closes_idle_connections() -> None:
    async with serving() as served:
        idle_reader, idle_writer = await served.open()
        idle_writer.write(GET % b"idle")
        await read_answers(idle_reader)
        busy_reader, busy_writer = await served.open()
        busy_writer.write(b"GET /slow-stream HTTP/1.1\r\nhost: t\r\n\r\n")
        await asyncio.wait_for(busy_reader.readuntil(b"\r\n\r\n"), 10)
        closing = asyncio.ensure_future(served.server.close(5.0))
        assert await closed_by_server(idle_reader) == b""
        rest = await closed_by_server(busy_reader)
        await closing
        idle_writer.close()
        busy_writer.close()
        assert rest.count(b"data: x") == 3
        assert rest.endswith(b"0\r\n\r\n")  # the stream ended whole


async def test_a_handler_that_fails_before_answering_gets_a_500() -> None:
    async def broken(request: Request, writer: ResponseWriter) -> None:
        raise RuntimeError("a bug")

    async with serving(handler=broken) as served:
        reader, writer = await served.open()
        writer.write(GET % b"x")
        status, error, _ = error_of(await closed_by_server(reader))
        writer.close()
        assert status == 500
        assert "bug" not in str(error["message"])


async def _until(condition: object, timeout_s: float = 5.0) -> None:
    assert callable(condition)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def refuse_unread(request: Request, writer: ResponseWriter) -> None:
    """``/refuse``: 413 without reading the body (as the proxy refuses one); else echo."""
    if request.path != "/refuse":
        await echo(request, writer)
        return
    payload = b'{"error": "refused"}'
    await writer.start(
        413, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    )
    await writer.end(payload)


async def test_a_body_answered_unread_is_dropped_at_the_listeners_pace() -> None:
    # 4 MiB/s, 1 MiB at once: the 2 MiB refused body's second half waits for the budget.
    limits = dataclasses.replace(FAST, discard_bytes_per_s=4 * 1024 * 1024)
    async with serving(limits, handler=refuse_unread) as served:
        reader, writer = await served.open()
        body = b"x" * (2 * 1024 * 1024)
        writer.write(b"POST /refuse HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % len(body))
        writer.write(body)
        writer.write(GET % b"after")
        await writer.drain()
        refused, after = await read_answers(reader, 2)
        assert (refused.status, after.status) == (413, 200)  # the connection stays usable
        assert after.json()["x"] == "after"
        assert served.server.discard.waits > 0
        writer.close()


async def test_a_body_read_for_its_request_is_never_paced() -> None:
    limits = dataclasses.replace(FAST, discard_bytes_per_s=64 * 1024)
    async with serving(limits) as served, httpx.AsyncClient(base_url=served.url) as client:
        answer = await client.post("/x", content=b"x" * 900_000)
        assert answer.json()["body_bytes"] == 900_000
        assert served.server.discard.waits == 0


def test_the_discard_budget_is_a_token_bucket() -> None:
    budget = DiscardBudget(1000)  # 250 bytes at once
    assert budget.take(200, now=0.0) == 0.0
    assert budget.take(100, now=0.0) == pytest.approx(0.05)  # 50 in debt at 1,000 a second
    assert budget.take(0, now=0.05) == 0.0  # paid back
    assert budget.take(250, now=10.0) == 0.0  # refilled, to a quarter second's worth only
    assert budget.take(1, now=10.0) == pytest.approx(0.001)
    assert budget.waits == 2


def test_the_defaults_are_the_documented_ones() -> None:
    limits = ListenerLimits()
    assert (limits.max_head_bytes, limits.max_header_count) == (32 * 1024, 100)
    assert (limits.head_timeout_s, limits.keepalive_timeout_s, limits.body_timeout_s) == (
        10.0,
        15.0,
        30.0,
    )
    assert (limits.max_connections, limits.max_connections_per_address) == (4096, 1024)
    assert limits.discard_bytes_per_s == 64 * 1024 * 1024
