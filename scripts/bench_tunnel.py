"""Benchmark the paths to an engine: alone, through the leader to a local deployment, and
through the leader to a deployment on an agent, by the tunnel and by the direct path.

Real processes on loopback, set up with berth's own CLI in throw-away homes:

* a leader (``berth daemon start``) with an API key and two enrolled nodes;
* two agents (``berth agent start``, each its own home) linked to the leader over mTLS:
  ``bench-agent`` reached only through its link's tunnel, and ``bench-direct`` started with
  ``--advertise 127.0.0.1:PORT``, whose requests the leader sends straight to its ingress;
* three deployments of one stand-in engine, launched by berth as ``llama-server``
  (``BERTH_LLAMA_SERVER_BIN`` points at a wrapper that runs ``scripts/bench_tunnel_engine.py``):
  ``bench-local`` on node ``local``, ``bench-remote`` on ``bench-agent`` and ``bench-direct``
  on ``bench-direct``. The engine is raw asyncio + httptools on uvloop: a canned chat
  completion of about 300 bytes, or an SSE stream of ``max_tokens`` content events plus role,
  finish, usage and ``[DONE]`` events, each event its own write (``bench_interval_ms`` in the
  request body spaces them out);
* this process, the load generator (``scripts/bench_tunnel_load.py``): keep-alive
  connections on uvloop, requests written raw, answers parsed with httptools, one request in
  flight per connection (closed loop).

Four paths get the same load: ``engine alone`` (plain HTTP to the local deployment's engine
port), ``leader → local`` (HTTPS to the leader's public listener, bearer key), ``leader →
agent, tunnel`` and ``leader → agent, direct``. Per path: non-streamed and streamed requests
with 1 and ``--concurrency`` clients for ``--duration-s`` seconds each (after
``--warmup-s``), then ``--streams`` streams held open at once (one connection each, an event
every 250 ms). The CPU time of the leader and of the path's agent (``utime + stime`` in
``/proc/PID/stat``) is read at the start and end of each measured window, and their RSS
(``VmRSS``) sampled every 50 ms. Run: ``.venv/bin/python scripts/bench_tunnel.py`` (about 3
minutes); ``--repeat N`` runs the loads N times on the same cluster and prints each table.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop
from bench_tunnel_load import Cell, Path_, PathResult, RssSampler, log, measure_path, ms

ROOT = Path(__file__).resolve().parent.parent
AGENT_LABEL = "bench-agent"
DIRECT_LABEL = "bench-direct"
LOCAL_MODEL = "bench-local"
REMOTE_MODEL = "bench-remote"
DIRECT_MODEL = "bench-direct"
#: Requests each stand-in deployment serves at once, as its ``--parallel`` tells the leader.
ENGINE_SLOTS = 4096
#: The stand-in engine berth launches as ``llama-server``.
ENGINE_SCRIPT = Path(__file__).resolve().parent / "bench_tunnel_engine.py"

# -- the cluster: a leader, an agent and two deployments, set up through the CLI ------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class Cluster:
    """Paths, ports, pids and the key of the set-up cluster."""

    workdir: Path
    env: dict[str, str]
    public_port: int
    leader_pid: int = 0
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    api_key: str = ""
    engine_pids: dict[str, int] = field(default_factory=dict)
    engine_ports: dict[str, int] = field(default_factory=dict)

    @property
    def leader_home(self) -> Path:
        return self.workdir / "leader"

    def agent_home(self, label: str) -> Path:
        return self.workdir / label

    def agent_pid(self, label: str) -> int:
        agent = self.agents.get(label)
        return agent.pid if agent is not None else 0

    def berth(self, home: Path, *args: str, timeout_s: float = 120.0) -> str:
        """Run the ``berth`` CLI on ``home``; its stdout. Raises ``RuntimeError`` on failure."""
        command = [sys.executable, "-m", "berth", "--home", str(home), *args]
        result = subprocess.run(
            command, capture_output=True, text=True, env=self.env, timeout=timeout_s,
            cwd=self.workdir,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(
                f"berth {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}"
            )
        return result.stdout

    def leader(self, *args: str, timeout_s: float = 120.0) -> str:
        return self.berth(self.leader_home, *args, timeout_s=timeout_s)


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BERTH_", "HF_"))}
    env["COLUMNS"] = "200"
    env.update(extra)
    return env


def _set_up(cluster: Cluster) -> None:
    cluster.leader("daemon", "start")
    cluster.leader_pid = int((cluster.leader_home / "daemon.pid").read_text().split()[0])
    log(f"leader running (pid {cluster.leader_pid}, HTTPS port {cluster.public_port})")
    keys = re.findall(r"sk-berth-\S+", cluster.leader("key", "create", "bench"))
    if not keys:
        raise RuntimeError("berth key create printed no key")
    cluster.api_key = keys[0]
    _start_agent(cluster, AGENT_LABEL, advertise=None)
    _start_agent(cluster, DIRECT_LABEL, advertise=f"127.0.0.1:{_free_port()}")
    weights = cluster.workdir / "bench.gguf"
    weights.write_bytes(b"GGUF" + bytes(60))
    cluster.leader("models", "add", LOCAL_MODEL, str(weights))
    # The stand-in serves any number of requests at once; said so, the leader's fair queue
    # does not hold the load at llama-server's default of 4 slots.
    slots = f"--extra-arg=--parallel={ENGINE_SLOTS}"
    cluster.leader("run", LOCAL_MODEL, "--engine", "llamacpp", slots, "--timeout", "60")
    for model, label in ((REMOTE_MODEL, AGENT_LABEL), (DIRECT_MODEL, DIRECT_LABEL)):
        cluster.leader("models", "add", model, str(weights), "--node", label)
        cluster.leader("run", model, "--engine", "llamacpp", slots, "--node", label,
                       "--timeout", "60")  # fmt: skip
    for deployment in json.loads(cluster.leader("ps", "--json")):
        name = deployment.get("served_model_name") or deployment.get("model_name")
        cluster.engine_pids[name] = int(deployment["pid"])
        cluster.engine_ports[name] = int(deployment["port"])
    if set(cluster.engine_ports) != {LOCAL_MODEL, REMOTE_MODEL, DIRECT_MODEL}:
        raise RuntimeError(f"unexpected deployments: {cluster.engine_ports}")
    log(f"deployments serving: {cluster.engine_ports}")
    paths = {n["label"]: n for n in json.loads(cluster.leader("nodes", "ls", "--json"))}
    if paths[DIRECT_LABEL]["data_path"] != "direct" or paths[AGENT_LABEL]["data_path"] != "tunnel":
        raise RuntimeError(f"unexpected data paths: {paths}")
    log(f"data paths: {AGENT_LABEL} tunnel, {DIRECT_LABEL} direct")


def _start_agent(cluster: Cluster, label: str, advertise: str | None) -> None:
    """Enroll ``label``, register its home and start its agent; returns once it is ready
    (and, when it advertises, its data path is direct)."""
    enrolled = cluster.leader("nodes", "enroll", label)
    uri = next(line for line in enrolled.splitlines() if line.startswith("berth://"))
    home = cluster.agent_home(label)
    cluster.berth(home, "agent", "register", "--uri", uri.strip())
    extra = ["--advertise", advertise] if advertise else []
    agent_log = (cluster.workdir / f"{label}.out").open("wb")
    agent = cluster.agents[label] = subprocess.Popen(
        [sys.executable, "-m", "berth", "--home", str(home), "agent", "start", *extra],
        stdin=subprocess.DEVNULL, stdout=agent_log, stderr=subprocess.STDOUT, env=cluster.env,
        cwd=cluster.workdir, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    want = "direct" if advertise else "tunnel"
    while True:
        nodes = json.loads(cluster.leader("nodes", "ls", "--json"))
        if any(n["label"] == label and n["data_path"] == want for n in nodes):
            break
        if agent.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the agent did not link; see {cluster.workdir / label}.out")
        time.sleep(0.2)
    log(f"agent {label} linked (pid {agent.pid}, data path {want})")


def _tear_down(cluster: Cluster) -> None:
    """Stop everything this run started, whatever state it is in."""
    if cluster.leader_pid:
        with contextlib.suppress(Exception):
            cluster.leader("stop", "--all", timeout_s=30)
        with contextlib.suppress(Exception):
            cluster.leader("daemon", "stop", timeout_s=30)
    for agent in cluster.agents.values():
        if agent.poll() is None:
            agent.send_signal(signal.SIGINT)
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
    # Whatever is left (an engine the agent leaves running, a daemon that did not stop).
    leftovers = [*cluster.engine_pids.values(), cluster.leader_pid]
    for pid in leftovers:
        if pid and _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for pid in leftovers:
        while pid and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid and _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def running_cluster(keep: bool) -> Iterator[Cluster]:
    workdir = Path(tempfile.mkdtemp(prefix="berth-bench-tunnel-"))
    wrapper = workdir / "bin" / "llama-server"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ENGINE_SCRIPT}" "$@"\n')
    wrapper.chmod(0o755)
    public_port = _free_port()
    env = _clean_env(
        {
            "BERTH_LLAMA_SERVER_BIN": str(wrapper),
            "BERTH_PUBLIC_PORT": str(public_port),
            "BERTH_CLUSTER_PORT": str(_free_port()),
            "BERTH_HEALTH_TIMEOUT_S": "30",
            "BERTH_STOP_GRACE_S": "5",
        }
    )
    cluster = Cluster(workdir, env, public_port)
    try:
        _set_up(cluster)
        yield cluster
    finally:
        log("tearing down")
        _tear_down(cluster)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


# -- the report -----------------------------------------------------------------------------------


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()}"


LOCAL = "leader → local"
TUNNEL = "leader → agent, tunnel"
DIRECT = "leader → agent, direct"


def _report(results: dict[str, PathResult], paths: list[Path_], args: argparse.Namespace) -> None:
    n = args.concurrency
    names = list(results)
    agent_of = {path.name: path.agent for path in paths}
    print(f"machine: {_machine()}; load average {os.getloadavg()[0]:.2f} at the end")
    print(
        f"each cell: {args.duration_s:g} s measured after {args.warmup_s:g} s warm-up; "
        f"streams of {args.events} content events + 4 (role, finish, usage, [DONE]); CPU: "
        "the leader's and the path's agent's user + system time in the measured window\n"
    )
    print("| measure | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))

    def row(label: str, cell: Any) -> None:
        print(f"| {label} | " + " | ".join(cell(results[name]) for name in names) + " |")

    def lat(values: list[float]) -> str:
        return f"{ms(values, 0.5):.2f} / {ms(values, 0.99):.2f}"

    def cpu(value: float, cell: Cell) -> str:
        return f"{value:.0f}" if cell.cpu_s else "-"

    row("json, 1 client: latency p50 / p99 ms", lambda r: lat(r.json_1.latencies_s))
    row("json, 1 client: req/s", lambda r: f"{r.json_1.rps:,.0f}")
    row(f"json, {n} clients: latency p50 / p99 ms", lambda r: lat(r.json_n.latencies_s))
    row(f"json, {n} clients: req/s", lambda r: f"{r.json_n.rps:,.0f}")
    row(f"json, {n} clients: CPU µs per request",
        lambda r: cpu(r.json_n.cpu_per_request_us, r.json_n))  # fmt: skip
    row(f"json, {n} clients: of which leader + agent",
        lambda r: r.json_n.split_us(len(r.json_n.latencies_s)) or "-")  # fmt: skip
    row("stream, 1 client: TTFB p50 / p99 ms", lambda r: lat(r.stream_1.ttfbs_s))
    row("stream, 1 client: SSE events/s", lambda r: f"{r.stream_1.events_per_s:,.0f}")
    row(f"stream, {n} clients: TTFB p50 / p99 ms", lambda r: lat(r.stream_n.ttfbs_s))
    row(f"stream, {n} clients: SSE events/s", lambda r: f"{r.stream_n.events_per_s:,.0f}")
    row(f"stream, {n} clients: CPU µs per SSE event",
        lambda r: cpu(r.stream_n.cpu_per_event_us, r.stream_n))  # fmt: skip
    row(f"stream, {n} clients: CPU µs per 100 SSE events, leader + agent",
        lambda r: r.stream_n.split_us(r.stream_n.events // 100) or "-")  # fmt: skip
    row(
        "errors (all four loads)",
        lambda r: str(r.json_1.errors + r.json_n.errors + r.stream_1.errors + r.stream_n.errors),
    )
    s = args.streams
    if s:
        row(f"{s} held streams: completed / most open at once",
            lambda r: f"{r.held.completed} / {r.held.most_open}")  # fmt: skip
        row(f"{s} held streams: TTFB p50 / p99 ms", lambda r: lat(r.held.ttfbs_s))

    def rss(values: tuple[float, float, float] | None) -> str:
        return " / ".join(f"{v:.0f}" for v in values) if values else "-"

    def agent_rss(result: PathResult, which: str) -> str:
        name = next(k for k, v in results.items() if v is result)
        agent = agent_of[name]
        table = result.rss_load if which == "load" else result.rss_held
        return rss(table.get(agent)) if agent else "-"

    row("leader RSS MiB before / peak / after, the four loads", lambda r: rss(r.rss_load["leader"]))
    row("agent RSS MiB before / peak / after, the four loads", lambda r: agent_rss(r, "load"))
    if s:
        row("leader RSS MiB before / peak / after, held streams",
            lambda r: rss(r.rss_held["leader"]))  # fmt: skip
        row("agent RSS MiB before / peak / after, held streams", lambda r: agent_rss(r, "held"))
    for name, result in results.items():
        if result.held.failures:
            print(f"\n{name}: held stream failures: {result.held.failures}")
    local, tunnel, direct = results.get(LOCAL), results.get(TUNNEL), results.get(DIRECT)
    if local is None or tunnel is None or direct is None:
        return
    _compare(local, tunnel, direct, n)
    _targets(local, tunnel, args)


def _compare(local: PathResult, tunnel: PathResult, direct: PathResult, n: int) -> None:
    """The direct path beside the tunnel: what each adds to a local deployment, and what
    each costs."""

    def added(result: PathResult, pick: Any) -> float:
        return ms(pick(result), 0.5) - ms(pick(local), 0.5)

    rows: list[tuple[str, float, float, str]] = [
        ("json, 1 client: p50 latency added to leader → local, ms",
         added(tunnel, lambda r: r.json_1.latencies_s),
         added(direct, lambda r: r.json_1.latencies_s), "{:+.2f}"),
        ("stream, 1 client: p50 TTFB added to leader → local, ms",
         added(tunnel, lambda r: r.stream_1.ttfbs_s),
         added(direct, lambda r: r.stream_1.ttfbs_s), "{:+.2f}"),
        (f"json, {n} clients: req/s", tunnel.json_n.rps, direct.json_n.rps, "{:,.0f}"),
        (f"stream, {n} clients: SSE events/s", tunnel.stream_n.events_per_s,
         direct.stream_n.events_per_s, "{:,.0f}"),
        (f"json, {n} clients: CPU µs per request (leader + agent)",
         tunnel.json_n.cpu_per_request_us, direct.json_n.cpu_per_request_us, "{:.0f}"),
        (f"stream, {n} clients: CPU µs per SSE event (leader + agent)",
         tunnel.stream_n.cpu_per_event_us, direct.stream_n.cpu_per_event_us, "{:.1f}"),
    ]  # fmt: skip
    print("\n| direct beside tunnel | tunnel | direct | direct / tunnel |")
    print("| --- | ---: | ---: | ---: |")
    for label, via_tunnel, via_direct, form in rows:
        ratio = f"{via_direct / via_tunnel:.2f}" if via_tunnel > 0 and via_direct > 0 else "-"
        print(f"| {label} | {form.format(via_tunnel)} | {form.format(via_direct)} | {ratio} |")


def _targets(local: PathResult, remote: PathResult, args: argparse.Namespace) -> None:
    """The tunnel's own targets (from its first benchmark)."""
    n, s = args.concurrency, args.streams
    added_json = ms(remote.json_1.latencies_s, 0.5) - ms(local.json_1.latencies_s, 0.5)
    added_ttfb = ms(remote.stream_1.ttfbs_s, 0.5) - ms(local.stream_1.ttfbs_s, 0.5)
    met = {True: "met", False: "NOT met"}
    print("\n| tunnel target | measured | |\n| --- | --- | --- |")
    print(
        f"| 1 client: tunnel adds < 3 ms at p50 | json latency {added_json:+.2f} ms, "
        f"stream TTFB {added_ttfb:+.2f} ms | {met[max(added_json, added_ttfb) < 3.0]} |"
    )
    print(
        f"| {n} clients through the agent: ≥ 1,500 json req/s | {remote.json_n.rps:,.0f} req/s "
        f"| {met[n >= 32 and remote.json_n.rps >= 1500]} |"
    )
    if not s:
        return
    before, peak, after = remote.rss_held["leader"]
    ok = remote.held.completed == s >= 1000 and remote.held.most_open >= min(s, 1000)
    print(
        f"| one agent link carries 1,000 concurrent streams, leader memory bounded "
        f"| {remote.held.completed} of {s} completed, {remote.held.most_open} open at once; "
        f"leader RSS {before:.0f} → {peak:.0f} → {after:.0f} MiB "
        f"(+{(peak - before) * 1024 / max(1, s):.0f} KiB per stream at the peak) | {met[ok]} |"
    )


