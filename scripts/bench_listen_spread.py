"""How evenly N serving processes on one port share the load: ``SO_REUSEPORT`` against one
inherited listening socket (issue 40's choice for ``berth daemon start --workers N``).

Two ways exist for N processes to serve one public port:

* ``reuseport``: each process binds its own socket with ``SO_REUSEPORT``; the kernel hashes
  each new connection's 4-tuple to one of the listening sockets (Linux 3.9+), whatever the
  processes' load;
* ``inherited``: the parent binds and listens once and every process accepts on that same
  socket (uvicorn's and gunicorn's ``--workers``). asyncio's epoll wakes every process on a
  new connection and the first to call ``accept`` takes it, so an idle process tends to win.

Each worker here is berth's own HTTP server (:class:`berth.http_server.server.HttpServer`) in
its own process, answering every request after burning ``--burn-us`` microseconds of CPU (a
stand-in for berth's per-request cost). wrk drives the load in two shapes:

* ``keep-alive``: ``--connections`` long-lived connections, many requests each (an SDK's
  pool: the spread is fixed at connect time);
* ``close``: ``Connection: close`` on every request, so each request is a new connection (a
  client without a pool, or a load balancer that does not reuse).

Per mode, shape and round it prints each worker's share of the requests, the largest share
over the even one (``max/even``: 1.00 is perfectly even), and requests a second. Run:
``.venv/bin/python scripts/bench_listen_spread.py`` (about a minute with the defaults; needs
``wrk`` on ``PATH``). Medians over ``--rounds``, the modes alternating within each round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from berth.http_server.request import Request
from berth.http_server.server import HttpServer
from berth.http_server.writer import ResponseWriter

MODES = ("reuseport", "inherited")
SHAPES = ("keep-alive", "close")


@dataclass(frozen=True)
class Run:
    """One run's result: each worker's share of the requests (summing to 1) and wrk's rate."""

    shares: list[float]
    requests_per_s: float


def _burn(burn_s: float) -> None:
    end = time.thread_time() + burn_s
    while time.thread_time() < end:
        pass


async def _serve(sock: socket.socket, burn_s: float, report: Path) -> None:
    """Serve on ``sock`` until SIGTERM, then write ``{"requests": n, "connections": n}`` to
    ``report``."""
    counts = {"requests": 0}

    async def handle(request: Request, writer: ResponseWriter) -> None:
        counts["requests"] += 1
        _burn(burn_s)
        body = b'{"ok":true}'
        await writer.start(
            200,
            [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        )
        await writer.end(body)

    server = HttpServer("bench", handle)
    await server.start(sock)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close(grace_s=1.0)
    report.write_text(json.dumps(counts))


def _worker(args: argparse.Namespace) -> None:
    if args.fd is not None:
        sock = socket.socket(fileno=args.fd)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", args.port))
        sock.listen(1024)
    sock.setblocking(False)
    asyncio.run(_serve(sock, args.burn_us / 1e6, Path(args.report)))


def _wait_listening(port: int, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port} after {deadline_s} s")


def _run_once(mode: str, shape: str, args: argparse.Namespace, scratch: Path) -> Run:
    """Start ``args.workers`` workers in ``mode``, drive ``shape`` with wrk, return shares."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if mode == "reuseport":
        # Bound, never listening: it holds the port for the workers and takes no connection.
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    if mode == "inherited":
        holder.listen(1024)
    procs = []
    reports = []
    for index in range(args.workers):
        report = scratch / f"{mode}-{shape}-{index}.json"
        reports.append(report)
        command = [sys.executable, __file__, "--worker", "--burn-us", str(args.burn_us),
                   "--report", str(report)]  # fmt: skip
        if mode == "inherited":
            command += ["--fd", str(holder.fileno())]
            procs.append(subprocess.Popen(command, pass_fds=(holder.fileno(),)))
        else:
            command += ["--port", str(port)]
            procs.append(subprocess.Popen(command))
    try:
        _wait_listening(port)
        time.sleep(0.5)  # let every worker reach its accept loop before the load starts
        wrk = ["wrk", "-t", "2", "-c", str(args.connections), "-d", f"{args.duration_s}s",
               f"http://127.0.0.1:{port}/"]  # fmt: skip
        if shape == "close":
            wrk[1:1] = ["-H", "Connection: close"]
        out = subprocess.run(wrk, capture_output=True, text=True, check=True).stdout
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=10)
        holder.close()
    counts = [json.loads(r.read_text())["requests"] for r in reports]
    total = sum(counts) or 1
    rps = next((float(line.split()[1]) for line in out.splitlines()
                if line.startswith("Requests/sec:")), 0.0)  # fmt: skip
    return Run([c / total for c in counts], rps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration-s", type=int, default=4)
    parser.add_argument("--burn-us", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    results: dict[tuple[str, str], list[Run]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = MODES if round_index % 2 == 0 else tuple(reversed(MODES))
            for shape in SHAPES:
                for mode in order:
                    result = _run_once(mode, shape, args, Path(tmp))
                    results.setdefault((mode, shape), []).append(result)
    print(f"{args.workers} workers, {args.connections} connections, {args.burn_us} µs CPU per "
          f"request, {args.duration_s} s per run, medians of {args.rounds} rounds (cpus: "
          f"{os.cpu_count()})")  # fmt: skip
    print(f"{'mode':<10} {'shape':<11} {'max/even':>8} {'min/even':>8} {'req/s':>8}  shares")
    for (mode, shape), runs in results.items():
        even = 1 / args.workers
        max_even = statistics.median(max(r.shares) / even for r in runs)
        min_even = statistics.median(min(r.shares) / even for r in runs)
        rps = statistics.median(r.requests_per_s for r in runs)
        shares = " ".join(f"{s:.2f}" for s in sorted(runs[-1].shares, reverse=True))
        print(f"{mode:<10} {shape:<11} {max_even:>8.2f} {min_even:>8.2f} {rps:>8.0f}  {shares}")


if __name__ == "__main__":
    main()
