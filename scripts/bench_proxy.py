"""Benchmark the OpenAI proxy against the same load sent straight to the engine.

Three processes on loopback, plain HTTP:

* the fast stand-in engine (``tests/standin_engine.py``: raw asyncio + httptools, canned
  answers: a ~300-byte chat completion, or a 19-event stream written in one piece);
* the proxy: :class:`berth.daemon.proxy.OpenAIProxy` served by uvicorn (uvloop, httptools)
  with a fixed resolver, no auth in front;
* this process, the load generator: keep-alive connections on uvloop with httptools parsing,
  one request in flight per connection (closed loop).

For 1 and 32 concurrent clients, non-streamed and streamed, it measures each path for
``--duration`` seconds after ``--warmup`` seconds and prints p50/p99 latency (request sent to
response complete), p50 time to first body byte, requests per second, and the proxy/direct
ratios. Run: ``.venv/bin/python scripts/bench_proxy.py`` (about 40 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httptools
import uvloop

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"


# -- the engine and proxy processes ---------------------------------------------------------------


def _announce(sock: socket.socket) -> None:
    print(f"PORT {sock.getsockname()[1]}", flush=True)


def serve_engine() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from standin_engine import serve_fast_engine

    async def main() -> None:
        server = await serve_fast_engine()
        print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
        await server.serve_forever()

    uvloop.run(main())


def serve_proxy(engine_port: int) -> None:
    import uvicorn

    from berth.daemon.proxy import OpenAIProxy, Upstream
    from berth.observability.metrics import ProxyMetrics

    upstream = Upstream(f"http://127.0.0.1:{engine_port}", "d-bench", "local", MODEL)

    class FixedResolver:
        def resolve(self, model: str) -> Upstream:
            return upstream

        def models(self) -> list[str]:
            return [MODEL]

    proxy = OpenAIProxy(FixedResolver(), ProxyMetrics())
    config = uvicorn.Config(
        proxy,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        proxy_headers=False,
        backlog=1024,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _announce(sock)
    uvicorn.Server(config).run(sockets=[sock])


def _spawn(*args: str) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    process = subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("PORT "):
        process.kill()
        raise RuntimeError(f"{args[0]} did not start: {line!r}")
    return process, int(line.split()[1])


# -- the load generator ---------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; ``exchange`` sends a request and times the answer."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[None] | None = None
        self.first_body_at = 0.0
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._transport = cast(asyncio.Transport, transport)
        self._transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError("connection lost"))

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if not self.first_body_at:
            self.first_body_at = time.perf_counter()

    def on_message_complete(self) -> None:
        assert self._done is not None
        if self._parser.get_status_code() != 200:
            self._done.set_exception(RuntimeError(f"HTTP {self._parser.get_status_code()}"))
        else:
            self._done.set_result(None)

    async def exchange(self, request: bytes) -> None:
        assert self._transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self.first_body_at = 0.0
        self._transport.write(request)
        await self._done


@dataclass
class Result:
    latencies_s: list[float]
    ttfbs_s: list[float]
    elapsed_s: float
    errors: int

    @property
    def rps(self) -> float:
        return len(self.latencies_s) / self.elapsed_s

    def pct_ms(self, values: list[float], q: float) -> float:
        ordered = sorted(values)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _request(streamed: bool) -> bytes:
    stream = ', "stream": true, "stream_options": {"include_usage": true}' if streamed else ""
    body = (
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Say hello."}}],'
        f' "max_tokens": 16{stream}}}'
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


async def _load(port: int, streamed: bool, clients: int, warmup_s: float, run_s: float) -> Result:
    loop = asyncio.get_running_loop()
    request = _request(streamed)
    connections = []
    for _ in range(clients):
        _, protocol = await loop.create_connection(_Connection, "127.0.0.1", port)
        connections.append(protocol)
    latencies: list[float] = []
    ttfbs: list[float] = []
    errors = 0
    start = time.perf_counter()
    measure_from = start + warmup_s
    stop_at = measure_from + run_s

    async def client(connection: _Connection) -> None:
        nonlocal errors
        while True:
            sent = time.perf_counter()
            if sent >= stop_at:
                return
            try:
                await connection.exchange(request)
            except (RuntimeError, ConnectionError):
                errors += 1
                if connection.lost:
                    return
                continue
            done = time.perf_counter()
            if sent >= measure_from:
                latencies.append(done - sent)
                ttfbs.append(connection.first_body_at - sent)

    await asyncio.gather(*(client(c) for c in connections))
    for connection in connections:
        assert connection._transport is not None
        connection._transport.close()
    return Result(latencies, ttfbs, run_s, errors)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()}"


async def _bench(engine_port: int, proxy_port: int, args: argparse.Namespace) -> None:
    rows = []
    for streamed in (False, True):
        for clients in args.clients:
            direct = await _load(engine_port, streamed, clients, args.warmup, args.duration)
            proxied = await _load(proxy_port, streamed, clients, args.warmup, args.duration)
            rows.append((streamed, clients, direct, proxied))

    print(f"machine: {_machine()}")
    print(f"each cell: {args.duration:g} s measured after {args.warmup:g} s warm-up\n")
    header = (
        "| answer | clients | path | p50 ms | p99 ms | TTFB p50 ms | req/s | errors |\n"
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
    )
    print(header)
    for streamed, clients, direct, proxied in rows:
        kind = "stream" if streamed else "json"
        for name, r in (("direct", direct), ("proxy", proxied)):
            print(
                f"| {kind} | {clients} | {name} | {r.pct_ms(r.latencies_s, 0.5):.3f} | "
                f"{r.pct_ms(r.latencies_s, 0.99):.3f} | {r.pct_ms(r.ttfbs_s, 0.5):.3f} | "
                f"{r.rps:,.0f} | {r.errors} |"
            )
    print(
        "\n| answer | clients | proxy adds at p50 (ms) | proxy adds at p99 (ms) "
        "| proxy req/s ÷ direct |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for streamed, clients, direct, proxied in rows:
        kind = "stream" if streamed else "json"
        p50 = proxied.pct_ms(proxied.latencies_s, 0.5) - direct.pct_ms(direct.latencies_s, 0.5)
        p99 = proxied.pct_ms(proxied.latencies_s, 0.99) - direct.pct_ms(direct.latencies_s, 0.99)
        print(f"| {kind} | {clients} | {p50:+.3f} | {p99:+.3f} | {proxied.rps / direct.rps:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("bench", "engine", "proxy"), default="bench")
    parser.add_argument("--engine-port", type=int, default=0)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per cell")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds before measuring")
    parser.add_argument(
        "--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32]
    )
    args = parser.parse_args()
    if args.role == "engine":
        serve_engine()
        return
    if args.role == "proxy":
        serve_proxy(args.engine_port)
        return
    engine, engine_port = _spawn("--role", "engine")
    proxy, proxy_port = _spawn("--role", "proxy", "--engine-port", str(engine_port))
    try:
        uvloop.run(_bench(engine_port, proxy_port, args))
    finally:
        for process in (proxy, engine):
            process.terminate()
            process.wait(5)


if __name__ == "__main__":
    main()
