"""The paced-stream benchmark: many slow token streams through berth, vllm-router and LiteLLM.

A gateway's real load is many concurrent streams of small events, one per token, tens of
milliseconds apart. This script holds ``--streams`` streaming chat completions open at once
against one scripted stand-in engine and restarts each as it finishes. The engine
(``scripts/bench_tunnel_engine.py``: raw asyncio + httptools on uvloop) answers with
``--tokens`` content events, each its own write, ``1000 / --rate`` ms apart, plus role,
finish, usage and ``[DONE]`` events. The same load goes over each path, one after the other
in one run:

* ``engine alone``: plain HTTP straight to the engine;
* ``vllm-router``: the Rust router from PyPI's ``vllm-router``, plain HTTP, one worker URL;
* ``caddy + vllm-router``: Caddy terminating TLS (HTTP/1.1, a self-signed certificate for
  127.0.0.1 made here) in front of its own vllm-router: the stack a user who needs HTTPS
  runs, to set beside berth over TLS (both processes counted);
* ``berth local``: HTTPS to a real leader's public listener with a bearer key, relayed to a
  deployment on node ``local`` (the leader, its key and deployments are set up with berth's
  CLI by ``bench_tunnel.running_cluster``);
* ``berth local (socket)``: the same deployment over the leader's Unix socket (plain HTTP,
  no key): the relay without TLS, to set beside vllm-router's plain HTTP;
* ``berth proxy (TCP)``: berth's proxy alone, on berth's HTTP server over plain TCP (no
  TLS, no key, a fixed route to the engine; this script's ``proxy`` role): the relay beside
  vllm-router's on equal terms, since neither then pays for TLS;
* ``berth agent``: HTTPS to the leader, relayed over the mTLS link to a deployment on an
  enrolled agent (leader and agent both counted);
* ``berth agent, direct``: the same through a second agent that the leader reaches on its
  direct ingress (mTLS HTTP/1.1 from the leader's pool, no link framing; both counted);
* ``litellm``: LiteLLM's proxy (PyPI ``litellm[proxy]``), one worker, plain HTTP.

vllm-router and LiteLLM are looked for in ``--bench-venv`` (or ``$BERTH_BENCH_VENV``): a
virtualenv of their own, never the project's (``python -m venv .bench-venv &&
.bench-venv/bin/pip install vllm-router 'litellm[proxy]'``), Caddy on ``PATH`` (``setup.sh``
installs it). A path whose program is missing is skipped with a note.

Per path, after ``--warmup-s`` seconds of the load, ``--duration-s`` seconds are measured:

* CPU per relayed event: user + system time of the proxy processes only (from
  ``/proc/PID/stat``: not the engine, not this client), divided by the SSE events the client
  received in the window;
* TTFT: from writing the request to the first event that carries a token;
* gap between tokens: between consecutive token events of one stream, at the client.

The client is this process: one keep-alive connection per stream on uvloop, answers parsed
with httptools, TLS with the leader's CA. Run with ``--repeat N`` to measure every path N
times in turn and see the noise. Run: ``.venv/bin/python scripts/bench_stream.py`` (about
2 minutes with the defaults).

``--mode requests`` measures the same paths per request instead of per event: small
non-streamed chat completions by wrk at ``--connections`` (requests/s, latency, CPU per
request, and one client's latency); ``scripts/bench_requests.py`` says how.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httptools
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_requests
import bench_tunnel as harness
from bench_tunnel_engine import serve_engine

TOKEN_MARK = b'"content"'
#: Connections opened at once while (re)connecting the streams (TLS handshakes).
CONNECT_PARALLELISM = 32


# -- the client -----------------------------------------------------------------------------------


@dataclass
class Sample:
    """What the client saw in the measured window."""

    events: int = 0
    streams: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    measuring: bool = False

    def fail(self, why: str) -> None:
        self.errors[why] = self.errors.get(why, 0) + 1


class _Stream(asyncio.Protocol):
    """One keep-alive connection carrying one stream after another."""

    def __init__(self, sample: Sample) -> None:
        self._sample = sample
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[None] | None = None
        self._tail = b""
        self._sent_at = 0.0
        self._last_token_at = 0.0
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family != socket.AF_UNIX:
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
        now = time.perf_counter()
        sample = self._sample
        events = (self._tail + body).split(b"\n\n")
        self._tail = events.pop()
        for event in events:
            if sample.measuring:
                sample.events += 1
            if TOKEN_MARK not in event:
                continue
            if sample.measuring:
                if self._last_token_at:
                    sample.gaps_s.append(now - self._last_token_at)
                else:
                    sample.ttft_s.append(now - self._sent_at)
            self._last_token_at = now

    def on_message_complete(self) -> None:
        assert self._done is not None
        status = self._parser.get_status_code()
        if status != 200:
            self._done.set_exception(RuntimeError(f"HTTP {status}"))
        elif not self._done.done():
            self._done.set_result(None)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def stream(self, request: bytes) -> None:
        assert self._transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self._tail = b""
        self._last_token_at = 0.0
        self._sent_at = time.perf_counter()
        self._transport.write(request)
        await self._done


@dataclass(frozen=True)
class Target:
    """Where one path's requests go and which processes serve it."""

    name: str
    port: int = 0
    unix_path: str | None = None
    tls: ssl.SSLContext | None = None
    authorization: bytes = b""
    model: str = harness.LOCAL_MODEL
    pids: tuple[int, ...] = ()  # the proxy processes whose CPU is counted
    #: What each of ``pids`` is, for the split of a two-process path's CPU.
    roles: tuple[str, ...] = ("leader", "agent")


