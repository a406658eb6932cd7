"""Measure how soon a client leaving a stream closes the engine's request.

In one process on loopback: the scripted stand-in engine (``tests/support/standin_engine.py``)
streaming a long answer (an event every 20 ms, for about 4 s), and the OpenAI proxy
(:class:`berth.gateway.proxy.OpenAIProxy`, served by uvicorn as in the tests) in front of it.
A raw client sends a streamed chat request, reads until the first event, and closes its
socket. Measured: from the close to the moment the engine's handler sees its connection
gone. ``tests/test_proxy_streaming.py`` checks that it happens before the answer ends; the
number lives here, not in an assertion. Run: ``.venv/bin/python scripts/bench_disconnect.py``
(a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from berth.observability.metrics import ProxyMetrics  # noqa: E402
from support.proxy_fixtures import StaticResolver, running_proxy  # noqa: E402
from support.standin_engine import StandinEngine, chat_chunks, sse_reply  # noqa: E402

REQUEST = json.dumps({"model": "m", "stream": True}).encode()


async def one_disconnect(engine: StandinEngine, proxy_url: str) -> float:
    """Seconds from the client's close to the engine seeing its request gone."""
    engine.script(sse_reply(chat_chunks(["word " * 200]), pause_s=0.02))
    seen = len(engine.requests)
    host, port = proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(REQUEST), REQUEST)
    )
    await reader.readuntil(b"data: ")
    writer.close()
    left_at = time.monotonic()
    record = engine.requests[seen]
    await asyncio.wait_for(record.disconnected.wait(), 30)
    assert record.disconnected_at is not None and not record.completed
    return record.disconnected_at - left_at


async def main(repeats: int) -> None:
    async with StandinEngine() as engine:
        resolver = StaticResolver({"m": engine.base_url})
        async with running_proxy(resolver, ProxyMetrics()) as url:
            await one_disconnect(engine, url)  # untimed: warm the connection pool
            took = [await one_disconnect(engine, url) for _ in range(repeats)]
    ms = sorted(t * 1000 for t in took)
    print(f"client close -> engine request closed, {repeats} streams through the proxy:")
    print(f"  p50 {statistics.median(ms):.1f} ms   max {ms[-1]:.1f} ms   min {ms[0]:.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="streams to measure")
    asyncio.run(main(parser.parse_args().repeats))
