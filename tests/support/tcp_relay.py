"""A TCP relay on loopback that the test controls: it can add latency to each direction, and
it can turn into a black hole that swallows every byte without closing or resetting anything.

Put it between a client and a server (PostgreSQL, for the store's deadlines) and hand the
client its ``port``.  Each accepted connection gets a connection of its own to the target;
bytes are forwarded as they come, each chunk ``delay_s`` seconds after it arrived (order
kept, so a 200 ms relay adds 200 ms each way, not per chunk).

:meth:`TcpRelay.black_hole` is a silent network partition as the client sees it: the relay
goes on accepting connections and reading what both sides send (so the kernel acknowledges
it), forwards nothing, and closes nothing; no FIN, no RST, no error reaches either side.
Connections made while it is one are held the same way.  :meth:`TcpRelay.heal` forwards
again for connections made from then on (those cut meanwhile stay swallowed: bytes were
lost in the middle of them).  The relay runs its own event loop on a thread of its own, so
a test's blocked thread or loop does not stop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

#: Bytes read at a time.
_CHUNK = 65536


@dataclass
class _Pipe:
    """One accepted connection and its connection to the target."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None
    swallowed: bool
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class TcpRelay:
    """Relays ``127.0.0.1:port`` to ``target_host:target_port`` (see the module doc)."""

    def __init__(self, target_host: str, target_port: int, *, delay_s: float = 0.0) -> None:
        self._target = (target_host, target_port)
        self.delay_s = delay_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-relay",
                                        daemon=True)  # fmt: skip
        self._server: asyncio.Server | None = None
        self._pipes: list[_Pipe] = []
        self._black_hole = False
        #: connections accepted so far
        self.accepted = 0

    def start(self) -> TcpRelay:
        """Listen on a free loopback port (``port``) and start relaying."""
        self._thread.start()
        self._server = self._call(
            asyncio.start_server(self._accept, "127.0.0.1", 0, reuse_address=True)
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def black_hole(self) -> None:
        """Forward nothing from now on, on every connection, and close nothing."""
        self._loop.call_soon_threadsafe(self._swallow_all)

    def heal(self) -> None:
        """Forward again, for the connections made from now on."""
        self._loop.call_soon_threadsafe(setattr, self, "_black_hole", False)

    def close(self) -> None:
        """Stop listening, close every connection and end the relay's thread."""
        if not self._thread.is_alive():
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()

    def __enter__(self) -> TcpRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- on the relay's loop ------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30.0)

    def _swallow_all(self) -> None:
        self._black_hole = True
        for pipe in self._pipes:
            pipe.swallowed = True

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        pipe = _Pipe(writer, None, self._black_hole)
        self._pipes.append(pipe)
        if pipe.swallowed:
            pipe.tasks.append(asyncio.create_task(self._drain(reader)))
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        pipe.server = up_writer
        pipe.tasks += [
            asyncio.create_task(self._forward(pipe, reader, up_writer)),
            asyncio.create_task(self._forward(pipe, up_reader, writer)),
        ]

    async def _drain(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            while await reader.read(_CHUNK):
                pass

    async def _forward(
        self, pipe: _Pipe, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it came, until the
        pipe is swallowed (then read on and drop) or a side closes (then close the other)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(pipe, queue, writer))
        pipe.tasks.append(sender)
        try:
            while True:
                try:
                    data = await reader.read(_CHUNK)
                except OSError:
                    data = b""
                if pipe.swallowed:
                    if not data:
                        return  # the side went away: nothing more to swallow
                    continue
                await queue.put((time.monotonic() + self.delay_s, data))
                if not data:
                    return
        finally:
            if pipe.swallowed:
                sender.cancel()

    async def _send(
        self, pipe: _Pipe, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(OSError):
            while True:
                due, data = await queue.get()
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                if pipe.swallowed:
                    return
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pipe in self._pipes:
            for task in pipe.tasks:
                task.cancel()
            for writer in (pipe.client, pipe.server):
                if writer is not None:
                    writer.close()
        tasks = [task for pipe in self._pipes for task in pipe.tasks]
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pipes.clear()
