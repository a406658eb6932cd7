"""Benchmark the tail of one client's sequential requests: berth beside the engine alone.

A periodic stall of the leader's event loop hides in averages and shows in the tail: one
client that sends its next request as soon as the last answer arrived meets every stall. This
script measures that tail on loopback with real processes, set up with berth's own CLI in a
throw-away home:

* a leader (``berth daemon start``) with an API key;
* ``--deployments`` local deployments (``bench-0``, ``bench-1``, ...), each a stand-in
  engine launched by berth as ``llama-server`` (``BERTH_LLAMA_SERVER_BIN`` points at a
  wrapper running this script's ``engine`` role: the fast engine of
  ``tests/support/standin_engine.py``, raw asyncio + httptools, a canned ~300-byte chat
  completion for any request, ``/health`` included). A list such as ``1,4`` measures 1
  deployment, then adds 3 and measures again, to show whether a stall grows with their count
  (each is probed every 5 s);
* this process, the client: one keep-alive connection, one non-streamed chat completion for
  ``bench-0`` after another, for ``--duration-s`` seconds (60 by default).

Paths, in order: ``engine alone`` (plain HTTP straight to ``bench-0``'s engine port), then
``berth, N deployment(s)`` (HTTPS to the public listener with a bearer key) for each N; with
``--rounds R`` the engine and the first count alternate R times, then each larger count runs R
times. Per path and round it prints the number of requests, p50, p99, p99.9 and max latency in
ms, and how many requests took over each ``--over-ms`` line (10 and 50 ms). For berth it also
reads the leader's own monitor: how many of its loop-lag observations
(``berth_event_loop_lag_seconds{node="local"}``) were over 10 ms and 50 ms during the run, and
which callbacks its "event loop blocked" warnings named (these are absent on a berth without the
monitor). Rounds show the noise of a shared machine.
Run:
``.venv/bin/python scripts/bench_sequential.py [--duration-s 60] [--deployments 1,4]``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_PREFIX = "bench-"
LAG_SERIES = "berth_event_loop_lag_seconds_bucket"
_WARNING = re.compile(r"event loop (?:has been )?blocked for [\d.]+ m?s (.*)")


# -- the engine: `bench_sequential.py engine -m PATH --host H --port P ...` ------------------------


def serve_engine(argv: list[str]) -> None:
    """Serve as ``llama-server``: its flags, unknown ones ignored; canned answers."""
    import asyncio

    import uvloop

    sys.path.insert(0, str(ROOT / "tests"))
    from support.standin_engine import serve_fast_engine

    parser = argparse.ArgumentParser(prog="llama-server", add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ignored = parser.parse_known_args(argv)

    async def main() -> None:
        server = await serve_fast_engine(args.host, args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with server:
            await stop.wait()

    uvloop.run(main())


# -- the leader, set up through the CLI ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Leader:
    """The leader's home, environment, port, key and the deployments it runs."""

    workdir: Path
    env: dict[str, str]
    public_port: int
    pid: int = 0
    api_key: str = ""
    engine_ports: dict[str, int] = field(default_factory=dict)
    engine_pids: list[int] = field(default_factory=list)

    @property
    def home(self) -> Path:
        return self.workdir / "leader"

    def berth(self, *args: str, timeout_s: float = 120.0) -> str:
        """Run the ``berth`` CLI on the leader's home; its stdout (``RuntimeError`` if it fails)."""
        command = [sys.executable, "-m", "berth", "--home", str(self.home), *args]
        result = subprocess.run(
            command, capture_output=True, text=True, env=self.env, timeout=timeout_s,
            cwd=self.workdir,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"berth {' '.join(args)} exited {result.returncode}: "
                               f"{result.stderr.strip()}")  # fmt: skip
        return result.stdout

    def deploy(self, count: int) -> None:
        """Have ``count`` deployments running (adds the missing ones)."""
        weights = self.workdir / "bench.gguf"
        if not weights.exists():
            weights.write_bytes(b"GGUF" + bytes(60))
        for index in range(len(self.engine_ports), count):
            name = f"{MODEL_PREFIX}{index}"
            self.berth("models", "add", name, str(weights))
            self.berth("run", name, "--engine", "llamacpp", "--timeout", "60")
        for deployment in json.loads(self.berth("ps", "--json")):
            name = deployment.get("served_model_name") or deployment.get("model_name")
            if name not in self.engine_ports:
                self.engine_ports[name] = int(deployment["port"])
                self.engine_pids.append(int(deployment["pid"]))
        _log(f"{len(self.engine_ports)} deployment(s) serving")

    def metrics(self) -> str:
        context = ssl.create_default_context(cafile=str(self.home / "ca" / "ca.pem"))
        connection = http.client.HTTPSConnection(
            "127.0.0.1", self.public_port, context=context, timeout=30
        )
        try:
            connection.request(
                "GET", "/metrics", headers={"authorization": f"Bearer {self.api_key}"}
            )
            return connection.getresponse().read().decode()
        finally:
            connection.close()

    @property
    def log_file(self) -> Path:
        return self.home / "logs" / "daemon.log"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def running_leader(keep: bool) -> Iterator[Leader]:
    workdir = Path(tempfile.mkdtemp(prefix="berth-bench-sequential-"))
    wrapper = workdir / "bin" / "llama-server"
    wrapper.parent.mkdir()
    wrapper.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" engine "$@"\n'
    )
    wrapper.chmod(0o755)
    public_port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BERTH_", "HF_"))}
    env.update(
        {
            "COLUMNS": "200",
            "BERTH_LLAMA_SERVER_BIN": str(wrapper),
            "BERTH_PUBLIC_PORT": str(public_port),
            "BERTH_CLUSTER_PORT": str(_free_port()),
            "BERTH_HEALTH_TIMEOUT_S": "30",
            "BERTH_STOP_GRACE_S": "5",
        }
    )
    leader = Leader(workdir, env, public_port)
    try:
        leader.berth("daemon", "start")
        leader.pid = int((leader.home / "daemon.pid").read_text().split()[0])
        keys = re.findall(r"sk-berth-\S+", leader.berth("key", "create", "bench"))
        if not keys:
            raise RuntimeError("berth key create printed no key")
        leader.api_key = keys[0]
        _log(f"leader running (pid {leader.pid}, HTTPS port {public_port})")
        yield leader
    finally:
        _log("tearing down")
        if leader.pid:
            with contextlib.suppress(Exception):
                leader.berth("stop", "--all", timeout_s=60)
            with contextlib.suppress(Exception):
                leader.berth("daemon", "stop", timeout_s=30)
        for pid in [*leader.engine_pids, leader.pid]:
            if pid and _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if keep:
            _log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# -- the client ------------------------------------------------------------------------------------


