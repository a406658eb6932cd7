"""Benchmark the proxy's routing: the load-aware scorer against round-robin, two engines.

Everything runs in this process, on one uvloop event loop, over real HTTP on loopback:

* two stand-in engines (raw asyncio + httptools) that model a continuous-batching engine as
  ``--slots`` requests served at once, each taking a fixed time, the rest waiting in FIFO
  order: a fast one (``--fast-ms``, default 20 ms) on node ``node-fast`` and a slow one
  (``--slow-ms``, default 120 ms: an older GPU or a busier host) on node ``node-slow``,
  8 slots each. Each answers a 300-byte chat completion naming itself;
* the proxy: :class:`berth.gateway.proxy.OpenAIProxy` served by uvicorn (httptools) on
  127.0.0.1, with a resolver whose ``candidates()`` returns both engines, and either the
  real :class:`berth.routing.router.Router` (``scorer``) or :class:`RoundRobinRouter`
  (``round-robin``: rotates the candidates, no signals, no affinity); a fresh proxy and
  router per cell, so that no latency samples or affinity entries carry over;
* the load generator: one keep-alive connection per client, one request in flight per
  connection (closed loop), answers parsed with httptools.

Per number of clients, the scorer runs with three kinds of affinity key: none (no header
that yields one), ``X-Session-Id: client-N`` (a distinct session per client), and one shared
``Authorization: Bearer`` key on every request (every request of one API key, as behind the
leader's authentication; the key is the affinity fallback). Round-robin ignores keys.
Each cell measures ``--duration-s`` seconds after ``--warmup-s`` seconds and prints
requests/s, p50/p99 latency (request written to answer complete) and the share of the
measured requests each engine answered. Run: ``.venv/bin/python scripts/bench_routing.py``
(about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import httptools
import uvicorn
import uvloop

from berth.gateway.proxy import OpenAIProxy
from berth.observability.metrics import ProxyMetrics
from berth.routing.resolver import Upstream
from berth.routing.router import Router

if TYPE_CHECKING:
    from berth.routing.resolver import UpstreamResolver

MODEL = "bench-model"
KEY_KINDS = ("none", "session per client", "one API key")


# -- the stand-in engines -------------------------------------------------------------------------


class Engine:
    """An engine that serves ``slots`` requests at once, each in ``service_s`` seconds."""

    def __init__(self, name: str, service_s: float, slots: int) -> None:
        self.name = name
        self.service_s = service_s
        self.slots = asyncio.Semaphore(slots)
        self.tasks: set[asyncio.Task[None]] = set()
        body = {
            "id": f"chatcmpl-{name}",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "system_fingerprint": f"engine-{name}",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello! How can I help?"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16},
        }
        data = json.dumps(body).encode()
        self.response = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(data), data)
        )
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _EngineConnection(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self.tasks):
            task.cancel()

    async def answer(self, transport: asyncio.Transport) -> None:
        async with self.slots:
            await asyncio.sleep(self.service_s)
        if not transport.is_closing():
            transport.write(self.response)


class _EngineConnection(asyncio.Protocol):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        assert self._transport is not None
        task = asyncio.get_running_loop().create_task(self._engine.answer(self._transport))
        self._engine.tasks.add(task)
        task.add_done_callback(self._engine.tasks.discard)


# -- the routers and the resolver -----------------------------------------------------------------


class TwoEngines:
    """An ``UpstreamResolver``: both engines serve ``MODEL``, each on its own node."""

    def __init__(self, engines: list[Engine]) -> None:
        self.upstreams = [
            Upstream(f"http://127.0.0.1:{e.port}", f"d-{e.name}", f"node-{e.name}", MODEL)
            for e in engines
        ]

    def candidates(self, model: str) -> list[Upstream]:
        return list(self.upstreams)

    def models(self) -> list[str]:
        return [MODEL]


class RoundRobinRouter(Router):
    """The baseline: each request's plan starts one candidate further on; nothing is scored."""

    def __init__(self, resolver: UpstreamResolver) -> None:
        super().__init__(resolver)
        self._turns = itertools.count()

    def plan(self, model: str, affinity_key: str | None) -> list[Upstream]:
        upstreams = self.resolver.candidates(model)
        turn = next(self._turns) % len(upstreams)
        return upstreams[turn:] + upstreams[:turn]


# -- the load generator ---------------------------------------------------------------------------


