"""Benchmark a tenant with a valid key beside two clients flooding absurd request bodies.

Issue 38: one 16.5 MB body of five million empty arrays
(``{"model":"nosuch","messages":[[],[],...]}``) added about 390 MB to the leader and blocked
its event loop for seconds while it was parsed, and two clients sending it in a loop raised
another tenant's median latency from 3 ms to 3.5 s. The target: the tenant's p99 at most
twice its p99 alone, and the leader's RSS under 300 MB above idle. This script measures
both on loopback with real processes, set up with berth's own CLI in a throw-away home:

* a leader (``berth daemon start``) serving one model on a stand-in engine
  (``scripts/bench_tunnel_engine.py``, launched by berth as ``llama-server``), with two
  standard keys: the tenant's and the flood's;
* the tenant, in this process: one keep-alive HTTPS connection, one small non-streamed chat
  completion after another (a thread; ``http.client``);
* the flooders, ``--flooders`` subprocesses (their own interpreters, at ``--flooder-nice``:
  an attacker's CPU is not the leader's host's): each one keep-alive HTTPS connection
  sending the flood body (``--elements`` empty arrays) with the flood key as fast as it is
  answered, counting the answers by status.

Per round: the tenant alone for ``--seconds``, then beside the flood for as long (the flood
begins a second earlier). The table has the tenant's requests, p50, p99 and max, its p99
over its p99 alone, the flood's answers and rate, the leader's RSS (``VmRSS``, sampled
every 20 ms): idle before the round, and its peak during the flood, and, over the flooded
phase, the leader's CPU (user + system, of one core), and in each phase its own
event-loop lag samples (``berth_event_loop_lag_seconds``, one every 20 ms) later than 10
and 50 ms: a loop held up (parsing, reading bodies) is told apart from a machine whose other
work holds the leader up. The machine may be
shared: rounds show the noise. ``PYTHONPATH=OTHER/src`` runs another tree's berth (the
script itself needs only the CLI), to set a tree before a change beside one after.

Run: ``.venv/bin/python scripts/bench_body_flood.py [--rounds 3] [--elements 5000000]``.
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
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

_LAG_BUCKET = re.compile(r"^berth_event_loop_lag_seconds_bucket\{([^}]*)\} (\S+)$", re.M)
ENGINE_SCRIPT = Path(__file__).resolve().parent / "bench_tunnel_engine.py"
MODEL = "bench"
TENANT_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
).encode()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def flood_body(elements: int, shape: str = "arrays") -> bytes:
    """The issue's body (``arrays``): ``elements`` empty arrays as the messages of an unknown
    model; or (``text``) a body of the same size holding one message of plain text, which
    any limit on elements lets through: what the bytes alone cost."""
    if shape == "text":
        text = b"x" * (3 * elements - 40)
        return b'{"model":"nosuch","messages":[{"role":"user","content":"' + text + b'"}]}'
    return b'{"model":"nosuch","messages":[' + b"[]," * (elements - 1) + b"[]]}"


# -- the leader --------------------------------------------------------------------------------


@dataclass
class Leader:
    workdir: Path
    env: dict[str, str]
    port: int
    pid: int = 0
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def home(self) -> Path:
        return self.workdir / "home"

    @property
    def ca(self) -> str:
        return str(self.home / "ca" / "ca.pem")

    def berth(self, *args: str) -> str:
        command = [sys.executable, "-m", "berth", "--home", str(self.home), *args]
        result = subprocess.run(command, capture_output=True, text=True, env=self.env,
                                timeout=120, cwd=self.workdir)  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"berth {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def connect(self) -> http.client.HTTPSConnection:
        tls = ssl.create_default_context(cafile=self.ca)
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=tls, timeout=120)

    def cpu_s(self) -> float:
        """The leader's user + system CPU seconds so far (``/proc/PID/stat``)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def loop_lag(self) -> dict[float, int]:
        """The leader's own event-loop lag histogram (``berth_event_loop_lag_seconds``,
        node ``local``): samples at or under each bound, in seconds (``inf`` last)."""
        connection = self.connect()
        connection.request(
            "GET", "/metrics", headers={"authorization": f"Bearer {self.keys['tenant']}"}
        )
        text = connection.getresponse().read().decode()
        connection.close()
        counts: dict[float, int] = {}
        for labels, count in _LAG_BUCKET.findall(text):
            pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if pairs.get("node") == "local":
                counts[float(pairs["le"])] = int(float(count))
        return counts

    def rss_mib(self) -> float:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0


