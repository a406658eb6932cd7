"""The load generator and process meters of ``scripts/bench_tunnel.py``.

Keep-alive HTTP/1.1 connections on uvloop, requests written raw, answers parsed with
httptools, one request in flight per connection (closed loop); streams held open at once;
the CPU time (``utime + stime`` in ``/proc/PID/stat``) and RSS (``VmRSS``) of berth's
processes. :func:`measure_path` runs every load on one path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import httptools

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
#: Spacing of the events of the held-open streams, in milliseconds.
HELD_STREAM_INTERVAL_MS = 250.0
#: Connections opened at once while setting up the held-open streams (TLS handshakes).
CONNECT_PARALLELISM = 64


def rss_mib(pid: int) -> float | None:
    """The resident set size of ``pid`` in MiB (``VmRSS``), or ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` has used (user + system, ``/proc/PID/stat``); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Path_:
    """Where one path's requests go, and which berth processes serve them (their CPU time
    is what the path costs)."""

    name: str
    port: int
    tls: ssl.SSLContext | None
    authorization: bytes
    model: str
    pids: tuple[int, ...] = ()
    agent: str | None = None  # the agent's label, for its RSS

    def cpu_s(self) -> list[float]:
        """CPU seconds of each of ``pids`` so far, in order."""
        return [cpu_s(pid) for pid in self.pids]


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; ``exchange`` sends a request and awaits its answer."""

    def __init__(self, gauge: list[int] | None = None) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[None] | None = None
        self._gauge = gauge  # [open now, most open at once]: streams between first byte and end
        self.first_body_at = 0.0
        self.events = 0
        self._tail = b""
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError("connection lost"))

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._done is not None and not self._done.done():
                self._done.set_exception(ConnectionError(f"bad answer: {exc}"))
            self.close()

    def on_body(self, body: bytes) -> None:
        if not self.first_body_at:
            self.first_body_at = time.perf_counter()
            if self._gauge is not None:
                self._gauge[0] += 1
                self._gauge[1] = max(self._gauge[1], self._gauge[0])
        # SSE events end with a blank line; one may straddle two reads
        joined = self._tail + body
        self.events += joined.count(b"\n\n")
        self._tail = joined[-1:]
        if self._tail != b"\n":
            self._tail = b""

    def on_message_complete(self) -> None:
        if self._gauge is not None and self.first_body_at:
            self._gauge[0] -= 1
        assert self._done is not None
        status = self._parser.get_status_code()
        if status != 200:
            self._done.set_exception(RuntimeError(f"HTTP {status}"))
        elif not self._done.done():
            self._done.set_result(None)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def exchange(self, request: bytes) -> None:
        assert self._transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self.first_body_at = 0.0
        self.events = 0
        self._tail = b""
        self._transport.write(request)
        await self._done


async def _connect(path: Path_, gauge: list[int] | None = None) -> _Connection:
    loop = asyncio.get_running_loop()
    if path.tls is None:
        _, protocol = await loop.create_connection(
            lambda: _Connection(gauge), "127.0.0.1", path.port
        )
    else:
        _, protocol = await loop.create_connection(
            lambda: _Connection(gauge), "127.0.0.1", path.port, ssl=path.tls,
            server_hostname="127.0.0.1",
        )  # fmt: skip
    return protocol


def _request(path: Path_, streamed: bool, tokens: int, interval_ms: float = 0.0) -> bytes:
    payload: dict[str, Any] = {
        "model": path.model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": tokens,
    }
    if streamed:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    if interval_ms:
        payload["bench_interval_ms"] = interval_ms
    body = json.dumps(payload).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
        % (path.authorization, len(body), body)
    )


@dataclass
class Cell:
    """One closed-loop run: latencies and TTFBs of the requests sent while measuring, and the
    CPU seconds the path's berth processes used meanwhile."""

    latencies_s: list[float]
    ttfbs_s: list[float]
    events: int
    elapsed_s: float
    errors: int
    cpu_by_process_s: list[float] = field(default_factory=list)  # leader, then the agent

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu_by_process_s)

    @property
    def rps(self) -> float:
        return len(self.latencies_s) / self.elapsed_s

    @property
    def events_per_s(self) -> float:
        return self.events / self.elapsed_s

    @property
    def cpu_per_request_us(self) -> float:
        return 1e6 * self.cpu_s / max(1, len(self.latencies_s))

    @property
    def cpu_per_event_us(self) -> float:
        return 1e6 * self.cpu_s / max(1, self.events)

    def split_us(self, per: int) -> str:
        """CPU µs per ``per`` units of work of each process: ``leader + agent``."""
        return " + ".join(f"{1e6 * cpu / max(1, per):.0f}" for cpu in self.cpu_by_process_s)


def ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def closed_loop(
    path: Path_, streamed: bool, clients: int, tokens: int, warmup_s: float, run_s: float
) -> Cell:
    request = _request(path, streamed, tokens)
    connections = [await _connect(path) for _ in range(clients)]
    cell = Cell([], [], 0, run_s, 0)
    measure_from = time.perf_counter() + warmup_s
    stop_at = measure_from + run_s

    async def client(connection: _Connection) -> None:
        while True:
            sent = time.perf_counter()
            if sent >= stop_at:
                return
            try:
                await connection.exchange(request)
            except (RuntimeError, ConnectionError):
                cell.errors += 1
                if connection.lost:
                    return
                continue
            if sent >= measure_from:
                cell.latencies_s.append(time.perf_counter() - sent)
                cell.ttfbs_s.append(connection.first_body_at - sent)
                cell.events += connection.events

    async def cpu_meter() -> None:
        await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
        begun = path.cpu_s()
        await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
        cell.cpu_by_process_s = [
            end - start for start, end in zip(begun, path.cpu_s(), strict=True)
        ]

    await asyncio.gather(cpu_meter(), *(client(c) for c in connections))
    for connection in connections:
        connection.close()
    return cell


@dataclass
class Held:
    """``--streams`` streams held open at once."""

    wanted: int
    connected: int = 0
    completed: int = 0
    most_open: int = 0
    ttfbs_s: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.failures[why] = self.failures.get(why, 0) + 1


async def held_streams(path: Path_, streams: int, tokens: int) -> Held:
    held = Held(streams)
    gauge = [0, 0]
    gate = asyncio.Semaphore(CONNECT_PARALLELISM)

    async def connect() -> _Connection | None:
        async with gate:
            try:
                return await _connect(path, gauge)
            except (OSError, ssl.SSLError) as exc:
                held.fail(type(exc).__name__)
                return None

    opened = await asyncio.gather(*(connect() for _ in range(streams)))
    connections = [c for c in opened if c is not None]
    held.connected = len(connections)
    request = _request(path, True, tokens, HELD_STREAM_INTERVAL_MS)
    expected_events = tokens + 4  # role, tokens, finish, usage, [DONE]

    async def one(connection: _Connection) -> None:
        sent = time.perf_counter()
        try:
            await connection.exchange(request)
        except (RuntimeError, ConnectionError) as exc:
            held.fail(str(exc))
            return
        if connection.events != expected_events:
            held.fail(f"{connection.events} of {expected_events} events")
            return
        held.completed += 1
        held.ttfbs_s.append(connection.first_body_at - sent)

    timeout_s = 60 + tokens * HELD_STREAM_INTERVAL_MS / 1000
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(one(c) for c in connections))
    except TimeoutError:
        held.fail(f"not done within {timeout_s:.0f} s")
    for connection in connections:
        connection.close()
    held.most_open = gauge[1]
    return held


class RssSampler:
    """Samples the RSS of some processes every ``interval_s``; keeps the peak since a mark."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.05) -> None:
        self._pids = pids
        self._interval_s = interval_s
        self.peak: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def now(self) -> dict[str, float]:
        return {name: rss_mib(pid) or 0.0 for name, pid in self._pids.items()}

    def mark(self) -> dict[str, float]:
        """Start a new peak from the current values; returns them."""
        current = self.now()
        self.peak = dict(current)
        return current

    async def _run(self) -> None:
        while True:
            for name, value in self.now().items():
                if value > self.peak.get(name, 0.0):
                    self.peak[name] = value
            await asyncio.sleep(self._interval_s)

    def __enter__(self) -> RssSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


@dataclass
class PathResult:
    json_1: Cell
    json_n: Cell
    stream_1: Cell
    stream_n: Cell
    held: Held
    rss_load: dict[str, tuple[float, float, float]]  # name -> (before, peak, after), MiB
    rss_held: dict[str, tuple[float, float, float]]


async def measure_path(path: Path_, sampler: RssSampler, args: argparse.Namespace) -> PathResult:
    load = args.warmup_s, args.duration_s
    tokens = args.events
    log(f"{path.name}: warming up")
    await closed_loop(path, False, args.concurrency, tokens, 0.0, 1.0)
    await asyncio.sleep(0.5)
    before = sampler.mark()
    log(f"{path.name}: non-streamed and streamed, 1 and {args.concurrency} clients")
    json_1 = await closed_loop(path, False, 1, tokens, *load)
    json_n = await closed_loop(path, False, args.concurrency, tokens, *load)
    stream_1 = await closed_loop(path, True, 1, tokens, *load)
    stream_n = await closed_loop(path, True, args.concurrency, tokens, *load)
    peak = dict(sampler.peak)
    await asyncio.sleep(1.0)
    after = sampler.now()
    rss_load = {k: (before[k], peak[k], after[k]) for k in before}
    before = sampler.mark()
    if args.streams:
        log(f"{path.name}: {args.streams} streams held open")
        held = await held_streams(path, args.streams, tokens)
    else:
        held = Held(0)
    peak = dict(sampler.peak)
    await asyncio.sleep(2.0)
    after = sampler.now()
    rss_held = {k: (before[k], peak[k], after[k]) for k in before}
    return PathResult(json_1, json_n, stream_1, stream_n, held, rss_load, rss_held)
