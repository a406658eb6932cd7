"""Agents after a database outage (issue 37): two leader-only leaders on a real PostgreSQL lose
it (a relay turned black hole: nothing answers, nothing is reset) for three leases, then it
comes back.  Both stand by during the outage and refuse the agent at once (``NOT_LEADER``,
no active named) without asking their store; the agent redials every 1 to 2 s rather than
backing off; when the database is back one leader takes the lease, the agent reaches it, and
a request through it is answered.  The times are printed (``scripts/bench_outage.py``
measures five outages; docs/ha.md records them), not asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.outage import one_outage, outage_cluster
from support.postgres import PostgresServer

pytestmark = pytest.mark.slow

LEASE_S = 2.0


def test_after_a_database_outage_the_agent_is_served_through_the_new_active(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    with outage_cluster(tmp_path, postgres_server, LEASE_S) as cluster:
        pids = cluster.leaders[0].deployment(cluster.deployment)["pid"]
        outage = one_outage(cluster, 3 * LEASE_S)
        print(f"database out {outage.out_s:.2f} s (lease {LEASE_S:g} s); after its return the "
              f"agent was on {outage.active} after {outage.linked_s:.2f} s and a request "
              f"through it answered after {outage.answered_s:.2f} s")  # fmt: skip
        agent_log = (cluster.agent.home / "agent.out").read_text()
        assert "code 4421: not leader): active=" in agent_log
        served_by = cluster.leaders[0 if outage.active == "a" else 1]
        assert served_by.deployment(cluster.deployment)["pid"] == pids  # re-attached