@contextlib.contextmanager
def running_leader(keep: bool) -> Iterator[Leader]:
    workdir = Path(tempfile.mkdtemp(prefix="berth-bench-body-flood-"))
    wrapper = workdir / "bin" / "llama-server"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ENGINE_SCRIPT}" "$@"\n')
    wrapper.chmod(0o755)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BERTH_", "HF_"))}
    env.update(BERTH_PUBLIC_PORT=str(port), BERTH_CLUSTER_PORT=str(_free_port()),
               BERTH_LLAMA_SERVER_BIN=str(wrapper), BERTH_HEALTH_TIMEOUT_S="30",
               BERTH_STOP_GRACE_S="5")  # fmt: skip
    leader = Leader(workdir, env, port)
    try:
        leader.berth("daemon", "start")
        leader.pid = int((leader.home / "daemon.pid").read_text().split()[0])
        for name in ("tenant", "flood"):
            printed = leader.berth("key", "create", name)
            leader.keys[name] = re.findall(r"sk-berth-\S+", printed)[0]
        weights = workdir / "bench.gguf"
        weights.write_bytes(b"GGUF" + bytes(60))
        leader.berth("models", "add", MODEL, str(weights))
        leader.berth("run", MODEL, "--engine", "llamacpp", "--extra-arg=--parallel=64",
                     "--timeout", "60")  # fmt: skip
        _log(f"leader running (pid {leader.pid}, HTTPS port {port}), {MODEL} served")
        yield leader
    finally:
        with contextlib.suppress(Exception):
            leader.berth("stop", "--all")
        with contextlib.suppress(Exception):
            leader.berth("daemon", "stop")
        if keep:
            _log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# -- the tenant --------------------------------------------------------------------------------


class Tenant:
    """One keep-alive connection, one small chat completion after another, in a thread."""

    def __init__(self, leader: Leader) -> None:
        self._connection = leader.connect()
        self._headers = {
            "authorization": f"Bearer {leader.keys['tenant']}",
            "content-type": "application/json",
        }
        self._stop = threading.Event()
        self.latencies_s: list[float] = []
        self.errors = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.perf_counter()
            self._connection.request("POST", "/v1/chat/completions", TENANT_BODY, self._headers)
            response = self._connection.getresponse()
            response.read()
            if response.status == 200:
                self.latencies_s.append(time.perf_counter() - sent)
            else:
                self.errors += 1

    def measure(self, seconds: float) -> tuple[list[float], int]:
        """Run for ``seconds``; (sorted latencies, errors)."""
        self.latencies_s, self.errors = [], 0
        self._stop.clear()
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        time.sleep(seconds)
        self._stop.set()
        thread.join()
        return sorted(self.latencies_s), self.errors


# -- the flooders ------------------------------------------------------------------------------


def flooder(port: int, ca: str, key: str, elements: int, shape: str, nice: int) -> None:
    """A flooder's process (at ``nice``): say ``ready``, flood from ``go`` until ``stop``,
    then print its answers by status as JSON."""
    os.nice(nice)
    body = flood_body(elements, shape)
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    tls = ssl.create_default_context(cafile=ca)
    stop = threading.Event()
    answers: Counter[str] = Counter()
    print("ready", flush=True)
    sys.stdin.readline()  # go

    def run() -> None:
        connection = http.client.HTTPSConnection("127.0.0.1", port, context=tls, timeout=120)
        while not stop.is_set():
            try:
                connection.request("POST", "/v1/chat/completions", body, headers)
                response = connection.getresponse()
                response.read()
                answers[str(response.status)] += 1
            except (OSError, http.client.HTTPException) as exc:
                answers[type(exc).__name__] += 1
                connection.close()
                connection = http.client.HTTPSConnection("127.0.0.1", port, context=tls,
                                                         timeout=120)  # fmt: skip

    started = time.perf_counter()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    sys.stdin.readline()  # stop
    stop.set()
    thread.join(120)
    elapsed = time.perf_counter() - started
    print(json.dumps({"answers": dict(answers), "elapsed_s": elapsed}), flush=True)


