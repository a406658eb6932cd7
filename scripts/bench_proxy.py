"""Benchmark the OpenAI proxy against the same load sent straight to the engine.

Processes on loopback, plain HTTP, each its own Python:

* the fast stand-in engine (``tests/support/standin_engine.py``: raw asyncio + httptools, canned
  answers: a 257-byte chat completion, or a 19-event stream of 3.3 kB written in one piece);
* the proxy: :class:`berth.gateway.proxy.OpenAIProxy` served by berth's own HTTP server
  (:mod:`berth.http_server`, on uvloop) with a fixed resolver and no auth in front, as the
  leader serves ``/v1``; it reaches the engine with berth's own client
  (:mod:`berth.engine_http.pool`);
* two reference servers, for the ceiling of this stack on this machine: uvicorn answering
  the canned JSON itself (``uvicorn alone``), and a bare uvicorn + aiohttp relay with none of
  the proxy's checks, metrics or disconnect handling (``bare relay``: the proxy's previous
  upstream client, kept as a reference);
* this process, the load generator: keep-alive connections on uvloop with httptools parsing,
  one request in flight per connection (closed loop).

For 1 and 32 concurrent clients, non-streamed and streamed, it measures each path for
``--duration`` seconds after ``--warmup`` seconds and prints p50/p99 latency (request written
to answer complete), p50 time to the first body byte, requests per second, CPU time the
serving process spent per request, and the proxy/direct comparison.
Every server first gets one untimed second of load. Run:
``.venv/bin/python scripts/bench_proxy.py`` (about 45 s).

``--limits`` compares, side by side, the proxy without admission and the proxy with it:
requests from a key with every limit set (none ever reached), its rate-limit headers on
every answer, the usage ledger buffering each request and written to a SQLite store every
5 s, each request taking a slot of its deployment at the fair admission gate and giving it
back, and, for a stream that does not ask for usage, the body asking the engine and the usage
event taken out. Each cell is measured ``--rounds`` times, off and on in turn, and the median
CPU per request is printed; ``--control`` adds the same comparison between two proxies
without admission, which shows how far two identical processes differ on this machine
(``--limits --control --clients 32``: about 4 minutes). Each proxy freezes its start-up heap
once serving, as the leader does. ``scripts/bench_admission.py`` measures the same in one
process, without the sockets' noise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httptools
import uvloop

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"
Message = MutableMapping[str, Any]


# -- the servers, each run as `bench_proxy.py --role NAME` ----------------------------------------


def _bound_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    return sock


def _uvicorn(app: Any) -> None:
    import uvicorn

    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        proxy_headers=False,
        backlog=1024,
    )
    uvicorn.Server(config).run(sockets=[_bound_socket()])


def serve_engine() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from support.standin_engine import serve_fast_engine

    async def main() -> None:
        server = await serve_fast_engine()
        print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
        await server.serve_forever()

    uvloop.run(main())


def add_limited_key(store: Any, model: str) -> Any:
    """A key in ``store`` (a migrated :class:`berth.store.Store`) with every limit set far
    above any load this machine can make, so that each check runs and none refuses; its
    model list names ``model``."""
    from berth.vocab.limits import LimitOverrides

    huge = 10**12
    own = LimitOverrides(
        rpm=huge,
        tpm=huge,
        max_concurrency=100_000,
        daily_tokens=huge,
        monthly_tokens=huge,
        models=frozenset({model, "other"}),
    )
    return store.add_api_key("bench", "standard", "0" * 64, "sk-berth-0000", limits=own)


def serve_proxy(engine_port: int, *, limits: bool = False) -> None:
    from berth.eventloop import freeze_startup_objects
    from berth.gateway.proxy import OpenAIProxy
    from berth.observability.metrics import ProxyMetrics
    from berth.routing.resolver import Upstream

    # With limits, the deployment has slots (far more than the load), so every request also
    # takes one and gives it back through the fair admission gate.
    slots = 1_000_000 if limits else None
    upstream = Upstream(f"http://127.0.0.1:{engine_port}", "d-bench", "local", MODEL, slots=slots)

    class FixedResolver:
        def candidates(self, model: str) -> list[Upstream]:
            return [upstream]

        def models(self) -> list[str]:
            return [MODEL]

    from berth.http_server.server import HttpServer

    proxy_options: dict[str, Any] = {}
    key: Any = None
    ledger: Any = None
    if limits:
        # Every request made by one key with every limit set far above the load (so each
        # check runs and none refuses), its usage ledger written to a SQLite store in a
        # temporary folder by the flusher, as the leader runs it.
        import tempfile

        from berth.admission import Admission, SlotGate, UsageLedger
        from berth.config import TierTable
        from berth.store import Store

        store = Store(f"sqlite:///{tempfile.mkdtemp(prefix='bench-proxy-')}/berth.db")
        store.migrate()
        key = add_limited_key(store, MODEL)
        ledger = UsageLedger(store)
        admission = Admission(TierTable(), ledger)
        admission.load([key], {})
        proxy_options["admission"] = admission
        proxy_options["slots"] = SlotGate()
    proxy = OpenAIProxy(FixedResolver(), ProxyMetrics(), **proxy_options)

    async def handle(request: Any, writer: Any) -> None:
        await proxy.handle(request, writer, key)  # the key the listener's auth hands the proxy

    async def main() -> None:
        # As the leader serves /v1: berth's own HTTP server, the proxy's own request and writer.
        await proxy.startup()
        if ledger is not None:
            asyncio.get_running_loop().create_task(ledger.run())
        server = HttpServer("bench", handle if limits else proxy.handle)
        await server.start(_bound_socket())
        freeze_startup_objects()  # as the leader does once started
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_uvicorn_alone() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import json

    from support.standin_engine import chat_completion

    body = json.dumps(chat_completion("Hello! How can I help you today?")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]

    async def app(scope: Message, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    _uvicorn(app)


def serve_bare_relay(engine_port: int) -> None:
    import aiohttp

    url = f"http://127.0.0.1:{engine_port}/v1/chat/completions"
    sessions: list[aiohttp.ClientSession] = []

    async def app(scope: Message, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            sessions.append(aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()))
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await sessions[0].close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        message = await receive()
        headers = {"content-type": "application/json"}
        response = await sessions[0].post(url, data=message["body"], headers=headers)
        data = await response.read()
        response.release()
        answer = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": 200, "headers": answer})
        await send({"type": "http.response.body", "body": data})

    _uvicorn(app)


@dataclass
class Server:
    name: str
    process: subprocess.Popen[str]
    port: int

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the process has used; Linux /proc."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spawn(name: str, *args: str) -> Server:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    process = subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("PORT "):
        process.kill()
        raise RuntimeError(f"{name} did not start: {line!r}")
    return Server(name, process, int(line.split()[1]))


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
        sock = self._transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

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

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

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
    cpu_us_per_request: float

    @property
    def rps(self) -> float:
        return len(self.latencies_s) / self.elapsed_s

    def ms(self, values: list[float], q: float) -> float:
        ordered = sorted(values)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _request(streamed: bool, *, asks_usage: bool = True) -> bytes:
    stream = ""
    if streamed:
        stream = ', "stream": true'
        if asks_usage:
            stream += ', "stream_options": {"include_usage": true}'

    body = (
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Say hello."}}],'
        f' "max_tokens": 16{stream}}}'
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


async def _load(
    server: Server,
    streamed: bool,
    clients: int,
    warmup_s: float,
    run_s: float,
    *,
    asks_usage: bool = True,
) -> Result:
    loop = asyncio.get_running_loop()
    request = _request(streamed, asks_usage=asks_usage)
    connections = []
    for _ in range(clients):
        _, protocol = await loop.create_connection(_Connection, "127.0.0.1", server.port)
        connections.append(protocol)
    latencies: list[float] = []
    ttfbs: list[float] = []
    errors = 0
    measure_from = time.perf_counter() + warmup_s
    stop_at = measure_from + run_s
    cpu_at_start: list[float] = []

    async def client(connection: _Connection) -> None:
        nonlocal errors
        while True:
            sent = time.perf_counter()
            if sent >= stop_at:
                return
            if sent >= measure_from and not cpu_at_start:
                cpu_at_start.append(server.cpu_s())
            try:
                await connection.exchange(request)
            except (RuntimeError, ConnectionError):
                errors += 1
                if connection.lost:
                    return
                continue
            if sent >= measure_from:
                latencies.append(time.perf_counter() - sent)
                ttfbs.append(connection.first_body_at - sent)

    await asyncio.gather(*(client(c) for c in connections))
    cpu_us = 1e6 * (server.cpu_s() - cpu_at_start[0]) / max(1, len(latencies))
    for connection in connections:
        connection.close()
    return Result(latencies, ttfbs, run_s, errors, cpu_us)


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


def _row(kind: str, clients: int, name: str, r: Result) -> str:
    return (
        f"| {kind} | {clients} | {name} | {r.ms(r.latencies_s, 0.5):.3f} | "
        f"{r.ms(r.latencies_s, 0.99):.3f} | {r.ms(r.ttfbs_s, 0.5):.3f} | {r.rps:,.0f} | "
        f"{r.cpu_us_per_request:.0f} | {r.errors} |"
    )


async def _bench(servers: dict[str, Server], args: argparse.Namespace) -> None:
    load = args.warmup, args.duration
    # The leader is a long-lived process: let each server reach its steady state (pools
    # filled, code specialised, start-up objects past the young GC generations) first.
    for server in servers.values():
        await _load(server, False, max(args.clients), 0.0, 1.0)
    rows = []
    for streamed in (False, True):
        for clients in args.clients:
            direct = await _load(servers["engine"], streamed, clients, *load)
            proxied = await _load(servers["proxy"], streamed, clients, *load)
            rows.append((streamed, clients, direct, proxied))
    floors = []
    if "alone" in servers:
        clients = max(args.clients)
        for name in ("alone", "relay"):
            floors.append((servers[name].name, await _load(servers[name], False, clients, *load)))

    print(f"machine: {_machine()}; load average {os.getloadavg()[0]:.2f} at the end")
    print(f"each cell: {args.duration:g} s measured after {args.warmup:g} s warm-up\n")
    print(
        "| answer | clients | path | p50 ms | p99 ms | TTFB p50 ms | req/s | server CPU µs/req "
        "| errors |\n| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for streamed, clients, direct, proxied in rows:
        kind = "stream" if streamed else "json"
        print(_row(kind, clients, "direct", direct))
        print(_row(kind, clients, "proxy", proxied))
    for name, result in floors:
        print(_row("json", max(args.clients), name, result))
    print(
        "\n| answer | clients | proxy adds at p50 (ms) | proxy adds at p99 (ms) "
        "| proxy req/s ÷ direct |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for streamed, clients, direct, proxied in rows:
        kind = "stream" if streamed else "json"
        p50 = proxied.ms(proxied.latencies_s, 0.5) - direct.ms(direct.latencies_s, 0.5)
        p99 = proxied.ms(proxied.latencies_s, 0.99) - direct.ms(direct.latencies_s, 0.99)
        print(f"| {kind} | {clients} | {p50:+.3f} | {p99:+.3f} | {proxied.rps / direct.rps:.2f} |")


async def _bench_limits(servers: dict[str, Server], args: argparse.Namespace) -> None:
    """Median CPU per request of the proxy without and with admission, measured in turn."""
    load = args.warmup, args.duration
    for name in ("proxy", "limits", "control"):
        if name not in servers:
            continue
        server = servers[name]
        await _load(server, False, max(args.clients), 0.0, 1.0)
        await _load(server, True, max(args.clients), 0.0, 1.0, asks_usage=False)
    cells = [
        ("json", False, True),
        ("stream", True, True),
        ("stream, usage not asked", True, False),
    ]
    # The control: a second proxy without admission measured as "on", to show how far two
    # identical processes differ on this machine.
    pairs = [("", servers["limits"])]
    if "control" in servers:
        pairs.append((" (control: off twice)", servers["control"]))
    rows = []
    for label, other in pairs:
        for kind, streamed, asks in cells:
            for clients in args.clients:
                off: list[Result] = []
                on: list[Result] = []
                for _ in range(args.rounds):
                    proxy = servers["proxy"]
                    off.append(await _load(proxy, streamed, clients, *load, asks_usage=asks))
                    on.append(await _load(other, streamed, clients, *load, asks_usage=asks))
                rows.append((kind + label, clients, off, on))

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    print(f"machine: {_machine()}; load average {os.getloadavg()[0]:.2f} at the end")
    print(f"each cell: {args.rounds} rounds of {args.duration:g} s, off and on in turn\n")
    print(
        "| answer | clients | CPU µs/req, limits off | CPU µs/req, limits on | added µs/req "
        "| req/s off | req/s on | p50 ms off | p50 ms on | errors |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for kind, clients, off, on in rows:
        cpu_off = median([r.cpu_us_per_request for r in off])
        cpu_on = median([r.cpu_us_per_request for r in on])
        print(
            f"| {kind} | {clients} | {cpu_off:.1f} | {cpu_on:.1f} | {cpu_on - cpu_off:+.1f} "
            f"| {median([r.rps for r in off]):,.0f} | {median([r.rps for r in on]):,.0f} "
            f"| {median([r.ms(r.latencies_s, 0.5) for r in off]):.3f} "
            f"| {median([r.ms(r.latencies_s, 0.5) for r in on]):.3f} "
            f"| {sum(r.errors for r in off + on)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--role",
        choices=("bench", "engine", "proxy", "proxy-limits", "alone", "relay"),
        default="bench",
    )
    parser.add_argument("--engine-port", type=int, default=0)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per cell")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds before measuring")
    parser.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    parser.add_argument("--no-floor", action="store_true", help="skip the reference servers")
    parser.add_argument(
        "--limits", action="store_true", help="compare the proxy without and with admission"
    )
    parser.add_argument("--rounds", type=int, default=5, help="--limits: rounds per cell")
    parser.add_argument(
        "--control",
        action="store_true",
        help="--limits: also compare two proxies without admission (the machine's noise)",
    )
    args = parser.parse_args()
    if args.role == "engine":
        serve_engine()
    elif args.role == "proxy":
        serve_proxy(args.engine_port)
    elif args.role == "proxy-limits":
        serve_proxy(args.engine_port, limits=True)
    elif args.role == "alone":
        serve_uvicorn_alone()
    elif args.role == "relay":
        serve_bare_relay(args.engine_port)
    else:
        engine = _spawn("engine", "--role", "engine")
        port = str(engine.port)
        servers = {
            "engine": engine,
            "proxy": _spawn("proxy", "--role", "proxy", "--engine-port", port),
        }
        if args.limits:
            servers["limits"] = _spawn(
                "proxy with limits", "--role", "proxy-limits", "--engine-port", port
            )
            if args.control:
                servers["control"] = _spawn("proxy", "--role", "proxy", "--engine-port", port)
        elif not args.no_floor:
            servers["alone"] = _spawn("uvicorn alone", "--role", "alone")
            servers["relay"] = _spawn("bare relay", "--role", "relay", "--engine-port", port)
        try:
            uvloop.run(_bench_limits(servers, args) if args.limits else _bench(servers, args))
        finally:
            for server in servers.values():
                server.process.terminate()
                server.process.wait(5)


if __name__ == "__main__":
    main()
