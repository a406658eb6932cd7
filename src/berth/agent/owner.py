"""The owner of an engine journal (an agent, or the leader for node ``local``) and the
warden it leaves behind.

An owner holds its owner lock (``agent.lock`` or ``leader.lock`` in ``$BERTH_HOME``: an
exclusive ``flock``) from before it takes its engines back until its process ends; the
kernel drops the lock however the process ends.  The warden (:mod:`berth.agent.warden`) reads
the lock's absence as the owner's.  One warden per journal: each owner starts its own (its
settings, its berth) and then stops the one an earlier owner left, whose pid and start time
are in ``warden-<owner>.pid`` (so a recycled pid is never signalled).  With ``orphan_grace_s``
0 no warden is started, and an earlier one is stopped all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from berth.agent.warden import WardenConfig, try_owner_lock
from berth.config import Settings
from berth.errors import ConflictError
from berth.paths import BerthHome, JournalOwner, WardenFiles
from berth.runtime.docker import resolve_docker_host
from berth.runtime.proc import ProcessId, signal_process

log = logging.getLogger(__name__)

#: Seconds between two tries at the owner lock while another process holds it.
CLAIM_POLL_S = 0.05
#: Seconds the warden's first process may take to fork the second and exit.
WARDEN_START_TIMEOUT_S = 30.0
#: Seconds an owner waits for the lock beyond ``stop_grace_s``: a warden stopping engines
#: takes them back and waits up to ``stop_grace_s`` and the runtime's 5 s after SIGKILL.
CLAIM_MARGIN_S = 30.0


def warden_config(
    home: BerthHome, owner: JournalOwner, settings: Settings, node_id: str
) -> WardenConfig | None:
    """The warden ``owner`` starts with ``settings``; ``None`` when ``orphan_grace_s`` is 0
    (engines are never stopped for their owner's absence)."""
    if settings.orphan_grace_s <= 0:
        return None
    return WardenConfig(
        home=home.root,
        owner=owner,
        orphan_grace_s=settings.orphan_grace_s,
        stop_grace_s=settings.stop_grace_s,
        process_tree=settings.process_tree,
        node_id=node_id,
        docker_host=resolve_docker_host(settings.docker_host),
    )


async def own_engines(
    home: BerthHome, owner: JournalOwner, settings: Settings, node_id: str
) -> JournalOwnership:
    """Become the owner of ``owner``'s journal before taking its engines back: claim the
    owner lock and replace the warden (none with ``orphan_grace_s`` 0).  Blocking steps run
    off the event loop.  The lock's descriptor is never closed but by :meth:`release`, so
    it stays held until this process ends, whether the result is kept or not.

    Raises :class:`ConflictError` when the lock stays held (:meth:`JournalOwnership.claim`)
    or the warden cannot be started.
    """
    ownership = JournalOwnership(home.warden_files(owner))
    await asyncio.to_thread(ownership.claim, settings.stop_grace_s + CLAIM_MARGIN_S)
    try:
        pid = await asyncio.to_thread(
            ownership.replace_warden, warden_config(home, owner, settings, node_id)
        )
    except ConflictError:
        ownership.release()
        raise
    if pid is not None:
        log.info("engine warden pid %d: engines stopped %g s after this %s is gone",
                 pid, settings.orphan_grace_s, owner)  # fmt: skip
    return ownership


class JournalOwnership:
    """This process as the owner of ``files.journal``'s engines.

    :meth:`claim` takes the owner lock, :meth:`replace_warden` starts this owner's warden
    and stops an earlier one, :meth:`release` lets the lock go (the process's end does too).
    """

    def __init__(self, files: WardenFiles) -> None:
        self.files = files
        self._fd: int | None = None
        #: the warden this owner started (its pid), if any
        self.warden_pid: int | None = None

    def claim(self, timeout_s: float) -> None:
        """Take the owner lock, waiting up to ``timeout_s`` seconds for whoever holds it: a
        warden stopping engines of a previous owner holds it until they are stopped.  Blocks
        (call it off the event loop).

        Raises :class:`ConflictError` naming the lock when it is still held then (another
        agent or leader runs on this home), or when it cannot be opened.
        """
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fd = try_owner_lock(self.files.owner_lock)
            except OSError as exc:
                raise ConflictError(
                    f"cannot open {self.files.owner_lock}: {exc.strerror or exc}"
                ) from None
            if fd is not None:
                self._fd = fd
                return
            if time.monotonic() >= deadline:
                raise ConflictError(
                    f"{self.files.owner_lock} is held by another process for "
                    f"{timeout_s:g} s: another berth process owns the engines of "
                    f"{self.files.journal.name}, or its warden is still stopping them"
                )
            if not waited:
                log.info("waiting for %s (a warden may be stopping orphaned engines)",
                         self.files.owner_lock)  # fmt: skip
                waited = True
            time.sleep(CLAIM_POLL_S)

    def release(self) -> None:
        """Let the owner lock go (the warden then sees this owner gone)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def replace_warden(self, config: WardenConfig | None) -> int | None:
        """Start a warden for ``config`` (``None``: ``orphan_grace_s`` is 0, start none),
        then stop the warden an earlier owner left; the new warden's pid (``None`` when
        none was started, or it exited at once).

        The new one is started first, so the engines are never without one.  It runs in a
        session of its own (no signal sent to this process's group reaches it), with no
        terminal, no descriptor of this process, and not as its child.  Blocks for the
        warden's start (call it off the event loop).  Raises :class:`ConflictError` when it
        cannot be started (the owner should not run with no warden).
        """
        earlier = read_warden_pid(self.files.pid_file)
        self.warden_pid = None
        if config is not None:
            try:
                # The warden forks into the background and its first process exits once
                # the pid file names the second: nothing is left to reap here.
                started = subprocess.run(
                    config.argv(),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    cwd=config.home,
                    start_new_session=True,
                    timeout=WARDEN_START_TIMEOUT_S,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise ConflictError(f"cannot start the engine warden: {exc}") from None
            if started.returncode != 0:
                why = started.stderr.decode(errors="replace").strip().splitlines()
                raise ConflictError(
                    f"cannot start the engine warden (exit {started.returncode}): "
                    f"{why[-1] if why else 'no message'}"
                )
            found = read_warden_pid(self.files.pid_file)
            self.warden_pid = found.pid if found is not None else None
        if earlier is not None and earlier.pid != self.warden_pid:
            try:
                if signal_process(earlier, signal.SIGTERM):
                    log.info("stopped the earlier engine warden (pid %d)", earlier.pid)
            except PermissionError:
                log.warning("the engine warden pid %d is not ours to stop", earlier.pid)
        return self.warden_pid


def read_warden_pid(path: Path) -> ProcessId | None:
    """The warden a pid file names (pid and start time); ``None`` when there is none or it
    is unreadable (a warden that is gone removes its own)."""
    try:
        data = json.loads(path.read_text())
        return ProcessId(int(data["pid"]), int(data["start_time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
