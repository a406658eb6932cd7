"""The proxy served as an ASGI app (by uvicorn) answers as it does on berth's own server,
which the other proxy tests use: the ASGI adapters (``gateway/asgi.py``) keep the
relay, the read-ahead buffer and the disconnect watcher working."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from berth.observability.metrics import ProxyMetrics
from support.proxy_fixtures import StaticResolver, running_proxy, sample
from support.standin_engine import StandinEngine, chat_chunks, json_reply, sse_reply

M = {"model": "m", "deployment": "d-m", "node": "local"}


@pytest.fixture
async def asgi_proxy_url(resolver: StaticResolver, metrics: ProxyMetrics) -> AsyncIterator[str]:
    """The proxy over ``resolver`` as an ASGI app, served by uvicorn: its base URL."""
    async with running_proxy(resolver, metrics, server="uvicorn") as url:
        yield url


async def test_a_json_answer_and_a_stream_are_relayed(
    asgi_proxy_url: str, engine: StandinEngine, metrics: ProxyMetrics
) -> None:
    answer = {"id": "x", "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    events = chat_chunks(["one two", "three"], usage=(4, 2))
    engine.script(json_reply(answer))
    engine.script(sse_reply(events, pause_s=0.01))
    async with httpx.AsyncClient(base_url=asgi_proxy_url) as client:
        plain = await client.post("/v1/chat/completions", json={"model": "m"})
        async with client.stream(
            "POST", "/v1/chat/completions", json={"model": "m", "stream": True}
        ) as streamed:
            body = b"".join([chunk async for chunk in streamed.aiter_raw()])
    assert plain.json() == answer
    assert streamed.headers["content-type"] == "text/event-stream"
    assert body == b"".join(events)
    assert sample(metrics, "berth_proxy_completion_tokens_total", **M) == 3


async def test_a_client_leaving_mid_stream_closes_the_engine_request(
    asgi_proxy_url: str, engine: StandinEngine, metrics: ProxyMetrics
) -> None:
    engine.script(sse_reply(chat_chunks(["word " * 200]), pause_s=0.02))
    host, port = asgi_proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"model": "m", "stream": True}).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: p\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body)
    )
    await reader.readuntil(b"data: ")
    writer.close()
    record = engine.requests[0]
    await asyncio.wait_for(record.disconnected.wait(), 10)
    assert not record.completed
