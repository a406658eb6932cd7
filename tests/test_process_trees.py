"""Whole process trees: an engine's descendants that call ``setsid`` (leaving its process
group and session), or whose parent exits (given to init), are stopped with it, by the
process runtime on both mechanisms (a cgroup per engine, descendants from ``/proc``), and by
the agent core after a failed start and when it takes back what a dead engine left.

Real processes throughout: a small script engine whose helper forks a grandchild that calls
``os.setsid()``.  The cgroup cases are skipped where this host gives berth no writable
cgroup v2 (``berth doctor`` says why).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from berth.agent.core import AgentCore
from berth.doctor.engines import process_tree_check
from berth.errors import ConfigError, EngineError
from berth.runtime.base import EngineHandle, LaunchSpec
from berth.runtime.cgroups import cgroup2_mount, own_cgroup
from berth.runtime.engines import EngineBinaries, find_free_port
from berth.runtime.gpu import StaticInventory
from berth.runtime.proc import read_stat
from berth.runtime.process import ProcessRuntime
from berth.runtime.trees import TreeMechanism, TreeTracking
from berth.vocab.deployment_request import DeploymentRequest
from support.cluster_harness import fake_engine_wrapper
from support.processes import alive

# The engine: a helper whose child calls setsid() and writes its pid; the helper exits once
# the release file appears (its child is then given to init), or never.
TREE_ENGINE = r"""
import argparse, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--pidfile", required=True)
parser.add_argument("--release")
args = parser.parse_args()

HELPER = '''
import os, sys, time
pidfile, release = sys.argv[1], sys.argv[2]
if os.fork() == 0:
    os.setsid()
    with open(pidfile + ".tmp", "w") as out:
        out.write(str(os.getpid()))
    os.rename(pidfile + ".tmp", pidfile)
    time.sleep(3600)
while not (release and os.path.exists(release)):
    time.sleep(0.02)
'''
subprocess.Popen([sys.executable, "-c", HELPER, args.pidfile, args.release or ""])


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format, *values):
        pass


