"""A database outage under two shared leaders (issue 37): both leaders' PostgreSQL traffic goes
through one TCP relay (``support.tcp_relay``), which the outage turns into a black hole, and
an agent serves a deployment of the fake engine.  Used by ``tests/test_ha_outage.py`` (one
outage) and ``scripts/bench_outage.py`` (several, with the numbers).

:func:`outage_cluster` starts it; :func:`one_outage` cuts the database for a while, brings it
back, and measures how soon a request through the leader that took the lease is answered.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from support.cluster_harness import TINY_GGUF_BYTES, Agent, Cluster, clean_env, fake_engine_wrapper
from support.postgres import PostgresServer
from support.tcp_relay import TcpRelay
from support.waiting import wait_for

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
#: A cluster_secret for the pair (the CA and pepper shared through the database).
SECRET = "outage-cluster-secret-0123456789"
#: Longest wait for one event (a bound for a loaded machine, not a target).
BOUND_S = 120.0


@dataclass
class OutageCluster:
    leaders: tuple[Cluster, Cluster]
    relay: TcpRelay
    agent: Agent
    deployment: str
    lease_s: float

    @property
    def key(self) -> str:
        return self.leaders[0].api_key


@dataclass(frozen=True)
class Outage:
    """One outage: how long the database was out, and from its return to the agent linked
    to the new active and to the first answer through it (seconds); the leader that answered
    (``a`` or ``b``)."""

    out_s: float
    linked_s: float
    answered_s: float
    active: str


def _role(leader: Cluster) -> str:
    try:
        return str(leader.admin("GET", "/admin/leader")["role"])
    except (httpx.HTTPError, OSError):
        return "down"


def _answered(leader: Cluster, key: str) -> bool:
    try:
        with leader.http(timeout_s=5.0) as http:
            reply = http.post(
                "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}
            )
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def _linked_to(agent: Agent, leader: Cluster) -> bool:
    try:
        status: dict[str, Any] = json.loads((agent.home / "agent-status.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(status["connected"]) and status["leader_url"] == (
        f"https://127.0.0.1:{leader.cluster_port}"
    )


@contextlib.contextmanager
def outage_cluster(root: Path, server: PostgresServer, lease_s: float) -> Iterator[OutageCluster]:
    """Two leader-only leaders (``a`` active) on a fresh database of ``server`` behind one
    relay, an agent and a ready deployment on it; all stopped on exit."""
    (root / "tiny.gguf").write_bytes(TINY_GGUF_BYTES)
    url = server.create_database()
    relay = TcpRelay("127.0.0.1", server.port).start()
    env = clean_env(
        {
            "BERTH_DATABASE_URL": url.replace(f":{server.port}/", f":{relay.port}/"),
            "BERTH_LEADER_HA": "true",
            "BERTH_LEADER_LEASE_S": str(lease_s),
            "BERTH_LEADER_ONLY": "true",
            "BERTH_CLUSTER_SECRET": SECRET,
            "BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(root)),
        }
    )
    a, b = Cluster(root / "a", env), Cluster(root / "b", env)
    started: list[Cluster] = []
    try:
        for leader in (a, b):
            leader.start()
            started.append(leader)
        agent = a.add_agent("gpu1")
        deployment = a.deploy("tiny", root / "tiny.gguf", agent)
        yield OutageCluster((a, b), relay, agent, deployment, lease_s)
    finally:
        relay.heal()  # the leaders stop cleanly with their database back
        active = next((leader for leader in started if _role(leader) == "active"), None)
        if active is not None:
            for leader in started:
                if leader is not active:
                    active.agents.update(leader.agents)
                    leader.agents.clear()
            active.close()
        for leader in started:
            if leader is not active:
                leader.berth("daemon", "stop", check=False)
        relay.close()
        server.drop_database(url)


def one_outage(cluster: OutageCluster, out_s: float) -> Outage:
    """Cut the database for ``out_s`` seconds (both leaders stand by meanwhile), bring it
    back, and measure (see :class:`Outage`)."""
    leaders = cluster.leaders
    before = next(leader for leader in leaders if _role(leader) == "active")
    assert _answered(before, cluster.key)
    cut_at = time.monotonic()
    cluster.relay.black_hole()
    wait_for(lambda: all(_role(leader) == "standby" for leader in leaders), BOUND_S,
             "both leaders to stand by")  # fmt: skip
    wait_for(lambda: time.monotonic() - cut_at >= out_s, BOUND_S, "the outage's end",
             interval_s=0.05)  # fmt: skip
    cluster.relay.heal()
    back_at = time.monotonic()
    found: dict[str, float] = {}

    def served() -> bool:
        for name, leader in zip("ab", leaders, strict=True):
            if "linked" not in found and _linked_to(cluster.agent, leader):
                found["linked"] = time.monotonic() - back_at
            if _answered(leader, cluster.key):
                found["answered"] = time.monotonic() - back_at
                found["active"] = float(name == "b")
                return True
        return False

    wait_for(served, BOUND_S, "an answer through the new active", interval_s=0.05)
    linked_s = found.get("linked", found["answered"])
    return Outage(back_at - cut_at, linked_s, found["answered"], "b" if found["active"] else "a")
