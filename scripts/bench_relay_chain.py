"""The Python cost per event of the leader's pushed relay alone: no socket, TLS or wake-up.

What a local deployment's token event goes through on the leader once its bytes are read,
with berth's own classes: the engine connection's ``data_received`` (``httptools`` parsing
the chunk, ``on_body``), the answer's push to ``StreamPush``, the SSE split, the event count
and usage check, and ``ResponseWriter.write_now``'s chunk framing, down to the client
transport's ``write``, which here only counts. The engine side is an
``UpstreamConnection`` on a transport that writes nothing; the client side a writer on a
connection whose transport does nothing either. Each round feeds ``--events`` chunked
events of one stream, one ``data_received`` per event, and divides the process's CPU time
by them.

It measures the relay chain with hot caches, which the paced benchmark
(``bench_stream.py``) cannot separate from the system calls, the TLS record and the other
processes around each event; use it to compare two versions of the chain.

    PYTHONPATH=src .venv/bin/python scripts/bench_relay_chain.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import uvloop

from berth.engine_http.connection import UpstreamConnection
from berth.engine_http.origin import Origin
from berth.gateway.outcome import Exchange
from berth.gateway.push import StreamPush
from berth.gateway.sse import SSEEventSplitter
from berth.http_server.writer import ResponseWriter

EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
)
CHUNK = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class NullTransport:
    """A transport that takes every write and sends nothing."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


class Pool:
    """The pool's surface an engine connection uses (``ConnectionOwner``)."""

    read_timeout_s = 300.0
    high_water_bytes = 1 << 20

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def release(self, conn: UpstreamConnection) -> None:
        pass

    def forget(self, conn: UpstreamConnection) -> None:
        pass


class ClientConnection:
    """The client connection's surface a writer uses (``WriterOwner``)."""

    write_paused = False
    lost = False
    keeps_alive = True

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: Any = NullTransport()

    async def drain(self) -> None:
        pass

    def response_done(self, writer: ResponseWriter, keep_alive: bool) -> None:
        pass


class ChatRequest:
    """The request's surface a writer reads."""

    method = "POST"
    http_version = "1.1"
    keep_alive = True

    def no_continue(self) -> None:
        pass


async def one_round(events: int) -> float:
    """Relay ``events`` events of one stream; CPU nanoseconds per event."""
    loop = asyncio.get_running_loop()
    engine = UpstreamConnection(Pool(loop), Origin("127.0.0.1", 1))
    engine.connection_made(NullTransport())  # type: ignore[arg-type]
    exchange_task = asyncio.ensure_future(engine.exchange(b"POST / HTTP/1.1\r\n\r\n", b"", None))
    await asyncio.sleep(0)
    engine.data_received(HEAD)
    answer = await exchange_task
    writer = ResponseWriter(ClientConnection(loop), ChatRequest())  # type: ignore[arg-type]
    await writer.start(200, [(b"content-type", b"text/event-stream")])
    exchange = Exchange(time.perf_counter())
    push = StreamPush(
        answer, writer, exchange, SSEEventSplitter(), False, 1 << 20, time.perf_counter
    )
    relay = asyncio.ensure_future(push.run())
    await asyncio.sleep(0)
    received = engine.data_received
    started = time.process_time()
    for _ in range(events):
        received(CHUNK)
    used_s = time.process_time() - started
    engine.data_received(b"0\r\n\r\n")
    await relay
    if exchange.events != events:
        raise RuntimeError(f"relayed {exchange.events} events of {events}")
    return 1e9 * used_s / events


async def main(args: argparse.Namespace) -> None:
    await one_round(1000)  # warm up
    results = [await one_round(args.events) for _ in range(args.rounds)]
    print(f"{args.rounds} rounds of {args.events:,} events, one stream, uvloop\n")
    print("| relay chain | ns per event: median | lowest | highest |")
    print("| --- | ---: | ---: | ---: |")
    print(
        f"| engine connection → StreamPush → ResponseWriter.write_now "
        f"| {statistics.median(results):,.0f} | {min(results):,.0f} | {max(results):,.0f} |"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="events per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds")
    uvloop.run(main(parser.parse_args()))
