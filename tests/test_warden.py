"""Orphaned engines: the warden an agent (or the leader) leaves behind stops the engines it
ran once it has been gone for ``orphan_grace_s``; an owner back within the grace takes them
back.

The decision is tested as a pure function; the owner lock and the warden's loop in this
process against a real engine-like process; the whole story with a real leader, real agents
and the stand-in engine (slow).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from berth.agent.journal import EngineJournal, JournalEntry
from berth.agent.owner import JournalOwnership, read_warden_pid
from berth.agent.warden import (
    NothingToGuard,
    StopOrphans,
    Warden,
    WardenConfig,
    Watch,
    decide,
    poll_interval_s,
    running_engines,
    stop_orphans,
)
from berth.errors import ConflictError
from berth.paths import BerthHome
from berth.runtime.docker.api import (
    ContainerEnded,
    ContainerInfo,
    ContainerState,
    EventStream,
    PortBinding,
)
from berth.runtime.docker.spec import DEPLOYMENT_LABEL, HOME_LABEL, NODE_LABEL
from berth.runtime.engines import find_free_port
from support.cluster_harness import (
    TINY_GGUF_BYTES,
    Agent,
    Cluster,
    clean_env,
    fake_engine_wrapper,
    started_cluster,
)
from support.processes import alive
from support.waiting import EVENT_TIMEOUT_S, wait_for

# -- the decision ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("owner_running", "engines", "gone_since", "now", "grace_s", "expected"),
    [
        # The owner runs: watch, and forget any earlier absence.
        (True, 2, None, 100.0, 600.0, Watch(None, "the agent runs")),
        (
            True,
            2,
            50.0,
            100.0,
            600.0,
            Watch(None, "the agent is back after 50.0 s: its engines are its own again"),
        ),
        # Gone, first seen now: the grace starts.
        (False, 2, None, 100.0, 600.0, Watch(100.0, "")),
        # Gone for less than the grace: keep waiting, from when it was first seen gone.
        (False, 2, 100.0, 699.0, 600.0, Watch(100.0, "")),
        # Gone for the grace: stop.
        (False, 2, 100.0, 700.0, 600.0, StopOrphans("")),
        (False, 1, 100.0, 103.5, 2.0, StopOrphans("")),
        # Gone and nothing of its journal runs: nothing to guard.
        (False, 0, None, 100.0, 600.0, NothingToGuard("")),
        (False, 0, 100.0, 900.0, 600.0, NothingToGuard("")),
        # orphan_grace_s 0: engines are never stopped.
        (False, 2, 100.0, 10_000.0, 0.0, Watch(100.0, "")),
    ],
)
def test_decide(
    owner_running: bool,
    engines: int,
    gone_since: float | None,
    now: float,
    grace_s: float,
    expected: Watch | StopOrphans | NothingToGuard,
) -> None:
    verdict = decide(
        owner_running=owner_running,
        engines_running=engines,
        gone_since=gone_since,
        now=now,
        grace_s=grace_s,
    )
    assert type(verdict) is type(expected)
    if isinstance(expected, Watch):
        assert isinstance(verdict, Watch)
        assert verdict.gone_since == expected.gone_since
        if expected.reason:
            assert verdict.reason == expected.reason


def test_the_reasons_say_what_happens_and_when() -> None:
    waiting = decide(owner_running=False, engines_running=2, gone_since=100.0, now=160.0,
                     grace_s=600.0, owner="leader")  # fmt: skip
    assert waiting.reason == (
        "the leader is gone: its 2 engine(s) are stopped in 540.0 s unless it comes back"
    )
    stopping = decide(owner_running=False, engines_running=1, gone_since=100.0, now=700.0,
                      grace_s=600.0)  # fmt: skip
    assert stopping.reason == (
        "the agent has been gone for 600.0 s (orphan_grace_s 600): stopping its 1 engine(s)"
    )


@pytest.mark.parametrize(("grace_s", "poll_s"), [(600.0, 1.0), (2.0, 0.5), (0.1, 0.1)])
def test_a_short_grace_is_looked_at_more_often(grace_s: float, poll_s: float) -> None:
    assert poll_interval_s(grace_s) == poll_s


def test_the_config_round_trips_through_its_command_line(tmp_path: Path) -> None:
    config = WardenConfig(tmp_path, "leader", 2.5, 10.0, "proc", "local", "unix:///x.sock")
    argv = config.argv()
    assert argv[:3] == [sys.executable, "-m", "berth.agent.warden"]
    assert WardenConfig.from_argv(argv[3:]) == config


# -- the owner lock and the watch loop, in this process ---------------------------------------


@pytest.fixture
def warden_engine() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A process whose command line carries ``--port P`` (how a pid is recognised as an
    engine), in a session of its own like an engine; killed at the end."""
    port = find_free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "--port", str(port)],
        start_new_session=True,
    )
    wait_for(lambda: running_engines({"d": JournalEntry(process.pid, port, "/health")}),
             EVENT_TIMEOUT_S, "the process to run")  # fmt: skip
    yield process, port
    if process.poll() is None:
        process.kill()
    process.wait()


