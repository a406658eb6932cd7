"""Relaying answers as they are made: SSE streams, split characters, engine deaths,
client disconnects and backpressure, through berth's HTTP server on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable

import httpx

from berth.gateway.sse import split_events
from berth.observability.metrics import ProxyMetrics
from support.proxy_fixtures import StaticResolver, running_proxy, sample
from support.standin_engine import (
    Head,
    ReceivedRequest,
    Reply,
    Stall,
    StandinEngine,
    Write,
    chat_chunks,
    responses_events,
    sse_event,
    sse_reply,
)
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

M = {"model": "m", "deployment": "d-m", "node": "local"}
STREAM_REQUEST = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}


async def stream_chunks(
    client: httpx.AsyncClient, path: str = "/v1/chat/completions", request: object = None
) -> tuple[httpx.Response, list[bytes]]:
    """POST and collect the answer's body as the network reads delivered it."""
    chunks: list[bytes] = []
    payload = STREAM_REQUEST if request is None else request
    async with client.stream("POST", path, json=payload) as response:
        async for chunk in response.aiter_raw():
            chunks.append(chunk)
    return response, chunks


async def test_a_stream_is_relayed_byte_for_byte_as_each_event_is_made(
    client: httpx.AsyncClient, engine: StandinEngine, metrics: ProxyMetrics
) -> None:
    events = chat_chunks(["one two three", "four five"], tool_call=True, usage=(7, 5))
    engine.script(sse_reply(events, pause_s=0.03))
    written_at_first_read: list[int] = []
    chunks: list[bytes] = []
    async with client.stream("POST", "/v1/chat/completions", json=STREAM_REQUEST) as response:
        async for chunk in response.aiter_raw():
            if not chunks:
                written_at_first_read.append(engine.requests[0].bytes_written)
            chunks.append(chunk)

    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["cache-control"] == "no-cache"
    assert b"".join(chunks) == b"".join(events)
    # Not buffered: the first event reached the client while the engine was still writing.
    assert written_at_first_read[0] < sum(map(len, events)) / 2
    # Event for event: no read cut an event, so the proxy never re-framed them.
    for chunk in chunks:
        assert b"".join(split_events(chunk)) == chunk
    assert sample(metrics, "berth_proxy_prompt_tokens_total", **M) == 7
    assert sample(metrics, "berth_proxy_completion_tokens_total", **M) == 5
    labels = {**M, "status_class": "2xx"}
    assert sample(metrics, "berth_proxy_time_to_first_byte_seconds_count", **labels) == 1


async def test_a_character_cut_across_engine_writes_arrives_whole(
    client: httpx.AsyncClient, engine: StandinEngine
) -> None:
    event = sse_event({"choices": [{"index": 0, "delta": {"content": "déjà vu 日本"}}]})
    event = event.replace(b"\\u00e9", "é".encode()).replace(b"\\u65e5\\u672c", "日本".encode())
    cut = event.index("日".encode()) + 1
    engine.script(
        Reply(
            (
                Head(200, "text/event-stream"),
                Write(event[:cut]),
                Write(event[cut:], pause_s=0.05),
                Write(b"data: [DONE]\n\n"),
            )
        )
    )
    _, chunks = await stream_chunks(client)
    body = b"".join(chunks)
    assert body == event + b"data: [DONE]\n\n"
    first = json.loads(body.split(b"\n\n")[0].removeprefix(b"data: "))
    assert first["choices"][0]["delta"]["content"] == "déjà vu 日本"


