"""Benchmark a client with a valid API key beside a spray of distinct invalid ones.

Issue 23 asks that 10,000 distinct invalid keys sent at full speed leave a client with a
valid key at most twice its p99 latency alone, and bound the store reads they cost. This
script measures that on loopback with real processes, set up with berth's own CLI in a
throw-away home:

* a leader-only leader (``berth daemon start``, no engines: ``GET /v1/models`` is answered by
  the leader itself, so what is measured is TLS, the HTTP server, authentication and the
  proxy's model list) with one standard key;
* the valid client, in this process: one keep-alive HTTPS connection, one ``GET /v1/models``
  with the valid key after another;
* the sprayer, a subprocess (its own interpreter, so it does not share this one's GIL):
  ``--connections`` keep-alive HTTPS connections (opened before the spray begins) sending
  ``--keys`` distinct random ``sk-berth-...`` keys, each connection its next request as soon
  as the last was answered,
  from ``--sources`` loopback source addresses: one is the valid client's own address
  (127.0.0.1: the per-address limiter refuses the spray past its burst, and must not refuse
  the valid key); more are fresh addresses each round (127.R.N.2, 127.R.N.3, ...), each with
  a burst of its own, to show the bound on concurrent store reads.

Per round: the valid client alone for ``--alone-s`` seconds, then beside each spray (one per
``--sources`` value); the valid client's p50, p99 and max, the ratio of its p99 during the
spray to alone, the spray's answers (401, 429) and rate, and the store's API-key reads during
the spray (``berth_auth_key_reads_total`` from ``/metrics``). Rounds show the noise of a
shared machine.

Run: ``.venv/bin/python scripts/bench_auth_spray.py [--rounds 3] [--sources 1,16]
[--refusal-delay-s 0]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_READS = re.compile(r"^berth_auth_key_reads_total (\S+)$", re.M)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the sprayer: `bench_auth_spray.py spray PORT CA KEYS CONNECTIONS SOURCES NETWORK` -------------


async def _open(port: int, tls: ssl.SSLContext, source: str) -> Connection:
    return await asyncio.open_connection(
        "127.0.0.1", port, ssl=tls, server_hostname="127.0.0.1", local_addr=(source, 0)
    )


async def _spray_connection(
    port: int,
    tls: ssl.SSLContext,
    source: str,
    connection: Connection,
    keys: list[str],
    answers: Counter[int],
) -> None:
    reader, writer = connection
    try:
        for key in keys:
            writer.write(
                b"GET /v1/models HTTP/1.1\r\nhost: berth\r\nauthorization: Bearer "
                + key.encode()
                + b"\r\n\r\n"
            )
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = int(re.search(rb"content-length: *(\d+)", head, re.I)[1])  # type: ignore[index]
            await reader.readexactly(length)
            answers[status] += 1
            if re.search(rb"connection: *close", head, re.I):
                writer.close()
                reader, writer = await _open(port, tls, source)
    finally:
        writer.close()


async def _spray(
    port: int, ca: str, keys: int, connections: int, sources: int, network: str
) -> None:
    tls = ssl.create_default_context(cafile=ca)
    every = [f"sk-berth-{secrets.token_urlsafe(24)}" for _ in range(keys)]
    assert len(set(every)) == keys
    shares = [every[i::connections] for i in range(connections)]
    # One source: the valid client's own address. More: fresh ones, a network per round.
    addresses = [
        "127.0.0.1" if sources == 1 else f"{network}.{2 + i % sources}" for i in range(connections)
    ]
    opened = [await _open(port, tls, a) for a in addresses]  # handshakes before the spray
    answers: Counter[int] = Counter()
    print("ready", flush=True)
    sys.stdin.readline()  # go
    began = time.perf_counter()
    await asyncio.gather(
        *(
            _spray_connection(port, tls, a, c, s, answers)
            for a, c, s in zip(addresses, opened, shares, strict=True)
        )
    )
    elapsed_s = time.perf_counter() - began
    print(json.dumps({"elapsed_s": elapsed_s, "answers": dict(answers)}), flush=True)


# -- the leader ------------------------------------------------------------------------------------


@dataclass
class Leader:
    workdir: Path
    env: dict[str, str]
    port: int
    key: str = ""
    pid: int = 0

    @property
    def home(self) -> Path:
        return self.workdir / "leader"

    @property
    def ca(self) -> str:
        return str(self.home / "ca" / "ca.pem")

    def berth(self, *args: str) -> str:
        command = [sys.executable, "-m", "berth", "--home", str(self.home), *args]
        result = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"berth {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def key_reads(self) -> int:
        connection = self.connect()
        try:
            connection.request("GET", "/metrics", headers={"authorization": f"Bearer {self.key}"})
            text = connection.getresponse().read().decode()
        finally:
            connection.close()
        found = _READS.search(text)
        return int(float(found[1])) if found else -1

    def connect(self) -> http.client.HTTPSConnection:
        tls = ssl.create_default_context(cafile=self.ca)
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=tls, timeout=30)


@contextlib.contextmanager
def running_leader(keep: bool, refusal_delay_s: float | None) -> Iterator[Leader]:
    workdir = Path(tempfile.mkdtemp(prefix="berth-bench-auth-spray-"))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BERTH_", "HF_"))}
    env.update(
        BERTH_PUBLIC_PORT=str(port), BERTH_CLUSTER_PORT=str(_free_port()), BERTH_LEADER_ONLY="1"
    )
    if refusal_delay_s is not None:
        env["BERTH_AUTH_REFUSAL_DELAY_S"] = str(refusal_delay_s)
    leader = Leader(workdir, env, port)
    try:
        leader.berth("daemon", "start")
        leader.pid = int((leader.home / "daemon.pid").read_text().split()[0])
        leader.key = json.loads(leader.berth("key", "create", "bench", "--json"))["secret"]
        _log(f"leader running (pid {leader.pid}, HTTPS port {port})")
        yield leader
    finally:
        with contextlib.suppress(Exception):
            leader.berth("daemon", "stop")
        if keep:
            _log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# -- the valid client ------------------------------------------------------------------------------


class ValidClient:
    """One keep-alive connection, one request after another, in a thread, until stopped."""

    def __init__(self, leader: Leader) -> None:
        self._connection = leader.connect()
        self._headers = {"authorization": f"Bearer {leader.key}"}
        self._stop = threading.Event()
        self.latencies_s: list[float] = []
        self.errors = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> None:
        sent = time.perf_counter()
        self._connection.request("GET", "/v1/models", headers=self._headers)
        response = self._connection.getresponse()
        response.read()
        elapsed = time.perf_counter() - sent
        if response.status == 200:
            self.latencies_s.append(elapsed)
        else:
            self.errors += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._one()

    def measure(self, until: threading.Event | float) -> tuple[list[float], int]:
        """Run until ``until`` (an event set, or seconds passed); (sorted latencies, errors)."""
        self.latencies_s, self.errors = [], 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if isinstance(until, threading.Event):
            until.wait()
        else:
            time.sleep(until)
        self._stop.set()
        self._thread.join()
        return sorted(self.latencies_s), self.errors


@dataclass(frozen=True)
class Row:
    round: int
    what: str
    latencies_s: list[float]
    errors: int
    spray: dict[str, object] | None = None
    key_reads: int | None = None


def _quantile_ms(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_spray(
    leader: Leader, client: ValidClient, args: argparse.Namespace, sources: int, round_: int
) -> Row:
    sprayer = subprocess.Popen(
        [sys.executable, __file__, "spray", str(leader.port), leader.ca, str(args.keys),
         str(args.connections), str(sources), f"127.{round_}.{sources % 256}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert sprayer.stdin is not None and sprayer.stdout is not None
    assert sprayer.stdout.readline().strip() == "ready"
    reads_before = leader.key_reads()
    done = threading.Event()
    result: dict[str, object] = {}

    def wait_for_sprayer() -> None:
        assert sprayer.stdin is not None and sprayer.stdout is not None
        sprayer.stdin.write("go\n")
        sprayer.stdin.flush()
        result.update(json.loads(sprayer.stdout.readline()))
        done.set()

    threading.Thread(target=wait_for_sprayer, daemon=True).start()
    latencies, errors = client.measure(done)
    sprayer.wait(60)
    reads = leader.key_reads() - reads_before
    label = f"during spray, {sources} source address{'es' if sources > 1 else ''}"
    return Row(round_, label, latencies, errors, result, reads)


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
    delay = "default" if args.refusal_delay_s is None else f"{args.refusal_delay_s:g} s"
    print(f"valid client: sequential GET /v1/models; spray: {args.keys:,} distinct invalid keys "
          f"on {args.connections} connections; auth_refusal_delay_s: {delay}\n")  # fmt: skip
    print("| round | valid client | requests | p50 ms | p99 ms | max ms | p99 / alone "
          "| spray answers | spray rate /s | store key reads |")  # fmt: skip
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    alone_p99: dict[int, float] = {}
    for row in rows:
        lat = row.latencies_s
        p99 = _quantile_ms(lat, 0.99)
        ratio = answers = rate = reads = "-"
        if row.spray is None:
            alone_p99[row.round] = p99
        else:
            ratio = f"{p99 / alone_p99[row.round]:.2f}x"
            counts = row.spray.get("answers", {})
            assert isinstance(counts, dict)
            answers = ", ".join(f"{n:,} x {s}" for s, n in sorted(counts.items()))
            elapsed = row.spray.get("elapsed_s", 0.0)
            assert isinstance(elapsed, float)
            rate = f"{args.keys / elapsed:,.0f}" if elapsed else "-"
            reads = f"{row.key_reads:,}"
        errors = f" ({row.errors} errors)" if row.errors else ""
        print(f"| {row.round} | {row.what}{errors} | {len(lat):,} | {_quantile_ms(lat, 0.5):.2f} "
              f"| {p99:.2f} | {1000 * lat[-1] if lat else float('nan'):.1f} | {ratio} "
              f"| {answers} | {rate} | {reads} |")  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["spray"]:
        port, ca, keys, connections, sources, network = sys.argv[2:8]
        asyncio.run(_spray(int(port), ca, int(keys), int(connections), int(sources), network))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=10_000, help="distinct invalid keys a spray")
    parser.add_argument("--connections", type=int, default=64, help="the sprayer's connections")
    parser.add_argument(
        "--sources",
        default="1,16",
        help="source addresses of each spray, e.g. 1,16 (at most --connections, one each)",
    )
    parser.add_argument("--alone-s", type=float, default=5.0, help="seconds of the client alone")
    parser.add_argument("--rounds", type=int, default=1, help="times to measure every row")
    parser.add_argument(
        "--refusal-delay-s",
        type=float,
        default=None,
        help="the leader's auth_refusal_delay_s (default: its own default)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary home and logs")
    args = parser.parse_args()
    spreads = [int(s) for s in args.sources.split(",")]
    if any(not 1 <= s <= min(250, args.connections) for s in spreads):
        parser.error("--sources counts must be between 1 and --connections (250 at most)")
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(1))  # tear down on SIGTERM
    load_before = _load()
    rows: list[Row] = []
    with running_leader(args.keep, args.refusal_delay_s) as leader:
        client = ValidClient(leader)
        client.measure(1.0)  # warm-up: TLS, the key cache
        for round_ in range(1, args.rounds + 1):
            _log(f"round {round_}: the valid client alone")
            latencies, errors = client.measure(args.alone_s)
            rows.append(Row(round_, "alone", latencies, errors))
            for sources in spreads:
                _log(f"round {round_}: beside a spray from {sources} address(es)")
                rows.append(measure_spray(leader, client, args, sources, round_))
                time.sleep(1.0)  # the leader settles; the limiter's buckets stay as they are
    report(rows, args, load_before)


if __name__ == "__main__":
    main()