async def _connect(target: Target, sample: Sample) -> _Stream:
    loop = asyncio.get_running_loop()
    if target.unix_path is not None:
        _, protocol = await loop.create_unix_connection(lambda: _Stream(sample), target.unix_path)
    elif target.tls is None:
        _, protocol = await loop.create_connection(
            lambda: _Stream(sample), "127.0.0.1", target.port
        )
    else:
        _, protocol = await loop.create_connection(
            lambda: _Stream(sample), "127.0.0.1", target.port, ssl=target.tls,
            server_hostname="127.0.0.1",
        )  # fmt: skip
    return protocol


def _request(target: Target, tokens: int, interval_ms: float) -> bytes:
    payload = {
        "model": target.model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "bench_interval_ms": interval_ms,
    }
    body = json.dumps(payload).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
        % (target.authorization, len(body), body)
    )


def cpu_s(pids: tuple[int, ...]) -> float:
    """User + system CPU seconds the processes ``pids`` have used (their threads included,
    their children not); Linux ``/proc``."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


@dataclass
class Result:
    name: str
    sample: Sample
    window_s: float
    cpu_s: float
    #: The CPU seconds of each of the path's processes, in ``Target.pids`` order.
    cpu_s_each: list[float]
    roles: tuple[str, ...] = ("leader", "agent")

    @property
    def us_per_event(self) -> float:
        return 1e6 * self.cpu_s / max(1, self.sample.events)

    @property
    def events_per_s(self) -> float:
        return self.sample.events / self.window_s


def pct_ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(target: Target, args: argparse.Namespace) -> Result:
    """Hold ``args.streams`` streams open for the warm-up and the window; the window's numbers."""
    sample = Sample()
    gate = asyncio.Semaphore(CONNECT_PARALLELISM)
    request = _request(target, args.tokens, 1000.0 / args.rate)
    stop_at = time.perf_counter() + args.warmup_s + args.duration_s

    async def one_client(index: int) -> None:
        # Spread the first requests over one stream's length, as a steady state would have them.
        await asyncio.sleep(index * args.tokens / args.rate / args.streams)
        connection: _Stream | None = None
        while time.perf_counter() < stop_at:
            if connection is None or connection.lost:
                async with gate:
                    try:
                        connection = await _connect(target, sample)
                    except (OSError, ssl.SSLError) as exc:
                        sample.fail(type(exc).__name__)
                        await asyncio.sleep(0.1)
                        continue
            try:
                await connection.stream(request)
            except (RuntimeError, ConnectionError) as exc:
                sample.fail(str(exc))
                connection.close()
                connection = None
                await asyncio.sleep(0.05)
                continue
            if sample.measuring:
                sample.streams += 1
        if connection is not None:
            connection.close()

    clients = [asyncio.ensure_future(one_client(i)) for i in range(args.streams)]
    await asyncio.sleep(args.warmup_s)
    sample.measuring = True
    profilers = _start_profilers(target, args)
    cpu_before, started = [cpu_s((pid,)) for pid in target.pids], time.perf_counter()
    await asyncio.sleep(args.duration_s)
    cpu_after = [cpu_s((pid,)) for pid in target.pids]
    window_s = time.perf_counter() - started
    for profiler in profilers:
        await asyncio.to_thread(profiler.wait)
    sample.measuring = False
    try:
        async with asyncio.timeout(args.tokens / args.rate + 30):
            await asyncio.gather(*clients)
    except TimeoutError:
        sample.fail("streams not finished after the window")
        for client in clients:
            client.cancel()
    used = [after - before for before, after in zip(cpu_before, cpu_after, strict=True)]
    return Result(target.name, sample, window_s, sum(used), used, target.roles)


