"""The tasks one agent link runs besides its writer and its keepalive.

:class:`LinkTasks` holds, for one :class:`~berth.cluster.link.connection.LinkConnection`, the
reader task (the one running :meth:`~berth.cluster.link.connection.LinkConnection.run`, which the
keepalive's verdict of a dead link cancels) and the handler tasks the reader starts: one per
request, stream and progress event the peer sends, so that a slow handler never blocks the
reader. A handler task is kept referenced until it is done and a failure is logged (it has
no caller to raise to); when the link ends they are cancelled and waited for, within a bound.
The writer task is :class:`~berth.cluster.link.link_output.LinkOutput`'s, the pings
:class:`~berth.cluster.link.liveness.KeepAlive`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

# The connection's logger: a failed handler task is the link's news, logged where it was.
log = logging.getLogger("berth.cluster.link.connection")


class LinkTasks:
    """The reader and handler tasks of the link to ``peer`` (which names them in logs)."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[Any] | None = None
        #: set when the keepalive found the link dead (then it cancels the reader)
        self.dead = False

    def hold_reader(self) -> None:
        """The calling task is the link's reader (what :meth:`kill_reader` cancels)."""
        self._reader = asyncio.current_task()

    def kill_reader(self) -> None:
        """The link is dead: mark it so and cancel the reader (if one is running)."""
        self.dead = True
        if self._reader is not None:
            self._reader.cancel()

    def reader_killed(self) -> bool:
        """On the reader's ``CancelledError``: whether it came from :meth:`kill_reader`
        alone (then the reader ends the link itself), not from whoever runs the link."""
        reader = self._reader
        return self.dead and reader is not None and reader.uncancel() == 0

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[None]:
        """Run ``coro`` as the task ``link-<peer>-<name>``, kept until done; a failure is
        logged."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(f"link-{self._peer}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("link %s task %s failed", self._peer, task.get_name(),
                      exc_info=task.exception())  # fmt: skip

    def cancel(self) -> None:
        """The link ended: cancel every handler task still running."""
        for task in list(self._tasks):
            task.cancel()

    async def wait(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` seconds) for the handler tasks still running."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
