"""One stream of an agent link, as its two ends use it (``docs/protocol.md``, Streams).

:class:`TunnelStream` turns the session's stream bookkeeping into an async reader of the
peer's payload (reading grants the peer more credit) and a writer that waits for credit, so a
slow reader slows the writer. A reader that is no task pushes instead
(:meth:`TunnelStream.push_to`: each payload handed to a sink as the link reader dispatches
it, credit held back while the sink is paused), and a writer that is no task sends within
the credit at once (:meth:`TunnelStream.write_nowait`).
:class:`~berth.cluster.link.connection.LinkConnection` makes it (through its
:class:`~berth.cluster.link.link_streams.LinkStreams`) and hands it the events that arrive for it
(``data_received``, ``head_received``, ``credit_granted``, ``abort``); it sends through the
link's stream methods (:class:`StreamCarrier`), never touching the session itself.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from berth.cluster.protocol.errors import LinkError
from berth.cluster.protocol.frames import ResetCode, StreamHead, StreamOpen


class StreamCarrier(Protocol):
    """What a stream needs of the link that carries it
    (:class:`berth.cluster.link.link_streams.LinkStreams`, one per link): its stream methods,
    each one session call plus queueing what the session wants sent, and waiting for the
    socket to drain."""

    peer: str

    @property
    def closed(self) -> bool: ...

    async def drain(self) -> None: ...

    def has_stream(self, stream_id: int) -> bool: ...

    def send_room(self, stream_id: int) -> int | None: ...

    def send_head(self, head: StreamHead) -> None: ...

    async def send_data(self, stream_id: int, payload: bytes, end: bool) -> None: ...

    def send_data_nowait(self, stream_id: int, payload: bytes, end: bool) -> None: ...

    @property
    def backlogged(self) -> bool: ...

    def consume(self, stream_id: int, size: int) -> None: ...

    def reset_stream(self, stream_id: int, code: ResetCode, message: str = "") -> None: ...

    def forget_stream(self, stream_id: int) -> None: ...


class PayloadSink(Protocol):
    """Where a stream's received payload is pushed (:meth:`TunnelStream.push_to`), from the
    link reader's dispatch of each frame: ``payload_received(data, end)`` for each payload
    (``end``: the peer's side is done), ``stream_aborted`` once when the stream is reset or
    lost with its link, ``read_timed_out`` once when nothing came for the read timeout.
    Nothing follows the end or either failure. It must not block and must not raise."""

    def payload_received(self, data: bytes, end: bool) -> None: ...

    def stream_aborted(self, error: StreamResetError) -> None: ...

    def read_timed_out(self, timeout_s: float) -> None: ...


class StreamResetError(LinkError):
    """The stream was reset (``reset_code``: by the peer, or here) or lost with its link
    (``reset_code`` ``None``)."""

    def __init__(self, message: str, reset_code: ResetCode | None) -> None:
        super().__init__(message)
        self.reset_code = reset_code


class TunnelStream:
    """One stream of a link: the received payload as an async reader, and a writer that
    waits for credit. ``opening`` is the StreamOpen frame (agent side), ``head`` the answer's
    head once it arrives (leader side); ``task`` the agent's task serving the stream, which a
    reset by the leader cancels."""

    def __init__(self, conn: StreamCarrier, stream_id: int, opening: StreamOpen | None) -> None:
        self.conn = conn
        self.id = stream_id
        self.opening = opening
        self.head: StreamHead | None = None
        self._chunks: deque[bytes] = deque()
        self._ended = False
        self._reset: StreamResetError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._credit_waiter: asyncio.Future[None] | None = None
        # The read timeout: one timer per stream, not one per read (a token stream reads
        # once per event). It fires at the earliest possible deadline and looks at when the
        # current wait began.
        self._read_timer: asyncio.TimerHandle | None = None
        self._waiting_since = 0.0
        self.task: asyncio.Task[None] | None = None
        # Pushed (push_to): where the payload goes, and the credit held back while paused.
        self._sink: PayloadSink | None = None
        self._push_paused = False
        self._unconsumed = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timeout_s: float | None = None

    @property
    def ended(self) -> bool:
        """True once the peer's side has ended and every received byte was read."""
        return self._ended and not self._chunks

    # -- events, from the connection -----------------------------------------------------

    def data_received(self, payload: bytes, end: bool) -> None:
        """The peer sent ``payload`` (``end``: and its side is done)."""
        sink = self._sink
        if sink is not None:
            if end:
                self._ended = True
                self._sink = None
                self._stop_read_timer()
            elif self._loop is not None:
                self._waiting_since = self._loop.time()
            if payload:
                if self._push_paused:
                    self._unconsumed += len(payload)
                else:
                    self.conn.consume(self.id, len(payload))
            sink.payload_received(payload, end)
            return
        if payload:
            self._chunks.append(payload)
        if end:
            self._ended = True
        self._wake()

    def head_received(self, head: StreamHead) -> None:
        """Leader: the answer's head arrived, with its first body bytes."""
        self.head = head
        self.data_received(head.payload, head.end)

    def credit_granted(self) -> None:
        """The peer granted more credit: a writer waiting for it goes on."""
        waiter = self._credit_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abort(self, error: StreamResetError) -> None:
        """The stream is over with ``error`` (reset by the peer, or lost with the link):
        waiting readers and writers raise it."""
        self._reset = error
        self._wake()
        self.credit_granted()
        sink = self._sink
        if sink is not None:
            self._sink = None
            self._stop_read_timer()
            sink.stream_aborted(error)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- reading -------------------------------------------------------------------------

    async def wait_head(self, timeout_s: float | None) -> StreamHead:
        """Leader: wait for the answer's head. Raises ``StreamResetError`` or
        ``TimeoutError``."""
        async with asyncio.timeout(timeout_s):
            while self.head is None:
                if self._reset is not None:
                    raise self._reset
                await self._wait()
        return self.head

    async def read(self, timeout_s: float | None = None) -> bytes:
        """The payload that arrived since the last read (``b""`` at the end).

        Reading grants the sender credit for more. Raises ``StreamResetError`` when the
        stream was reset and ``TimeoutError`` when nothing arrives for ``timeout_s``.
        """
        while not self._chunks:
            if self._reset is not None:
                raise self._reset
            if self._ended:
                return b""
            await self._wait(timeout_s)
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.conn.consume(self.id, len(data))
        return data

    async def wait_readable(self) -> None:
        """Return once payload, the peer's end or a reset has arrived; takes nothing and
        grants no credit (the next :meth:`read` or :meth:`push_to` does), raises nothing."""
        while not (self._chunks or self._ended or self._reset is not None):
            await self._wait()

    def push_to(self, sink: PayloadSink, timeout_s: float | None = None) -> None:
        """Hand the received payload to ``sink`` from now on instead of :meth:`read`: what
        arrived already at once, then each frame's from the link reader. Taking it grants
        the sender credit, as reading does, except while paused (:meth:`pause_push`).
        ``timeout_s`` bounds the silence between two payloads while not paused."""
        chunks = self._chunks
        if chunks:
            data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self.conn.consume(self.id, len(data))
            sink.payload_received(data, self._ended)
            if self._ended:
                return
        elif self._ended:
            sink.payload_received(b"", True)
            return
        if self._reset is not None:
            sink.stream_aborted(self._reset)
            return
        self._sink = sink
        self._loop = asyncio.get_running_loop()
        self._timeout_s = timeout_s
        self._arm_push_timer()

    def pause_push(self) -> None:
        """Stop granting credit for what is pushed (the sink's reader is slow), until
        :meth:`resume_push`; the read timeout does not run meanwhile."""
        self._push_paused = True

    def resume_push(self) -> None:
        """Grant the credit held back since :meth:`pause_push`, and go on."""
        self._push_paused = False
        if self._unconsumed:
            size, self._unconsumed = self._unconsumed, 0
            self.conn.consume(self.id, size)
        if self._sink is not None:
            self._arm_push_timer()

    def _arm_push_timer(self) -> None:
        loop, timeout_s = self._loop, self._timeout_s
        if loop is None or timeout_s is None:
            return
        self._waiting_since = now = loop.time()
        if self._read_timer is None:
            self._read_timer = loop.call_at(now + timeout_s, self._push_timed_out, timeout_s)

    def _push_timed_out(self, timeout_s: float) -> None:
        self._read_timer = None
        sink, loop = self._sink, self._loop
        if sink is None or loop is None or self._push_paused:
            return  # over, or paused: resuming arms the timer again
        due = self._waiting_since + timeout_s
        if loop.time() < due:  # something came since the timer was set
            self._read_timer = loop.call_at(due, self._push_timed_out, timeout_s)
            return
        self._sink = None
        sink.read_timed_out(timeout_s)

    async def read_all(self, limit_bytes: int) -> bytes:
        """Everything until the peer's end; ``LinkError`` past ``limit_bytes``."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.read():
            size += len(chunk)
            if size > limit_bytes:
                raise LinkError(f"stream {self.id} body exceeds {limit_bytes} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def _wait(self, timeout_s: float | None = None) -> None:
        """Wait for the next event; ``TimeoutError`` when none comes for ``timeout_s``."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        if timeout_s is not None:
            self._waiting_since = now = loop.time()
            if self._read_timer is None:
                self._read_timer = loop.call_at(now + timeout_s, self._timed_out, timeout_s)
        try:
            await waiter
        finally:
            self._waiter = None

    def _timed_out(self, timeout_s: float) -> None:
        self._read_timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits now: the next wait arms the timer again
        loop = waiter.get_loop()
        due = self._waiting_since + timeout_s
        if loop.time() < due:  # this wait began after the timer was set
            self._read_timer = loop.call_at(due, self._timed_out, timeout_s)
            return
        waiter.set_exception(TimeoutError())

    def _stop_read_timer(self) -> None:
        timer = self._read_timer
        if timer is not None:
            self._read_timer = None
            timer.cancel()

    # -- writing -------------------------------------------------------------------------

    async def send_head(
        self, status: int, headers: Sequence[tuple[bytes, bytes]], payload: bytes, end: bool
    ) -> None:
        """Agent: answer with ``status`` and ``headers`` (lower-case byte pairs, as the
        engine sent them; the frame codec writes them in the wire's form); the head frame
        carries as much of ``payload`` as the credit allows (a small answer is one frame),
        the rest follows as data. ``end``: ``payload`` is the whole answer.

        Raises ``StreamResetError`` when the peer resets the stream or the link is lost.
        """
        await self.conn.drain()  # a head carries up to a window of payload
        room = self.conn.send_room(self.id)
        if room is None:
            self._raise_if_over()
            return  # ended or reset under us: nothing more to send
        first, rest = payload[:room], payload[room:]
        self.conn.send_head(StreamHead(id=self.id, status=status, headers=list(headers),
                                       payload=first, end=end and not rest))  # fmt: skip
        if rest:
            await self.write(rest, end=end)

    async def write(self, data: bytes, end: bool = False) -> None:
        """Send ``data`` in frames no larger than the link allows, waiting for credit.

        Raises ``StreamResetError`` when the peer resets the stream or the link is lost.
        """
        conn = self.conn
        if self._reset is None and not conn.closed:
            room = conn.send_room(self.id)
            if room is not None and len(data) <= room:
                # The common case (one event, or the end): one frame, no copy.
                await conn.send_data(self.id, data, end)
                await conn.drain()
                return
        view = memoryview(data)
        while True:
            if self._reset is not None or conn.closed:
                self._raise_if_over()
            room = conn.send_room(self.id)
            if room is None:
                return  # ended or reset under us: nothing more to send
            size = min(len(view), room)
            if size < len(view) and size == 0:
                await self._wait_credit()
                continue
            last = size == len(view)
            await conn.send_data(self.id, bytes(view[:size]), end and last)
            view = view[size:]
            await conn.drain()
            if last:
                return

    def write_nowait(self, data: bytes, end: bool = False) -> bool:
        """Send ``data`` at once, without waiting, if it can be (one frame within the
        stream's credit, on a live link): for a caller that is no task (an engine
        connection's callback). ``False`` when it cannot: then :meth:`write` it, which
        waits. Whether to slow down afterwards: :attr:`backlogged`."""
        conn = self.conn
        if self._reset is not None or conn.closed:
            return False
        room = conn.send_room(self.id)
        if room is None or len(data) > room:
            return False
        conn.send_data_nowait(self.id, data, end)
        return True

    @property
    def backlogged(self) -> bool:
        """The link has more queued than its high-water mark: wait (:meth:`drain`)."""
        return self.conn.backlogged

    async def drain(self) -> None:
        """Wait until the link's queue is below its high-water mark (or the link is over)."""
        await self.conn.drain()

    def _raise_if_over(self) -> None:
        if self._reset is not None:
            raise self._reset
        if self.conn.closed:
            raise StreamResetError(f"the link to {self.conn.peer} was lost", None)

    async def _wait_credit(self) -> None:
        self._credit_waiter = asyncio.get_running_loop().create_future()
        try:
            await self._credit_waiter
        finally:
            self._credit_waiter = None

    def release(self) -> None:
        """Done with the stream: reset it if it is still open on either side, then forget it."""
        self._sink = None
        self._stop_read_timer()
        if self.conn.has_stream(self.id):
            self.reset(ResetCode.CANCELLED)
        self.conn.forget_stream(self.id)

    def reset(self, code: ResetCode = ResetCode.CANCELLED, message: str = "") -> None:
        """Abandon the stream; the peer stops sending (and, agent side, stops the engine)."""
        self.conn.reset_stream(self.id, code, message)
        if self._reset is None:
            self.abort(StreamResetError(f"stream {self.id} was reset here", code))
