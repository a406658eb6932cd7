"""An agent whose clock runs a minute behind the leader's (Debian's ``faketime -f -60s``
around the real ``berth agent register`` and ``berth agent start``): its fresh certificate
is usable at once (notBefore is backdated), it serves a request through the tunnel, and it
renews on the leader's schedule (the renewal is timed by the leader's clock, which Welcome
tells it), not a minute late."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from berth.agent.renewal import read_certificate
from support.cluster_harness import URI_PATTERN, Agent, Cluster, started_cluster
from support.waiting import wait_for

#: How far behind the agent's clock runs.
SKEW = "-60s"

pytestmark = [pytest.mark.slow, pytest.mark.needs("faketime")]


def behind(*argv: str) -> list[str]:
    faketime = shutil.which("faketime")
    assert faketime is not None  # the needs mark checked it
    return [faketime, "-f", SKEW, *argv]


def test_an_agent_a_minute_behind_enrolls_serves_and_renews_on_time(tmp_path: Path) -> None:
    lifetime_s = 40.0  # renewed 26.7 s after issue by the leader's clock; 86.7 s by its own
    settings = {"BERTH_AGENT_CERT_LIFETIME_S": str(lifetime_s), "BERTH_HEARTBEAT_INTERVAL_S": "1"}
    with started_cluster(tmp_path, settings) as cluster:
        # The wrapper does what it says: the agent's clock is a minute behind ours.
        shown = subprocess.run(
            behind(sys.executable, "-c", "import time; print(time.time())"),
            capture_output=True, text=True, check=True, env=cluster.env,
        )  # fmt: skip
        assert -70 < float(shown.stdout) - time.time() < -50

        printed = cluster.berth("nodes", "enroll", "slow-clock").stdout
        uri = URI_PATTERN.search(printed)
        assert uri, printed
        home = cluster.root / "agent-slow-clock"
        home.mkdir()
        berth = [sys.executable, "-m", "berth", "--home", str(home)]
        subprocess.run(
            behind(*berth, "agent", "register", "--uri", uri.group(0)),
            capture_output=True, text=True, check=True, env=cluster.env, timeout=120,
        )  # fmt: skip
        first = read_certificate(home / "agent.crt")
        assert first is not None
        node_id = next(
            line.split(":", 1)[1].strip().strip("'\"")
            for line in (home / "agent.yaml").read_text().splitlines()
            if line.startswith("node_id:")
        )
        agent = Agent("slow-clock", home, node_id)
        cluster.agents[agent.label] = agent
        with (home / "agent.out").open("ab") as log:
            agent.process = subprocess.Popen(
                behind(*berth, "agent", "start", "--verbose"),
                stdout=log, stderr=subprocess.STDOUT, env=cluster.env, cwd=home,
                start_new_session=True,
            )  # fmt: skip
        try:
            serve_and_renew(cluster, agent, first.serial, first.not_after)
        finally:
            # faketime runs berth as its child: the agent is stopped through its group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.process.pid, signal.SIGTERM)
            agent.process.wait(timeout=30)


def serve_and_renew(cluster: Cluster, agent: Agent, serial: str, not_after: float) -> None:
    """The agent comes up, serves a chat completion through the tunnel, and renews its
    certificate (first ``serial``, valid until ``not_after``) before it expires."""
    cluster.wait_node(agent.node_id, "ready")

    cluster.deploy("tiny-slow", cluster.root / "tiny.gguf", agent)
    with cluster.openai() as client:
        answer = client.chat.completions.create(
            model="tiny-slow", messages=[{"role": "user", "content": "hi"}]
        )
    assert answer.choices[0].message.content

    def renewed() -> bool:
        facts = read_certificate(agent.cert)
        return facts is not None and facts.serial != serial

    # Due two thirds into the lifetime on the leader's clock; on the agent's own, a minute
    # later, after the certificate expired (and the leader closed the link).
    wait_for(renewed, not_after - time.time(), "the renewal before expiry", interval_s=0.2)
    assert cluster.node(agent.node_id)["status"] == "ready"
