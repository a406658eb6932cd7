"""An engine killed under load (issue 37): ``kill -9`` of a ready engine while three clients
send chat completions steadily, on a real leader daemon with the fake engine, on the
leader's own host and on an agent's.

Its exit is known at once (a pidfd on the host that started it; an agent reports it over
its link in a heartbeat sent at once), so the deployment leaves the ready table before the
next request is routed to it, and the supervisor restarts it.  No client gets a 502: every
answer is a 200 (from the other replica, when there is one, retried before the first byte)
or a 503 with ``Retry-After``.  The time from the kill to the deployment's leaving the table
is read from the logs' timestamps and printed (docs/ha.md records it), not asserted: the
order of events is what the test asserts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from support.cluster_harness import Agent, Cluster, started_cluster
from support.waiting import wait_for

pytestmark = pytest.mark.slow

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CLIENTS = 3
#: 200s after the restart that end the load.
AFTER_RESTART = 30
BOUND_S = 60.0
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class Load:
    """Clients sending one request after another: every answer's time, status and
    ``Retry-After``."""

    leader: Cluster
    answers: list[tuple[float, int, str | None]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._client) for _ in range(CLIENTS)]
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _client(self) -> None:
        with self.leader.http(timeout_s=30.0) as http:
            while not self.stop.is_set():
                try:
                    reply = http.post("/v1/chat/completions", json=CHAT)
                except httpx.HTTPError as exc:  # the leader never breaks a connection
                    self.failures.append(repr(exc))
                    continue
                self.answers.append(
                    (time.time(), reply.status_code, reply.headers.get("retry-after"))
                )

    def oks_after(self, moment: float) -> int:
        return sum(1 for at, status, _ in self.answers if at > moment and status == 200)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with started_cluster(tmp_path) as leader:
        yield leader


def _logged_at(path: Path, needle: str, after: float) -> float:
    """The time (epoch seconds) of the first line of the log at ``path`` holding ``needle``
    written after ``after``; ``AssertionError`` when there is none."""
    for line in path.read_text().splitlines():
        found = _STAMP.match(line)
        if found and needle in line:
            at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= after - 0.001:
                return at
    raise AssertionError(f"no line with {needle!r} in {path}")


def _kill_under_load(cluster: Cluster, deployment: str, pid: int) -> tuple[Load, float]:
    """Kill ``pid`` (the deployment's engine) while the clients send, and go on until the
    restarted engine answered :data:`AFTER_RESTART` requests; the load and the kill's time."""
    load = Load(cluster)
    load.start()
    try:
        wait_for(lambda: load.oks_after(0) >= 20, BOUND_S, "the load to get going")
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)

        def restarted() -> bool:
            record = cluster.deployment(deployment)
            return record["state"] == "ready" and record["pid"] not in (None, pid)

        wait_for(restarted, BOUND_S, "the supervisor to restart the engine", interval_s=0.1)
        ready_at = time.time()
        wait_for(lambda: load.oks_after(ready_at) >= AFTER_RESTART, BOUND_S,
                 "answers from the restarted engine")  # fmt: skip
    finally:
        load.finish()
    return load, killed_at


def _judge(load: Load, killed_at: float, replicas: int, log: Path, deployment: str) -> Counter[int]:
    """Every answer a 200 or a 503 with ``Retry-After``; a 502 only for a request whose engine
    had begun its answer (its head read) when it was killed, which the leader logs as
    ``failed while answering``: retry is before the engine's first byte, and a kill that lands
    inside a 4-token answer is rare but not impossible (seen once, 8 December, full run)."""
    statuses = Counter(status for _, status, _ in load.answers)
    print(f"{len(load.answers)} answers around the kill: {dict(statuses)}")
    assert not load.failures, load.failures
    begun = log.read_text().count(f"the engine of deployment {deployment} failed while answering")
    assert statuses[502] <= begun, (
        f"an engine's exit before its answer reached a client: {statuses}"
    )
    assert set(statuses) <= {200, 502, 503}, statuses
    assert all(retry is not None and int(retry) >= 1
               for _, status, retry in load.answers if status == 503)  # fmt: skip
    if replicas > 1:  # the other replica took every request, retried before the first byte
        assert statuses[503] == 0, statuses
    return statuses


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_local_engine_killed_under_load_leaves_routing_at_once(
    cluster: Cluster, replicas: int
) -> None:
    deployment = cluster.deploy("tiny", cluster.root / "tiny.gguf", None)
    for _ in range(replicas - 1):
        cluster.berth("run", "tiny", "--engine", "llamacpp")
    pid = cluster.deployment(deployment)["pid"]
    load, killed_at = _kill_under_load(cluster, deployment, pid)

    log = cluster.leader_home / "logs" / "daemon.log"
    _judge(load, killed_at, replicas, log, deployment)
    heard_at = _logged_at(log, f"the engine of deployment {deployment} ended by itself", killed_at)
    out_at = _logged_at(log, f"deployment {deployment}: engine exited unexpectedly", killed_at)
    assert "killed by SIGKILL" in log.read_text()
    print(
        f"local engine, {replicas} replica(s): exit heard {1000 * (heard_at - killed_at):.0f} ms "
        f"after the kill, out of the ready table {1000 * (out_at - killed_at):.0f} ms after it"
    )
    record = cluster.deployment(deployment)
    assert record["restart_count"] == 1 and record["state"] == "ready"


def test_an_agents_engine_killed_under_load_is_reported_over_the_link(
    cluster: Cluster,
) -> None:
    agent: Agent = cluster.add_agent("gpu1")
    deployment = cluster.deploy("tiny", cluster.root / "tiny.gguf", agent)
    journal = json.loads((agent.home / "agent-engines.json").read_text())
    pid = int(journal[deployment]["pid"])
    load, killed_at = _kill_under_load(cluster, deployment, pid)

    _judge(load, killed_at, 1, cluster.leader_home / "logs" / "daemon.log", deployment)
    agent_log = agent.home / "logs" / "agent.log"
    heard_at = _logged_at(agent_log, f"the engine of deployment {deployment} ended by itself",
                          killed_at)  # fmt: skip
    told_at = _logged_at(agent_log, "ended by itself; telling the leader", killed_at)
    log = cluster.leader_home / "logs" / "daemon.log"
    out_at = _logged_at(log, f"deployment {deployment}: engine exited unexpectedly", killed_at)
    assert "engine exited unexpectedly (killed by SIGKILL)" in log.read_text()
    print(
        f"agent's engine: exit heard on the agent {1000 * (heard_at - killed_at):.0f} ms after "
        f"the kill, reported {1000 * (told_at - killed_at):.0f} ms, out of the leader's "
        f"ready table {1000 * (out_at - killed_at):.0f} ms after it"
    )
    assert cluster.deployment(deployment)["restart_count"] == 1