class Flood:
    """``count`` flooder processes, started ready and flooding between :meth:`go` and
    :meth:`stop`."""

    def __init__(self, leader: Leader, count: int, elements: int, shape: str, nice: int) -> None:
        command = [sys.executable, __file__, "flooder", str(leader.port), leader.ca,
                   leader.keys["flood"], str(elements), shape, str(nice)]  # fmt: skip
        self._processes = [
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(count)
        ]
        for process in self._processes:
            assert process.stdout is not None
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError("a flooder did not start")

    def go(self) -> None:
        for process in self._processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()

    def stop(self) -> tuple[Counter[str], float]:
        answers: Counter[str] = Counter()
        rate = 0.0
        for process in self._processes:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write("stop\n")
            process.stdin.flush()
            result = json.loads(process.stdout.readline())
            answers.update(result["answers"])
            rate += sum(result["answers"].values()) / result["elapsed_s"]
            process.wait(30)
        return answers, rate


class PeakRss:
    """The leader's peak RSS from :meth:`start` to :meth:`stop`, sampled every 20 ms."""

    def __init__(self, leader: Leader) -> None:
        self._leader = leader
        self._stop = threading.Event()
        self.peak = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._leader.rss_mib())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


# -- the report --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    round: int
    alone: list[float]
    flooded: list[float]
    errors: int
    answers: Counter[str]
    rate: float
    idle_mib: float
    peak_mib: float
    cpu_share: float
    lag_alone: dict[float, int]
    lag: dict[float, int]


