"""``/readyz`` means able to serve, and leaving is visible first (issue 41).

A leader says ready only once it leads, its ready table is loaded and the deployments the
store says are ready on agents are routed again, or the wait for their links
(``node_timeout_s``) has passed (:mod:`berth.daemon.link_wait`): a restarted leader with a
deployment on an agent, polled as a load balancer would, answers no
``503 no_ready_deployment`` once it first says 200.  A leader that stops first drains: 503
``draining`` for ``drain_s`` while ``/v1`` still answers, then its listeners close.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from berth.admin.status import RunState, readiness
from berth.daemon.link_wait import LinkWait
from berth.daemon.server import Leader
from berth.paths import BerthHome
from support.cluster_harness import Cluster, clean_env, started_cluster
from support.processes import alive, wait_gone
from support.waiting import EVENT_TIMEOUT_S, wait_for, wait_for_async
from test_leader_object import leader_settings, port_is_free, public_get


class Clock:
    """Monotonic seconds a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the wait for the agents' links (pure) ------------------------------------------------


def test_a_leader_with_nothing_on_agents_waits_for_nothing() -> None:
    wait = LinkWait({}, lambda _: False, wait_s=15.0)
    assert wait.done and wait.pending() is None


def test_the_wait_names_what_is_missing_until_every_deployment_is_routed() -> None:
    routed: set[str] = set()
    clock = Clock()
    wait = LinkWait(
        {"d-1": "gpu-a", "d-2": "gpu-a", "d-3": "gpu-b"}, routed.__contains__,
        wait_s=15.0, clock=clock,
    )  # fmt: skip
    assert wait.pending() == (
        "waiting for the links of nodes gpu-a, gpu-b (deployments d-1, d-2, d-3), at most 15 s more"
    )
    routed.update({"d-1", "d-2"})
    clock.now += 5.0
    missing = "waiting for the link of node gpu-b (deployment d-3), at most 10 s more"
    assert wait.pending() == missing
    routed.add("d-3")
    assert wait.pending() is None and wait.done


def test_an_agent_gone_for_good_delays_readiness_by_the_bound_only() -> None:
    routed: set[str] = set()
    clock = Clock()
    wait = LinkWait({"d-1": "gpu-a"}, routed.__contains__, wait_s=15.0, clock=clock)
    clock.now += 14.9
    assert wait.pending() is not None
    clock.now += 0.1
    assert wait.pending() is None
    assert wait.done  # and stays so: a later drop is the router's business
    assert wait.pending() is None


# -- /readyz's answer (pure) ---------------------------------------------------------------


class Serving:
    def __init__(self, pending: str | None) -> None:
        self._pending = pending

    def pending(self) -> str | None:
        return self._pending


def test_readyz_is_200_only_once_started_leading_and_waiting_for_nothing() -> None:
    run = RunState()
    assert readiness(run, None)[0] == 503  # not started
    run.ready = True
    status, body = readiness(run, None)
    assert (status, body.status, body.detail) == (503, "starting", None)  # not leading yet
    run.serving = Serving("waiting for the link of node gpu-a (deployment d-1), at most 9 s more")
    status, body = readiness(run, None)
    assert (status, body.status) == (503, "starting")
    assert body.detail is not None and "gpu-a" in body.detail
    run.serving = Serving(None)
    assert readiness(run, None)[0] == 200
    run.draining = True
    status, body = readiness(run, None)
    assert (status, body.status) == (503, "draining")


# -- the drain, in process -----------------------------------------------------------------


async def test_a_stopping_leader_answers_503_draining_while_v1_still_answers(
    tmp_path: Path,
) -> None:
    home = BerthHome(tmp_path / "leader")
    leader = Leader(home, leader_settings(home, leader_only=True, drain_s=600))
    await leader.start()
    port = leader.public_port
    transport = httpx.AsyncHTTPTransport(uds=str(home.socket_file))
    async with httpx.AsyncClient(transport=transport, base_url="http://berth") as api:
        created = await api.post("/admin/keys", json={"name": "lb"})
    assert created.status_code == 201, created.text
    secret = created.json()["secret"]
    assert (await public_get(home, port, "/readyz")).status_code == 200

    stopping = asyncio.create_task(leader.stop())
    try:
        draining = await wait_for_async(
            lambda: leader.graph.run.draining, EVENT_TIMEOUT_S, "the drain to begin"
        )
        assert draining
        ready = await public_get(home, port, "/readyz")
        print("/readyz while draining:", ready.status_code, ready.text)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        trust = ssl.create_default_context(cafile=str(home.ca_dir / "ca.pem"))
        async with httpx.AsyncClient(verify=trust, timeout=30) as client:
            served = await client.get(
                f"https://127.0.0.1:{port}/v1/models",
                headers={"Authorization": f"Bearer {secret}"},
            )
        assert served.status_code == 200, served.text
        assert not stopping.done() and not port_is_free(port)
    finally:
        leader.end_drain()  # as a second SIGTERM does
        await stopping
    assert port_is_free(port)


async def test_a_standby_or_a_leader_without_a_drain_closes_at_once(tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "leader")
    leader = Leader(home, leader_settings(home, leader_only=True, drain_s=0))
    await leader.start()
    run = leader.graph.run
    await leader.stop()
    assert not run.draining and not leader.started