def _config(home: BerthHome, grace_s: float) -> WardenConfig:
    home.ensure()
    return WardenConfig(home.root, "agent", grace_s, 1.0, "proc", "n-1", "unix:///nowhere.sock")


def test_an_owner_holds_the_lock_until_it_lets_it_go(home: BerthHome) -> None:
    files = home.warden_files("agent")
    first = JournalOwnership(files)
    first.claim(timeout_s=1.0)
    with pytest.raises(ConflictError, match=r"agent\.lock is held by another process"):
        JournalOwnership(files).claim(timeout_s=0.2)
    first.release()
    second = JournalOwnership(files)
    second.claim(timeout_s=1.0)
    second.release()


def test_the_warden_keeps_the_engines_of_a_running_owner_and_stops_them_once_it_is_gone(
    home: BerthHome, warden_engine: tuple[subprocess.Popen[bytes], int]
) -> None:
    process, port = warden_engine
    config = _config(home, grace_s=0.3)
    EngineJournal(config.files.journal).save({"d-1": JournalEntry(process.pid, port, "/health")})
    ownership = JournalOwnership(config.files)
    ownership.claim(timeout_s=1.0)
    looks = 0
    released = threading.Event()

    def sleep(seconds: float) -> None:
        nonlocal looks
        looks += 1
        if looks == 5:  # the owner ran for five looks, then it is gone
            assert process.poll() is None
            ownership.release()
            released.set()
        threading.Event().wait(seconds)

    assert Warden(config, sleep=sleep).run() == 0
    assert released.is_set()
    assert process.wait(timeout=EVENT_TIMEOUT_S) == -signal.SIGTERM
    assert EngineJournal(config.files.journal).load() == {}


