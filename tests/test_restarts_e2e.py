"""The restart policy on real processes: a real leader daemon (the real CLI, its own home)
starting the fake llama-server as its engine, killed, stopped and crashing for real.

- ``kill -9`` of a ready engine, at the default settings, is answered again within 10 s:
  same deployment id, a new engine process, a completion through berth;
- an engine that served, then exits at once on every start, backs off as stated (each gap
  between restarts at least its backoff, so no busy loop), ends in ``crashloop``, and its
  log and the leader's hold a few lines per restart, not a flood;
- a SIGSTOPped engine is restarted after its failed health probes;
- ``--restart never`` keeps the old behaviour: failed, with why, and still in ``berth ps``;
- ``berth stop`` during a backoff wins: no engine is started again;
- an engine killed on an agent's host is restarted there (the remote link's path).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.berth_cli import Berth, running_daemon
from support.cluster_harness import TINY_GGUF_BYTES, Cluster, clean_env, fake_engine_wrapper
from support.fake_llama_server import FAIL_LINE
from support.processes import alive, wait_gone
from support.waiting import wait_for

pytestmark = pytest.mark.slow

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
#: Short probe and backoff settings, so a hung or crashing engine is handled in a second.
SHORT = {
    "BERTH_PROBE_INTERVAL_S": "0.3",
    "BERTH_PROBE_TIMEOUT_S": "0.2",
    "BERTH_PROBES_TO_FAIL": "2",
    "BERTH_RESTART_BACKOFF_S": "0.2",
    "BERTH_STOP_GRACE_S": "1",
}


def _leader(root: Path, settings: dict[str, str]) -> Iterator[tuple[Berth, int]]:
    (root / "tiny.gguf").write_bytes(TINY_GGUF_BYTES)
    env = clean_env({"BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(root)), **settings})
    berth = Berth(root / "home", env=env, cwd=root)
    with running_daemon(berth) as port:
        berth.add_model("tiny", root / "tiny.gguf")
        yield berth, port


@pytest.fixture(scope="module")
def default_leader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Berth, int]]:
    yield from _leader(tmp_path_factory.mktemp("restart-defaults"), {})


@pytest.fixture(scope="module")
def short_leader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Berth, int]]:
    yield from _leader(tmp_path_factory.mktemp("restart-short"), SHORT)


def _run(berth: Berth, *args: str) -> dict[str, Any]:
    berth("run", "tiny", *args)
    ready = [d for d in berth.deployments() if d["state"] == "ready"]
    newest: dict[str, Any] = max(ready, key=lambda d: d["created_at"])
    return newest


def _deployment(berth: Berth, deployment_id: str) -> dict[str, Any]:
    record: dict[str, Any] = berth.admin("GET", f"/admin/deployments/{deployment_id}")
    return record


def _socket(berth: Berth) -> httpx.Client:
    transport = httpx.HTTPTransport(uds=str(berth.home / "berth.sock"))
    return httpx.Client(transport=transport, base_url="http://berth", timeout=5.0)


def _chat(berth: Berth) -> bool:
    """Whether a completion through berth (its Unix socket) is answered now."""
    try:
        with _socket(berth) as client:
            return client.post("/v1/chat/completions", json=CHAT).status_code == 200
    except httpx.HTTPError:
        return False


def _restarts(berth: Berth, deployment_id: str) -> list[dict[str, Any]]:
    audit = berth.home / "logs" / "audit.log"
    if not audit.exists():
        return []
    events = [json.loads(line) for line in audit.read_text().splitlines() if line.strip()]
    return [
        e
        for e in events
        if e.get("event") == "deployment_restarted" and e.get("deployment") == deployment_id
    ]


def _stop(berth: Berth, deployment_id: str) -> None:
    berth("stop", deployment_id, check=False)


def test_kill_9_of_a_ready_engine_is_answered_again_within_10_s(
    default_leader: tuple[Berth, int],
) -> None:
    berth, _port = default_leader
    deployment = _run(berth)
    first_pid = deployment["pid"]
    try:
        os.kill(first_pid, signal.SIGKILL)
        assert wait_gone(first_pid, 10.0)
        # Found by the 5 s health watch, restarted after 1 s, answering again.
        wait_for(
            lambda: (
                _deployment(berth, deployment["id"])["state"] == "ready"
                and _deployment(berth, deployment["id"])["pid"] != first_pid
                and _chat(berth)
            ),
            10.0,
            "the killed engine to be restarted and answer",
        )
        restarted = _deployment(berth, deployment["id"])
        assert restarted["restart_count"] == 1
        assert restarted["last_exit"] == "killed by SIGKILL"
        assert alive(restarted["pid"])
        [event] = _restarts(berth, deployment["id"])
        assert (event["reason"], event["restart_count"]) == ("signal", 1)
        with _socket(berth) as client:
            metrics = client.get("/metrics").text
        line = next(
            (
                row
                for row in metrics.splitlines()
                if row.startswith("berth_deployment_restarts_total{") and deployment["id"] in row
            ),
            "",
        )
        assert 'reason="signal"' in line and line.endswith(" 1.0"), line
        listed = berth("ps").stdout
        assert "last exit: killed by SIGKILL (1 restart)" in listed
    finally:
        _stop(berth, deployment["id"])


def test_an_engine_that_exits_at_once_backs_off_into_crashloop(
    short_leader: tuple[Berth, int], tmp_path: Path
) -> None:
    berth, _port = short_leader
    flag = tmp_path / "fail-from-now-on"
    deployment = _run(berth, "-x", "--x-fail-start-if", "-x", str(flag))
    deployment_id = deployment["id"]
    try:
        flag.touch()  # every start from now on exits 1 at once
        os.kill(deployment["pid"], signal.SIGKILL)
        looping = wait_for(
            lambda: (d := _deployment(berth, deployment_id))["state"] == "crashloop" and d,
            30.0,
            "the crashing deployment to be in crashloop",
        )
        # crashloop_restarts (3) restarts in a row that never became ready
        assert looping["restart_count"] >= 3
        assert looping["last_exit"].startswith("start failed")
        assert FAIL_LINE in (looping["last_exit_log"] or "")
        events = _restarts(berth, deployment_id)
        moments = [datetime.fromisoformat(e["at"]).timestamp() for e in events]
        gaps = [later - earlier for earlier, later in itertools.pairwise(moments)]
        # Restart n waits 0.2 s * 2**(n-1) after the start before it failed: the gap between
        # restarts n and n+1 is at least the backoff before n+1 (no busy loop).
        for n, gap in enumerate(gaps, start=1):
            assert gap >= 0.2 * 2**n - 0.05, (n, gaps)
        # `berth ps` while it waits in crashloop (each wait longer than the last, so a slow
        # CLI catches one of them).
        wait_for(
            lambda: f"{deployment_id} crashloop: its engine start failed" in berth("ps").stdout,
            30.0,
            "berth ps to show the crashloop",
        )
    finally:
        _stop(berth, deployment_id)
    # Not flooded: one failure line per failed start in the engine's log, a few leader
    # lines per restart.
    engine_log = berth.home / "logs" / f"engine-{deployment_id}.log"
    failures = engine_log.read_text().count(FAIL_LINE)
    restarts = _deployment(berth, deployment_id)["restart_count"]
    assert failures <= restarts
    daemon_log = (berth.home / "logs" / "daemon.log").read_text()
    assert daemon_log.count(deployment_id) <= 12 * (restarts + 2)
    assert _deployment(berth, deployment_id)["state"] == "stopped"


def test_a_sigstopped_engine_is_restarted_after_its_failed_probes(
    short_leader: tuple[Berth, int],
) -> None:
    berth, _port = short_leader
    deployment = _run(berth)
    hung_pid = deployment["pid"]
    try:
        os.kill(hung_pid, signal.SIGSTOP)
        restarted = wait_for(
            lambda: (
                (d := _deployment(berth, deployment["id"]))["state"] == "ready"
                and d["pid"] != hung_pid
                and d
            ),
            30.0,
            "the hung engine to be restarted",
        )
        assert wait_gone(hung_pid, 10.0)  # stopped for good (SIGKILL reaches it stopped)
        assert restarted["restart_count"] == 1
        assert restarted["last_exit"] == "stopped after 2 failed health probes"
        wait_for(lambda: _chat(berth), 10.0, "the restarted engine to answer")
        [event] = _restarts(berth, deployment["id"])
        assert event["reason"] == "unhealthy"
    finally:
        with_pid = _deployment(berth, deployment["id"])["pid"]
        if with_pid and alive(with_pid):
            os.kill(with_pid, signal.SIGCONT)
        _stop(berth, deployment["id"])


def test_restart_never_keeps_failed_and_listed(short_leader: tuple[Berth, int]) -> None:
    berth, _port = short_leader
    deployment = _run(berth, "--restart", "never")
    assert deployment["restart_policy"] == "never"
    os.kill(deployment["pid"], signal.SIGKILL)
    failed = wait_for(
        lambda: (d := _deployment(berth, deployment["id"]))["state"] == "failed" and d,
        30.0,
        "the killed engine's deployment to fail",
    )
    assert failed["restart_count"] == 0
    assert "killed by SIGKILL" in failed["failure_reason"]
    assert "restart policy never" in failed["failure_reason"]
    assert _restarts(berth, deployment["id"]) == []
    # A deployment never disappears silently: `berth ps` still lists it, with why.
    listed = berth("ps").stdout
    assert f"{deployment['id']} failed: engine exited unexpectedly (killed by SIGKILL)" in listed
    assert deployment["id"] in {d["id"] for d in berth.json("ps")}


def test_a_stop_during_the_backoff_wins(short_leader: tuple[Berth, int], tmp_path: Path) -> None:
    berth, _port = short_leader
    flag = tmp_path / "fail-from-now-on"
    deployment = _run(berth, "-x", "--x-fail-start-if", "-x", str(flag))
    flag.touch()
    os.kill(deployment["pid"], signal.SIGKILL)
    wait_for(
        lambda: _deployment(berth, deployment["id"])["state"] == "crashloop",
        30.0,
        "the deployment to be waiting in crashloop",
    )
    stopped = berth("stop", deployment["id"]).stdout
    assert f"{deployment['id']} stopped" in stopped
    count = _deployment(berth, deployment["id"])["restart_count"]
    # Its next restart was due 0.2 s * 2**count after its last failed start: past that
    # moment nothing was started again.
    time.sleep(0.2 * 2**count + 1.0)
    record = _deployment(berth, deployment["id"])
    assert (record["state"], record["restart_count"]) == ("stopped", count)
    assert len(_restarts(berth, deployment["id"])) == count


@pytest.fixture(scope="module")
def supervised_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("restart-cluster")
    (root / "tiny.gguf").write_bytes(TINY_GGUF_BYTES)
    env = clean_env({"BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(root)), **SHORT})
    supervised_cluster = Cluster(root, env)
    supervised_cluster.start()
    try:
        yield supervised_cluster
    finally:
        supervised_cluster.close()


def test_an_engine_killed_on_an_agent_is_restarted_there(supervised_cluster: Cluster) -> None:
    """The same restart through a remote node's link: the agent reports the signal in its
    probe answer, and the leader starts the engine again on that node."""
    agent = supervised_cluster.add_agent("gpu-a")
    deployment_id = supervised_cluster.deploy("tiny", supervised_cluster.root / "tiny.gguf", agent)
    first = supervised_cluster.deployment(deployment_id)
    assert first["node_id"] == agent.node_id
    os.kill(first["pid"], signal.SIGKILL)
    again = wait_for(
        lambda: (
            (d := supervised_cluster.deployment(deployment_id))["state"] == "ready"
            and d["pid"] != first["pid"]
            and d
        ),
        30.0,
        "the agent's engine to be restarted",
    )
    assert (again["node_id"], again["restart_count"]) == (agent.node_id, 1)
    assert again["last_exit"] == "killed by SIGKILL"
    assert alive(again["pid"])
