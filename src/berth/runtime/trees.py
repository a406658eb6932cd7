"""An engine's whole process tree: how the process runtime finds every process an engine
started, so that stopping the engine stops them all, including those that called ``setsid``
(they leave the engine's process group) and those whose parent exited (they are given to
init, or to the nearest subreaper).

Two mechanisms, chosen once per host (:class:`TreeTracking`, the ``process_tree`` setting):

- ``cgroup``: a cgroup v2 per engine (:mod:`berth.runtime.cgroups`); nothing an engine does
  takes a process out of it.
- ``proc``: where cgroups cannot be used, the engine's descendants are recorded from
  ``/proc`` (parent links) every ``scan_interval_s`` and again when it stops.  A recorded
  process is still stopped after it was given to init, and it is named by its pid and start
  time (:class:`~berth.runtime.proc.ProcessId`), so a recycled pid is never signalled.  What
  this cannot see: a process that forks a child and exits between two scans, the child
  calling ``setsid`` meanwhile (a daemon's double fork).
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from berth.errors import ConfigError
from berth.runtime.cgroups import EngineCgroup, EngineCgroups, detect
from berth.runtime.proc import ProcessId, ProcStat, descendants, is_same_process, signal_process

#: How engines' process trees are found: ``auto`` (cgroups where the host allows, else
#: ``/proc``), or one of the two forced.
TreeMode = Literal["auto", "cgroup", "proc"]
TREE_MODES: tuple[TreeMode, ...] = get_args(TreeMode)
#: What a host ended up with.
TreeMechanism = Literal["cgroup", "proc"]


class TreeTracking:
    """The mechanism this host uses for engines' process trees, chosen at construction.

    ``mode`` is the ``process_tree`` setting.  Raises :class:`~berth.errors.ConfigError`
    when it is ``cgroup`` and the host cannot give engines cgroups (saying why).
    """

    def __init__(self, mode: TreeMode = "auto") -> None:
        self.cgroups: EngineCgroups | None = None
        self.reason = ""
        if mode == "proc":
            self.reason = "the process_tree setting is proc"
            return
        found = detect()
        if isinstance(found, EngineCgroups):
            self.cgroups = found
        elif mode == "cgroup":
            raise ConfigError(f"process_tree is cgroup, but engines cannot get one: {found.reason}")
        else:
            self.reason = found.reason

    @property
    def mechanism(self) -> TreeMechanism:
        return "cgroup" if self.cgroups is not None else "proc"

    def describe(self) -> str:
        """One line for logs and ``berth doctor``: the mechanism, and why not cgroups."""
        if self.cgroups is not None:
            return self.cgroups.describe()
        return f"descendants recorded from /proc (no cgroups: {self.reason})"


@dataclass
class EngineTree:
    """What berth knows of one engine's processes: the engine itself (``None`` when it was
    not running when berth took it back), its cgroup (``None`` on the ``proc`` mechanism,
    or for an engine started without one), and the descendants recorded from ``/proc``."""

    engine: ProcessId | None
    cgroup: EngineCgroup | None = None
    recorded: frozenset[ProcessId] = field(default_factory=frozenset)

    @property
    def scanned(self) -> bool:
        """Whether its descendants come from ``/proc`` scans (it has no cgroup)."""
        return self.cgroup is None

    def update(self, processes: Mapping[int, ProcStat]) -> frozenset[ProcessId]:
        """Record the descendants ``processes`` shows below the engine and below those
        recorded before (which may have been given to init since); forget recorded ones that
        exited.  Returns the ones recorded now for the first time."""
        roots = {*self.recorded, *([self.engine] if self.engine is not None else [])}
        alive = {
            p
            for p in self.recorded
            if (stat := processes.get(p.pid)) is not None
            and stat.running
            and stat.start_time == p.start_time
        }
        found = descendants(processes, roots)
        new = frozenset(found - self.recorded)
        self.recorded = frozenset(alive | found)
        return new

    def members(self) -> list[int]:
        """The pids known to belong to the engine now: its cgroup's members, or the engine
        and the recorded descendants still running."""
        if self.cgroup is not None:
            return self.cgroup.members()
        known = [*([self.engine] if self.engine is not None else []), *self.recorded]
        return sorted(p.pid for p in known if is_same_process(p))

    def signal_descendants(
        self, sig: signal.Signals, only: frozenset[ProcessId] | None = None
    ) -> None:
        """Send ``sig`` to the cgroup's members, or to the recorded descendants (``only``
        those, when given) that still run."""
        if self.cgroup is not None:
            if sig is signal.SIGKILL:
                self.cgroup.kill()
            else:
                self.cgroup.signal_members(sig)
            return
        for process in self.recorded if only is None else only:
            signal_process(process, sig)

    def anything_left(self) -> bool:
        """Whether any process of the tree may still run: its cgroup is populated (the
        engine included), or a recorded descendant runs."""
        if self.cgroup is not None:
            return self.cgroup.populated()
        return any(is_same_process(p) for p in self.recorded)
