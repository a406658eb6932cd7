"""A leader cut off from PostgreSQL by a silent network (issue 37, docs/ha.md): two real
leader daemons (``leader_only``, ``leader_ha``, a 2 s lease) on one real PostgreSQL, and a
real agent process serving a deployment with the fake engine.

The active's database traffic goes through a TCP relay the test turns into a black hole:
every byte swallowed, no connection reset or closed.  The active's lease runs out by its own
clock while its renewal hangs; it closes its agents' links with 4421 and stands by; the
standby takes the lease; the agent dials it; a request through it is answered; and the
engine was re-attached, not restarted.  The times from the cut to each of these are printed
(docs/ha.md records them), not asserted: only a bound that tells slow from never.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.cluster_harness import TINY_GGUF_BYTES, Agent, Cluster, clean_env, fake_engine_wrapper
from support.postgres import PostgresServer
from support.processes import alive
from support.tcp_relay import TcpRelay
from support.waiting import wait_for

pytestmark = pytest.mark.slow

LEASE_S = 2.0
#: Longest wait for any one event (a bound for a loaded machine, not a target).
BOUND_S = 60.0
CLUSTER_SECRET = "test-partition-secret-0123456789"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def partitionable_pair(
    tmp_path: Path, postgres_server: PostgresServer
) -> Iterator[tuple[Cluster, Cluster, TcpRelay]]:
    """Leaders ``a`` (active, its database behind the relay) and ``b`` (standby, direct),
    sharing the CA and pepper through the database (``cluster_secret``)."""
    (tmp_path / "tiny.gguf").write_bytes(TINY_GGUF_BYTES)
    url = postgres_server.create_database()
    relay = TcpRelay("127.0.0.1", postgres_server.port).start()
    common = {
        "BERTH_LEADER_HA": "true",
        "BERTH_LEADER_LEASE_S": str(LEASE_S),
        "BERTH_LEADER_ONLY": "true",
        "BERTH_CLUSTER_SECRET": CLUSTER_SECRET,
        "BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(tmp_path)),
    }
    relayed = url.replace(f":{postgres_server.port}/", f":{relay.port}/")
    a = Cluster(tmp_path / "a", clean_env({**common, "BERTH_DATABASE_URL": relayed}))
    b = Cluster(tmp_path / "b", clean_env({**common, "BERTH_DATABASE_URL": url}))
    started: list[Cluster] = []
    try:
        for leader in (a, b):
            leader.start()
            started.append(leader)
        yield a, b, relay
    finally:
        # b closes the deployments and the agents (a cannot write any more), then a stops.
        if b in started:
            b.agents.update(a.agents)
            a.agents.clear()
            b.close()
        if a in started:
            a.berth("daemon", "stop", check=False)
        relay.close()
        postgres_server.drop_database(url)


def _connected_to(agent: Agent, leader: Cluster) -> bool:
    try:
        status: dict[str, Any] = json.loads((agent.home / "agent-status.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(status["connected"]) and status["leader_url"] == (
        f"https://127.0.0.1:{leader.cluster_port}"
    )


def _answered(leader: Cluster, key: str) -> bool:
    try:
        with leader.http(timeout_s=10.0) as http:
            reply = http.post(
                "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}
            )
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def test_a_leader_cut_off_from_its_database_hands_its_agents_to_the_standby(
    partitionable_pair: tuple[Cluster, Cluster, TcpRelay],
) -> None:
    a, b, relay = partitionable_pair
    assert a.admin("GET", "/admin/leader")["role"] == "active"
    agent = a.add_agent("gpu1")
    deployment = a.deploy("tiny", a.root.parent / "tiny.gguf", agent)
    assert _answered(a, a.api_key)
    engine_pid = a.deployment(deployment)["pid"]
    log = a.leader_home / "logs" / "daemon.log"

    cut_at = time.monotonic()
    relay.black_hole()
    times: dict[str, float] = {}

    def seen(what: str, happened: bool) -> bool:
        if happened and what not in times:
            times[what] = time.monotonic() - cut_at
        return happened

    def stood_by() -> bool:
        return seen("a stood by and closed its links",
                    "standing by: the leader-only loops stopped" in log.read_text())  # fmt: skip

    wait_for(stood_by, BOUND_S, "the cut-off active to stand by", interval_s=0.05)
    wait_for(lambda: seen("the agent is on b", _connected_to(agent, b)), BOUND_S,
             "the agent to reach b", interval_s=0.05)  # fmt: skip
    wait_for(lambda: seen("b answered through it", _answered(b, a.api_key)), BOUND_S,
             "b to answer through the agent", interval_s=0.05)  # fmt: skip
    print(f"silent partition of the active's database (lease {LEASE_S:g} s): "
          + ", ".join(f"{what} {at:.2f} s" for what, at in times.items()))  # fmt: skip

    text = log.read_text()
    assert "ran out unrenewed by this leader's clock" in text
    assert "stepping down to standby" in text
    agent_log = (agent.home / "agent.out").read_text()
    assert "code 4421: not leader" in agent_log
    assert alive(a.leader_pid()), "the cut-off leader exited rather than standing by"
    role = a.admin("GET", "/admin/leader")
    assert role["role"] == "standby"
    now = b.deployment(deployment)
    assert (now["state"], now["pid"]) == ("ready", engine_pid), "the engine was restarted"