def test_the_warden_exits_when_nothing_of_the_journal_runs(home: BerthHome) -> None:
    config = _config(home, grace_s=60.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    EngineJournal(config.files.journal).save({"d-1": JournalEntry(dead.pid, 1234, "/health")})
    assert Warden(config, sleep=lambda _s: None).run() == 0  # no owner, no engine: at once


def test_a_new_owner_replaces_the_warden_and_grace_0_starts_none(home: BerthHome) -> None:
    config = _config(home, grace_s=60.0)
    ownership = JournalOwnership(config.files)
    ownership.claim(timeout_s=1.0)
    first = ownership.replace_warden(config)
    assert first is not None and alive(first)
    second = ownership.replace_warden(config)
    assert second is not None and second != first
    assert wait_for(lambda: not alive(first), EVENT_TIMEOUT_S, "the earlier warden to exit")
    found = read_warden_pid(config.files.pid_file)
    assert found is not None and found.pid == second
    assert ownership.replace_warden(None) is None  # orphan_grace_s 0 starts none ...
    assert wait_for(lambda: not alive(second), EVENT_TIMEOUT_S, "the warden to exit")
    assert wait_for(lambda: not config.files.pid_file.exists(), EVENT_TIMEOUT_S, "no pid file")
    ownership.release()
    log = config.files.log.read_text()
    assert "watching the agent's engines (agent-engines.json, orphan_grace_s 60)" in log
    assert "replaced by a newer warden (SIGTERM): exiting" in log


def test_a_malformed_journal_stops_nothing(home: BerthHome) -> None:
    config = _config(home, grace_s=0.1)
    config.files.journal.write_bytes(b"{not json")
    assert Warden(config, sleep=lambda _s: None).run() == 1


class OneContainerDocker:
    """A Docker engine in memory (the ``DockerApi`` calls taking back and stopping a
    container use) holding the running container ``info``."""

    def __init__(self, info: ContainerInfo) -> None:
        self.containers = {info.id: info}
        self.stopped: list[str] = []
        self.removed: list[str] = []

    def list_containers(self, labels: Sequence[str]) -> list[str]:
        def carries(info: ContainerInfo, label: str) -> bool:
            key, _, value = label.partition("=")
            return key in info.labels and (not value or info.labels[key] == value)

        return [i for i, c in self.containers.items() if all(carries(c, x) for x in labels)]

    def inspect_container(self, container: str) -> ContainerInfo | None:
        return self.containers.get(container)

    def follow_logs(self, container_id: str, *, since: float | None = None) -> Iterator[bytes]:
        return iter(())

    def container_ends(self, labels: Sequence[str]) -> EventStream:
        """An events stream that reports no end (the warden stops its containers on
        purpose) and ends when closed."""
        closed = threading.Event()

        class Quiet:
            def __iter__(self) -> Iterator[ContainerEnded]:
                closed.wait()
                yield from ()

            def close(self) -> None:
                closed.set()

        return Quiet()

    def stop_container(self, container_id: str, timeout_s: int) -> None:
        self.stopped.append(container_id)
        info = self.containers[container_id]
        self.containers[container_id] = replace(info, state=ContainerState(running=False))

    def remove_container(self, container_id: str) -> None:
        self.removed.append(container_id)
        del self.containers[container_id]

    def close(self) -> None:
        pass


async def test_the_warden_stops_process_engines_and_the_containers_of_its_journal(
    home: BerthHome, warden_engine: tuple[subprocess.Popen[bytes], int]
) -> None:
    process, port = warden_engine
    config = _config(home, grace_s=1.0)
    labels = {HOME_LABEL: str(home.root), NODE_LABEL: "n-1", DEPLOYMENT_LABEL: "d-2"}
    container = ContainerInfo("c0ffee" * 4, "berth-d-2", labels, ContainerState(True, pid=4242),
                              ports={"8080/tcp": (PortBinding("127.0.0.1", 45678),)})  # fmt: skip
    docker = OneContainerDocker(container)
    EngineJournal(config.files.journal).save({
        "d-1": JournalEntry(process.pid, port, "/health"),
        "d-2": JournalEntry(4242, 45678, "/health", "docker"),
    })  # fmt: skip

    stopped = await stop_orphans(config, lambda _host: docker)  # type: ignore[arg-type,return-value]

    assert sorted(stopped) == ["d-1", "d-2"]
    assert process.wait(timeout=EVENT_TIMEOUT_S) == -signal.SIGTERM
    assert docker.stopped == docker.removed == [container.id]
    assert EngineJournal(config.files.journal).load() == {}


# -- a real leader and real agents ----------------------------------------------------------


def _engine_of(agent_home: Path, deployment: str) -> int:
    journal = json.loads((agent_home / "agent-engines.json").read_text())
    return int(journal[deployment]["pid"])


def _wardens_of(home: Path) -> list[int]:
    """Warden processes started for ``home`` (found by their command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            wanted = b"berth.agent.warden" in argv and str(home).encode() in argv
            if wanted and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _kill(agent: Agent) -> None:
    assert agent.process is not None
    agent.process.send_signal(signal.SIGKILL)
    agent.process.wait()
    agent.process = None


@pytest.fixture(scope="module")
def warden_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    settings = {"BERTH_STOP_GRACE_S": "2", "BERTH_HEARTBEAT_INTERVAL_S": "1",
                "BERTH_NODE_TIMEOUT_S": "6"}  # fmt: skip
    with started_cluster(tmp_path_factory.mktemp("orphans"), settings) as warden_cluster:
        yield warden_cluster


@pytest.mark.slow
def test_an_agent_killed_for_good_leaves_no_engine_after_the_grace(warden_cluster: Cluster) -> None:
    agent = warden_cluster.add_agent("gone", env={"BERTH_ORPHAN_GRACE_S": "2"})
    deployment = warden_cluster.deploy("tiny-gone", warden_cluster.root / "tiny.gguf", agent)
    engine = _engine_of(agent.home, deployment)
    [warden] = _wardens_of(agent.home)

    _kill(agent)

    wait_for(lambda: not alive(engine), EVENT_TIMEOUT_S, f"engine pid {engine} to be stopped")
    wait_for(lambda: not alive(warden), EVENT_TIMEOUT_S, "the warden to exit")  # after its log
    assert json.loads((agent.home / "agent-engines.json").read_text()) == {}
    log = (agent.home / "logs" / "warden-agent.log").read_text()
    assert "the agent has been gone for" in log
    assert f"stopped engine {deployment} (pid {engine}, port" in log
    assert not (agent.home / "warden-agent.pid").exists()


@pytest.mark.slow
def test_an_agent_back_within_the_grace_takes_its_engine_back(warden_cluster: Cluster) -> None:
    agent = warden_cluster.add_agent("back", env={"BERTH_ORPHAN_GRACE_S": "120"})
    deployment = warden_cluster.deploy("tiny-back", warden_cluster.root / "tiny.gguf", agent)
    engine = _engine_of(agent.home, deployment)
    [first_warden] = _wardens_of(agent.home)

    _kill(agent)
    warden_cluster.wait_node(agent.node_id, "unreachable")
    warden_cluster.start_agent(agent)

    wait_for(lambda: not alive(first_warden), EVENT_TIMEOUT_S, "the first warden to go")
    assert len(_wardens_of(agent.home)) == 1  # the new agent's own
    assert alive(engine) and _engine_of(agent.home, deployment) == engine
    with warden_cluster.http() as http:
        answer = wait_for(
            lambda: (r := http.post("/v1/chat/completions", json={
                "model": "tiny-back", "messages": [{"role": "user", "content": "hi"}]})
            ).status_code == 200 and r,
            EVENT_TIMEOUT_S, "the deployment to be served again",
        )  # fmt: skip
    assert answer.json()["choices"]
    assert warden_cluster.deployment(deployment)["state"] == "ready"


@pytest.mark.slow
def test_orphan_grace_0_leaves_engines_running(warden_cluster: Cluster) -> None:
    agent = warden_cluster.add_agent("kept", env={"BERTH_ORPHAN_GRACE_S": "0"})
    deployment = warden_cluster.deploy("tiny-kept", warden_cluster.root / "tiny.gguf", agent)
    engine = _engine_of(agent.home, deployment)
    assert _wardens_of(agent.home) == []  # nothing that could stop it

    _kill(agent)
    time.sleep(3.0)  # a bounded look: longer than the 2 s grace of the first test's agent

    assert alive(engine)
    assert _wardens_of(agent.home) == []
    os.killpg(engine, signal.SIGKILL)  # the harness stops only what the leader still reaches


@pytest.mark.slow
def test_a_leader_killed_for_good_leaves_no_engine_of_its_own(tmp_path: Path) -> None:
    settings = {"BERTH_ORPHAN_GRACE_S": "2", "BERTH_STOP_GRACE_S": "2",
                "BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(tmp_path))}  # fmt: skip
    (tmp_path / "tiny.gguf").write_bytes(TINY_GGUF_BYTES)
    leader = Cluster(tmp_path, clean_env(settings))
    leader.start()
    engine = 0
    try:
        deployment = leader.deploy("tiny-local", tmp_path / "tiny.gguf", None)
        journal = json.loads((leader.leader_home / "local-engines.json").read_text())
        engine = int(journal[deployment]["pid"])

        os.kill(leader.leader_pid(), signal.SIGKILL)

        wait_for(lambda: not alive(engine), EVENT_TIMEOUT_S, f"engine pid {engine} to be stopped")
        log = leader.leader_home / "logs" / "warden-leader.log"
        wait_for(lambda: f"stopped engine {deployment} (pid {engine}" in log.read_text(),
                 EVENT_TIMEOUT_S, "the warden's line")  # fmt: skip
    finally:  # not Cluster.close: the leader is gone, and so is what it started
        if engine and alive(engine):
            os.killpg(engine, signal.SIGKILL)
