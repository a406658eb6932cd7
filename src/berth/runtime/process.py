"""The process runtime: each engine is a child process leading its own process group.

An engine such as vLLM or SGLang forks helpers (tokenizer, scheduler and worker processes),
so berth never signals just the pid it started: the engine is started with
``start_new_session=True`` and is stopped by signalling its whole process group, SIGTERM first
and SIGKILL after a grace period.  stdout and stderr are appended to the deployment's log
file, whose last lines travel in every :class:`~berth.errors.EngineError`.

After a daemon restart the engines started by the previous daemon are no longer our children.
:meth:`ProcessRuntime.attach` adopts one again only when its pid still runs the engine (its
command line carries ``--port P``), so a recycled pid is never signalled; stopping such a
handle polls ``/proc`` for liveness instead of waiting on the child.

This module reads ``/proc``: it targets Linux, as berth's GPU nodes do.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncGenerator
from pathlib import Path

from berth.errors import EngineError
from berth.runtime.base import EngineHandle, LaunchSpec, ProgressListener
from berth.runtime.health import HealthProber

#: Lines of engine output carried by an :class:`EngineError`.
DEFAULT_LOG_TAIL_LINES = 40

# Bounds on how far back a tail read goes, so one huge line cannot exhaust memory.
_TAIL_BLOCK_BYTES = 8192
_TAIL_MAX_BYTES = 1 << 20
_FOLLOW_CHUNK_BYTES = 64 * 1024
# How often stop() looks whether the process group is gone.
_STOP_POLL_S = 0.05


class ProcessRuntime:
    """Runs engines as local child processes (the ``process`` runtime).

    ``poll_interval_s`` is the pause between health probes, ``probe_timeout_s`` the limit of
    one probe, ``kill_wait_s`` how long :meth:`stop` waits for the group to vanish after
    SIGKILL before giving up, ``log_tail_lines`` how many log lines errors carry.
    """

    name: str = "process"

    def __init__(
        self,
        *,
        poll_interval_s: float = 0.25,
        probe_timeout_s: float = 2.0,
        kill_wait_s: float = 5.0,
        log_tail_lines: int = DEFAULT_LOG_TAIL_LINES,
    ) -> None:
        self._poll_interval_s = poll_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._kill_wait_s = kill_wait_s
        self._log_tail_lines = log_tail_lines
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._health = HealthProber()  # one HTTP client for every probe

    async def start(
        self, spec: LaunchSpec, on_progress: ProgressListener | None = None
    ) -> EngineHandle:
        """Start ``spec.argv`` in a new session and return its handle at once.

        The environment is berth's own plus ``spec.env``; stdin is ``/dev/null``; stdout and
        stderr are appended to ``spec.log_path`` (its folder is created), after a header line
        naming the deployment and command.

        Raises :class:`~berth.errors.EngineError` when the program cannot be executed (not
        found, not executable) or the log file cannot be opened.  ``on_progress`` is not
        called: there is nothing to prepare.
        """
        return await asyncio.to_thread(self._spawn, spec)

    def _spawn(self, spec: LaunchSpec) -> EngineHandle:
        if not spec.argv:
            raise EngineError("empty engine command line", deployment_id=spec.deployment_id)
        env = {**os.environ, **spec.env}
        try:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = spec.log_path.open("ab")
        except OSError as exc:
            raise EngineError(
                f"cannot open engine log {spec.log_path}: {exc.strerror or exc}",
                deployment_id=spec.deployment_id,
            ) from exc
        with log_file:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            header = f"=== berth {stamp} deployment {spec.deployment_id}: {' '.join(spec.argv)}\n"
            log_file.write(header.encode())
            log_file.flush()
            try:
                child = subprocess.Popen(
                    spec.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise EngineError(
                    f"cannot start {spec.argv[0]}: {exc.strerror or exc}",
                    deployment_id=spec.deployment_id,
                ) from exc
        self._children[child.pid] = child
        return EngineHandle(
            deployment_id=spec.deployment_id, pid=child.pid, port=spec.port, host=spec.host
        )

    async def wait_healthy(self, handle: EngineHandle, spec: LaunchSpec, timeout_s: float) -> None:
        """Poll ``GET http://host:port{spec.health_path}`` until it answers 200.

        Any other status, a refused connection or a probe timeout counts as "not yet".
        Environment proxies are ignored: the engine is on loopback.

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
        )
        if outcome == "exited":
            raise EngineError(
                f"engine {self._exit_description(handle)} before {url} answered 200",
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
        return await self._health.probe(f"{handle.base_url}{health_path}", timeout_s)

    async def stop(self, handle: EngineHandle, grace_s: float) -> None:
        """Stop the engine's process group: SIGTERM, then SIGKILL after ``grace_s`` seconds.

        Returns once no process of the group is left (zombies aside) and our child, if it is
        one, has been reaped.  For an adopted handle: a pid that now runs another program is
        left alone; when the engine itself is gone but helpers of its group still run, those
        are stopped (the kernel never gives a new process the number of a live group); an
        engine that does not lead its own group is signalled alone, never the group it shares.

        Raises :class:`~berth.errors.EngineError` when the processes cannot be signalled or
        are still there ``kill_wait_s`` seconds after SIGKILL.
        """
        child = self._children.get(handle.pid)
        whole_group = await asyncio.to_thread(_stop_scope, handle, child)
        if whole_group is None:
            if child is not None:
                self._children.pop(handle.pid, None)
            return
        try:
            self._signal(handle, signal.SIGTERM, whole_group)
            if not await self._wait_gone(handle, child, whole_group, grace_s):
                self._signal(handle, signal.SIGKILL, whole_group)
                if not await self._wait_gone(handle, child, whole_group, self._kill_wait_s):
                    raise EngineError(
                        f"engine pid {handle.pid} still runs {self._kill_wait_s:g} s after SIGKILL",
                        deployment_id=handle.deployment_id,
                    )
        finally:
            if child is not None and child.poll() is not None:
                self._children.pop(handle.pid, None)

    def is_alive(self, handle: EngineHandle) -> bool:
        """Whether the engine's main process still runs (a zombie counts as exited).

        For an adopted handle this also checks that the pid still runs the engine.
        """
        child = self._children.get(handle.pid)
        if child is not None:
            return child.poll() is None
        return _is_engine_process(handle.pid, handle.port)

    async def poll(self, handle: EngineHandle) -> bool:
        """Same as :meth:`is_alive` (reading ``/proc`` is cheap)."""
        return self.is_alive(handle)

    def attach(
        self, deployment_id: str, pid: int, port: int, host: str = "127.0.0.1"
    ) -> EngineHandle | None:
        """Adopt an engine started before a daemon restart, for reconciliation.

        Returns a handle when ``pid`` runs and its command line carries ``--port <port>``
        (or ``--port=<port>``); ``None`` when it exited or the pid now belongs to another
        program, which must then never be signalled.  When the engine itself died, passing
        an ``EngineHandle`` with its old pid and port to :meth:`stop` still stops helpers
        left running in its process group.
        """
        if pid <= 1 or pid == os.getpid():
            return None
        if pid not in self._children and not _is_engine_process(pid, port):
            return None
        return EngineHandle(deployment_id=deployment_id, pid=pid, port=port, host=host)

    def _signal(self, handle: EngineHandle, sig: signal.Signals, whole_group: bool) -> None:
        try:
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

    async def _wait_gone(
        self,
        handle: EngineHandle,
        child: subprocess.Popen[bytes] | None,
        whole_group: bool,
        timeout_s: float,
    ) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            leader_alive = child.poll() is None if child is not None else pid_running(handle.pid)
            if not leader_alive and not (
                whole_group and await asyncio.to_thread(_group_has_live_members, handle.pid)
            ):
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(_STOP_POLL_S)

    def _exit_description(self, handle: EngineHandle) -> str:
        child = self._children.get(handle.pid)
        code = child.returncode if child is not None else None
        if code is None:
            return "exited"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    async def _log_tail(self, path: Path) -> str:
        return await asyncio.to_thread(read_log_tail, path, self._log_tail_lines)


def read_log_tail(path: Path, lines: int = DEFAULT_LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``path`` as text (undecodable bytes replaced).

    Returns ``""`` when the file does not exist.  Reads at most 1 MiB from the end.
    """
    data, _ = _tail_bytes(path, lines)
    return data.decode("utf-8", errors="replace")


async def follow_log(
    path: Path, *, from_start_lines: int = DEFAULT_LOG_TAIL_LINES, poll_interval_s: float = 0.25
) -> AsyncGenerator[bytes, None]:
    """Yield what ``path`` holds and then what is appended to it, like ``tail -f``.

    The first chunk is the last ``from_start_lines`` lines already in the file (none when
    0); later chunks are new bytes, checked every ``poll_interval_s`` seconds.  A file that
    does not exist yet is waited for; one that shrinks (truncated or replaced) is read again
    from its start.  The generator never ends by itself: the consumer stops it with
    ``aclose()`` (or by leaving ``async for`` and letting it be collected).
    """
    head, offset = await asyncio.to_thread(_tail_bytes, path, from_start_lines)
    if head:
        yield head
    while True:
        chunk, offset = await asyncio.to_thread(_read_from, path, offset)
        if chunk:
            yield chunk
        else:
            await asyncio.sleep(poll_interval_s)


def _tail_bytes(path: Path, lines: int) -> tuple[bytes, int]:
    """The last ``lines`` lines of ``path`` and the file offset they end at."""
    try:
        with path.open("rb") as handle:
            end = handle.seek(0, os.SEEK_END)
            if lines <= 0:
                return b"", end
            position = end
            data = b""
            # One newline more than ``lines`` is needed to know the first line is whole.
            while position > 0 and data.count(b"\n") <= lines and len(data) < _TAIL_MAX_BYTES:
                step = min(_TAIL_BLOCK_BYTES, position)
                position -= step
                handle.seek(position)
                data = handle.read(step) + data
            return b"".join(data.splitlines(keepends=True)[-lines:]), end
    except FileNotFoundError:
        return b"", 0


def _read_from(path: Path, offset: int) -> tuple[bytes, int]:
    """Bytes of ``path`` from ``offset`` (from 0 when the file shrank) and the new offset."""
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < offset:
                offset = 0
            handle.seek(offset)
            data = handle.read(_FOLLOW_CHUNK_BYTES)
    except FileNotFoundError:
        return b"", 0
    return data, offset + len(data)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, process group)`` of ``pid`` from ``/proc/<pid>/stat``, ``None`` if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ")".
    fields = raw[raw.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[2])


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def _leads_own_group(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[1] == pid and pid != os.getpgrp()


def _group_has_live_members(pgid: int) -> bool:
    """Whether any process of group ``pgid`` runs; zombies awaiting their reaper do not."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                stat = _proc_stat(int(entry.name))
                if stat is not None and stat[1] == pgid and stat[0] != "Z":
                    return True
    return False


def _stop_scope(handle: EngineHandle, child: subprocess.Popen[bytes] | None) -> bool | None:
    """Whether to signal the engine's whole group (True), its pid alone (False) or nothing."""
    if child is not None:
        if child.poll() is not None and not _group_has_live_members(handle.pid):
            return None
        return True
    if _is_engine_process(handle.pid, handle.port):
        return _leads_own_group(handle.pid)
    if _orphaned_group(handle.pid):
        return True
    return None


def _orphaned_group(pgid: int) -> bool:
    """Whether ``pgid``'s leader is gone (or a zombie) while other members still run."""
    return pgid != os.getpgrp() and not pid_running(pgid) and _group_has_live_members(pgid)


def _is_engine_process(pid: int, port: int) -> bool:
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
