"""Measure what a slow database adds to requests whose API key is cached (issue 37).

Real processes on loopback, set up with the tests' harnesses: a throwaway PostgreSQL server
(``tests/support/postgres.py``) behind a TCP relay that delays every chunk by ``--delay-ms``
each way (``tests/support/tcp_relay.py``), and one leader daemon (``leader_ha``,
its store through the relay; a lease of ``--lease-s``, 10 s by default: a renewal is six
round trips, 2.4 s at 200 ms each way and up to 4.5 s seen under this load, which a lease
must outlast twice) with a deployment of the fake engine on its own host.  Each
round sends ``--clients`` clients' non-streamed chat completions, one after another per
client, for ``--round-s`` seconds (several lives of the 5 s key cache, so the key is read
again several times per round), with one key used from the start, and reports p50 and p99
latency and the requests that waited for a key read (``berth_auth_key_read_waits_total``).
Rounds alternate between no delay and the delay, ``--rounds`` of each, in one sitting; the
table ends with the medians and what the delay added to the p99.

Run: ``.venv/bin/python scripts/bench_slow_store.py`` (about four minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.cluster_harness import Cluster, started_cluster  # noqa: E402
from support.postgres import PostgresServer  # noqa: E402
from support.tcp_relay import TcpRelay  # noqa: E402

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass(frozen=True)
class Round:
    delay_ms: int
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    waits: dict[str, int]


def _waits(leader: Cluster) -> dict[str, int]:
    with leader.http() as http:
        text = http.get("/metrics").text
    found: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "berth_auth_key_read_waits":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    found[sample.labels["why"]] = int(sample.value)
    return found


def _round(leader: Cluster, relay: TcpRelay, delay_ms: int, clients: int, round_s: float) -> Round:
    relay.delay_s = delay_ms / 1000
    before = _waits(leader)
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    ends = time.monotonic() + round_s

    def client() -> None:
        with leader.http(timeout_s=30.0) as http:
            while time.monotonic() < ends:
                began = time.perf_counter()
                try:
                    ok = http.post("/v1/chat/completions", json=CHAT).status_code == 200
                except httpx.HTTPError:
                    ok = False
                took = time.perf_counter() - began
                with lock:
                    if ok:
                        latencies.append(took)
                    else:
                        errors[0] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = _waits(leader)
    latencies.sort()
    return Round(
        delay_ms=delay_ms,
        requests=len(latencies),
        errors=errors[0],
        p50_ms=statistics.median(latencies) * 1000,
        p99_ms=latencies[int(len(latencies) * 0.99) - 1] * 1000,
        waits={why: after.get(why, 0) - before.get(why, 0) for why in after},
    )


def main(delay_ms: int, rounds: int, clients: int, round_s: float, lease_s: float) -> None:
    server = PostgresServer.start()
    relay: TcpRelay | None = None
    try:
        url = server.create_database()
        relay = TcpRelay("127.0.0.1", server.port).start()
        relayed = url.replace(f":{server.port}/", f":{relay.port}/")
        settings = {
            "BERTH_DATABASE_URL": relayed,
            "BERTH_LEADER_HA": "true",
            "BERTH_LEADER_LEASE_S": str(lease_s),
            "PYTHONPATH": str(ROOT / "src"),
        }
        with tempfile.TemporaryDirectory(prefix="berth-bench-slow-store-") as folder:
            root = Path(folder)
            with started_cluster(root, settings) as leader:
                leader.deploy("tiny", root / "tiny.gguf", None)
                with leader.http() as http:  # the key's first use: cached from here on
                    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
                results: list[Round] = []
                for number in range(rounds):
                    for delay in (0, delay_ms) if number % 2 == 0 else (delay_ms, 0):
                        try:
                            result = _round(leader, relay, delay, clients, round_s)
                        except httpx.HTTPError:
                            log = leader.leader_home / "logs" / "daemon.log"
                            print("the leader stopped answering; its log ends:",
                                  *log.read_text().splitlines()[-120:], sep="\n")  # fmt: skip
                            raise
                        results.append(result)
                        print(f"delay {delay:>3} ms each way: {result.requests} requests, "
                              f"{result.errors} errors, p50 {result.p50_ms:.2f} ms, p99 "
                              f"{result.p99_ms:.2f} ms, waited for a key read: {result.waits}",
                              flush=True)  # fmt: skip
                relay.delay_s = 0.0
    finally:
        if relay is not None:
            relay.close()
        server.stop()
    print()
    print("| delay each way | rounds | requests | p50 (median) | p99 (median) | key-read waits |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    medians: dict[int, float] = {}
    for delay in (0, delay_ms):
        mine = [r for r in results if r.delay_ms == delay]
        medians[delay] = statistics.median(r.p99_ms for r in mine)
        waits = {why: sum(r.waits.get(why, 0) for r in mine) for why in ("new", "changed", "stale")}
        print(f"| {delay} ms | {len(mine)} | {sum(r.requests for r in mine)} | "
              f"{statistics.median(r.p50_ms for r in mine):.2f} ms | {medians[delay]:.2f} ms | "
              f"{waits} |")  # fmt: skip
    print(f"\np99 added by the {delay_ms} ms database: {medians[delay_ms] - medians[0]:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--round-s", type=float, default=20.0)
    parser.add_argument("--lease-s", type=float, default=10.0)
    args = parser.parse_args()
    main(args.delay_ms, args.rounds, args.clients, args.round_s, args.lease_s)
