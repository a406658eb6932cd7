"""Knowing the moment an engine's container ends: Docker's events stream, followed on a thread.

One thread per docker runtime reads the ``die`` events of the containers it owns (selected by
its labels) as Docker sends them, and hands each one to the event loop
(``call_soon_threadsafe``), where the container's listener is called once.  When the stream
breaks (Docker restarted, the socket went away) it is opened again a second later, and every
watched container is inspected then: one that ended meanwhile is reported as if its event
had come.  A container that ended just before it was watched is reported at once: the last
:data:`RECENT_ENDS` ends are remembered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

from berth.errors import EngineError
from berth.runtime.docker.api import DockerApi, DockerApiError, EventStream

log = logging.getLogger(__name__)

#: Seconds before a broken events stream is opened again.
REOPEN_S: Final = 1.0
#: Ends remembered for a container watched just after it ended.
RECENT_ENDS: Final = 256

#: Called on the event loop with the container's exit code (``None``: unknown).
EndListener = Callable[[int | None], None]


class ContainerEnds:
    """The ends of the containers carrying ``labels``, from Docker's events stream (see the
    module doc).  ``connected()`` gives the Docker client (raising ``EngineError`` when there
    is none).  :meth:`watch` and :meth:`unwatch` are called on the event loop."""

    def __init__(self, connected: Callable[[], DockerApi], labels: Sequence[str]) -> None:
        self._connected = connected
        self._labels = list(labels)
        self._listeners: dict[str, EndListener] = {}
        self._recent: OrderedDict[str, int | None] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._stream: EventStream | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def watch(self, container_id: str, on_end: EndListener) -> None:
        """Call ``on_end(exit code)`` once the container ends (soon, when it already did)."""
        self._loop = asyncio.get_running_loop()
        if container_id in self._recent:
            self._loop.call_soon(on_end, self._recent[container_id])
            return
        self._listeners[container_id] = on_end
        with self._lock:
            if self._thread is None and not self._closing.is_set():
                self._thread = threading.Thread(
                    target=self._follow, name="docker-container-ends", daemon=True
                )
                self._thread.start()

    def unwatch(self, container_id: str) -> None:
        """Stop watching the container (it is being stopped on purpose)."""
        self._listeners.pop(container_id, None)

    def close(self) -> None:
        """Stop following the stream (the thread ends within a moment)."""
        self._closing.set()
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    # -- on the event loop ----------------------------------------------------------------

    def _ended(self, container_id: str, exit_code: int | None) -> None:
        self._recent[container_id] = exit_code
        while len(self._recent) > RECENT_ENDS:
            self._recent.popitem(last=False)
        listener = self._listeners.pop(container_id, None)
        if listener is not None:
            listener(exit_code)

    # -- on the thread ----------------------------------------------------------------------

    def _post(self, container_id: str, exit_code: int | None) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._ended, container_id, exit_code)

    def _follow(self) -> None:
        while not self._closing.is_set():
            try:
                client = self._connected()
                stream = client.container_ends(self._labels)
            except (DockerApiError, EngineError) as exc:
                log.warning("cannot follow Docker's events (%s); again in %g s", exc, REOPEN_S)
                self._closing.wait(REOPEN_S)
                continue
            with self._lock:
                if self._closing.is_set():
                    stream.close()
                    return
                self._stream = stream
            self._sweep(client)
            try:
                for ended in stream:
                    self._post(ended.container_id, ended.exit_code)
            except DockerApiError as exc:
                if not self._closing.is_set():
                    log.warning("Docker's events stream broke: %s", exc.reason)
            self._closing.wait(REOPEN_S)

    def _sweep(self, client: DockerApi) -> None:
        """Report the watched containers that ended while the stream was not open."""
        for container_id in list(self._listeners):
            try:
                info = client.inspect_container(container_id)
            except DockerApiError:
                continue
            if info is None or not info.state.running:
                code = info.state.exit_code if info is not None else None
                self._post(container_id, code)
