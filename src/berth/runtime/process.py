"""The process runtime: each engine is a child process leading its own process group.

An engine such as vLLM or SGLang forks helpers (tokenizer, scheduler and worker processes),
and a helper may leave the engine's process group (``setsid``) or outlive its own parent, so
berth never signals just the pid it started.  The engine is started with
``start_new_session=True`` and inside a tree berth can follow (:mod:`berth.runtime.trees`:
a cgroup of its own where the host allows, else its descendants recorded from ``/proc``);
stopping it signals its process group and its whole tree, SIGTERM first and SIGKILL after a
grace period, and returns once none of them is left.  stdout and stderr are appended to the
deployment's log file, whose last lines travel in every :class:`~berth.errors.EngineError`.
Its working folder is an empty one of berth's beside that log (:func:`engine_workdir`), so a
relative path among its arguments (``--tokenizer=outside``, which Hugging Face loaders read
as a local folder when one exists) names nothing of the agent's own working folder.

An engine's exit is known the moment it happens (:meth:`ProcessRuntime.watch_exit`: a pidfd
per engine on the event loop, :mod:`berth.runtime.exit_watch`), for a child and for an engine
taken back after a restart alike; a child's exit code or signal comes with it.

After a daemon restart the engines started by the previous daemon are no longer our children.
:meth:`ProcessRuntime.attach` adopts one again only when its pid still runs the engine (its
command line carries ``--port P``), so a recycled pid is never signalled; stopping such a
handle polls ``/proc`` for liveness instead of waiting on the child.

This module reads ``/proc``: it targets Linux, as berth's GPU nodes do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from berth.errors import EngineError
from berth.runtime.base import (
    EngineExit,
    EngineHandle,
    LaunchSpec,
    ProgressListener,
    printable_command,
)
from berth.runtime.cgroups import EngineCgroup, existing_cgroup, spawn_in
from berth.runtime.engine_log import DEFAULT_LOG_TAIL_LINES, read_log_tail
from berth.runtime.exit_watch import ExitWatch
from berth.runtime.exits import REBUILD_POINTER, exit_words, killed_by_illegal_instruction
from berth.runtime.health import HealthProber, bearer_headers
from berth.runtime.proc import (
    all_processes,
    group_has_live_members,
    leads_own_group,
    orphaned_group,
    pid_running,
    process_id,
    runs_engine_on_port,
)
from berth.runtime.trees import EngineTree, TreeMechanism, TreeMode, TreeTracking

log = logging.getLogger(__name__)

#: Seconds between two ``/proc`` scans for engines' descendants (the ``proc`` mechanism).
DEFAULT_TREE_SCAN_INTERVAL_S = 1.0

# How often stop() looks whether the engine's processes are gone.
_STOP_POLL_S = 0.05


def engine_workdir(spec: LaunchSpec) -> Path:
    """The working folder an engine process starts in: ``engine-cwd/<deployment id>`` beside
    its log file, berth's own and empty when first made (mode 0700)."""
    return spec.log_path.parent / "engine-cwd" / spec.deployment_id