def _body(model: str) -> bytes:
    return json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
    }).encode()  # fmt: skip


def sequential(connection: http.client.HTTPConnection, headers: dict[str, str], body: bytes,
               duration_s: float) -> tuple[list[float], int]:  # fmt: skip
    """Send one request after another for ``duration_s``; (latencies in s, errors)."""
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + duration_s
    while True:
        sent = time.perf_counter()
        if sent >= stop_at:
            return latencies, errors
        connection.request("POST", "/v1/chat/completions", body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        elapsed = time.perf_counter() - sent
        if response.status == 200:
            latencies.append(elapsed)
        else:
            errors += 1


@dataclass(frozen=True)
class Row:
    path: str
    round: int
    latencies_s: list[float]
    errors: int
    lag_over_10_ms: int | None = None
    lag_over_50_ms: int | None = None
    lag_ticks: int | None = None
    stalls_named: Counter[str] | None = None


def quantile_ms(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _lag_buckets(metrics_text: str) -> dict[float, float]:
    """``le`` -> cumulative count of the leader's own loop-lag histogram (empty if absent)."""
    out: dict[float, float] = {}
    pattern = re.compile(LAG_SERIES + r'\{(?=[^}]*node="local")[^}]*le="([^"]+)"[^}]*\} (\S+)')
    for le, value in pattern.findall(metrics_text):
        out[float("inf") if le == "+Inf" else float(le)] = float(value)
    return out


def _named_stalls(log_file: Path, offset: int) -> Counter[str]:
    """The callbacks the leader's stall warnings named since ``offset`` in its log."""
    named: Counter[str] = Counter()
    with open(log_file, "rb") as log_in:
        log_in.seek(offset)
        text = log_in.read().decode("utf-8", "replace")
    for match in _WARNING.finditer(text):
        what = match.group(1).split(";")[0]
        what = re.sub(r" in task '[^']*'", "", what)
        named[what.removeprefix("by ")] += 1
    return named


def measure_engine(port: int, duration_s: float, round_: int) -> Row:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"content-type": "application/json"}
    body = _body(f"{MODEL_PREFIX}0")
    try:
        sequential(connection, headers, body, 1.0)  # warm-up
        latencies, errors = sequential(connection, headers, body, duration_s)
    finally:
        connection.close()
    return Row("engine alone", round_, sorted(latencies), errors)


def measure_berth(leader: Leader, name: str, duration_s: float, round_: int) -> Row:
    context = ssl.create_default_context(cafile=str(leader.home / "ca" / "ca.pem"))
    connection = http.client.HTTPSConnection(
        "127.0.0.1", leader.public_port, context=context, timeout=30
    )
    headers = {"content-type": "application/json", "authorization": f"Bearer {leader.api_key}"}
    body = _body(f"{MODEL_PREFIX}0")
    try:
        sequential(connection, headers, body, 1.0)  # warm-up: TLS, the key cache, the pool
        before = _lag_buckets(leader.metrics())
        offset = leader.log_file.stat().st_size
        latencies, errors = sequential(connection, headers, body, duration_s)
        after = _lag_buckets(leader.metrics())
    finally:
        connection.close()
    over_10 = over_50 = ticks = None
    if after:
        ticks = int(after[float("inf")] - before.get(float("inf"), 0))
        over_10 = ticks - int(after[0.01] - before.get(0.01, 0))
        over_50 = ticks - int(after[0.05] - before.get(0.05, 0))
    return Row(name, round_, sorted(latencies), errors, over_10, over_50, ticks,
               _named_stalls(leader.log_file, offset))  # fmt: skip


# -- the report ------------------------------------------------------------------------------------


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()}"


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def report(rows: list[Row], args: argparse.Namespace, load_before: str) -> None:
    print(f"machine: {_machine()}")
    print(f"load average (1, 5, 15 min): {load_before} before, {_load()} after")
    print(f"one client, sequential non-streamed chat completions, {args.duration_s:g} s per row\n")
    lines = " | ".join(f"over {limit:g} ms" for limit in args.over_ms)
    print(f"| path | round | requests | p50 ms | p99 ms | p99.9 ms | max ms | {lines} "
          "| errors | loop lag > 10 ms / > 50 ms (of ticks) |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(args.over_ms)
          + " ---: | --- |")  # fmt: skip
    for row in rows:
        lat = row.latencies_s
        slow = " | ".join(str(sum(1 for v in lat if v * 1000 > limit)) for limit in args.over_ms)
        lag = "-"
        if row.lag_ticks is not None:
            lag = f"{row.lag_over_10_ms} / {row.lag_over_50_ms} (of {row.lag_ticks:,})"
        elif row.path != "engine alone":
            lag = "n/a (no monitor)"
        print(
            f"| {row.path} | {row.round} | {len(lat):,} | {quantile_ms(lat, 0.5):.2f} "
            f"| {quantile_ms(lat, 0.99):.2f} | {quantile_ms(lat, 0.999):.2f} "
            f"| {1000 * lat[-1] if lat else float('nan'):.1f} | {slow} | {row.errors} | {lag} |"
        )
    for row in rows:
        if row.stalls_named:
            print(f"\n{row.path}, round {row.round}: the leader's stall warnings named")
            for what, count in row.stalls_named.most_common(8):
                print(f"  {count} x {what}")


