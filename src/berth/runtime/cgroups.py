"""A cgroup (v2) per engine: every process an engine starts, whatever it does, stays in it.

A process can leave its process group and its session (``setsid``), and it is given a new
parent when its own exits, but it cannot leave its cgroup unless it is allowed to write to the
cgroup tree.  So the process runtime puts each engine in a cgroup of its own,
``berth/<deployment id>`` (``berth/<deployment id>.<6 hex>`` when that name is taken), below
the cgroup berth itself runs in (the cgroup its service manager delegated to it, or the root
cgroup), before the engine runs a single instruction of its own: the child writes ``0`` to the
new cgroup's ``cgroup.procs`` between ``fork`` and ``exec``.  Stopping the engine then reaches
every descendant: ``cgroup.kill`` (Linux 5.14) kills them all at once; on older kernels the
cgroup is frozen (``cgroup.freeze``) while each member is killed, so none can fork meanwhile.

No controller is enabled (``cgroup.subtree_control`` is never written), so creating the
cgroups breaks no rule of the v2 hierarchy ("no internal processes" concerns controllers) and
changes no limit.  File names and behaviour are those of the kernel's
``Documentation/admin-guide/cgroup-v2.rst``.

Where cgroup v2 is not mounted, or berth may not write its part of the tree (a container
without a writable cgroupfs, a systemd unit with ``ProtectControlGroups=yes``), :func:`detect`
says why and the process runtime records descendants from ``/proc`` instead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

#: The folder below berth's own cgroup that holds one cgroup per engine.
CGROUP_FOLDER = "berth"
log = logging.getLogger(__name__)

#: Seconds after which an empty engine cgroup counts as left over (see
#: :meth:`EngineCgroups.remove_stale`).
STALE_AFTER_S = 60.0


@dataclass(frozen=True)
class CgroupsUnavailable:
    """Why engines cannot get cgroups of their own here, in a sentence."""

    reason: str


@dataclass(frozen=True)
class EngineCgroup:
    """One engine's cgroup: ``name`` as ``/proc/<pid>/cgroup`` shows it (``/berth/d-1a2b3c4d``,
    below berth's own cgroup), ``path`` its folder in the cgroup filesystem."""

    name: str
    path: Path

    def open_procs(self) -> int:
        """A write-only descriptor of ``cgroup.procs``: writing ``0`` to it moves the writer
        into this cgroup.  It is not inherited across ``exec``.  Raises :class:`OSError`."""
        return os.open(self.path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    def members(self) -> list[int]:
        """The pids of the processes in the cgroup now (none once it is removed)."""
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(line) for line in text.split()]

    def populated(self) -> bool:
        """Whether any process is in the cgroup (or a cgroup below it); exited processes
        awaiting their reaper are not."""
        try:
            text = (self.path / "cgroup.events").read_text()
        except OSError:
            return False
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "populated":
                return value.strip() == "1"
        return bool(self.members())

    def signal_members(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every process in the cgroup.  A pid listed here is a member
        (nothing outside berth moves processes in), so no recycled pid is signalled."""
        for pid in self.members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """SIGKILL every process in the cgroup, including those forking meanwhile.

        ``cgroup.kill`` where the kernel has it (5.14); else the cgroup is frozen while each
        member is killed, then thawed so the kills take effect.  Raises :class:`OSError`
        when the cgroup's files cannot be written.
        """
        kill_file = self.path / "cgroup.kill"
        if kill_file.exists():
            kill_file.write_text("1")
            return
        freeze = self.path / "cgroup.freeze"
        frozen = False
        try:
            freeze.write_text("1")
            frozen = True
        except OSError:
            pass  # a kernel before 5.2 has no v2 freezer: kill as they are listed
        try:
            self.signal_members(signal.SIGKILL)
        finally:
            if frozen:
                with contextlib.suppress(OSError):
                    freeze.write_text("0")

    def remove(self) -> bool:
        """Remove the (empty) cgroup; whether it is gone.  A cgroup still populated stays."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class EngineCgroups:
    """Where engines' cgroups are made: the cgroup v2 filesystem mounted at ``mount``, and
    the folder below berth's own cgroup that holds them (``parent``, a path inside ``mount``
    that ``parent_name`` names as ``/proc/<pid>/cgroup`` does)."""

    mount: Path
    parent_name: str

    @property
    def parent(self) -> Path:
        return self.mount / self.parent_name.lstrip("/")

    def describe(self) -> str:
        """One line saying where engines' cgroups go, for logs and ``berth doctor``."""
        return f"a cgroup per engine under {self.parent} (cgroup v2)"

    def create(self, deployment_id: str) -> EngineCgroup:
        """A new, empty cgroup for ``deployment_id``'s engine.

        Named after the deployment; when that name is taken (another berth home on this
        host, a cgroup left by a crash) a random suffix is added, so no two engines ever
        share one.  Empty engine cgroups older than :data:`STALE_AFTER_S` (left when an
        engine was killed behind berth's back) are removed first.  Raises :class:`OSError`
        when it cannot be made.
        """
        self.parent.mkdir(exist_ok=True)
        self.remove_stale()
        for name in (deployment_id, *(f"{deployment_id}.{secrets.token_hex(3)}" for _ in "xyz")):
            try:
                (self.parent / name).mkdir()
            except FileExistsError:
                continue
            return self.named(f"{self.parent_name.rstrip('/')}/{name}")
        raise OSError(errno.EEXIST, f"no free cgroup name for {deployment_id}")

    def remove_stale(self, now: float | None = None) -> None:
        """Remove the empty engine cgroups made more than :data:`STALE_AFTER_S` ago.  One is
        empty from its making until its engine joins it (a moment), and again once it is
        stopped (when berth removes it): an older empty one is left over."""
        now = time.time() if now is None else now
        with contextlib.suppress(OSError), os.scandir(self.parent) as entries:
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_ctime < STALE_AFTER_S:
                        continue
                    cgroup = EngineCgroup(f"{self.parent_name}/{entry.name}", Path(entry.path))
                    if not cgroup.populated():
                        cgroup.remove()

    def named(self, name: str) -> EngineCgroup:
        """The engine cgroup ``name`` (as :attr:`EngineCgroup.name` gives it)."""
        return EngineCgroup(name, self.mount / name.lstrip("/"))

    def owns(self, name: str) -> bool:
        """Whether ``name`` is an engine cgroup berth makes (directly below a ``berth``
        folder, and no ``..`` in it): only those are ever killed as a whole."""
        path = PurePosixPath(name)
        return (
            path.is_absolute()
            and ".." not in path.parts
            and path.parent.name == CGROUP_FOLDER
            and bool(path.name)
        )

    def cgroup_of(self, pid: int) -> EngineCgroup | None:
        """The engine cgroup process ``pid`` is in, when it is one berth makes; else
        ``None`` (the process is gone, or was started without one)."""
        name = own_cgroup(pid)
        if name is None or not self.owns(name):
            return None
        return self.named(name)


def own_cgroup(pid: int | None = None) -> str | None:
    """The cgroup v2 path of process ``pid`` (this process by default), as the ``0::`` line
    of ``/proc/<pid>/cgroup`` gives it; ``None`` when there is none."""
    source = Path("/proc/self/cgroup" if pid is None else f"/proc/{pid}/cgroup")
    try:
        text = source.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def cgroup2_mount() -> Path | None:
    """Where the cgroup v2 filesystem is mounted (``/sys/fs/cgroup``, or
    ``/sys/fs/cgroup/unified`` on a hybrid host); ``None`` when it is not."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        # proc(5): ... mount-point options ... - fstype source super-options
        before, _, after = line.partition(" - ")
        fields = before.split()
        if after.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            return Path(fields[4].replace("\\040", " "))
    return None


def detect() -> EngineCgroups | CgroupsUnavailable:
    """Whether engines can get cgroups of their own here, and where.

    They can when cgroup v2 is mounted and berth may create ``berth/`` below its own cgroup
    and move processes into it (root, or a cgroup delegated to berth's user).
    """
    mount = cgroup2_mount()
    if mount is None:
        return CgroupsUnavailable("cgroup v2 is not mounted")
    own = own_cgroup()
    if own is None:
        return CgroupsUnavailable("this process is in no cgroup v2 (see /proc/self/cgroup)")
    cgroups = EngineCgroups(mount, f"{own.rstrip('/')}/{CGROUP_FOLDER}")
    try:
        cgroups.parent.mkdir(exist_ok=True)
    except OSError as exc:
        why = exc.strerror or str(exc)
        return CgroupsUnavailable(f"cannot create {cgroups.parent}: {why}")
    own_procs = mount / own.lstrip("/") / "cgroup.procs"
    if not os.access(cgroups.parent, os.W_OK) or not os.access(own_procs, os.W_OK):
        return CgroupsUnavailable(f"{cgroups.parent} is not writable by this user")
    return cgroups


def spawn_in(
    cgroup: EngineCgroup | None,
    spawn: Callable[[Callable[[], None] | None], subprocess.Popen[bytes]],
    deployment_id: str,
) -> subprocess.Popen[bytes] | None:
    """``spawn(join)`` the engine inside ``cgroup``: ``join`` runs in the child between fork
    and exec and moves it there (``spawn(None)`` without a cgroup).

    ``None`` when it cannot join it (the child exits before exec; the cgroup is removed):
    the caller starts the engine without one.  Raises :class:`OSError` when the program
    cannot be executed.
    """
    if cgroup is None:
        return spawn(None)
    try:
        procs = cgroup.open_procs()
    except OSError as exc:
        log.warning("cannot join cgroup %s (%s): following deployment %s from /proc",
                    cgroup.name, exc.strerror or exc, deployment_id)  # fmt: skip
        cgroup.remove()
        return None

    def join() -> None:
        # Runs in the child between fork and exec: one write, nothing that takes a lock.
        os.write(procs, b"0")

    try:
        return spawn(join)
    except subprocess.SubprocessError as exc:  # raised for a failing preexec_fn
        log.warning("moving deployment %s into cgroup %s failed (%s): following it from "
                    "/proc", deployment_id, cgroup.name, exc)  # fmt: skip
        cgroup.remove()
        return None
    finally:
        os.close(procs)


def existing_cgroup(cgroups: EngineCgroups | None, name: str | None) -> EngineCgroup | None:
    """The engine cgroup ``name`` (recorded in an engine's handle) when it is one berth makes
    and it exists; ``cgroups`` is this host's (``None``: engines get none now)."""
    if name is None:
        return None
    if cgroups is None:
        # Started when this host allowed cgroups (or another setting): still killed.
        mount = cgroup2_mount()
        if mount is None:
            return None
        cgroups = EngineCgroups(mount, "/")
    if not cgroups.owns(name):
        return None
    found = cgroups.named(name)
    return found if found.path.is_dir() else None