# -- real processes: a restart with a deployment on an agent -------------------------------


def _no_ready(reply: httpx.Response) -> bool:
    return reply.status_code == 503 and "no_ready_deployment" in reply.text


@pytest.mark.slow
def test_a_restarted_leader_says_ready_only_once_its_agents_deployment_is_routed(
    tmp_path: Path,
) -> None:
    settings = {
        "BERTH_HEARTBEAT_INTERVAL_S": "1",
        # Far longer than the agent's redial: the wait ends because the link is back.
        "BERTH_NODE_TIMEOUT_S": "60",
        "BERTH_STOP_GRACE_S": "5",
    }
    with started_cluster(tmp_path, settings) as cluster:
        agent = cluster.add_agent("gpu-a")
        cluster.deploy("tiny-a", cluster.root / "tiny.gguf", agent)
        assert agent.process is not None
        # The agent is held still across the restart, so the new leader surely starts
        # without its link (a quick redial could otherwise beat the first /readyz).
        os.kill(agent.process.pid, signal.SIGSTOP)
        try:
            cluster.berth("daemon", "stop")
            cluster.berth("daemon", "start", "--public-port", str(cluster.public_port),
                          "--cluster-port", str(cluster.cluster_port))  # fmt: skip
            with cluster.http() as http:
                waiting = http.get("/readyz")
            print("/readyz with the agent still away:", waiting.status_code, waiting.text)
            assert waiting.status_code == 503
            assert waiting.json()["status"] == "starting"
            assert "link of node gpu-a" in waiting.json()["detail"]
        finally:
            os.kill(agent.process.pid, signal.SIGCONT)
        _first_ready_then_served(cluster, "tiny-a")


def _first_ready_then_served(cluster: Cluster, model: str) -> None:
    """Poll ``/readyz`` as a load balancer does until it first says 200, then ask for
    ``model`` at once, 20 times: none may be ``503 no_ready_deployment``."""
    details: list[str] = []
    began = time.monotonic()
    with cluster.http(timeout_s=30.0) as http:

        def ready() -> bool:
            reply = http.get("/readyz")
            if reply.status_code != 200:
                detail = reply.json().get("detail")
                if detail and detail not in details:
                    details.append(detail)
            return reply.status_code == 200

        wait_for(ready, 90.0, "the restarted leader to say ready", interval_s=0.05)
        print(f"/readyz 200 after {time.monotonic() - began:.2f} s; meanwhile: {details}")
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        replies = [http.post("/v1/chat/completions", json=body) for _ in range(20)]
    refused = [r.text for r in replies if _no_ready(r)]
    assert refused == [], refused
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    log = (cluster.leader_home / "logs" / "daemon.log").read_text()
    assert "readiness: waiting for the links of node(s) gpu-a (1 ready deployment(s))" in log


@pytest.mark.slow
def test_berth_daemon_stop_drains_visibly_before_the_listener_closes(tmp_path: Path) -> None:
    """A real daemon with ``drain_s`` 600: after ``berth daemon stop`` ``/readyz`` says 503
    ``draining`` while ``/v1`` answers; a second SIGTERM ends the drain, and the daemon
    exits."""
    # Not started_cluster: its close asks the leader for deployments, and this one is gone.
    cluster = Cluster(tmp_path, clean_env({"BERTH_DRAIN_S": "600"}))
    cluster.start()
    try:
        pid = cluster.leader_pid()
        stop = subprocess.Popen(
            [sys.executable, "-m", "berth", "--home", str(cluster.leader_home), "daemon", "stop"],
            env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            with cluster.http(timeout_s=30.0) as http:
                began = time.monotonic()
                wait_for(lambda: http.get("/readyz").status_code == 503, 60.0,
                         "the drain to show", interval_s=0.05)  # fmt: skip
                shown_s = time.monotonic() - began
                ready = http.get("/readyz")
                served = http.get("/v1/models")
            print(f"/readyz 503 {shown_s:.2f} s after the stop began: {ready.text}")
            assert ready.json()["status"] == "draining"
            assert served.status_code == 200, served.text
            assert stop.poll() is None and alive(pid)
        finally:
            os.kill(pid, signal.SIGTERM)  # the second: the drain ends at once
        out, _ = stop.communicate(timeout=60)
        assert stop.returncode == 0, out
        assert wait_gone(pid, 60.0)
        log = (cluster.leader_home / "logs" / "daemon.log").read_text()
        assert "berth leader draining: /readyz answers 503 for 600.0 s (drain_s)" in log
    finally:
        cluster.berth("daemon", "stop", check=False)


@pytest.mark.slow
def test_berth_daemon_stop_no_drain_closes_at_once(tmp_path: Path) -> None:
    """``berth daemon stop --no-drain`` on a leader with ``drain_s`` 600 sends the second
    SIGTERM itself: the daemon is gone well before the drain would have ended."""
    cluster = Cluster(tmp_path, clean_env({"BERTH_DRAIN_S": "600"}))
    cluster.start()
    try:
        pid = cluster.leader_pid()
        stop = cluster.berth("daemon", "stop", "--no-drain", "--timeout", "60", check=False)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "berth daemon stopped" in stop.stdout
        assert wait_gone(pid, 10.0)
    finally:
        cluster.berth("daemon", "stop", check=False)