def main() -> None:
    if sys.argv[1:2] == ["engine"]:
        serve_engine(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=60.0, help="seconds per row")
    parser.add_argument(
        "--deployments", default="1", help="deployment counts to measure, e.g. 1,4 (ascending)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="times to measure every path")
    parser.add_argument(
        "--over-ms",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[10.0, 50.0],
        help="slow-request lines, in ms, each counted in its own column (default: 10,50)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary home and logs")
    args = parser.parse_args()
    counts = sorted({int(c) for c in args.deployments.split(",")})
    if not counts or counts[0] < 1:
        parser.error("--deployments needs counts of at least 1")
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(1))  # tear down on SIGTERM
    load_before = _load()
    rows: list[Row] = []
    with running_leader(args.keep) as leader:
        for count in counts:
            leader.deploy(count)
            name = f"berth, {count} deployment{'s' if count > 1 else ''}"
            for round_ in range(1, args.rounds + 1):
                if count == counts[0]:
                    _log(f"round {round_}: engine alone")
                    port = leader.engine_ports[f"{MODEL_PREFIX}0"]
                    rows.append(measure_engine(port, args.duration_s, round_))
                _log(f"round {round_}: {name}")
                rows.append(measure_berth(leader, name, args.duration_s, round_))
    report(rows, args, load_before)


if __name__ == "__main__":
    main()
