"""The engine warden: stops the engines an agent left running when it does not come back.

Engines outlive their agent on purpose (own process group and cgroup), so that a restarted
agent takes them back (:meth:`~berth.agent.core.AgentCore.restore`).  An agent that is killed
and never restarted would leave them holding GPUs and ports forever.  So each agent, and the
leader for node ``local``, starts one warden (:mod:`berth.agent.owner`), a small process in a
session of its own that outlives it::

    python -m berth.agent.warden --home H --owner agent --orphan-grace-s 600 ...

The running owner holds an exclusive ``flock`` on its owner lock (``agent.lock``) for its
whole life, and the kernel drops it when the owner's process ends, however it ends (``kill
-9`` too).  About once a second the warden tries to take that lock without waiting: while it
cannot, the owner runs.  Once it can, it looks at the journal, and :func:`decide` says what to
do: keep watching; stop, when the owner has been gone for ``orphan_grace_s`` while engines of
its journal still run; or end, when none runs (nothing is left to guard).  To stop them it
keeps the lock (an owner starting meanwhile waits until it is done), takes the journal's
engines back the way a restarted agent does (a process by pid and ``--port`` on its command
line, its cgroup or recorded descendants; a container by its labels) and stops each whole
tree (SIGTERM, SIGKILL after ``stop_grace_s``), which removes it from the journal; then it
exits.  An owner back within the grace re-attaches its engines as before and replaces the
warden with one of its own (its settings, its berth).

The warden logs one line per action to ``$BERTH_HOME/logs/warden-<owner>.log``.  While it
waits it imports only the standard library and the journal's reader (about 18 MiB resident);
the agent core and the runtimes it stops engines with are imported when it acts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, get_args

from berth.agent.journal import EngineJournal, JournalEntry
from berth.atomic import write_atomic
from berth.errors import ConfigError
from berth.paths import BerthHome, JournalOwner, WardenFiles
from berth.runtime.proc import process_id, runs_engine_on_port
from berth.runtime.trees import TREE_MODES, TreeMode

if TYPE_CHECKING:
    from berth.runtime.docker.api import DockerApi

log = logging.getLogger("berth.warden")

#: The module ``python -m`` runs (:meth:`WardenConfig.argv`).
WARDEN_MODULE = "berth.agent.warden"
#: The longest pause between two looks at the owner lock.
MAX_POLL_S = 1.0


# -- the decision ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Watch:
    """Keep watching; ``gone_since`` is when the owner was first seen gone (monotonic
    seconds), ``None`` while it runs."""

    gone_since: float | None
    reason: str


@dataclass(frozen=True)
class StopOrphans:
    """Stop every engine of the journal, then exit."""

    reason: str


@dataclass(frozen=True)
class NothingToGuard:
    """The owner is gone and none of its engines runs: exit."""

    reason: str


Verdict = Watch | StopOrphans | NothingToGuard


def decide(
    *,
    owner_running: bool,
    engines_running: int,
    gone_since: float | None,
    now: float,
    grace_s: float,
    owner: JournalOwner = "agent",
) -> Verdict:
    """What the warden does after one look at the owner lock.

    ``owner_running``: whether the owner holds its lock now; ``engines_running``: how many
    engines of its journal still run (read only when the owner does not); ``gone_since``:
    the previous verdict's, ``None`` at first; ``now`` and ``gone_since`` in monotonic
    seconds; ``grace_s``: the ``orphan_grace_s`` setting (0: never stop).  The checks, in
    the order they run:

    1. the owner runs: :class:`Watch` with ``gone_since`` ``None`` (a grace starts again
       from its next absence);
    2. no engine of its journal runs: :class:`NothingToGuard`;
    3. ``grace_s`` is 0: :class:`Watch` (today's behaviour: engines run until someone stops
       them);
    4. gone for ``grace_s`` seconds or more: :class:`StopOrphans`;
    5. else :class:`Watch`, ``gone_since`` kept (``now`` when first seen gone).
    """
    if owner_running:
        if gone_since is None:
            return Watch(None, f"the {owner} runs")
        return Watch(None, f"the {owner} is back after {now - gone_since:.1f} s: its engines "
                           "are its own again")  # fmt: skip
    if engines_running == 0:
        return NothingToGuard(f"the {owner} is gone and none of its engines runs")
    since = now if gone_since is None else gone_since
    if grace_s <= 0:
        return Watch(since, f"the {owner} is gone; orphan_grace_s is 0: its engines keep running")
    gone_s = now - since
    if gone_s >= grace_s:
        return StopOrphans(
            f"the {owner} has been gone for {gone_s:.1f} s (orphan_grace_s {grace_s:g}): "
            f"stopping its {engines_running} engine(s)"
        )
    return Watch(
        since,
        f"the {owner} is gone: its {engines_running} engine(s) are stopped in "
        f"{grace_s - gone_s:.1f} s unless it comes back",
    )


def poll_interval_s(grace_s: float) -> float:
    """Seconds between two looks: a quarter of the grace, within 0.1 s and :data:`MAX_POLL_S`
    (a short grace is kept to within a fraction of itself)."""
    return min(MAX_POLL_S, max(0.1, grace_s / 4))


def running_engines(entries: dict[str, JournalEntry]) -> int:
    """How many of the journal's engines run: a process whose pid still runs the engine on
    its port (a recycled pid does not count); a container always (only Docker can tell,
    and it is asked when the engines are stopped)."""
    return sum(
        1
        for entry in entries.values()
        if entry.runtime == "docker" or runs_engine_on_port(entry.pid, entry.port)
    )


# -- the process ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WardenConfig:
    """What a warden is started with: the home and the journal's owner, the
    ``orphan_grace_s``, ``stop_grace_s`` and ``process_tree`` settings, and the node id and
    Docker engine URL its containers are labelled and reached with."""

    home: Path
    owner: JournalOwner
    orphan_grace_s: float
    stop_grace_s: float
    process_tree: TreeMode
    node_id: str
    docker_host: str

    @property
    def files(self) -> WardenFiles:
        return BerthHome(self.home).warden_files(self.owner)

    def argv(self) -> list[str]:
        """The command line that starts this warden (with this process's Python)."""
        return [
            sys.executable, "-m", WARDEN_MODULE,
            "--home", str(self.home),
            "--owner", self.owner,
            "--orphan-grace-s", repr(self.orphan_grace_s),
            "--stop-grace-s", repr(self.stop_grace_s),
            "--process-tree", self.process_tree,
            "--node-id", self.node_id,
            "--docker-host", self.docker_host,
        ]  # fmt: skip

    @classmethod
    def from_argv(cls, args: Sequence[str]) -> WardenConfig:
        """The config :meth:`argv` wrote; argparse exits with a usage line on bad ones."""
        parser = argparse.ArgumentParser(prog=f"python -m {WARDEN_MODULE}")
        parser.add_argument("--home", type=Path, required=True)
        parser.add_argument("--owner", choices=get_args(JournalOwner), required=True)
        parser.add_argument("--orphan-grace-s", type=float, required=True)
        parser.add_argument("--stop-grace-s", type=float, required=True)
        parser.add_argument("--process-tree", choices=TREE_MODES, default="auto")
        parser.add_argument("--node-id", required=True)
        parser.add_argument("--docker-host", required=True)
        ns = parser.parse_args(args)
        return cls(ns.home, ns.owner, ns.orphan_grace_s, ns.stop_grace_s, ns.process_tree,
                   ns.node_id, ns.docker_host)  # fmt: skip


def try_owner_lock(path: Path) -> int | None:
    """The owner lock, taken without waiting: an open descriptor holding it, or ``None``
    when another process holds it (the owner runs).  Raises :class:`OSError` when the file
    cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def write_pid_file(path: Path, pid: int) -> None:
    """Record process ``pid`` (pid and start time) as the warden, atomically; nothing when
    it has exited already."""
    warden = process_id(pid)
    if warden is None:
        return
    data = {"pid": warden.pid, "start_time": warden.start_time}
    write_atomic(path, json.dumps(data).encode(), mode=0o600, durable=False)


def remove_own_pid_file(path: Path) -> None:
    """Remove the pid file if it still names this process (a newer warden's is kept)."""
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


class Warden:
    """The watch loop of one warden (:func:`decide` on each look, and its action).

    ``clock`` gives monotonic seconds and ``sleep`` pauses (tests may pass their own).
    """

    def __init__(
        self,
        config: WardenConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self.files = config.files
        self._clock = clock
        self._sleep = sleep
        #: set while engines are being stopped: SIGTERM then waits for the end
        self.acting = False
        self.terminate_asked = False

    def run(self) -> int:
        """Watch until the engines are stopped, none is left, or SIGTERM; the exit status
        (1 when the owner lock or the journal cannot be read, or stopping failed: logged)."""
        grace_s = self.config.orphan_grace_s
        log.info("watching the %s's engines (%s, orphan_grace_s %g)", self.config.owner,
                 self.files.journal.name, grace_s)  # fmt: skip
        try:
            return self._watch()
        except _Replaced:
            log.info("replaced by a newer warden (SIGTERM): exiting")
            return 0

    def _watch(self) -> int:
        grace_s = self.config.orphan_grace_s
        journal = EngineJournal(self.files.journal)
        gone_since: float | None = None
        while not self.terminate_asked:
            try:
                held = try_owner_lock(self.files.owner_lock)
            except OSError as exc:  # the home was removed, say: nothing left to watch
                log.error("cannot open %s: %s: exiting", self.files.owner_lock, exc)
                return 1
            try:
                engines = 0
                if held is not None:
                    try:
                        engines = running_engines(journal.load())
                    except ConfigError as exc:
                        log.error("cannot read the engine journal, stopping nothing: %s", exc)
                        return 1
                verdict = decide(
                    owner_running=held is None,
                    engines_running=engines,
                    gone_since=gone_since,
                    now=self._clock(),
                    grace_s=grace_s,
                    owner=self.config.owner,
                )
                match verdict:
                    case Watch():
                        if (verdict.gone_since is None) != (gone_since is None):
                            log.info("%s", verdict.reason)  # gone, or back: one line each
                        gone_since = verdict.gone_since
                    case NothingToGuard():
                        log.info("%s: exiting", verdict.reason)
                        return 0
                    case StopOrphans():
                        log.info("%s", verdict.reason)
                        self.acting = True
                        try:
                            asyncio.run(stop_orphans(self.config))
                        except Exception:  # the process's edge: say what broke, then end
                            log.exception("stopping the %s's engines failed", self.config.owner)
                            return 1
                        log.info("exiting")
                        return 0
            finally:
                if held is not None:
                    os.close(held)  # the lock with it: an owner may start now
            self._sleep(poll_interval_s(grace_s))
        raise _Replaced

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM (an owner replacing this warden): exit at once while watching, after
        the engines are stopped while acting."""
        self.terminate_asked = True
        if not self.acting:
            raise _Replaced


class _Replaced(Exception):
    """Raised by SIGTERM's handler into the watch loop: a newer warden took over."""


async def stop_orphans(
    config: WardenConfig, docker_client: Callable[[str], DockerApi] | None = None
) -> list[str]:
    """Take back the journal's engines and stop each one's whole tree; the deployment ids
    stopped.

    Each is logged (deployment, pid, port) or, when it cannot be stopped, the reason; the
    journal ends without the engines stopped (those Docker did not answer for stay in it,
    for the next agent).  ``docker_client(host)`` connects to Docker when the journal names
    a container (default: the docker SDK; tests pass an in-memory engine).
    """
    # Imported here: a warden spends its life waiting, and these double what it holds.
    from berth.agent.core import AgentCore
    from berth.runtime.docker import DockerRuntime
    from berth.runtime.engines import EngineBinaries
    from berth.runtime.gpu import StaticInventory
    from berth.runtime.process import ProcessRuntime

    files = config.files
    home = BerthHome(config.home)
    entries = await asyncio.to_thread(EngineJournal(files.journal).load)
    docker = None
    if any(entry.runtime == "docker" for entry in entries.values()):
        docker = DockerRuntime(host=config.docker_host, home=home.root, node_id=config.node_id,
                               client_factory=docker_client)  # fmt: skip
    core = AgentCore(
        ProcessRuntime(process_tree=config.process_tree),
        EngineBinaries(llama_server=None, vllm=None, sglang_python=sys.executable),
        StaticInventory(),
        logs_dir=home.logs_dir,
        journal_path=files.journal,
        keys_dir=home.engine_keys_dir,
        docker=docker,
    )
    try:
        await core.restore()
        reports = core.engines()
        outcomes = await asyncio.gather(
            *(core.stop(report.deployment_id, config.stop_grace_s) for report in reports),
            return_exceptions=True,
        )
        stopped = []
        for report, outcome in zip(reports, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                log.error("could not stop engine %s (pid %d, port %d): %s",
                          report.deployment_id, report.pid, report.port, outcome)  # fmt: skip
            else:
                log.info("stopped engine %s (pid %d, port %d)", report.deployment_id,
                         report.pid, report.port)  # fmt: skip
                stopped.append(report.deployment_id)
        return stopped
    finally:
        core.close()


def main(args: Sequence[str] | None = None) -> int:
    """``python -m berth.agent.warden``: fork into the background (the parent writes the
    warden's pid file and exits, so whoever started it waits for nothing and keeps no
    child), then configure the log and watch.  Bad arguments exit 2 before the fork, with
    a usage line on stderr."""
    config = WardenConfig.from_argv(sys.argv[1:] if args is None else args)
    files = config.files
    child = os.fork()
    if child:
        write_pid_file(files.pid_file, child)
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # nothing the starter reads waits on this process
        os.dup2(devnull, fd)
    os.close(devnull)
    handler = logging.FileHandler(files.log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for noisy in ("asyncio", "httpx", "urllib3", "docker"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warden = Warden(config)
    signal.signal(signal.SIGTERM, warden.on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its own session: only SIGTERM ends it
    try:
        return warden.run()
    finally:
        remove_own_pid_file(files.pid_file)


if __name__ == "__main__":
    raise SystemExit(main())