class ProcessRuntime:
    """Runs engines as local child processes (the ``process`` runtime).

    ``poll_interval_s`` is the pause between health probes, ``probe_timeout_s`` the limit of
    one probe, ``kill_wait_s`` how long :meth:`stop` waits for the processes to vanish after
    SIGKILL before giving up, ``log_tail_lines`` how many log lines errors carry.
    ``process_tree`` chooses how engines' process trees are followed (:data:`TreeMode`;
    ``auto``: a cgroup per engine where the host allows it), ``tree_scan_interval_s`` how
    often ``/proc`` is scanned for descendants when it does not.

    Raises :class:`~berth.errors.ConfigError` when ``process_tree`` is ``cgroup`` and the
    host cannot give engines cgroups.
    """

    name: str = "process"

    def __init__(
        self,
        *,
        poll_interval_s: float = 0.25,
        probe_timeout_s: float = 2.0,
        kill_wait_s: float = 5.0,
        log_tail_lines: int = DEFAULT_LOG_TAIL_LINES,
        process_tree: TreeMode = "auto",
        tree_scan_interval_s: float = DEFAULT_TREE_SCAN_INTERVAL_S,
    ) -> None:
        self._poll_interval_s = poll_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._kill_wait_s = kill_wait_s
        self._log_tail_lines = log_tail_lines
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._health = HealthProber()  # one HTTP client for every probe
        self.trees = TreeTracking(process_tree)
        self._tree_scan_interval_s = tree_scan_interval_s
        #: what is known of each engine's processes, by the engine's pid
        self._trees: dict[int, EngineTree] = {}
        self._scanner: asyncio.Task[None] | None = None
        self._exits = ExitWatch()

    @property
    def tree_mechanism(self) -> TreeMechanism:
        """``cgroup`` or ``proc``: how this runtime follows engines' process trees."""
        return self.trees.mechanism

    def close(self) -> None:
        """Stop scanning ``/proc`` and watching exits (engines keep running)."""
        if self._scanner is not None:
            self._scanner.cancel()
            self._scanner = None
        self._exits.close()

    def watch_exit(
        self, handle: EngineHandle, on_exit: Callable[[EngineExit | None], None]
    ) -> None:
        """Call ``on_exit`` on the event loop as soon as the engine's main process exits,
        with how it ended (its exit code or signal; ``None`` for an engine that is not our
        child, whose status is not ours to read).  Call it on the event loop."""

        def exited() -> None:
            child = self._children.get(handle.pid)
            ended = None
            if child is not None and child.poll() is not None:  # reaped here
                ended = EngineExit.from_returncode(child.returncode)
            on_exit(ended)

        self._exits.watch(handle.pid, exited, lambda: self.is_alive(handle))

    def unwatch_exit(self, handle: EngineHandle) -> None:
        """Stop watching the engine's exit (it is being stopped on purpose)."""
        self._exits.unwatch(handle.pid)

    async def start(
        self, spec: LaunchSpec, on_progress: ProgressListener | None = None
    ) -> EngineHandle:
        """Start ``spec.argv`` in a new session and return its handle at once.

        The environment is berth's own plus ``spec.environment()``; stdin is ``/dev/null``;
        stdout and stderr are appended to ``spec.log_path`` (its folder is created), after a
        header line naming the deployment, the command (secret flag values hidden) and how
        its process tree is followed.  With the ``cgroup`` mechanism the engine is moved
        into a new cgroup before it runs (between fork and exec); if that fails it is
        started without one, its tree followed from ``/proc``, and a warning logged.

        Raises :class:`~berth.errors.EngineError` when the program cannot be executed (not
        found, not executable) or the log file cannot be opened.  ``on_progress`` is not
        called: there is nothing to prepare.
        """
        handle = await asyncio.to_thread(self._spawn, spec)
        self._ensure_scanner()
        return handle

    def _spawn(self, spec: LaunchSpec) -> EngineHandle:
        if not spec.argv:
            raise EngineError("empty engine command line", deployment_id=spec.deployment_id)
        env = {**os.environ, **spec.environment()}
        workdir = engine_workdir(spec)
        try:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
            log_file = spec.log_path.open("ab")
        except OSError as exc:
            raise EngineError(
                f"cannot open engine log {spec.log_path} or working folder {workdir}: "
                f"{exc.strerror or exc}",
                deployment_id=spec.deployment_id,
            ) from exc
        cgroup = self._new_cgroup(spec.deployment_id)
        with log_file:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            tree = f"cgroup {cgroup.name}" if cgroup else "descendants from /proc"
            header = (
                f"=== berth {stamp} deployment {spec.deployment_id}: "
                f"{printable_command(spec.argv)}\n=== process tree: {tree}\n"
            )
            log_file.write(header.encode())
            log_file.flush()

            def spawn(join: Callable[[], None] | None) -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    spec.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=workdir,
                    start_new_session=True,
                    preexec_fn=join,
                )

            try:
                child = spawn_in(cgroup, spawn, spec.deployment_id)
            except OSError as exc:
                if cgroup is not None:
                    cgroup.remove()
                raise EngineError(
                    f"cannot start {spec.argv[0]}: {exc.strerror or exc}",
                    deployment_id=spec.deployment_id,
                ) from exc
            if child is None:  # it could not join its cgroup
                cgroup = None
                log_file.write(b"=== process tree: descendants from /proc (no cgroup)\n")
                log_file.flush()
                child = spawn(None)
        self._children[child.pid] = child
        handle = EngineHandle(
            deployment_id=spec.deployment_id,
            pid=child.pid,
            port=spec.port,
            host=spec.host,
            cgroup=cgroup.name if cgroup is not None else None,
            api_key=spec.api_key,
        )
        self._trees[child.pid] = EngineTree(process_id(child.pid), cgroup)
        return handle

    def _new_cgroup(self, deployment_id: str) -> EngineCgroup | None:
        cgroups = self.trees.cgroups
        if cgroups is None:
            return None
        try:
            return cgroups.create(deployment_id)
        except OSError as exc:
            log.warning("no cgroup for deployment %s (%s): following its processes from "
                        "/proc", deployment_id, exc.strerror or exc)  # fmt: skip
            return None

    async def wait_healthy(self, handle: EngineHandle, spec: LaunchSpec, timeout_s: float) -> None:
        """Poll ``GET http://host:port{spec.health_path}`` until it answers 200.

        Any other status, a refused connection or a probe timeout counts as "not yet".
        Environment proxies are ignored: the engine is on loopback.  The engine's API key
        goes with every probe.

        Raises :class:`~berth.errors.EngineError` with the log tail when the engine exits
        first (the message gives its exit status when it is our child) or when ``timeout_s``
        seconds pass.
        """
        url = f"http://{handle.host}:{handle.port}{spec.health_path}"

        async def alive() -> bool:
            return self.is_alive(handle)

        outcome = await self._health.wait(
            url,
            timeout_s,
            alive=alive,
            poll_interval_s=self._poll_interval_s,
            probe_timeout_s=self._probe_timeout_s,
            headers=bearer_headers(handle.api_key),
        )
        if outcome == "exited":
            child = self._children.get(handle.pid)
            rebuild = (
                f"; {REBUILD_POINTER}"
                if child is not None and killed_by_illegal_instruction(child.returncode)
                else ""
            )
            raise EngineError(
                f"engine {self._exit_description(handle)} before {url} answered 200{rebuild}",
                deployment_id=handle.deployment_id,
                log_tail=await self._log_tail(spec.log_path),
            )
        if outcome == "timeout":
            raise EngineError(
                f"engine did not answer 200 on {url} within {timeout_s:g} s",
                deployment_id=handle.deployment_id,
                log_tail=await self._log_tail(spec.log_path),
            )

    async def check_health(self, handle: EngineHandle, health_path: str, timeout_s: float) -> bool:
        """One health probe: whether ``GET health_path`` answers 200 within ``timeout_s``."""
        url = f"{handle.base_url}{health_path}"
        return await self._health.probe(url, timeout_s, headers=bearer_headers(handle.api_key))

    async def stop(self, handle: EngineHandle, grace_s: float) -> None:
        """Stop the engine and its whole tree: SIGTERM, then SIGKILL after ``grace_s`` seconds.

        Signalled are the engine's process group, and every process of its cgroup or every
        descendant recorded from ``/proc`` (scanned once more now, and while waiting).
        Returns once none of them is left (zombies aside), our child, if it is one, reaped,
        and its cgroup removed.  For an adopted handle: a pid that now runs another program
        is left alone; when the engine itself is gone but helpers of its group or its cgroup
        still run, those are stopped (the kernel never gives a new process the number of a
        live group, and only berth puts processes in an engine's cgroup); an engine that
        does not lead its own group is signalled alone, never the group it shares.

        Raises :class:`~berth.errors.EngineError` when the processes cannot be signalled or
        are still there ``kill_wait_s`` seconds after SIGKILL.
        """
        child = self._children.get(handle.pid)
        tree = self._tree_of(handle)
        whole_group = await asyncio.to_thread(_stop_scope, handle, child)
        if tree.scanned:
            await self._scan([tree])
        if whole_group is None and not await asyncio.to_thread(tree.anything_left):
            self._forget(handle, child, tree)
            return
        try:
            await self._signal(handle, tree, signal.SIGTERM, whole_group)
            if not await self._wait_gone(handle, child, tree, whole_group, grace_s, signal.SIGTERM):
                await self._signal(handle, tree, signal.SIGKILL, whole_group)
                if not await self._wait_gone(
                    handle, child, tree, whole_group, self._kill_wait_s, signal.SIGKILL
                ):
                    raise EngineError(
                        f"engine pid {handle.pid} still runs {self._kill_wait_s:g} s after SIGKILL",
                        deployment_id=handle.deployment_id,
                    )
        finally:
            reaped = child is None or child.poll() is not None
            if reaped and not await asyncio.to_thread(tree.anything_left):
                self._forget(handle, child, tree)

    def _forget(
        self, handle: EngineHandle, child: subprocess.Popen[bytes] | None, tree: EngineTree
    ) -> None:
        if child is not None:
            self._children.pop(handle.pid, None)
        self._trees.pop(handle.pid, None)
        if tree.cgroup is not None and not tree.cgroup.remove():
            log.warning("cgroup %s of deployment %s could not be removed", tree.cgroup.name,
                        handle.deployment_id)  # fmt: skip

    def processes(self, handle: EngineHandle) -> list[int]:
        """The pids known now to belong to the engine's tree (the engine, and its cgroup's
        members or the descendants recorded from ``/proc``)."""
        return self._tree_of(handle).members()

    def is_alive(self, handle: EngineHandle) -> bool:
        """Whether the engine's main process still runs (a zombie counts as exited).

        For an adopted handle this also checks that the pid still runs the engine.
        """
        child = self._children.get(handle.pid)
        if child is not None:
            return child.poll() is None
        return runs_engine_on_port(handle.pid, handle.port)

    async def poll(self, handle: EngineHandle) -> bool:
        """Same as :meth:`is_alive` (reading ``/proc`` is cheap)."""
        return self.is_alive(handle)

    def exit_status(self, handle: EngineHandle) -> EngineExit | None:
        """The exit code or signal of an engine this runtime started and reaped; ``None``
        while it runs or for an adopted one (not our child: its status is not ours)."""
        child = self._children.get(handle.pid)
        if child is None or child.poll() is None:
            return None
        return EngineExit.from_returncode(child.returncode)

    def attach(
        self,
        deployment_id: str,
        pid: int,
        port: int,
        host: str = "127.0.0.1",
        *,
        cgroup: str | None = None,
        api_key: str | None = None,
    ) -> EngineHandle | None:
        """Adopt an engine started before a daemon restart, for reconciliation.

        Returns a handle when ``pid`` runs and its command line carries ``--port <port>``
        (or ``--port=<port>``); ``None`` when it exited or the pid now belongs to another
        program, which must then never be signalled.  The handle's cgroup is the one the
        engine is in now, when berth made it (else ``cgroup``, as recorded); ``api_key`` is
        the key it was started with.  When the engine itself died, passing an
        ``EngineHandle`` with its old pid, port and cgroup to :meth:`stop` still stops
        helpers left running in its process group or cgroup.  The engine's descendants are
        followed from now on.
        """
        if pid <= 1 or pid == os.getpid():
            return None
        if pid not in self._children and not runs_engine_on_port(pid, port):
            return None
        cgroups = self.trees.cgroups
        found = cgroups.cgroup_of(pid) if cgroups is not None else None
        handle = EngineHandle(
            deployment_id=deployment_id,
            pid=pid,
            port=port,
            host=host,
            cgroup=found.name if found is not None else cgroup,
            api_key=api_key,
        )
        if pid not in self._trees:
            self._trees[pid] = EngineTree(
                process_id(pid), existing_cgroup(self.trees.cgroups, handle.cgroup)
            )
            self._ensure_scanner()
        return handle

    def _tree_of(self, handle: EngineHandle) -> EngineTree:
        """What is known of ``handle``'s processes; for a handle of an engine not followed
        (gone before a restart), its recorded cgroup only."""
        tree = self._trees.get(handle.pid)
        if tree is None:
            engine = (
                process_id(handle.pid) if runs_engine_on_port(handle.pid, handle.port) else None
            )
            tree = EngineTree(engine, existing_cgroup(self.trees.cgroups, handle.cgroup))
        return tree

    # -- the /proc scan ------------------------------------------------------------------

    def _ensure_scanner(self) -> None:
        if self._scanner is not None and not self._scanner.done():
            return
        if not any(tree.scanned for tree in self._trees.values()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # attached outside an event loop: scanned when it stops
            return
        self._scanner = loop.create_task(self._scan_forever(), name="berth-process-trees")

    async def _scan_forever(self) -> None:
        while True:
            scanned = [tree for tree in self._trees.values() if tree.scanned]
            if not scanned:
                return
            try:
                await self._scan(scanned)
            except OSError as exc:  # /proc unreadable for a moment: try again next time
                log.warning("scanning /proc for engines' processes failed: %s", exc)
            await asyncio.sleep(self._tree_scan_interval_s)

    async def _scan(self, trees: list[EngineTree]) -> None:
        processes = await asyncio.to_thread(all_processes)
        for tree in trees:
            tree.update(processes)

    # -- signals -------------------------------------------------------------------------

    async def _signal(
        self,
        handle: EngineHandle,
        tree: EngineTree,
        sig: signal.Signals,
        whole_group: bool | None,
    ) -> None:
        try:
            if whole_group is not None:
                if whole_group:
                    os.killpg(handle.pid, sig)
                else:
                    os.kill(handle.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            raise EngineError(
                f"not allowed to send {sig.name} to engine pid {handle.pid}",
                deployment_id=handle.deployment_id,
            ) from exc
        try:
            await asyncio.to_thread(tree.signal_descendants, sig)
        except OSError as exc:
            raise EngineError(
                f"cannot send {sig.name} to the processes of deployment {handle.deployment_id}: "
                f"{exc.strerror or exc}",
                deployment_id=handle.deployment_id,
            ) from exc

    async def _wait_gone(
        self,
        handle: EngineHandle,
        child: subprocess.Popen[bytes] | None,
        tree: EngineTree,
        whole_group: bool | None,
        timeout_s: float,
        sig: signal.Signals,
    ) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if tree.scanned:
                # A process forked since the last look gets the same signal as its elders.
                processes = await asyncio.to_thread(all_processes)
                new = tree.update(processes)
                if new:
                    await asyncio.to_thread(tree.signal_descendants, sig, new)
            if not await asyncio.to_thread(_anything_left, handle, child, tree, whole_group):
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(_STOP_POLL_S)

    def _exit_description(self, handle: EngineHandle) -> str:
        child = self._children.get(handle.pid)
        code = child.returncode if child is not None else None
        return "exited" if code is None else exit_words(code)

    async def _log_tail(self, path: Path) -> str:
        return await asyncio.to_thread(read_log_tail, path, self._log_tail_lines)


def _anything_left(
    handle: EngineHandle,
    child: subprocess.Popen[bytes] | None,
    tree: EngineTree,
    whole_group: bool | None,
) -> bool:
    leader_alive = child.poll() is None if child is not None else pid_running(handle.pid)
    if whole_group is not None and leader_alive:
        return True
    if whole_group and group_has_live_members(handle.pid):
        return True
    return tree.anything_left()


def _stop_scope(handle: EngineHandle, child: subprocess.Popen[bytes] | None) -> bool | None:
    """Whether to signal the engine's whole group (True), its pid alone (False) or neither
    (None; its cgroup or recorded descendants may still be signalled)."""
    if child is not None:
        if child.poll() is not None and not group_has_live_members(handle.pid):
            return None
        return True
    if runs_engine_on_port(handle.pid, handle.port):
        return leads_own_group(handle.pid)
    if orphaned_group(handle.pid):
        return True
    return None
