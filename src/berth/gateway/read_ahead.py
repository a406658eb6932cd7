"""A bounded buffer between an engine's answer and a slow client.

:class:`ReadAhead` reads an answer (local or tunneled) in a task of its own, at most
``max_chunks`` chunks and about ``max_bytes`` bytes ahead of the relay. While the client
keeps up, chunks pass straight through; when it stalls, the buffer fills and the task stops
reading, which pauses the engine connection (berth's HTTP client stops reading its socket; a
tunnel stops granting credit), so memory does not grow with a stalled client. Closing it
(the client went away) cancels the read and closes the answer, which is what tells the
engine to stop generating.
"""

from __future__ import annotations

import asyncio

from berth.engine_http.answer import EngineAnswer, read_body

#: Chunks read ahead of the client by default (``[server] relay_buffer_chunks``).
DEFAULT_BUFFER_CHUNKS = 64
#: Bytes read ahead of the client at most, whatever the chunk count: a chunk is whatever
#: arrived since the last read, so chunks alone do not bound memory.
DEFAULT_BUFFER_BYTES = 1024 * 1024


class ReadAhead:
    """An :class:`EngineAnswer` that reads ``answer`` ahead of its reader, bounded.

    Has the same interface: ``status``, ``headers``, ``content_length``, ``header()``,
    ``read_chunk()``, ``read()``, ``at_eof``, ``close()``; errors of the answer are raised by
    ``read_chunk`` after the chunks that came before them.
    """

    def __init__(
        self,
        answer: EngineAnswer,
        max_chunks: int = DEFAULT_BUFFER_CHUNKS,
        max_bytes: int = DEFAULT_BUFFER_BYTES,
    ) -> None:
        if max_chunks < 1 or max_bytes < 1:
            raise ValueError("ReadAhead needs room for at least one chunk")
        self._max_bytes = max_bytes
        self._buffered_bytes = 0
        self._room = asyncio.Event()
        self._room.set()
        self._answer = answer
        self.status = answer.status
        self.headers = answer.headers
        self.content_length = answer.content_length
        self._queue: asyncio.Queue[tuple[bytes, bool, Exception | None]] = asyncio.Queue(max_chunks)
        self._eof = False
        self._pump = asyncio.ensure_future(self._read_ahead())

    def header(self, name: bytes) -> bytes | None:
        return self._answer.header(name)

    @property
    def at_eof(self) -> bool:
        return self._eof

    async def read_chunk(self) -> bytes:
        if self._eof:
            return b""
        chunk, eof, error = await self._queue.get()
        self._buffered_bytes -= len(chunk)
        if self._buffered_bytes < self._max_bytes:
            self._room.set()
        if error is not None:
            self._eof = True  # nothing follows an error: a second read ends, never waits
            raise error
        self._eof = eof
        return chunk

    async def read(self, limit_bytes: int | None = None) -> bytes:
        return await read_body(self, limit_bytes)

    def close(self) -> None:
        """Stop reading and close the answer (an unfinished one tells the engine to stop)."""
        self._pump.cancel()
        self._answer.close()

    async def _read_ahead(self) -> None:
        answer = self._answer
        try:
            while True:
                await self._room.wait()
                chunk = await answer.read_chunk()
                eof = not chunk or answer.at_eof
                self._buffered_bytes += len(chunk)
                if self._buffered_bytes >= self._max_bytes:
                    self._room.clear()
                await self._queue.put((chunk, eof, None))
                if eof:
                    return
        except Exception as exc:  # handed to the reader, which raises it where it would have
            await self._queue.put((b"", False, exc))
