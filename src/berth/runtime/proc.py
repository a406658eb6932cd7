"""What ``/proc`` says about processes: their state, parent, group and start time, the
descendants of a process, and signals that never reach a recycled pid.

A pid alone does not name a process for long: once it exits, the kernel may give its number
to another.  A process is named here by its pid *and* its start time (field 22 of
``/proc/<pid>/stat``, in clock ticks since boot), which no later process with that pid can
share.  :func:`signal_process` opens a pidfd first (``pidfd_open(2)``, Linux 5.3), checks the
start time through it, and signals through it, so the check and the signal are about the
same process.

Field numbers are those of proc(5).  This module targets Linux, as berth's GPU nodes do.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` berth reads: ``state`` (``R``, ``S``, ``Z``, ...),
    the parent's pid, the process group, the session and the start time in clock ticks."""

    pid: int
    state: str
    ppid: int
    pgrp: int
    session: int
    start_time: int

    @property
    def running(self) -> bool:
        """Whether the process has not exited (a zombie awaiting its reaper has)."""
        return self.state not in ("Z", "X")


@dataclass(frozen=True)
class ProcessId:
    """One process, for as long as it lives: its pid and its start time."""

    pid: int
    start_time: int


def read_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` of ``pid``; ``None`` when there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return _parse_stat(pid, raw)


def _parse_stat(pid: int, raw: bytes) -> ProcStat | None:
    # The command name (field 2) is in parentheses and may itself hold spaces or ")".
    try:
        fields = raw[raw.rindex(b")") + 2 :].split()
        return ProcStat(
            pid=pid,
            state=fields[0].decode(),
            ppid=int(fields[1]),
            pgrp=int(fields[2]),
            session=int(fields[3]),
            start_time=int(fields[19]),
        )
    except (ValueError, IndexError):
        return None


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    stat = read_stat(pid)
    return stat is not None and stat.running


def process_id(pid: int) -> ProcessId | None:
    """``pid`` with its start time, while it runs; ``None`` when it exited."""
    stat = read_stat(pid)
    if stat is None or not stat.running:
        return None
    return ProcessId(pid, stat.start_time)


def is_same_process(process: ProcessId) -> bool:
    """Whether ``process`` still runs (its pid not exited, nor given to another process)."""
    stat = read_stat(process.pid)
    return stat is not None and stat.running and stat.start_time == process.start_time


def all_processes() -> dict[int, ProcStat]:
    """Every process on the host (in this pid namespace), by pid.  Processes that exit while
    ``/proc`` is read are left out."""
    found: dict[int, ProcStat] = {}
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                stat = read_stat(int(entry.name))
                if stat is not None:
                    found[stat.pid] = stat
    return found


def descendants(processes: Mapping[int, ProcStat], roots: Iterable[ProcessId]) -> set[ProcessId]:
    """The running processes below ``roots`` in ``processes`` (children, theirs, ...).

    A root that no longer runs (or whose pid now names another process) has no descendants;
    the roots themselves are not in the result.
    """
    children: dict[int, list[ProcStat]] = {}
    for process in processes.values():
        if process.running:
            children.setdefault(process.ppid, []).append(process)
    live_roots = [
        root.pid
        for root in roots
        if (stat := processes.get(root.pid)) is not None
        and stat.running
        and stat.start_time == root.start_time
    ]
    found: set[ProcessId] = set()
    seen = set(live_roots)
    pending = list(live_roots)
    while pending:
        for child in children.get(pending.pop(), ()):
            if child.pid not in seen:
                seen.add(child.pid)
                found.add(ProcessId(child.pid, child.start_time))
                pending.append(child.pid)
    return found


def group_has_live_members(pgid: int) -> bool:
    """Whether any process of group ``pgid`` runs; zombies awaiting their reaper do not."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return any(s.pgrp == pgid and s.running for s in all_processes().values())


def signal_process(process: ProcessId, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``process`` if it still runs; whether it was sent.

    The pid is opened as a pidfd and its start time checked before signalling through that
    pidfd, so a pid the kernel gave to another process meanwhile is never signalled.
    Raises :class:`PermissionError` when the process is not ours to signal.
    """
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:
        return False
    except OSError:  # a kernel before 5.3: check, then signal by pid
        if not is_same_process(process):
            return False
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            return False
        return True
    try:
        if not is_same_process(process):
            return False
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)
            return True
        return False
    finally:
        os.close(pidfd)


def leads_own_group(pid: int) -> bool:
    """Whether ``pid`` leads a process group of its own (not this process's group)."""
    stat = read_stat(pid)
    return stat is not None and stat.pgrp == pid and pid != os.getpgrp()


def orphaned_group(pgid: int) -> bool:
    """Whether ``pgid``'s leader is gone (or a zombie) while other members still run."""
    return pgid != os.getpgrp() and not pid_running(pgid) and group_has_live_members(pgid)


def runs_engine_on_port(pid: int, port: int) -> bool:
    """Whether ``pid`` runs and its command line carries ``--port <port>``."""
    if pid <= 1 or not pid_running(pid):
        return False
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    argv = [part.decode(errors="replace") for part in raw.split(b"\0")]
    wanted = str(port)
    for index, arg in enumerate(argv):
        if arg == f"--port={wanted}":
            return True
        if arg == "--port" and index + 1 < len(argv) and argv[index + 1] == wanted:
            return True
    return False
