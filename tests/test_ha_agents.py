"""Agents fail over between two real leader daemons on one database (docs/ha.md, Agents
fail over): one SQLite file, ``leader_ha`` on, a real agent process serving a deployment
with the fake engine.

- ``kill -9`` of the active: the agent redials the other leader (the list it got in
  Welcome), which has taken the lease; the engine is re-attached (its pid unchanged) and a
  request through the new active is answered.
- An agent pointed first at the standby is refused with ``NOT_LEADER`` naming the active and
  ends on it.
- SIGSTOP of the active past its lease, then SIGCONT: the agent is on the new active, the
  old one steps down to standby, and no engine is started or stopped (engine starts are
  counted by the engine's wrapper; the engine's pid is unchanged), the node ``ready``.

The kill-to-reconnected and kill-to-answered times are printed, not asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from berth.agent.leaders import LEADERS_FILE
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.protocol.errors import CloseCode
from berth.keys import load_or_create_pepper
from support.cluster_harness import (
    TINY_GGUF_BYTES,
    Agent,
    Cluster,
    clean_env,
    fake_engine_wrapper,
)
from support.processes import alive, wait_gone
from support.waiting import wait_for

pytestmark = pytest.mark.slow

LEASE_S = "2.0"
BOUND_S = 60.0
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def ha_agent_pair(tmp_path: Path) -> Iterator[tuple[Cluster, Cluster]]:
    """Leaders ``a`` (active) and ``b`` (standby) on one SQLite file, sharing the CA and the
    pepper; agents get the fake engine."""
    (tmp_path / "tiny.gguf").write_bytes(TINY_GGUF_BYTES)
    env = clean_env(
        {
            "BERTH_DATABASE_URL": f"sqlite:///{tmp_path / 'shared' / 'berth.db'}",
            "BERTH_LEADER_HA": "true",
            "BERTH_LEADER_LEASE_S": LEASE_S,
            "BERTH_LEADER_ONLY": "true",
            "BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(tmp_path)),
        }
    )
    a, b = Cluster(tmp_path / "a", env), Cluster(tmp_path / "b", env)
    CertificateAuthority.load_or_create(a.leader_home / "ca")
    load_or_create_pepper(a.leader_home / "key_pepper")
    b.leader_home.mkdir(parents=True)
    shutil.copytree(a.leader_home / "ca", b.leader_home / "ca")
    shutil.copy2(a.leader_home / "key_pepper", b.leader_home / "key_pepper")
    started: list[Cluster] = []
    try:
        for leader in (a, b):
            leader.start()
            started.append(leader)
        yield a, b
    finally:
        # A killed leader's agents go to a live one, whose close stops the deployments
        # first, then the agents, and kills any engine left in their journals.
        live = [leader for leader in started if alive(leader.leader_pid())]
        for leader in started:
            if leader not in live and live:
                live[0].agents.update(leader.agents)
                leader.agents.clear()
                leader.berth("daemon", "stop", check=False)
        for leader in live:
            leader.close()


def _cluster_url(leader: Cluster) -> str:
    return f"https://127.0.0.1:{leader.cluster_port}"


def _chat(leader: Cluster, key: str) -> httpx.Response:
    with leader.http(timeout_s=30.0) as http:
        return http.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}
        )


def _engine_pids(agent: Agent) -> dict[str, int]:
    journal = json.loads((agent.home / "agent-engines.json").read_text() or "{}")
    return {name: int(entry["pid"]) for name, entry in journal.items()}


def _connected_to(agent: Agent, leader: Cluster) -> bool:
    """Whether the agent's status file says its link to ``leader`` is up (the node's
    record is shared by the leaders, so it says nothing of which one the agent is on)."""
    try:
        status: dict[str, Any] = json.loads((agent.home / "agent-status.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(status["connected"]) and status["leader_url"] == _cluster_url(leader)


def test_the_agent_follows_the_lease_when_the_active_is_killed(
    ha_agent_pair: tuple[Cluster, Cluster],
) -> None:
    a, b = ha_agent_pair
    assert a.admin("GET", "/admin/leader")["role"] == "active"
    agent = a.add_agent("gpu1")
    deployment = a.deploy("tiny", a.root.parent / "tiny.gguf", agent)
    assert _chat(a, a.api_key).status_code == 200
    # Welcome listed both leaders; the agent keeps them.
    kept = json.loads((agent.home / LEADERS_FILE).read_text())
    assert sorted(kept["leaders"]) == sorted([_cluster_url(a), _cluster_url(b)])
    assert kept["current"] == _cluster_url(a) and _connected_to(agent, a)
    pids = _engine_pids(agent)
    assert len(pids) == 1 and all(alive(pid) for pid in pids.values())
    record_pid = a.deployment(deployment)["pid"]

    leader_pid = a.leader_pid()
    killed_at = time.monotonic()
    os.kill(leader_pid, signal.SIGKILL)
    assert wait_gone(leader_pid, 10.0)
    wait_for(lambda: _connected_to(agent, b), BOUND_S, "the agent to reach b",
             interval_s=0.05)  # fmt: skip
    reconnected_s = time.monotonic() - killed_at

    def answered() -> bool:
        try:
            return _chat(b, a.api_key).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answered, BOUND_S, "b to answer through the agent", interval_s=0.05)
    answered_s = time.monotonic() - killed_at
    print(f"kill -9 of the active: agent on the new active after {reconnected_s:.2f} s, "
          f"first answer through it after {answered_s:.2f} s (lease {LEASE_S} s)")  # fmt: skip

    assert b.admin("GET", "/admin/leader")["role"] == "active"
    assert _engine_pids(agent) == pids, "the engine was restarted, not re-attached"
    assert all(alive(pid) for pid in pids.values())
    now = b.deployment(deployment)
    assert (now["state"], now["pid"]) == ("ready", record_pid)
    assert agent.process is not None and agent.process.poll() is None
    assert json.loads((agent.home / LEADERS_FILE).read_text())["current"] == _cluster_url(b)


def test_an_agent_pointed_at_the_standby_is_sent_to_the_active(
    ha_agent_pair: tuple[Cluster, Cluster],
) -> None:
    a, b = ha_agent_pair
    agent = a.enroll("gpu2")
    # As if enrolled through b: it knows b alone.
    config = agent.home / "agent.yaml"
    config.write_text(config.read_text().replace(_cluster_url(a), _cluster_url(b)))
    (agent.home / LEADERS_FILE).unlink(missing_ok=True)
    a.start_agent(agent)  # waits until a has it ready

    log = (agent.home / "agent.out").read_text()
    assert f"code {int(CloseCode.NOT_LEADER)}: not leader" in log, log
    assert f"active={_cluster_url(a)}" in log
    kept = json.loads((agent.home / LEADERS_FILE).read_text())
    assert kept["current"] == _cluster_url(a)
    assert sorted(kept["leaders"]) == sorted([_cluster_url(a), _cluster_url(b)])
    assert agent.status(a.env)["state"] == "connected"


def test_an_active_stopped_past_its_lease_steps_down_and_starts_or_stops_no_engine(
    ha_agent_pair: tuple[Cluster, Cluster],
) -> None:
    a, b = ha_agent_pair
    # Every engine start, by either leader, leaves a line (the wrapper runs for each).
    starts = a.root.parent / "engine-starts"
    wrapper = a.root.parent / "bin" / "llama-server"
    shebang, rest = wrapper.read_text().split("\n", 1)
    wrapper.write_text(f"{shebang}\necho start >> '{starts}'\n{rest}")
    agent = a.add_agent("gpu3")
    deployment = a.deploy("tiny", a.root.parent / "tiny.gguf", agent)
    assert _chat(a, a.api_key).status_code == 200
    pids = _engine_pids(agent)
    assert len(pids) == 1 and starts.read_text().count("start") == 1

    leader_pid = a.leader_pid()
    os.kill(leader_pid, signal.SIGSTOP)  # past its lease: b takes over, the agent moves
    try:
        wait_for(lambda: _connected_to(agent, b), BOUND_S, "the agent to reach b",
                 interval_s=0.05)  # fmt: skip
        wait_for(lambda: _chat(b, a.api_key).status_code == 200, BOUND_S,
                 "b to answer through the agent")  # fmt: skip
    finally:
        os.kill(leader_pid, signal.SIGCONT)
    log_file = a.leader_home / "logs" / "daemon.log"
    wait_for(lambda: "standing by: the leader-only loops stopped" in log_file.read_text(),
             BOUND_S, "the old active to step down")  # fmt: skip
    time.sleep(3.0)  # a few of the old active's loop rounds, had they gone on
    assert alive(leader_pid), "the old active exited rather than standing by"
    role = a.admin("GET", "/admin/leader")
    assert (role["role"], role["active_address"]) == ("standby", b.base_url)
    lines = [line for line in log_file.read_text().splitlines() if "leadership:" in line]
    print("old active's leadership lines:", *lines[-4:], sep="\n  ")
    print(f"engine starts counted: {starts.read_text().count('start')}; pids {pids} now "
          f"{_engine_pids(agent)}")  # fmt: skip

    assert starts.read_text().count("start") == 1, "an engine was started again"
    assert _engine_pids(agent) == pids and all(alive(pid) for pid in pids.values())
    now = b.deployment(deployment)
    assert now["state"] == "ready"
    node = next(n for n in b.admin("GET", "/admin/nodes") if n["label"] == "gpu3")
    assert node["status"] == "ready"  # the old active did not mark it unreachable
    assert _connected_to(agent, b)
    assert _chat(b, a.api_key).status_code == 200


def test_the_new_active_says_ready_only_once_it_serves_the_agents_deployment(
    ha_agent_pair: tuple[Cluster, Cluster],
) -> None:
    """Issue 41: polled as a load balancer polls ``/readyz``, the new active's first 200
    comes once the agent's deployment is routed through it; the requests sent at once
    after it get no ``503 no_ready_deployment`` (a new active answered 200 and then 145 of
    them in 0.7 s)."""
    a, b = ha_agent_pair
    agent = a.add_agent("gpu1")
    a.deploy("tiny", a.root.parent / "tiny.gguf", agent)
    leader_pid = a.leader_pid()
    killed_at = time.monotonic()
    os.kill(leader_pid, signal.SIGKILL)
    assert wait_gone(leader_pid, 10.0)
    seen: list[str] = []
    with b.http(timeout_s=30.0) as http:

        def ready() -> bool:
            reply = http.get("/readyz")
            body = reply.json()
            said = f"{body['status']}: {body.get('detail')}"
            if reply.status_code != 200 and said not in seen:
                seen.append(said)
            return reply.status_code == 200

        wait_for(ready, BOUND_S, "b to say ready", interval_s=0.05)
        ready_s = time.monotonic() - killed_at
        replies = [
            http.post(
                "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {a.api_key}"}
            )
            for _ in range(20)
        ]
    print(f"kill -9 of the active: b's /readyz 200 after {ready_s:.2f} s; before it: {seen}")
    refused = [r.text for r in replies if r.status_code == 503]
    assert refused == [], refused
    assert [r.status_code for r in replies] == [200] * 20