def _start_profilers(target: Target, args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    """``py-spy record`` of each of the path's berth processes over the window, when asked
    (``--profile-dir``): collapsed stacks, one file per path and process."""
    if args.profile_dir is None or not target.name.startswith("berth"):
        return []
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    args.profile_dir.mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() else "-" for c in target.name)
    profilers = []
    for role, pid in zip(("leader", "agent"), target.pids, strict=False):
        output = args.profile_dir / f"{name}-{role}.txt"
        command = [
            py_spy,
            "record",
            "--pid",
            str(pid),
            "--duration",
            f"{args.duration_s:.0f}",
            "--rate",
            "200",
            "--nonblocking",
            "--format",
            "raw",
            "--output",
            str(output),
        ]
        profilers.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )  # fmt: skip
    return profilers


def serve_proxy(argv: list[str]) -> None:
    """The ``proxy`` role: ``bench_stream.py proxy ENGINE_PORT``: berth's OpenAI proxy on
    berth's HTTP server, plain TCP on 127.0.0.1, a fixed route to the engine; prints its port."""
    from berth.gateway.proxy import OpenAIProxy
    from berth.http_server.server import HttpServer
    from berth.observability.metrics import ProxyMetrics
    from berth.routing.resolver import Upstream

    upstream = Upstream(f"http://127.0.0.1:{int(argv[0])}", "d-bench", "local", "bench-local")

    class FixedRoute:
        def candidates(self, model: str) -> list[Upstream]:
            return [upstream]

        def models(self) -> list[str]:
            return [upstream.model]

    async def main() -> None:
        proxy = OpenAIProxy(FixedRoute(), ProxyMetrics())
        await proxy.startup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        server = HttpServer("bench", proxy.handle)
        await server.start(sock)
        print(f"PORT {sock.getsockname()[1]}", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


@contextlib.contextmanager
def berth_proxy(engine_port: int) -> Iterator[Target]:
    process = subprocess.Popen(
        [sys.executable, __file__, "proxy", str(engine_port)], stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline().split()[1])
        yield Target("berth proxy (TCP)", port=port, pids=(process.pid,))
    finally:
        process.terminate()
        process.wait(10)


# -- the other proxies ----------------------------------------------------------------------------


def _wait_listening(port: int, process: subprocess.Popen[bytes], name: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited {process.returncode}; see {log}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not listen on {port} within 120 s; see {log}")


@contextlib.contextmanager
def vllm_router(
    venv: Path, engine_port: int, workdir: Path, log_name: str = "vllm-router.out"
) -> Iterator[Target | None]:
    program = venv / "bin" / "vllm-router"
    if not program.exists():
        harness.log(f"vllm-router skipped: {program} not found")
        yield None
        return
    port = harness._free_port()
    log = workdir / log_name
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(program), "--worker-urls", f"http://127.0.0.1:{engine_port}",
             "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
             # its metrics on a free port: the default, 29000, would clash with a second one
             "--prometheus-port", str(harness._free_port())],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        _wait_listening(port, process, "vllm-router", log)
        time.sleep(1.0)  # its health check of the worker
        yield Target("vllm-router", port=port, pids=tuple(descendants(process.pid)))
    finally:
        _stop(process)


def _self_signed(workdir: Path) -> tuple[Path, Path]:
    """A certificate for ``127.0.0.1`` (an IP address SAN) signed by its own key, and the key,
    as PEM files in ``workdir``: Caddy's, which the client then trusts alone."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = workdir / "caddy.crt", workdir / "caddy.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@contextlib.contextmanager
def caddy_vllm_router(venv: Path, engine_port: int, workdir: Path) -> Iterator[Target | None]:
    """Caddy terminating TLS on a free port, reverse-proxying (HTTP/1.1, every event flushed
    at once) to a vllm-router of its own in front of the engine."""
    program = shutil.which("caddy")
    if program is None:
        harness.log("caddy + vllm-router skipped: caddy not on PATH")
        yield None
        return
    with vllm_router(venv, engine_port, workdir, "vllm-router-behind-caddy.out") as router:
        if router is None:
            yield None
            return
        port = harness._free_port()
        cert, key = _self_signed(workdir)
        home = workdir / "caddy-home"  # its data and config dirs: not the user's
        home.mkdir(exist_ok=True)
        config = workdir / "Caddyfile"
        config.write_text(
            "{\n  admin off\n  auto_https off\n}\n"
            f"https://127.0.0.1:{port} {{\n"
            f"  tls {cert} {key}\n"
            f"  reverse_proxy 127.0.0.1:{router.port} {{\n    flush_interval -1\n  }}\n"
            "}\n"
        )
        log = workdir / "caddy.out"
        env = dict(os.environ, HOME=str(home), XDG_DATA_HOME=str(home),
                   XDG_CONFIG_HOME=str(home))  # fmt: skip
        with log.open("wb") as out:
            process = subprocess.Popen(
                [program, "run", "--config", str(config), "--adapter", "caddyfile"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, cwd=workdir,
            )  # fmt: skip
        try:
            _wait_listening(port, process, "caddy", log)
            tls = ssl.create_default_context(cafile=str(cert))
            yield Target(
                "caddy + vllm-router",
                port=port,
                tls=tls,
                pids=(*descendants(process.pid), *router.pids),
                roles=("caddy", "vllm-router"),
            )
        finally:
            _stop(process)


@contextlib.contextmanager
def litellm(venv: Path, engine_port: int, workdir: Path) -> Iterator[Target | None]:
    program = venv / "bin" / "litellm"
    if not program.exists():
        harness.log(f"litellm skipped: {program} not found")
        yield None
        return
    port = harness._free_port()
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {harness.LOCAL_MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{harness.LOCAL_MODEL}\n"
        f"      api_base: http://127.0.0.1:{engine_port}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  drop_params: false\n"
    )
    log = workdir / "litellm.out"
    master_key = "sk-bench-" + os.urandom(16).hex()  # it refuses to start without one
    env = dict(
        os.environ, LITELLM_LOG="ERROR", DISABLE_ADMIN_UI="True", LITELLM_MASTER_KEY=master_key
    )
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(program), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
             "--num_workers", "1"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, cwd=workdir,
        )  # fmt: skip
    try:
        _wait_listening(port, process, "litellm", log)
        time.sleep(2.0)
        bearer = b"authorization: Bearer %s\r\n" % master_key.encode()
        yield Target(
            "litellm", port=port, authorization=bearer, pids=tuple(descendants(process.pid))
        )
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# -- the report -----------------------------------------------------------------------------------


def _report(rounds: list[list[Result]], args: argparse.Namespace) -> None:
    print(
        f"machine: {harness._machine()}; load average {os.getloadavg()[0]:.2f} at the end\n"
        f"{args.streams} streams x {args.rate:g} tokens/s, {args.tokens} tokens a stream "
        f"(+ role, finish, usage, [DONE]); {args.duration_s:g} s measured after "
        f"{args.warmup_s:g} s warm-up, {len(rounds)} round(s)\n"
    )
    print(
        "| round | path | events/s | CPU µs per event | TTFT p50 / p99 ms "
        "| gap p50 / p99 / max ms | streams done | errors |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for number, results in enumerate(rounds, 1):
        for r in results:
            s = r.sample
            errors = ", ".join(f"{k}: {v}" for k, v in s.errors.items()) or "0"
            print(
                f"| {number} | {r.name} | {r.events_per_s:,.0f} | {r.us_per_event:.0f} "
                f"| {pct_ms(s.ttft_s, 0.5):.1f} / {pct_ms(s.ttft_s, 0.99):.1f} "
                f"| {pct_ms(s.gaps_s, 0.5):.1f} / {pct_ms(s.gaps_s, 0.99):.1f} "
                f"/ {1000 * max(s.gaps_s, default=float('nan')):.1f} | {s.streams} | {errors} |"
            )
    split = [r for results in rounds for r in results if len(r.cpu_s_each) == 2]
    if split:
        print("\n| round | path | CPU µs per event, by process |")
        print("| ---: | --- | ---: |")
        for number, results in enumerate(rounds, 1):
            for r in results:
                if len(r.cpu_s_each) == 2:
                    each = (1e6 * c / max(1, r.sample.events) for c in r.cpu_s_each)
                    shares = " + ".join(
                        f"{us:.0f} ({role})" for us, role in zip(each, r.roles, strict=True)
                    )
                    print(f"| {number} | {r.name} | {shares} |")
    reference = [r for results in rounds for r in results if r.name == "vllm-router"]
    if not reference:
        return
    ratios: dict[str, list[tuple[float, float, float]]] = {}
    print("\n| round | path | CPU per event ÷ vllm-router | TTFT p99 ÷ vllm-router "
          "| gap p99 - vllm-router ms |")  # fmt: skip
    print("| ---: | --- | ---: | ---: | ---: |")
    for number, results in enumerate(rounds, 1):
        ref = next((r for r in results if r.name == "vllm-router"), None)
        if ref is None:
            continue
        for r in results:
            if r.name in ("vllm-router", "engine alone"):
                continue
            cpu = r.us_per_event / ref.us_per_event
            ttft = pct_ms(r.sample.ttft_s, 0.99) / pct_ms(ref.sample.ttft_s, 0.99)
            gap = pct_ms(r.sample.gaps_s, 0.99) - pct_ms(ref.sample.gaps_s, 0.99)
            ratios.setdefault(r.name, []).append((cpu, ttft, gap))
            print(f"| {number} | {r.name} | {cpu:.2f} | {ttft:.2f} | {gap:+.1f} |")
    _report_against_caddy(rounds)
    if len(rounds) < 3:
        return
    # One round moves with whatever else the machine does; the median of the rounds does less.
    print(f"\nThe median of the {len(rounds)} rounds (lowest - highest):\n")
    print("| path | CPU per event ÷ vllm-router | TTFT p99 ÷ vllm-router "
          "| gap p99 - vllm-router ms |")  # fmt: skip
    print("| --- | ---: | ---: | ---: |")
    for name, values in ratios.items():
        cells = []
        for column, sign in ((0, ""), (1, ""), (2, "+")):
            low, *_, high = found = sorted(v[column] for v in values)
            middle = statistics.median(found)
            cells.append(f"{middle:{sign}.2f} ({low:{sign}.2f} - {high:{sign}.2f})")
        print(f"| {name} | {' | '.join(cells)} |")


def _report_against_caddy(rounds: list[list[Result]]) -> None:
    """Each berth path's CPU per event over Caddy + vllm-router's in the same round: berth
    over TLS beside the TLS-terminating stack a user would run instead."""
    caddy = "caddy + vllm-router"
    if not any(r.name == caddy for results in rounds for r in results):
        return
    print(f"\n| round | path | CPU per event ÷ {caddy} |")
    print("| ---: | --- | ---: |")
    ratios: dict[str, list[float]] = {}
    for number, results in enumerate(rounds, 1):
        ref = next((r for r in results if r.name == caddy), None)
        if ref is None:
            continue
        for r in results:
            if r.name.startswith("berth"):
                ratio = r.us_per_event / ref.us_per_event
                ratios.setdefault(r.name, []).append(ratio)
                print(f"| {number} | {r.name} | {ratio:.2f} |")
    if len(rounds) < 3:
        return
    print(f"\n| path | CPU per event ÷ {caddy}, median of {len(rounds)} (lowest - highest) |")
    print("| --- | ---: |")
    for name, values in ratios.items():
        found = sorted(values)
        middle, low, high = statistics.median(found), found[0], found[-1]
        print(f"| {name} | {middle:.2f} ({low:.2f} - {high:.2f}) |")


async def _bench(targets: list[Target], args: argparse.Namespace) -> list[list[Result]]:
    rounds = []
    for number in range(args.repeat):
        results = []
        for target in targets:
            harness.log(f"round {number + 1}: {target.name}")
            results.append(await measure(target, args))
            await asyncio.sleep(1.0)
        rounds.append(results)
    return rounds


def _bench_requests(targets: list[Target], args: argparse.Namespace) -> None:
    """``--mode requests``: every path by wrk, ``--repeat`` rounds, then the report."""
    if bench_requests.wrk_missing():
        raise SystemExit("--mode requests needs wrk on PATH (apt-get install wrk)")
    reachable = []
    for target in targets:
        if target.unix_path is not None:
            harness.log(f"{target.name} skipped: wrk does not speak to a Unix socket")
        else:
            reachable.append(target)
    rounds = []
    for number in range(args.repeat):
        results = []
        for target in reachable:
            harness.log(f"round {number + 1}: {target.name}")
            results.append(
                bench_requests.measure_requests(
                    target,
                    args.connections,
                    args.warmup_s,
                    args.duration_s,
                    cpu_s,
                    functools.partial(_start_profilers, target, args),
                )
            )
            time.sleep(1.0)
        rounds.append(results)
    bench_requests.report_requests(
        rounds,
        args.connections,
        f"machine: {harness._machine()}; load average {os.getloadavg()[0]:.2f} at the end\n"
        f"small non-streamed chat completions by wrk, {args.connections} connections, "
        f"{args.duration_s:g} s measured after {args.warmup_s:g} s warm-up, then one "
        f"connection; {len(rounds)} round(s)\n",
    )


PATHS = ("engine", "vllm-router", "caddy-vllm-router", "berth-proxy", "berth", "berth-socket",
         "berth-agent", "berth-direct", "litellm")  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["engine"]:
        serve_engine(sys.argv[2:])
        return
    if sys.argv[1:2] == ["proxy"]:
        serve_proxy(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=100, help="streams open at once")
    parser.add_argument("--rate", type=float, default=50.0, help="tokens a second per stream")
    parser.add_argument("--tokens", type=int, default=100, help="token events per stream")
    parser.add_argument("--duration-s", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="seconds before measuring")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over every path")
    parser.add_argument(
        "--paths", default=",".join(PATHS), help=f"comma-separated, of: {', '.join(PATHS)}"
    )
    parser.add_argument(
        "--bench-venv",
        type=Path,
        default=Path(os.environ.get("BERTH_BENCH_VENV", ".bench-venv")),
        help="virtualenv with vllm-router and litellm (default $BERTH_BENCH_VENV)",
    )
    parser.add_argument(
        "--mode", choices=("streams", "requests"), default="streams",
        help="paced streams (per event), or small non-streamed requests by wrk (per request)",
    )  # fmt: skip
    parser.add_argument(
        "--connections", type=int, default=32, help="wrk's connections in --mode requests"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary homes and logs")
    parser.add_argument(
        "--profile-dir", type=Path, help="py-spy each proxy over its window, stacks saved here"
    )
    args = parser.parse_args()
    wanted = args.paths.split(",")
    unknown = set(wanted) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths: {', '.join(sorted(unknown))}")
    signal.signal(signal.SIGTERM, harness._interrupt)
    workdir = Path(tempfile.mkdtemp(prefix="berth-bench-stream-"))
    try:
        with (
            harness.running_cluster(args.keep) as cluster,
            contextlib.ExitStack() as stack,
        ):
            engine_port = cluster.engine_ports[harness.LOCAL_MODEL]
            tls = ssl.create_default_context(cafile=str(cluster.leader_home / "ca" / "ca.pem"))
            key = cluster.api_key
            if args.mode == "requests":
                key = bench_requests.quota_key(cluster.leader)
            bearer = b"authorization: Bearer %s\r\n" % key.encode()
            leader = (cluster.leader_pid,)
            targets: list[Target] = []
            for name in wanted:
                if name == "engine":
                    engine = (cluster.engine_pids[harness.LOCAL_MODEL],)
                    targets.append(Target("engine alone", port=engine_port, pids=engine))
                elif name == "vllm-router":
                    found = stack.enter_context(vllm_router(args.bench_venv, engine_port, workdir))
                    targets += [found] if found else []
                elif name == "caddy-vllm-router":
                    found = stack.enter_context(
                        caddy_vllm_router(args.bench_venv, engine_port, workdir)
                    )
                    targets += [found] if found else []
                elif name == "berth-proxy":
                    targets.append(stack.enter_context(berth_proxy(engine_port)))
                elif name == "berth":
                    targets.append(Target("berth local", port=cluster.public_port, tls=tls,
                                          authorization=bearer, pids=leader))  # fmt: skip
                elif name == "berth-socket":
                    socket_path = str(cluster.leader_home / "berth.sock")
                    targets.append(
                        Target("berth local (socket)", unix_path=socket_path, pids=leader)
                    )
                elif name == "berth-agent":
                    agent = cluster.agent_pid(harness.AGENT_LABEL)
                    targets.append(Target("berth agent", port=cluster.public_port, tls=tls,
                                          authorization=bearer, model=harness.REMOTE_MODEL,
                                          pids=(*leader, agent)))  # fmt: skip
                elif name == "berth-direct":
                    agent = cluster.agent_pid(harness.DIRECT_LABEL)
                    targets.append(Target("berth agent, direct", port=cluster.public_port,
                                          tls=tls, authorization=bearer,
                                          model=harness.DIRECT_MODEL,
                                          pids=(*leader, agent)))  # fmt: skip
                elif name == "litellm":
                    found = stack.enter_context(litellm(args.bench_venv, engine_port, workdir))
                    targets += [found] if found else []
            if args.mode == "requests":
                _bench_requests(targets, args)
                return
            rounds = uvloop.run(_bench(targets, args))
        _report(rounds, args)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
