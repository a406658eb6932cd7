"""Stopping what a test run left running.

Every process a test run starts (leader daemons, agents, engines, and what they start in
turn) inherits :data:`RUN_VARIABLE`, naming the run by its pytest process's pid and start
time.  At the end of a run its own processes still running are stopped; at the start of a
run, those of earlier runs whose pytest process is gone (killed, timed out, interrupted
twice) are.  Runs of other checkouts at the same time are left alone: their pytest lives.

A process is found by the variable in ``/proc/PID/environ`` (its environment at exec), so
one that moved to a session or process group of its own, or whose parent died, is found
all the same.  The prefix is not ``BERTH_``: the harness strips berth's settings from the
environment it gives daemons and agents (``cluster_harness.clean_env``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.processes import alive

RUN_VARIABLE = "PYTEST_BERTH_RUN"
#: how long a process may take to stop on SIGTERM (a daemon stops its engines) before SIGKILL
GRACE_S = 20.0


@dataclass(frozen=True)
class Leftover:
    pid: int
    run: str
    command: str


def run_name(pid: int) -> str | None:
    """``PID:START`` (start in clock ticks since boot, from ``/proc/PID/stat``), or ``None``
    for a pid that does not run: a recycled pid gets another name."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid}:{stat.rsplit(') ', 1)[1].split()[19]}"


def _run_of(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{RUN_VARIABLE}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode()
    return None


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def leftovers() -> list[Leftover]:
    """Every running process that a test run started (any run's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        run = _run_of(pid)
        if run is not None and alive(pid):
            found.append(Leftover(pid, run, _command(pid)))
    return found


def orphaned() -> list[Leftover]:
    """The processes of runs whose pytest process is gone."""
    found = []
    for leftover in leftovers():
        owner = int(leftover.run.split(":", 1)[0])
        if run_name(owner) != leftover.run:
            found.append(leftover)
    return found


def reap(victims: list[Leftover], grace_s: float = GRACE_S) -> None:
    """SIGTERM each of ``victims``, then SIGKILL those still running after ``grace_s``
    seconds.  A pid is signalled only while it still carries its run's name."""

    def signal_all(sig: signal.Signals) -> None:
        for victim in victims:
            if _run_of(victim.pid) == victim.run:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim.pid, sig)

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(v.pid) for v in victims):
        time.sleep(0.1)
    signal_all(signal.SIGKILL)


def _say(session: pytest.Session, what: str, victims: list[Leftover]) -> None:
    lines = [f"berth tests: stopping {len(victims)} {what}:"]
    lines += [f"  pid {v.pid}: {v.command[:160]}" for v in victims]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:  # stderr may be captured here: the reporter writes to the terminal
        sys.stderr.write("\n".join(lines) + "\n")
        return
    reporter.write_line("")
    for line in lines:
        reporter.write_line(line, yellow=True)


class Reaper:
    """The pytest plugin: names the run at configure time (before any fixture starts a
    process), stops orphans of earlier runs at session start and this run's leftovers at
    session finish, after every fixture's teardown (also after a failure under ``-x`` or
    Ctrl-C)."""

    def __init__(self) -> None:
        name = run_name(os.getpid())
        assert name is not None
        self.run = name
        os.environ[RUN_VARIABLE] = name

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        victims = orphaned()
        if victims:
            _say(session, "processes left by earlier test runs", victims)
            reap(victims)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        victims = [v for v in leftovers() if v.run == self.run]
        if victims:
            _say(session, "processes this test run left running", victims)
            reap(victims)


__all__ = ["RUN_VARIABLE", "Leftover", "Reaper", "leftovers", "orphaned", "reap", "run_name"]