class _ClientConnection(asyncio.Protocol):
    """One keep-alive connection; ``exchange`` sends a request and returns the answer's body."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[bytes] | None = None
        self._body: list[bytes] = []
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError("connection lost"))

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._done is not None
        status = self._parser.get_status_code()
        if status != 200:
            self._done.set_exception(RuntimeError(f"HTTP {status}"))
        else:
            self._done.set_result(b"".join(self._body))

    async def exchange(self, request: bytes) -> bytes:
        assert self._transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self._body = []
        self._transport.write(request)
        return await self._done

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _request(key_kind: str, client: int) -> bytes:
    body = (
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Say hello."}}],'
        f' "max_tokens": 16}}'
    ).encode()
    if key_kind == "session per client":
        extra = b"x-session-id: client-%d\r\n" % client
    elif key_kind == "one API key":
        extra = b"authorization: Bearer sk-bench-shared-key\r\n"
    else:
        extra = b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"%scontent-length: %d\r\n\r\n%s" % (extra, len(body), body)
    )


@dataclass
class Cell:
    clients: int
    policy: str
    key_kind: str
    latencies_s: list[float]
    served_by: dict[str, int]
    errors: int
    duration_s: float

    def ms(self, q: float) -> float:
        """The ``q`` quantile of the latencies (nearest rank), in ms."""
        ordered = sorted(self.latencies_s)
        if not ordered:
            return float("nan")
        return 1000 * ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    def share(self, engine: str) -> float:
        return self.served_by.get(engine, 0) / max(1, len(self.latencies_s))


async def _load(
    port: int, key_kind: str, clients: int, warmup_s: float, duration_s: float, names: list[str]
) -> tuple[list[float], dict[str, int], int]:
    loop = asyncio.get_running_loop()
    connections = []
    for _ in range(clients):
        _, connection = await loop.create_connection(_ClientConnection, "127.0.0.1", port)
        connections.append(connection)
    markers = [(name, f'"engine-{name}"'.encode()) for name in names]
    latencies: list[float] = []
    served_by = dict.fromkeys(names, 0)
    errors = 0
    measure_from = time.perf_counter() + warmup_s
    stop_at = measure_from + duration_s

    async def client(index: int, connection: _ClientConnection) -> None:
        nonlocal errors
        request = _request(key_kind, index)
        while (sent := time.perf_counter()) < stop_at:
            try:
                body = await connection.exchange(request)
            except (RuntimeError, ConnectionError):
                errors += 1
                if connection.lost:
                    return
                continue
            if sent >= measure_from:
                latencies.append(time.perf_counter() - sent)
                for name, marker in markers:
                    if marker in body:
                        served_by[name] += 1

    await asyncio.gather(*(client(i, c) for i, c in enumerate(connections)))
    for connection in connections:
        connection.close()
    return latencies, served_by, errors


async def _serve(app: OpenAIProxy) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    config = uvicorn.Config(
        app, http="httptools", lifespan="on", access_log=False, log_level="warning"
    )
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


async def _cell(
    engines: list[Engine], policy: str, key_kind: str, clients: int, args: argparse.Namespace
) -> Cell:
    resolver = TwoEngines(engines)
    router = Router(resolver) if policy == "scorer" else RoundRobinRouter(resolver)
    proxy = OpenAIProxy(resolver, ProxyMetrics(), router=router)
    server, task, port = await _serve(proxy)
    try:
        names = [e.name for e in engines]
        latencies, served_by, errors = await _load(
            port, key_kind, clients, args.warmup_s, args.duration_s, names
        )
    finally:
        server.should_exit = True
        await task
    return Cell(clients, policy, key_kind, latencies, served_by, errors, args.duration_s)


def _cells(args: argparse.Namespace) -> Iterator[tuple[str, str, int]]:
    for clients in args.concurrency:
        yield "round-robin", "any", clients
        for key_kind in KEY_KINDS:
            yield "scorer", key_kind, clients


def _machine() -> str:
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()}"


async def _bench(args: argparse.Namespace) -> None:
    fast = Engine("fast", args.fast_ms / 1000, args.slots)
    slow = Engine("slow", args.slow_ms / 1000, args.slots)
    for engine in (fast, slow):
        await engine.start()
    cells = []
    try:
        for policy, key_kind, clients in _cells(args):
            cells.append(await _cell([fast, slow], policy, key_kind, clients, args))
    finally:
        for engine in (fast, slow):
            await engine.stop()

    print(f"machine: {_machine()}; load average {os.getloadavg()[0]:.2f} at the end")
    print(
        f"engines: fast {args.fast_ms:g} ms, slow {args.slow_ms:g} ms per request, "
        f"{args.slots} slots each; each cell {args.duration_s:g} s after {args.warmup_s:g} s "
        "warm-up\n"
    )
    print(
        "| clients | policy | affinity key | req/s | p50 ms | p99 ms | fast engine | "
        "slow engine | errors |\n| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for c in cells:
        rps = len(c.latencies_s) / c.duration_s
        print(
            f"| {c.clients} | {c.policy} | {c.key_kind} | {rps:,.0f} | {c.ms(0.5):.1f} | "
            f"{c.ms(0.99):.1f} | {c.share('fast'):.0%} | {c.share('slow'):.0%} | {c.errors} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=5.0, help="seconds measured per cell")
    parser.add_argument("--warmup-s", type=float, default=0.5, help="seconds before measuring")
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[4, 32],
        help="comma-separated numbers of concurrent clients (default 4,32)",
    )
    parser.add_argument("--fast-ms", type=float, default=20.0, help="fast engine, per request")
    parser.add_argument("--slow-ms", type=float, default=120.0, help="slow engine, per request")
    parser.add_argument("--slots", type=int, default=8, help="requests each engine serves at once")
    args = parser.parse_args()
    uvloop.run(_bench(args))


if __name__ == "__main__":
    main()
