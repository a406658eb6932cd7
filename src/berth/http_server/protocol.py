"""One client connection of berth's HTTP/1.1 server: parsing, bounds, keep-alive, pipelining.

:class:`HttpConnection` feeds what arrives to ``httptools`` and, for each request head,
starts the listener's handler with a :class:`~berth.http_server.request.Request` and a
:class:`~berth.http_server.writer.ResponseWriter`. Its bounds (:mod:`berth.http_server.limits`)
hold from the first byte:

* at most ``max_head_bytes`` of a head are fed to the parser (the parser keeps an unfinished
  header in memory), and at most ``max_header_count`` header lines are taken: beyond either,
  ``431`` and nothing more is read;
* one timer per connection: the head must arrive within ``head_timeout_s`` of its first byte
  (of the connection, for the first request), the body may pause at most
  ``body_timeout_s`` between two reads (re-armed lazily, not per read), and an idle
  keep-alive connection is closed after ``keepalive_timeout_s``;
* the listener's :class:`~berth.http_server.limits.ConnectionGate` admits or refuses the
  connection when it is made (``503``/``429``, then closed).

An error answer ends the connection with a *lingering close*: what the client still sends
is read and dropped for up to :data:`LINGER_S`, so that closing a socket with unread bytes
does not make the kernel reset the connection before the client has read the answer.

Requests pipelined behind one in progress wait their turn (reading pauses meanwhile) and
are answered in order (RFC 9112 section 9.3.2). ``Expect: 100-continue`` is answered when the
handler first reads the body, and not at all if it answers first.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.parse
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

import httptools

from berth.http_server.errors import (
    HeadTooLargeError,
    HttpServerError,
    MalformedRequestError,
    RequestTimeoutError,
)
from berth.http_server.limits import ConnectionGate, DiscardBudget, ListenerLimits
from berth.http_server.request import Request
from berth.http_server.writer import ResponseWriter, error_answer

log = logging.getLogger(__name__)

#: Handles one request: reads ``request``'s body if it wants it, answers through the writer.
Handler = Callable[[Request, ResponseWriter], Coroutine[Any, Any, None]]

#: Seconds an error answer's connection goes on reading (and dropping) before it closes.
LINGER_S = 1.0

_IDLE, _HEAD, _BODY, _READ = range(4)  # what the connection is reading


class _HeadRefused(Exception):
    """Raised inside a parser callback to stop parsing an oversized head."""


@dataclass
class ListenerState:
    """What the connections of one listener share: its handler, bounds, gate, open
    connections and handler tasks, and whether it still accepts new requests."""

    name: str
    handler: Handler
    limits: ListenerLimits
    gate: ConnectionGate
    discard: DiscardBudget
    connections: set[HttpConnection] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    accepting: bool = True


class HttpConnection(asyncio.Protocol):
    """One client connection: the protocol side of berth's HTTP/1.1 server."""

    def __init__(self, state: ListenerState, loop: asyncio.AbstractEventLoop) -> None:
        self._state = state
        self._limits = state.limits
        self.loop = loop
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self._parser = httptools.HttpRequestParser(self)
        # Answer the request before a "Connection: close" one, pipelined (as uvicorn does).
        self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.lost = False
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._discard_paused = False  # paused by the listener's DiscardBudget
        self._admitted = False
        self._address: str | None = None
        self._client: tuple[str, int] | None = None
        self._server: tuple[str, int] | None = None
        self._scheme = "http"
        self._discarding = False
        self._shutting_down = False
        # What is being read.
        self._phase = _IDLE
        self._head_bytes = 0
        self._header_count = 0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect_continue = False
        self._parsing: Request | None = None  # the request whose body is being read
        self._parsing_answered = False  # ... and it has been answered: drop the rest
        self._body_read_at = 0.0
        # What is being answered.
        self._active: tuple[Request, ResponseWriter] | None = None
        self._queue: deque[Request] = deque()
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._client = (str(peer[0]), int(peer[1]))
            self._address = self._client[0]
        local = transport.get_extra_info("sockname")
        if isinstance(local, tuple) and len(local) >= 2:
            self._server = (str(local[0]), int(local[1]))
        if transport.get_extra_info("ssl_object") is not None:
            self._scheme = "https"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Heads and answers are written whole; never let Nagle hold one back.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        refusal = self._state.gate.admit(self._address)
        if refusal is not None:
            log.warning("%s listener: %s", self._state.name, refusal)
            self._answer_error(refusal)
            return
        self._admitted = True
        self._state.connections.add(self)
        # The first head must come within the head timeout of the connection.
        self._phase = _HEAD
        self._arm(self._limits.head_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._cancel_timer()
        if self._admitted:
            self._admitted = False
            self._state.gate.release(self._address)
            self._state.connections.discard(self)
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        active = self._active
        if active is not None and not active[1].complete:
            active[0].disconnected()
        parsing = self._parsing
        if parsing is not None and (active is None or parsing is not active[0]):
            parsing.disconnected()
        for queued in self._queue:
            queued.disconnected()
        self._queue.clear()

    def eof_received(self) -> bool | None:
        # The client half-closed: an answer in progress may still be written, then close.
        return None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        phase = self._phase
        if phase == _IDLE:
            # The first byte of the next request: its head must come within the timeout.
            self._phase = _HEAD
            self._arm(self._limits.head_timeout_s, self._head_timed_out)
        elif phase == _BODY:
            self._body_read_at = now = self.loop.time()
            if self._parsing_answered:  # the rest of a body answered unread: dropped, paced
                wait_s = self._state.discard.take(len(data), now)
                if wait_s > 0 and not self._reading_paused:
                    self.pause_reading()
                    self._discard_paused = True
                    self.loop.call_later(wait_s, self._discard_resume)
        limit = self._limits.max_head_bytes
        try:
            while data:
                if self._phase == _HEAD:
                    # The parser holds an unfinished header in memory: feed at most the
                    # head's allowance while the head is incomplete.
                    room = limit - self._head_bytes
                    if room <= 0:
                        raise _HeadRefused
                    piece, data = data[:room], data[room:]
                    self._head_bytes += len(piece)
                else:
                    piece, data = data, b""
                self._parser.feed_data(piece)
                if self._discarding:
                    return
        except _HeadRefused:
            self._refuse_head()
        except httptools.HttpParserUpgrade:
            # An Upgrade (WebSocket, h2c) nobody here speaks: the request is answered as
            # plain HTTP/1.1 (its head is already out), and the connection closes after.
            if self._parsing is not None:
                self._parsing.keep_alive = False
                self._parsing.end()
                self._parsing = None
            self._phase = _READ
            self._discarding = True
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadRefused):  # raised by on_header, wrapped
                self._refuse_head()
                return
            log.info("%s listener: malformed request from %s: %s", self._state.name,
                     self._address or "the socket", exc)  # fmt: skip
            self._fail_connection(MalformedRequestError(f"malformed HTTP request: {exc}"))

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._phase != _HEAD:  # pipelined behind a finished body, in the same read
            self._phase = _HEAD
            self._head_bytes = 0
            self._arm(self._limits.head_timeout_s, self._head_timed_out)
        self._header_count = 0
        self._url = b""
        self._headers = []
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self._limits.max_header_count:
            raise _HeadRefused
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        parsed = httptools.parse_url(self._url)
        raw_path: bytes = parsed.path
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        request = Request(
            self,
            method=parser.get_method().decode("ascii"),
            path=path,
            raw_path=raw_path,
            query=parsed.query or b"",
            headers=self._headers,
            http_version=parser.get_http_version(),
            keep_alive=parser.should_keep_alive(),
            client=self._client,
            server=self._server,
            scheme=self._scheme,
            expect_continue=self._expect_continue,
        )
        self._parsing = request
        self._parsing_answered = False
        self._phase = _BODY
        self._body_read_at = self.loop.time()
        self._cancel_timer()
        if self._active is None:
            self._start(request)
        else:
            self._queue.append(request)
            self.pause_reading()  # one at a time: the next head waits for this answer

    def on_body(self, body: bytes) -> None:
        request = self._parsing
        if request is not None and not self._parsing_answered:
            request.feed(body)
        # else answered already (e.g. 413): the rest of the body is read and dropped

    def on_message_complete(self) -> None:
        request = self._parsing
        self._parsing = None
        self._phase = _READ
        self._cancel_timer()
        if request is not None:
            request.end()
        if self._active is None and not self._queue:
            self._go_idle()

    # -- for requests and writers -------------------------------------------------------------

    @property
    def keeps_alive(self) -> bool:
        """False once the listener is shutting down: answers then close their connection."""
        return not self._shutting_down

    def pause_reading(self) -> None:
        if not self._reading_paused and not self.lost:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and not self._queue and not self.lost:
            self._reading_paused = False
            self.transport.resume_reading()

    def _discard_resume(self) -> None:
        if self._discard_paused:
            self._discard_paused = False
            self.resume_reading()

    def send_interim(self, request: Request, data: bytes) -> None:
        active = self._active
        if active is not None and active[0] is request and not active[1].started:
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its low-water mark (or the connection
        is gone)."""
        while self.write_paused and not self.lost:
            waiter = self._drain_waiter = self.loop.create_future()
            try:
                await waiter
            finally:
                self._drain_waiter = None

    def response_done(self, writer: ResponseWriter, keep_alive: bool) -> None:
        """``writer``'s answer has been written in full."""
        active = self._active
        if active is None or active[1] is not writer:
            return
        self._active = None
        if self._parsing is writer.request:
            self._parsing_answered = True
        if not keep_alive or self._shutting_down:
            if self._parsing is not None and not self._parsing.body_complete:
                self._linger()  # unread body: do not reset the connection under the answer
            else:
                self.transport.close()
            return
        if self._queue:
            self._start(self._queue.popleft())
            if not self._queue:
                self.resume_reading()
        elif self._phase == _READ:
            self._go_idle()
        else:
            self.resume_reading()  # the rest of an unread body is read and dropped

    # -- the server ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """The listener is closing: close now if idle, else after the answer in progress."""
        self._shutting_down = True
        if self._active is None and not self.lost:
            self.transport.close()

    def abort(self) -> None:
        """Close the connection at once (shutdown's grace is over)."""
        if not self.lost:
            self.transport.abort()

    # -- internals ----------------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        writer = ResponseWriter(self, request)
        self._active = (request, writer)
        task = self.loop.create_task(self._state.handler(request, writer))
        self._state.tasks.add(task)
        task.add_done_callback(lambda t: self._handler_done(t, request, writer))
        if self._parsing is request:  # its body is still coming
            self._body_read_at = self.loop.time()
            self._arm(self._limits.body_timeout_s, self._body_timed_out)

    def _handler_done(
        self, task: asyncio.Task[None], request: Request, writer: ResponseWriter
    ) -> None:
        self._state.tasks.discard(task)
        if task.cancelled():
            error: BaseException | None = None
        else:
            error = task.exception()
        if error is not None:
            log.error("%s listener: %s %s failed", self._state.name, request.method,
                      request.path, exc_info=error)  # fmt: skip
        if writer.complete or self.lost:
            return
        if error is not None and not writer.started:
            self._answer_error(error)  # a 500 that names nothing of the bug
        elif not writer.started and not task.cancelled():
            log.error("%s listener: %s %s returned without answering", self._state.name,
                      request.method, request.path)  # fmt: skip
            self._answer_error(RuntimeError("no answer"))
        else:
            # An answer left unfinished (its source failed, or the task was cancelled): the
            # client must see it cut short, not complete-looking.
            self.transport.close()

    def _go_idle(self) -> None:
        self._phase = _IDLE
        self._head_bytes = 0
        self._arm(self._limits.keepalive_timeout_s, self._idle_timed_out)
        self.resume_reading()

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        timer = self._timer
        if timer is not None:
            timer.cancel()
        self._timer = self.loop.call_later(delay_s, callback)

    def _cancel_timer(self) -> None:
        timer = self._timer
        if timer is not None:
            timer.cancel()
            self._timer = None

    def _idle_timed_out(self) -> None:
        self._timer = None
        if self._phase == _IDLE and self._active is None and not self.lost:
            self.transport.close()

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._phase != _HEAD or self.lost:
            return
        timeout_s = self._limits.head_timeout_s
        if self._head_bytes == 0:
            self.transport.close()  # nothing asked, nothing to answer
        else:
            self._fail_connection(
                RequestTimeoutError(f"the request head did not arrive within {timeout_s:g} s")
            )

    def _body_timed_out(self) -> None:
        self._timer = None
        if self._phase != _BODY or self.lost:
            return
        timeout_s = self._limits.body_timeout_s
        if self._reading_paused:  # the reader is behind, not the client: wait for it
            self._body_read_at = self.loop.time()
        idle_s = self.loop.time() - self._body_read_at
        if idle_s < timeout_s:  # something came since the timer was set: wait the rest
            self._arm(timeout_s - idle_s, self._body_timed_out)
            return
        request = self._parsing
        if self._parsing_answered:  # the rest of an answered body stopped coming: just close
            self.transport.close()
            return
        error = RequestTimeoutError(f"no part of the request body came for {timeout_s:g} s")
        if request is not None:
            request.fail(error)
        self._fail_connection(error)

    def _refuse_head(self) -> None:
        limits = self._limits
        self._fail_connection(
            HeadTooLargeError(
                f"the request head is over {limits.max_head_bytes} bytes or "
                f"{limits.max_header_count} header lines"
            )
        )

    def _fail_connection(self, error: HttpServerError) -> None:
        """Answer ``error`` if no answer has begun, then end the connection."""
        active = self._active
        if active is not None:
            writer = active[1]
            if writer.started:
                self.transport.close()  # an answer is under way: it can only be cut short
                self._discarding = True
                return
            writer.complete = True  # whatever the handler writes now is dropped
            writer.started = True
        self._answer_error(error)

    def _answer_error(self, error: BaseException) -> None:
        self.transport.write(error_answer(error))
        self._linger()

    def _linger(self) -> None:
        self._discarding = True
        self._phase = _READ
        if self._reading_paused and not self.lost:  # read (and drop) even with a queue
            self._reading_paused = False
            self.transport.resume_reading()
        self._arm(LINGER_S, self._close_now)

    def _close_now(self) -> None:
        self._timer = None
        if not self.lost:
            self.transport.close()
