"""Measure how soon agents are served again after a database outage (issue 37).

Real processes on loopback, set up with the tests' harnesses (``tests/support/outage.py``): a
throwaway PostgreSQL server behind a TCP relay, two leader daemons (``leader_only``,
``leader_ha``, one ``cluster_secret``) whose database traffic goes through the relay, and one
agent serving a deployment of the fake engine.  Each round turns the relay into a black hole
(nothing answers, nothing is reset) for ``--outage-leases`` leases, then brings the database
back and measures, from its return, when the agent was linked to the leader that took the
lease and when a request through that leader was first answered (both leaders are polled
every 50 ms).  The target is the lease plus 3 s.

Run: ``.venv/bin/python scripts/bench_outage.py`` (about two minutes with the defaults).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.outage import Outage, one_outage, outage_cluster  # noqa: E402
from support.postgres import PostgresServer  # noqa: E402


def main(rounds: int, lease_s: float, outage_leases: float) -> None:
    server = PostgresServer.start()
    results: list[Outage] = []
    try:
        with (
            tempfile.TemporaryDirectory(prefix="berth-bench-outage-") as folder,
            outage_cluster(Path(folder), server, lease_s) as cluster,
        ):
            for number in range(1, rounds + 1):
                outage = one_outage(cluster, outage_leases * lease_s)
                results.append(outage)
                print(f"round {number}: database out {outage.out_s:.2f} s; after its return "
                      f"the agent on {outage.active} after {outage.linked_s:.2f} s, answered "
                      f"through it after {outage.answered_s:.2f} s", flush=True)  # fmt: skip
    finally:
        server.stop()
    answered = sorted(r.answered_s for r in results)
    linked = sorted(r.linked_s for r in results)
    target = lease_s + 3.0
    print()
    print("| lease | outage | rounds | linked p50 / worst | answered p50 / worst | target |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {lease_s:g} s | {outage_leases * lease_s:g} s | {len(results)} | "
          f"{statistics.median(linked):.2f} / {linked[-1]:.2f} s | "
          f"{statistics.median(answered):.2f} / {answered[-1]:.2f} s | {target:g} s |")  # fmt: skip
    met = sum(1 for a in answered if a <= target)
    print(f"\n{met} of {len(results)} rounds answered within the lease + 3 s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lease-s", type=float, default=5.0)
    parser.add_argument("--outage-leases", type=float, default=3.0)
    args = parser.parse_args()
    main(args.rounds, args.lease_s, args.outage_leases)