def _quantile_ms(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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


def report(rows: list[Row], args: argparse.Namespace, load_before: str, body_bytes: int) -> None:
    print(f"machine: {_machine()}")
    print(f"load average (1, 5, 15 min): {load_before} before, {_load()} after")
    print(f"tenant: sequential small chat completions; flood: {args.flooders} clients at "
          f"nice {args.flooder_nice}, bodies of {body_bytes / 1e6:.1f} MB: "
          f"{_SHAPES[args.shape].format(elements=args.elements)}\n")  # fmt: skip
    print("| round | tenant alone p50 / p99 ms | flooded p50 / p99 / max ms | requests alone "
          "/ flooded | p99 flooded / alone | flood answers | flood bodies/s "
          "| leader RSS idle / peak MiB | above idle MiB | leader CPU, flooded "
          "| loop lag > 10 / 50 ms, alone | flooded |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        alone_p99 = _quantile_ms(row.alone, 0.99)
        p99 = _quantile_ms(row.flooded, 0.99)
        answers = ", ".join(f"{n:,} x {s}" for s, n in sorted(row.answers.items()))
        errors = f" ({row.errors} errors)" if row.errors else ""
        print(f"| {row.round} | {_quantile_ms(row.alone, 0.5):.2f} / {alone_p99:.2f} "
              f"| {_quantile_ms(row.flooded, 0.5):.2f} / {p99:.2f} / "
              f"{1000 * row.flooded[-1] if row.flooded else float('nan'):.1f} "
              f"| {len(row.alone):,} / {len(row.flooded):,}{errors} | {p99 / alone_p99:.2f}x "
              f"| {answers} | {row.rate:.1f} | {row.idle_mib:.0f} / {row.peak_mib:.0f} "
              f"| {row.peak_mib - row.idle_mib:.0f} | {100 * row.cpu_share:.0f} % "
              f"| {_over(row.lag_alone, 0.01)} / {_over(row.lag_alone, 0.05)} "
              f"| {_over(row.lag, 0.01)} / {_over(row.lag, 0.05)} |")  # fmt: skip


@contextlib.contextmanager
def _profiled(leader: Leader, folder: Path | None, round_: int, seconds: float) -> Iterator[None]:
    """With ``folder``: py-spy samples the leader meanwhile, its collapsed stacks saved as
    ``round-N.txt`` there (py-spy beside the interpreter, as the dev extras install it)."""
    if folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    out = folder / f"round-{round_}.txt"
    command = [str(spy), "record", "--pid", str(leader.pid), "--format", "raw", "--nonblocking",
               "--duration", str(max(1, int(seconds))), "--output", str(out)]  # fmt: skip
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        recorder.wait(60)
        _log(f"profile of the leader: {out}")


def _delta(after: dict[float, int], before: dict[float, int]) -> dict[float, int]:
    return {bound: count - before.get(bound, 0) for bound, count in after.items()}


_SHAPES = {
    "arrays": "{elements:,} empty arrays, an unknown model",
    "text": "one message of text, an unknown model",
}


def _over(lag: dict[float, int], bound_s: float) -> str:
    """Loop-lag samples over ``bound_s``, of all (a sample every 20 ms)."""
    total = lag.get(float("inf"), 0)
    return f"{total - lag.get(bound_s, 0)} of {total}"


def main() -> None:
    if sys.argv[1:2] == ["flooder"]:
        port, ca, key, elements, shape, nice = sys.argv[2:8]
        flooder(int(port), ca, key, int(elements), shape, int(nice))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--flooders", type=int, default=2, help="flooding clients")
    parser.add_argument(
        "--elements", type=int, default=5_000_000, help="empty arrays in a flood body"
    )
    parser.add_argument(
        "--shape",
        choices=("arrays", "text"),
        default="arrays",
        help="the flood body: the issue's empty arrays, or one message of text as large",
    )
    parser.add_argument(
        "--flooder-nice",
        type=int,
        default=19,
        help="the flooders' niceness: they encrypt hundreds of MB a second, which on a small "
        "machine starves the leader and the tenant of CPU; an attacker's own CPU is elsewhere",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of each phase")
    parser.add_argument("--rounds", type=int, default=3, help="times to measure both phases")
    parser.add_argument(
        "--profile-dir", type=Path, help="py-spy the leader over each flooded phase, saved here"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary home and logs")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(1))  # tear down on SIGTERM
    load_before = _load()
    rows: list[Row] = []
    with running_leader(args.keep) as leader:
        tenant = Tenant(leader)
        tenant.measure(1.0)  # warm-up: TLS, the key cache, the engine connection
        for round_ in range(1, args.rounds + 1):
            _log(f"round {round_}: the tenant alone")
            lag_before = leader.loop_lag()
            alone, errors = tenant.measure(args.seconds)
            lag_alone = _delta(leader.loop_lag(), lag_before)
            idle = leader.rss_mib()
            flood = Flood(leader, args.flooders, args.elements, args.shape, args.flooder_nice)
            peak = PeakRss(leader)
            peak.start()
            _log(f"round {round_}: the tenant beside the flood")
            flood.go()
            time.sleep(1.0)
            lag_before, cpu_before, began = leader.loop_lag(), leader.cpu_s(), time.monotonic()
            with _profiled(leader, args.profile_dir, round_, args.seconds):
                flooded, flooded_errors = tenant.measure(args.seconds)
            cpu_share = (leader.cpu_s() - cpu_before) / (time.monotonic() - began)
            lag = _delta(leader.loop_lag(), lag_before)
            answers, rate = flood.stop()
            rows.append(Row(round_, alone, flooded, errors + flooded_errors, answers, rate,
                            idle, peak.stop(), cpu_share, lag_alone, lag))  # fmt: skip
            time.sleep(2.0)  # the leader settles (drained bodies, a collection)
    report(rows, args, load_before, len(flood_body(args.elements, args.shape)))


if __name__ == "__main__":
    main()
