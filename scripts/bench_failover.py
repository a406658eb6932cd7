"""Measure how soon a standby leader serves after the active is killed with SIGKILL.

Real processes on loopback, set up with the tests' harnesses: a throwaway PostgreSQL server
(``tests/support/postgres.py``) and two leader daemons (``berth daemon start``,
``leader_only``, ``leader_ha``, one CA and one key pepper) on one database of it. Each
round kills the active leader with SIGKILL, then polls the other's ``GET /v1/models`` every
20 ms, with a client that retries on 503 as a client behind a load balancer would, until
it answers 200: the time from the kill to that answer is the round's takeover. The killed
leader is started again (a standby now) before the next round, so the two take turns.

No agents, engines or load: this is the lease and the takeover alone (docs/ha.md says what
is not measured). Run: ``.venv/bin/python scripts/bench_failover.py`` (about two minutes
with the default 5 s lease; ``--lease-s 1`` for a short one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from berth.cluster.pki.ca import CertificateAuthority  # noqa: E402
from berth.keys import load_or_create_pepper  # noqa: E402
from support.cluster_harness import Cluster, clean_env  # noqa: E402
from support.postgres import PostgresServer  # noqa: E402
from support.processes import wait_gone  # noqa: E402

POLL_S = 0.02
ROUND_BOUND_S = 120.0


def _answers(leader: Cluster, key: str) -> bool:
    try:
        with httpx.Client(base_url=leader.base_url, verify=leader.tls(), timeout=5.0) as http:
            reply = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def start_leader_pair(folder: Path, env: dict[str, str]) -> tuple[Cluster, Cluster]:
    """Leaders ``a`` (started first: the active) and ``b`` (the standby) under ``folder``,
    both started with ``env`` after ``b``'s home was given ``a``'s CA and key pepper (what
    docs/ha.md asks of leaders that share a cluster). If ``b`` fails to start, ``a`` is
    stopped before the error goes on."""
    a, b = Cluster(folder / "a", env), Cluster(folder / "b", env)
    CertificateAuthority.load_or_create(a.leader_home / "ca")
    load_or_create_pepper(a.leader_home / "key_pepper")
    b.leader_home.mkdir(parents=True)
    shutil.copytree(a.leader_home / "ca", b.leader_home / "ca")
    shutil.copy2(a.leader_home / "key_pepper", b.leader_home / "key_pepper")
    a.start()
    try:
        b.start()
    except BaseException:
        a.berth("daemon", "stop", check=False)
        raise
    return a, b


def ha_env(
    database_url: str, lease_s: float, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """Every process's environment: this tree's berth, the shared database, ``leader_ha``
    with a ``lease_s`` lease, leader-only leaders, and ``extra``."""
    settings = {
        "BERTH_DATABASE_URL": database_url,
        "BERTH_LEADER_HA": "true",
        "BERTH_LEADER_LEASE_S": str(lease_s),
        "BERTH_LEADER_ONLY": "true",
        "PYTHONPATH": str(ROOT / "src"),
    }
    return clean_env({**settings, **(extra or {})})


def main(rounds: int, lease_s: float) -> None:
    server = PostgresServer.start()
    folder = Path(tempfile.mkdtemp(prefix="berth-bench-failover-"))
    leaders: list[Cluster] = []
    try:
        a, b = start_leader_pair(folder, ha_env(server.create_database(), lease_s))
        leaders += [a, b]
        key = a.api_key
        active, standby = a, b
        takeovers: list[float] = []
        for index in range(rounds):
            pid = active.leader_pid()
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while not _answers(standby, key):
                if time.monotonic() - killed_at > ROUND_BOUND_S:
                    raise SystemExit(f"round {index + 1}: no takeover in {ROUND_BOUND_S} s")
                time.sleep(POLL_S)
            takeovers.append(time.monotonic() - killed_at)
            print(f"round {index + 1}: served {takeovers[-1]:.2f} s after the kill", flush=True)
            wait_gone(pid, 10.0)
            active.start()  # back as a standby (it made its own key; the first one is used)
            active, standby = standby, active
        takeovers.sort()
        print(
            f"lease {lease_s} s, {rounds} kills: p50 {statistics.median(takeovers):.2f} s, "
            f"worst {takeovers[-1]:.2f} s, best {takeovers[0]:.2f} s"
        )
    finally:
        for leader in leaders:
            leader.berth("daemon", "stop", check=False)
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--lease-s", type=float, default=5.0)
    args = parser.parse_args()
    main(args.rounds, args.lease_s)
