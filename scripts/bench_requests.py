"""``bench_stream.py --mode requests``: many small non-streamed requests, closed loop, by wrk.

An embedding or classification workload is many small requests, where what a gateway costs
is its work per request (parsing, authentication, admission, routing, the engine request,
metrics, the request log, the answer's head), not per event. Per path this runs wrk (Debian's
``wrk``, C, one thread: it is the load, not the thing measured) against the path for
``--warmup-s`` seconds (discarded), then for ``--duration-s`` seconds with ``--connections``
keep-alive connections, each with one request in flight, then once more with one connection.
Each request is a non-streamed chat completion of the stand-in engine (about 300 bytes
back). Per path:

* requests/s and wrk's latency p50 / p99 at ``--connections``;
* CPU µs per request: user + system time of the path's proxy processes over that run (from
  ``/proc``), over the requests wrk completed in it;
* latency p50 with one connection, and what the path adds to the engine alone's.

Paths wrk cannot reach (the leader's Unix socket) are skipped with a note. berth's paths
send a key with quotas set (requests, tokens and concurrency limits far above the load, so
every request is counted and none refused), the usage ledger and the request log on, as a
user's would be.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class RequestTarget(Protocol):
    """What of ``bench_stream.Target`` this mode reads."""

    name: str
    port: int
    unix_path: str | None
    authorization: bytes
    model: str
    pids: tuple[int, ...]

    @property
    def tls(self) -> object | None: ...


@dataclass(frozen=True)
class WrkRun:
    """What one wrk run reported: ``requests`` completed in ``seconds``, latency quantiles in
    milliseconds, and the answers that were not 2xx/3xx plus socket errors (``errors``)."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int

    @property
    def per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


@dataclass(frozen=True)
class RequestResult:
    """One path's numbers in one round: the loaded run, its CPU, and the one-client run."""

    name: str
    loaded: WrkRun
    cpu_s: float
    single: WrkRun

    @property
    def us_per_request(self) -> float:
        return 1e6 * self.cpu_s / max(1, self.loaded.requests)


_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


def _ms(text: str) -> float:
    """``'1.23ms'``, ``'870.00us'``, ``'1.02s'`` → milliseconds."""
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(match[1]) * _UNITS_MS[match[2]]


def parse_wrk(output: str) -> WrkRun:
    """Read wrk's ``--latency`` report. Raises ``ValueError`` when it has no request count."""
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", output)
    if done is None:
        raise ValueError(f"wrk printed no request count:\n{output}")
    quantiles = dict(re.findall(r"^\s+(50|99)(?:\.000)?%\s+(\S+)$", output, re.MULTILINE))
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", output))
    socket_errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    if socket_errors is not None:
        errors += sum(int(n) for n in socket_errors.groups())
    return WrkRun(
        requests=int(done[1]),
        seconds=_ms(done[2] + done[3]) / 1000,
        p50_ms=_ms(quantiles["50"]) if "50" in quantiles else float("nan"),
        p99_ms=_ms(quantiles["99"]) if "99" in quantiles else float("nan"),
        errors=errors,
    )


