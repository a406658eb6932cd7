"""A TCP relay on loopback that the test controls: it can add latency to each direction, and
it can turn into a black hole that delivers nothing and closes or resets nothing.

Put it between a client and a server (PostgreSQL, for the store's deadlines) and hand the
client its ``port``.  Each accepted connection gets a connection of its own to the target;
bytes are forwarded as they come, each chunk ``delay_s`` seconds after it arrived (order
kept, so a 200 ms relay adds 200 ms each way, not per chunk).

:meth:`TcpRelay.black_hole` is a silent network partition as both ends see it: the relay goes
on accepting connections and reading what either side sends (so their kernels see every
byte acknowledged), and delivers nothing; no FIN, no RST, no error reaches either side.
:meth:`TcpRelay.heal` ends it: what was held is delivered, in order, and new connections
reach the target again, as TCP's retransmissions would after a partition.  A side that gave
up meanwhile (closed its socket) has its close delivered after its bytes.  The relay runs
its own event loop on a thread of its own, so a test's blocked thread or loop does not stop
it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from typing import Any

#: Bytes read at a time.
_CHUNK = 65536
#: What a direction's queue carries: when to deliver, and the bytes (``b""``: the close).
_Held = tuple[float, bytes]


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
        self._flowing: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        #: connections accepted so far
        self.accepted = 0

    def start(self) -> TcpRelay:
        """Listen on a free loopback port (``port``) and start relaying."""
        self._thread.start()
        self._server = self._call(self._listen())
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def black_hole(self) -> None:
        """Deliver nothing from now on, on every connection, and close nothing."""
        self._call(self._set_flowing(False))

    def heal(self) -> None:
        """Deliver again: what was held, then what comes."""
        self._call(self._set_flowing(True))

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

    async def _listen(self) -> asyncio.Server:
        self._flowing = asyncio.Event()
        self._flowing.set()
        return await asyncio.start_server(self._accept, "127.0.0.1", 0, reuse_address=True)

    async def _set_flowing(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        accepting = asyncio.current_task()
        if accepting is not None:  # cancelled by close() while held
            self._tasks.add(accepting)
            accepting.add_done_callback(self._tasks.discard)
        self.accepted += 1
        self._writers.append(writer)
        to_server: asyncio.Queue[_Held] = asyncio.Queue()
        self._spawn(self._read(reader, to_server))
        await self._flowing.wait()  # a connection made in the black hole is held
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers.append(up_writer)
        to_client: asyncio.Queue[_Held] = asyncio.Queue()
        self._spawn(self._send(to_server, up_writer))
        self._spawn(self._read(up_reader, to_client))
        self._spawn(self._send(to_client, writer))

    async def _read(self, reader: asyncio.StreamReader, queue: asyncio.Queue[_Held]) -> None:
        """Read everything (the sender's kernel sees it acknowledged) into ``queue``."""
        while True:
            try:
                data = await reader.read(_CHUNK)
            except OSError:
                data = b""
            await queue.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    async def _send(self, queue: asyncio.Queue[_Held], writer: asyncio.StreamWriter) -> None:
        """Deliver ``queue`` to ``writer``, each chunk when due and only while flowing."""
        assert self._flowing is not None
        with contextlib.suppress(OSError):
            while True:
                due, data = await queue.get()
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                await self._flowing.wait()
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        self._writers.clear()