async def _bench(cluster: Cluster, args: argparse.Namespace) -> None:
    tls = ssl.create_default_context(cafile=str(cluster.leader_home / "ca" / "ca.pem"))
    bearer = b"authorization: Bearer %s\r\n" % cluster.api_key.encode()
    leader = cluster.leader_pid
    tunnel_agent, direct_agent = cluster.agent_pid(AGENT_LABEL), cluster.agent_pid(DIRECT_LABEL)
    paths = [
        Path_("engine alone", cluster.engine_ports[LOCAL_MODEL], None, b"", LOCAL_MODEL),
        Path_(LOCAL, cluster.public_port, tls, bearer, LOCAL_MODEL, (leader,)),
        Path_(TUNNEL, cluster.public_port, tls, bearer, REMOTE_MODEL, (leader, tunnel_agent),
              AGENT_LABEL),
        Path_(DIRECT, cluster.public_port, tls, bearer, DIRECT_MODEL, (leader, direct_agent),
              DIRECT_LABEL),
    ]  # fmt: skip
    pids = {"leader": leader, AGENT_LABEL: tunnel_agent, DIRECT_LABEL: direct_agent}
    for run in range(args.repeat):
        if args.repeat > 1:
            log(f"run {run + 1} of {args.repeat}")
            print(f"\n### run {run + 1} of {args.repeat}\n")
        results: dict[str, PathResult] = {}
        with RssSampler(pids) as sampler:
            for path in paths:
                results[path.name] = await measure_path(path, sampler, args)
        _report(results, paths, args)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=3.0, help="seconds measured per cell")
    parser.add_argument("--warmup-s", type=float, default=0.5, help="seconds before measuring")
    parser.add_argument("--concurrency", type=int, default=32, help="clients of the busy cells")
    parser.add_argument("--streams", type=int, default=1000, help="streams held open at once")
    parser.add_argument("--events", type=int, default=16, help="content events per stream")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every load, one table each")
    parser.add_argument("--keep", action="store_true", help="keep the temporary homes and logs")
    args = parser.parse_args()
    # SIGTERM ends the run like Ctrl-C, so the cluster is torn down either way.
    signal.signal(signal.SIGTERM, _interrupt)
    with running_cluster(args.keep) as cluster:
        uvloop.run(_bench(cluster, args))


if __name__ == "__main__":
    main()