def _lua(target: RequestTarget, workdir: Path) -> Path:
    """wrk's script: POST a small non-streamed chat completion, with the path's key."""
    body = json.dumps(
        {
            "model": target.model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16,
        }
    )
    lines = [
        'wrk.method = "POST"',
        f"wrk.body = {json.dumps(body)}",
        'wrk.headers["content-type"] = "application/json"',
    ]
    if target.authorization:
        name, _, value = target.authorization.decode().strip().partition(": ")
        lines.append(f"wrk.headers[{json.dumps(name)}] = {json.dumps(value)}")
    path = workdir / "request.lua"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_wrk(target: RequestTarget, connections: int, seconds: float, workdir: Path) -> WrkRun:
    """One wrk run against ``target``; raises ``RuntimeError`` when wrk fails."""
    scheme = "https" if target.tls is not None else "http"
    url = f"{scheme}://127.0.0.1:{target.port}/v1/chat/completions"
    command = [
        "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency",
        "--timeout", "10s", "-s", str(_lua(target, workdir)), url,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    if done.returncode != 0:
        raise RuntimeError(f"wrk exited {done.returncode}: {done.stderr.strip()}")
    return parse_wrk(done.stdout)


def measure_requests(
    target: RequestTarget, connections: int, warmup_s: float, duration_s: float,
    cpu_s: Callable[[tuple[int, ...]], float],
    start_profilers: Callable[[], list[subprocess.Popen[bytes]]] = list,
) -> RequestResult:  # fmt: skip
    """The warm-up run (discarded), the loaded run with its CPU (and the profilers
    ``start_profilers`` starts, waited for after it), then the one-client run."""
    workdir = Path(tempfile.mkdtemp(prefix="berth-bench-requests-"))
    try:
        run_wrk(target, connections, warmup_s, workdir)
        profilers = start_profilers()
        before = cpu_s(target.pids)
        loaded = run_wrk(target, connections, duration_s, workdir)
        used = cpu_s(target.pids) - before
        for profiler in profilers:
            profiler.wait()
        time.sleep(0.5)
        single = run_wrk(target, 1, max(2.0, duration_s / 2), workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return RequestResult(target.name, loaded, used, single)


def wrk_missing() -> bool:
    return shutil.which("wrk") is None


def report_requests(rounds: list[list[RequestResult]], connections: int, header: str) -> None:
    """A row per round and path, then each path against vllm-router in the same round, and
    the medians of the rounds (lowest - highest) when there are three or more."""
    print(header)
    print(
        f"| round | path | req/s at {connections} | p50 / p99 ms | CPU µs per request "
        "| p50 ms, 1 client | added to the engine's, ms | errors |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for number, results in enumerate(rounds, 1):
        engine = next((r for r in results if r.name == "engine alone"), None)
        for r in results:
            added = (
                f"{r.single.p50_ms - engine.single.p50_ms:+.2f}"
                if engine is not None and r is not engine
                else "-"
            )
            print(
                f"| {number} | {r.name} | {r.loaded.per_s:,.0f} "
                f"| {r.loaded.p50_ms:.2f} / {r.loaded.p99_ms:.2f} | {r.us_per_request:.0f} "
                f"| {r.single.p50_ms:.2f} | {added} | {r.loaded.errors + r.single.errors} |"
            )
    ratios: dict[str, list[tuple[float, float, float]]] = {}
    for results in rounds:
        ref = next((r for r in results if r.name == "vllm-router"), None)
        if ref is None:
            continue
        for r in results:
            if r.name in ("vllm-router", "engine alone"):
                continue
            ratios.setdefault(r.name, []).append(
                (
                    r.loaded.per_s / ref.loaded.per_s,
                    r.us_per_request / ref.us_per_request,
                    r.loaded.p99_ms / ref.loaded.p99_ms,
                )
            )
    if not ratios:
        return
    print(f"\nEach path against vllm-router in the same round: median of {len(rounds)} "
          "(lowest - highest)\n")  # fmt: skip
    print("| path | req/s ÷ vllm-router | CPU per request ÷ vllm-router | p99 ÷ vllm-router |")
    print("| --- | ---: | ---: | ---: |")
    for name, values in ratios.items():
        cells = []
        for column in range(3):
            found = sorted(v[column] for v in values)
            cells.append(f"{statistics.median(found):.2f} ({found[0]:.2f} - {found[-1]:.2f})")
        print(f"| {name} | {' | '.join(cells)} |")


def quota_key(create: Callable[..., str]) -> str:
    """A key whose every limit is set, far above what the benchmark sends: each request is
    checked and counted against them, none refused. ``create`` runs ``berth key create``."""
    printed = create(
        "key", "create", "bench-quotas", "--rpm", "100m", "--tpm", "1000m",
        "--max-concurrency", "10000", "--daily-tokens", "100000m",
        "--monthly-tokens", "1000000m",
    )  # fmt: skip
    keys = re.findall(r"sk-berth-\S+", printed)
    if not keys:
        raise RuntimeError("berth key create printed no key")
    return keys[0]