async def test_a_large_json_answer_is_relayed_in_pieces_never_as_sse(
    resolver: StaticResolver, metrics: ProxyMetrics, engine: StandinEngine
) -> None:
    answer = json.dumps(
        {
            "object": "list",
            "data": [{"object": "embedding", "embedding": [0.25] * 3000, "index": 0}],
            "usage": {"prompt_tokens": 12, "total_tokens": 12},
        },
        ensure_ascii=False,
    ).encode()
    cut = len(answer) // 2
    engine.script(
        Reply(
            (
                Head(200, "application/json"),  # chunked: no Content-Length
                Write(answer[:cut]),
                Write(answer[cut:], pause_s=0.02),
            )
        )
    )
    async with (
        running_proxy(resolver, metrics, max_buffered_response_bytes=1024) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        response = await client.post("/v1/embeddings", json={"model": "m", "input": "x"})
    assert response.headers["content-type"] == "application/json"
    assert response.content == answer
    assert sample(metrics, "berth_proxy_prompt_tokens_total", **M) == 12


async def test_responses_api_streams_report_their_usage(
    client: httpx.AsyncClient, engine: StandinEngine, metrics: ProxyMetrics
) -> None:
    events = responses_events("Bonjour", usage=(11, 3))
    engine.script(sse_reply(events))
    _, chunks = await stream_chunks(client, "/v1/responses", {"model": "m", "stream": True})
    assert b"".join(chunks) == b"".join(events)
    assert sample(metrics, "berth_proxy_prompt_tokens_total", **M) == 11
    assert sample(metrics, "berth_proxy_completion_tokens_total", **M) == 3


async def test_an_engine_dying_mid_stream_ends_it_with_an_error_event_and_done(
    client: httpx.AsyncClient, engine: StandinEngine, metrics: ProxyMetrics
) -> None:
    events = chat_chunks(["a b c d"])[:3]
    partial = b'data: {"id": "chatcmpl-1", "choices": [{"ind'
    engine.script(sse_reply([*events, partial, b"never"], pause_s=0.01, die_after=4))
    response, chunks = await stream_chunks(client)

    assert response.status_code == 200
    body = b"".join(chunks)
    assert body.startswith(b"".join(events))
    tail = body[len(b"".join(events)) :]
    # The cut-off event is dropped, not glued to the error.
    assert partial not in tail
    error_event, done, rest = tail.split(b"\n\n")
    assert done == b"data: [DONE]" and rest == b""
    error = json.loads(error_event.removeprefix(b"data: "))["error"]
    assert error["code"] == "stream_aborted" and error["message"]
    labels = {**M, "status_class": "2xx", "reason": "stream_aborted"}
    assert sample(metrics, "berth_proxy_errors_total", **labels) == 1


async def open_stream_request(proxy_url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw keep-alive connection that has sent one streamed chat request."""
    host, port = proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(STREAM_REQUEST).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    return reader, writer


async def test_a_client_leaving_mid_stream_closes_the_engine_request_before_it_ends(
    proxy_url: str, engine: StandinEngine, metrics: ProxyMetrics
) -> None:
    long_answer = chat_chunks(["word " * 200])
    engine.script(sse_reply(long_answer, pause_s=0.05))  # 10 s, unless the request is closed
    reader, writer = await open_stream_request(proxy_url)
    await reader.readuntil(b"data: ")  # the stream has begun
    writer.close()

    record = engine.requests[0]
    # How soon is measured by scripts/bench_disconnect.py; here: before the answer ended.
    await asyncio.wait_for(record.disconnected.wait(), EVENT_TIMEOUT_S)
    assert not record.completed
    await _until(lambda: sample(metrics, "berth_proxy_in_flight_requests", **M) == 0)
    labels = {**M, "status_class": "2xx", "reason": "client_disconnected"}
    assert sample(metrics, "berth_proxy_errors_total", **labels) == 1


async def test_a_client_leaving_before_the_first_byte_closes_the_engine_request(
    proxy_url: str, engine: StandinEngine, metrics: ProxyMetrics
) -> None:
    engine.script(sse_reply(chat_chunks(["late"]), stall_s=30.0))
    _, writer = await open_stream_request(proxy_url)
    record = await engine.wait_for_request()
    writer.close()

    await asyncio.wait_for(record.disconnected.wait(), EVENT_TIMEOUT_S)
    await _until(lambda: sample(metrics, "berth_proxy_in_flight_requests", **M) == 0)
    labels = {**M, "status_class": "4xx", "reason": "client_disconnected"}
    assert sample(metrics, "berth_proxy_errors_total", **labels) == 1


async def test_a_slow_client_slows_the_reading_from_the_engine(
    proxy_url: str, engine: StandinEngine
) -> None:
    event = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
    count = 512  # 32 MiB in all, far more than every buffer on the way
    engine.script(Reply((Head(200, "text/event-stream"), *[Write(event)] * count)))
    host, port = proxy_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = json.dumps(STREAM_REQUEST).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: p\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body)
    )
    record = await engine.wait_for_request()

    stalled_at = await until_stalled(record)  # the client reads nothing meanwhile
    assert stalled_at < count * len(event) / 2

    await reader.readuntil(b"\r\n\r\n")  # the answer's head
    received = 0
    tail = b""
    while not tail.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked body
        data = await asyncio.wait_for(reader.read(1 << 20), 5.0)
        assert data
        received += len(data)
        tail = (tail + data)[-16:]
    writer.close()
    assert received >= count * len(event)
    assert record.completed


async def _until(condition: Callable[[], object]) -> None:
    await wait_for_async(condition, EVENT_TIMEOUT_S, "the proxy to count the request done")


#: Turns of the event loop a stalled engine must sit through without writing a byte.
STALL_TURNS = 50


async def until_stalled(record: ReceivedRequest) -> int:
    """Wait until the engine is held up by backpressure for good; the bytes it wrote.

    Held up: its write waits for the client to take data (``record.writing``). For good: it
    stays so, with no byte more written, over :data:`STALL_TURNS` polls; engine, proxy and
    this test share one event loop, so between two polls the proxy had its turn to read
    (and so to let the engine write on). A proxy without backpressure lets the engine
    finish instead, which fails here.
    """
    still = 0
    written = -1

    def stalled() -> bool:
        nonlocal still, written
        assert not record.completed, "the engine wrote its whole answer to a client reading nothing"
        if record.writing and record.bytes_written == written:
            still += 1
        else:
            still, written = 0, record.bytes_written
        return still >= STALL_TURNS

    await wait_for_async(stalled, EVENT_TIMEOUT_S, "the engine to be held up", interval_s=0.01)
    return written


async def test_an_event_longer_than_the_hold_back_limit_is_relayed_before_it_ends(
    resolver: StaticResolver, metrics: ProxyMetrics, engine: StandinEngine
) -> None:
    start = b"data: " + b"x" * 4000
    engine.script(
        Reply((Head(200, "text/event-stream"), Write(start), Write(b"\n\n", pause_s=0.3)))
    )
    async with (
        running_proxy(resolver, metrics, max_event_bytes=1024) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        _, chunks = await stream_chunks(client)
    # All of it was sent before the engine finished the event, 0.3 s later.
    assert b"".join(chunks[:-1]) == start
    assert chunks[-1] == b"\n\n"


async def test_an_engine_silent_mid_stream_past_the_idle_timeout_ends_it_with_an_error_event(
    resolver: StaticResolver, metrics: ProxyMetrics, engine: StandinEngine
) -> None:
    events = chat_chunks(["a b"])[:2]
    engine.script(Reply((Head(200, "text/event-stream"), *map(Write, events), Stall(5.0))))
    async with (
        running_proxy(resolver, metrics, stream_idle_timeout_s=0.3) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        response, chunks = await stream_chunks(client)
    body = b"".join(chunks)
    assert response.status_code == 200
    assert body.startswith(b"".join(events))
    error_event, done, rest = body[len(b"".join(events)) :].split(b"\n\n")
    assert done == b"data: [DONE]" and rest == b""
    error = json.loads(error_event.removeprefix(b"data: "))["error"]
    assert error["code"] == "stream_idle_timeout"
    assert "sent nothing for 0.3 s" in error["message"]
    record = engine.requests[0]
    await asyncio.wait_for(record.disconnected.wait(), EVENT_TIMEOUT_S)  # the engine was told
    assert not record.completed
    errors = "berth_proxy_errors_total"
    labels = {"model": "m", "deployment": "d-m", "node": "local", "status_class": "2xx"}
    assert sample(metrics, errors, reason="stream_idle_timeout", **labels) == 1