HTTPServer(("127.0.0.1", args.port), Health).serve_forever()
"""

CGROUPS = TreeTracking("auto").mechanism == "cgroup"
MECHANISMS = [
    pytest.param(
        "cgroup",
        marks=pytest.mark.skipif(not CGROUPS, reason="no writable cgroup v2 here"),
    ),
    "proc",
]


async def _wait_for(predicate: object, what: str, timeout_s: float = 10.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


class TreeEngines:
    """Starts tree engines on one runtime and stops whatever a test leaves running."""

    def __init__(self, tmp_path: Path, mechanism: TreeMechanism) -> None:
        self.runtime = ProcessRuntime(
            poll_interval_s=0.05, process_tree=mechanism, tree_scan_interval_s=0.05
        )
        self.tmp_path = tmp_path
        tmp_path.mkdir(exist_ok=True)
        self.script = tmp_path / "tree_engine.py"
        self.script.write_text(TREE_ENGINE)
        self.pidfile = tmp_path / "grandchild.pid"
        self.release = tmp_path / "release"
        self.started: list[EngineHandle] = []

    def spec(self, *, release: bool = False) -> LaunchSpec:
        port = find_free_port()
        flags = ["--pidfile", str(self.pidfile)]
        if release:
            flags += ["--release", str(self.release)]
        return LaunchSpec(
            deployment_id=f"d-tree{os.getpid() % 10000:04d}",
            argv=(sys.executable, str(self.script), "--port", str(port), *flags),
            port=port,
            health_path="/health",
            served_model_name="tree",
            log_path=self.tmp_path / "engine.log",
        )

    async def start(self, spec: LaunchSpec) -> tuple[EngineHandle, int]:
        handle = await self.runtime.start(spec)
        self.started.append(handle)
        await self.runtime.wait_healthy(handle, spec, timeout_s=20)
        await _wait_for(self.pidfile.exists, "the grandchild's pid file")
        grandchild = int(self.pidfile.read_text())
        return handle, grandchild

    async def close(self) -> None:
        for handle in self.started:
            await self.runtime.stop(handle, grace_s=0.5)
        self.runtime.close()


@pytest.fixture(params=MECHANISMS)
async def trees(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TreeEngines]:
    engines = TreeEngines(tmp_path, request.param)
    yield engines
    await engines.close()


async def test_a_setsid_grandchild_is_stopped_with_the_engine(trees: TreeEngines) -> None:
    handle, grandchild = await trees.start(trees.spec())
    stat = read_stat(grandchild)
    assert stat is not None and stat.session == grandchild  # it left the engine's session
    assert stat.pgrp != handle.pid
    await _wait_for(lambda: grandchild in trees.runtime.processes(handle), "it to be recorded")

    await trees.runtime.stop(handle, grace_s=5)

    assert not alive(handle.pid)
    assert not alive(grandchild)
    assert trees.runtime.processes(handle) == []


async def test_a_descendant_given_to_init_is_still_stopped(trees: TreeEngines) -> None:
    handle, grandchild = await trees.start(trees.spec(release=True))
    helper = read_stat(grandchild)
    assert helper is not None
    await _wait_for(lambda: grandchild in trees.runtime.processes(handle), "it to be recorded")
    trees.release.touch()  # its parent exits: it is given to init (or a subreaper)
    await _wait_for(lambda: not alive(helper.ppid), "its parent to exit")

    await trees.runtime.stop(handle, grace_s=5)

    assert not alive(grandchild)


async def test_the_mechanism_is_named_in_the_engine_log(trees: TreeEngines) -> None:
    spec = trees.spec()
    handle, _ = await trees.start(spec)

    log = spec.log_path.read_text()
    if trees.runtime.tree_mechanism == "cgroup":
        assert f"=== process tree: cgroup {handle.cgroup}" in log
    else:
        assert handle.cgroup is None
        assert "=== process tree: descendants from /proc" in log


@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup v2 here")
async def test_an_engine_gets_a_cgroup_of_its_own_removed_when_it_stops(tmp_path: Path) -> None:
    engines = TreeEngines(tmp_path, "cgroup")
    try:
        handle, grandchild = await engines.start(engines.spec())
        assert handle.cgroup is not None and handle.cgroup.endswith(
            "/berth/" + handle.deployment_id
        )
        assert own_cgroup(handle.pid) == handle.cgroup
        assert own_cgroup(grandchild) == handle.cgroup
        mount = cgroup2_mount()
        assert mount is not None
        folder = mount / handle.cgroup.lstrip("/")
        members = {int(pid) for pid in (folder / "cgroup.procs").read_text().split()}
        assert {handle.pid, grandchild} <= members

        await engines.runtime.stop(handle, grace_s=5)

        assert not folder.exists()
    finally:
        await engines.close()


@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup v2 here")
async def test_a_taken_name_gets_a_cgroup_of_its_own_too(tmp_path: Path) -> None:
    first, second = TreeEngines(tmp_path / "a", "cgroup"), TreeEngines(tmp_path / "b", "cgroup")
    try:
        one, _ = await first.start(first.spec())
        two, grandchild = await second.start(second.spec())  # the same deployment id
        assert one.cgroup != two.cgroup

        await first.runtime.stop(one, grace_s=5)

        assert alive(two.pid) and alive(grandchild)
    finally:
        await first.close()
        await second.close()


@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup v2 here")
async def test_after_a_restart_the_cgroup_is_found_and_what_a_dead_engine_left_is_stopped(
    tmp_path: Path,
) -> None:
    engines = TreeEngines(tmp_path, "cgroup")
    try:
        started, grandchild = await engines.start(engines.spec())
        after_restart = ProcessRuntime(process_tree="cgroup")
        adopted = after_restart.attach(started.deployment_id, started.pid, started.port)
        assert adopted is not None and adopted.cgroup == started.cgroup

        os.kill(started.pid, signal.SIGKILL)  # the engine dies; its helpers stay
        await _wait_for(lambda: not engines.runtime.is_alive(started), "the engine to die")
        assert alive(grandchild)
        gone = EngineHandle(started.deployment_id, started.pid, started.port, cgroup=started.cgroup)
        assert after_restart.attach(gone.deployment_id, gone.pid, gone.port) is None

        await after_restart.stop(gone, grace_s=5)

        assert not alive(grandchild)
    finally:
        await engines.close()


def test_a_forced_cgroup_mechanism_says_why_it_cannot_be_had(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("berth.runtime.cgroups.cgroup2_mount", lambda: None)

    with pytest.raises(ConfigError, match=r"process_tree is cgroup.*cgroup v2 is not mounted"):
        ProcessRuntime(process_tree="cgroup")
    assert "cgroup v2 is not mounted" in TreeTracking("auto").describe()


# -- the agent core: a failed start, and what a dead engine left -----------------------------


def _core(tmp_path: Path, mechanism: TreeMechanism) -> AgentCore:
    binaries = EngineBinaries(
        llama_server=str(fake_engine_wrapper(tmp_path)), vllm=None, sglang_python=sys.executable
    )
    return AgentCore(
        ProcessRuntime(poll_interval_s=0.05, process_tree=mechanism, tree_scan_interval_s=0.05),
        binaries,
        StaticInventory([]),
        logs_dir=tmp_path / "logs",
        journal_path=tmp_path / "agent-engines.json",
    )


def _request(tmp_path: Path, deployment_id: str, *flags: str) -> DeploymentRequest:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    return DeploymentRequest(
        deployment_id=deployment_id,
        model_name="m",
        model_path=model,
        engine="llamacpp",
        port=0,
        log_path=Path(),
        extra_args=flags,
    )


@pytest.mark.parametrize("mechanism", MECHANISMS)
async def test_a_failed_start_stops_the_whole_tree(
    tmp_path: Path, mechanism: TreeMechanism
) -> None:
    core = _core(tmp_path, mechanism)
    pidfile = tmp_path / "grandchild.pid"
    request = _request(
        tmp_path, "d-0fa11ed0", "--x-setsid-grandchild", str(pidfile), "--x-unhealthy"
    )
    starting = asyncio.ensure_future(core.start(request, health_timeout_s=3.0))
    await _wait_for(pidfile.exists, "the grandchild's pid file")
    grandchild = int(pidfile.read_text())

    with pytest.raises(EngineError, match="did not answer 200"):
        await starting

    assert not alive(grandchild)
    assert core.engines() == []
    core.close()


@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup v2 here")
async def test_an_engine_that_exits_at_once_leaves_nothing_in_its_cgroup(tmp_path: Path) -> None:
    core = _core(tmp_path, "cgroup")
    pidfile = tmp_path / "grandchild.pid"
    request = _request(
        tmp_path, "d-0fa11ed1", "--x-setsid-grandchild", str(pidfile), "--fail-start"
    )

    with pytest.raises(EngineError, match="exited with code 1"):
        await core.start(request, health_timeout_s=10.0)

    # The helper may still be writing the pid file when the engine is stopped: none survive.
    if pidfile.exists():
        assert not alive(int(pidfile.read_text()))
    mount = cgroup2_mount()
    assert mount is not None
    parent = mount / (own_cgroup() or "/").lstrip("/") / "berth"
    assert not any(p.name.startswith("d-0fa11ed1") for p in parent.iterdir())
    core.close()


@pytest.mark.parametrize("mechanism", MECHANISMS)
async def test_a_restarted_core_stops_what_a_dead_engine_left_in_its_group_or_cgroup(
    tmp_path: Path, mechanism: TreeMechanism
) -> None:
    core = _core(tmp_path, mechanism)
    pidfile = tmp_path / "grandchild.pid"
    handle = await core.start(
        _request(tmp_path, "d-1eft0ver", "--x-setsid-grandchild", str(pidfile)), 20.0
    )
    await _wait_for(pidfile.exists, "the grandchild's pid file")
    grandchild = int(pidfile.read_text())
    await _wait_for(lambda: grandchild in core.engine_processes("d-1eft0ver"), "its tree")
    helpers = [p for p in core.engine_processes("d-1eft0ver") if p not in (handle.pid, grandchild)]
    assert helpers
    os.kill(handle.pid, signal.SIGKILL)  # the engine dies while its agent is down
    await _wait_for(lambda: not core.is_alive("d-1eft0ver"), "the engine to die")
    core.close()

    restarted = _core(tmp_path, mechanism)
    assert await restarted.restore() == []

    try:
        assert all(not alive(pid) for pid in helpers)  # in its process group: stopped either way
        if mechanism == "cgroup":
            assert not alive(grandchild)  # it left the group, not the cgroup
    finally:
        # From /proc, a restarted core knows nothing of a dead engine's setsid grandchild.
        if alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        restarted.close()


def test_doctor_names_the_mechanism_and_fails_a_forced_cgroup_it_cannot_have(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forced_proc = process_tree_check("proc")
    assert forced_proc.verdict == "ok" and "descendants recorded from /proc" in forced_proc.detail
    if CGROUPS:
        assert "a cgroup per engine" in process_tree_check("auto").detail
    monkeypatch.setattr("berth.runtime.cgroups.cgroup2_mount", lambda: None)

    fallback, forced = process_tree_check("auto"), process_tree_check("cgroup")

    assert fallback.verdict == "warn" and "cgroup v2 is not mounted" in fallback.detail
    assert forced.verdict == "fail" and "process_tree" in forced.hint


@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup v2 here")
async def test_left_over_empty_cgroups_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    engines = TreeEngines(tmp_path, "cgroup")
    cgroups = engines.runtime.trees.cgroups
    assert cgroups is not None
    try:
        handle, _ = await engines.start(engines.spec())
        left_over = cgroups.create("d-1eft0ver")  # as if its engine had been killed by hand
        assert left_over.path.is_dir()

        cgroups.remove_stale(now=time.time() + 3600)

        assert not left_over.path.exists()
        assert handle.cgroup is not None and cgroups.named(handle.cgroup).path.is_dir()
    finally:
        await engines.close()
