"""Knowing the moment a process exits, on the event loop: a pidfd per watched process.

``pidfd_open(2)`` (Linux 5.3) gives a file descriptor that becomes readable when the process
exits, for a child or any other process; the event loop watches it like a socket
(``loop.add_reader``), so an engine's exit is heard within one turn of the loop, with no
polling and no thread.  It works beside :mod:`subprocess`: the pidfd only says the process
ended; whoever owns the child still reaps it (``Popen.poll``).  Where ``pidfd_open`` is
missing (an older kernel, another OS) each watched process is looked at every
:data:`POLL_S` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

log = logging.getLogger(__name__)

#: Seconds between two looks at a watched process where there is no pidfd.
POLL_S: Final = 0.1

#: Called once, on the event loop, when the watched process has exited.
ExitListener = Callable[[], None]
#: Whether the process still runs (for the fallback; a zombie counts as exited).
AliveCheck = Callable[[], bool]


@dataclass
class _Watch:
    on_exit: ExitListener
    fd: int | None = None
    poller: asyncio.Task[None] | None = None


class ExitWatch:
    """The processes being watched for their exit, by pid (see the module doc).

    Use it on the event loop: :meth:`watch` needs the running loop, and ``on_exit`` runs on
    it.  A pid is watched once; watching it again replaces the listener.
    """

    def __init__(self) -> None:
        self._watches: dict[int, _Watch] = {}

    def watch(self, pid: int, on_exit: ExitListener, alive: AliveCheck) -> None:
        """Call ``on_exit()`` as soon as process ``pid`` exits (at once, soon, when it is
        gone already); ``alive()`` answers for the fallback without pidfd."""
        self.unwatch(pid)
        loop = asyncio.get_running_loop()
        watch = _Watch(on_exit)
        self._watches[pid] = watch
        try:
            watch.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            loop.call_soon(self._exited, pid, watch)
            return
        except (AttributeError, OSError) as exc:  # no pidfd here: look now and then
            log.debug("no pidfd for pid %d (%s): polling its exit", pid, exc)
            watch.poller = loop.create_task(self._poll(pid, watch, alive), name=f"exit-{pid}")
            return
        loop.add_reader(watch.fd, self._exited, pid, watch)

    def unwatch(self, pid: int) -> None:
        """Stop watching ``pid`` (its listener is not called)."""
        watch = self._watches.pop(pid, None)
        if watch is not None:
            self._release(watch)

    def close(self) -> None:
        """Stop watching every process."""
        for pid in list(self._watches):
            self.unwatch(pid)

    def __contains__(self, pid: int) -> bool:
        return pid in self._watches

    def _exited(self, pid: int, watch: _Watch) -> None:
        if self._watches.get(pid) is not watch:
            return  # unwatched (or watched anew) meanwhile
        del self._watches[pid]
        self._release(watch)
        watch.on_exit()

    def _release(self, watch: _Watch) -> None:
        if watch.fd is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed first
                asyncio.get_running_loop().remove_reader(watch.fd)
            os.close(watch.fd)
            watch.fd = None
        if watch.poller is not None and watch.poller is not asyncio.current_task():
            watch.poller.cancel()

    async def _poll(self, pid: int, watch: _Watch, alive: AliveCheck) -> None:
        while alive():
            await asyncio.sleep(POLL_S)
        self._exited(pid, watch)
