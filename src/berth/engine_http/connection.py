"""One keep-alive TCP connection to an engine: the ``asyncio.Protocol`` side of berth's HTTP/1.1
client (:mod:`berth.engine_http.pool`).

It writes a request, feeds the bytes that come back to ``httptools`` (llhttp, the parser
uvicorn uses) and keeps what it parsed in an
:class:`~berth.engine_http.response.UpstreamResponse` for the task that reads the answer, or,
once the answer is pushed (``UpstreamResponse.push_body``), hands the body bytes of each
socket read to the answer's sink from ``data_received`` itself, with no task in between;
the read timeout then runs between two reads, and not while the sink has paused reading.

Message framing follows RFC 9112: the body of an answer ends where its ``Content-Length`` says
(section 6.3, rule 6), with the last chunk of a chunked transfer coding (section 7.1, decoded
by the parser), or, with neither, when the engine closes the connection (section 6.3, rule 8);
1xx interim answers are skipped (RFC 9110 section 15.2). A connection goes back to the pool
only when its answer ended cleanly and persistence was not declined (``Connection: close``, or
HTTP/1.0 without ``keep-alive``: RFC 9112 section 9.3); a close-delimited answer can never
leave it reusable. A connection whose answer was abandoned, failed or timed out is closed,
which is also how an engine learns that nobody waits for its answer any more.

A reused connection closed before any byte of its answer raises
:class:`StaleConnectionError`, which the pool never lets out: it sends the request again.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Protocol, cast

import httptools

from berth.engine_http.errors import (
    UpstreamDisconnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
)
from berth.engine_http.response import UpstreamResponse

if TYPE_CHECKING:
    from berth.engine_http.origin import Origin


class ConnectionOwner(Protocol):
    """What a connection needs of the pool that made it
    (:class:`berth.engine_http.pool.UpstreamPool`): its loop, its limits, and to be told
    when the connection is free again (:meth:`release`) or gone (:meth:`forget`)."""

    loop: asyncio.AbstractEventLoop
    read_timeout_s: float | None
    high_water_bytes: int

    def release(self, conn: UpstreamConnection) -> None: ...

    def forget(self, conn: UpstreamConnection) -> None: ...


class StaleConnectionError(UpstreamError):
    """A reused connection was closed before any byte of the answer: the engine had ended it
    while it was idle. Nothing was answered, so the request may be sent again."""


class UpstreamConnection(asyncio.Protocol):
    """One TCP connection to an engine and its parser: the protocol side of the client."""

    def __init__(self, pool: ConnectionOwner, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self._loop = pool.loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self.gone = False  # closed, or closing: never used again
        self.reused = False  # has carried a complete answer before
        self.idle_since = 0.0  # loop time it last went back to the pool idle
        self.reading_paused = False
        # The exchange in flight, if any.
        self._busy = False
        self._head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None  # None once complete or abandoned
        self._headers_done = False
        self._received = False  # some byte of the answer has arrived
        self._keep_alive = False
        self._close_delimited = False
        self._interim = False  # parsing a 1xx answer
        self._finished = False  # the answer ended during the current feed_data
        self._unexpected = False  # bytes nobody asked for
        # The read timeout of the body: one timer per answer, not one per wait (a stream
        # waits once per event). It fires at the earliest possible deadline and looks at
        # when the current wait began.
        self._body_timer: asyncio.TimerHandle | None = None
        self._waiting_since = 0.0
        # The body's read timeout of the exchange in flight: the pool's, unless the reader
        # set its own (set_body_timeout: a stream's longest silence).
        self._body_timeout_s = pool.read_timeout_s

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Requests are written in one piece; never let Nagle hold back the next one.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            # An idle connection has nothing to say; whatever it is, it is not to be trusted.
            self._discard()
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(self.origin, f"sent a malformed answer ({exc})"))
            return
        if self._unexpected:
            self._fail(UpstreamProtocolError(self.origin, "sent bytes after its answer"))
        elif self._finished:
            self._finish()
        else:
            response = self._response
            if response is not None and response._chunks:
                sink = response._sink
                if sink is not None:
                    # Pushed: what this read brought, in one piece, with no task between.
                    self._waiting_since = self._loop.time()
                    response._push(sink)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self._pool.forget(self)
        if not self._busy:
            return
        if self._headers_done and self._close_delimited and exc is None:
            self._complete()  # RFC 9112 section 6.3, rule 8: the close ends the body
            self._busy = False
            return
        error: UpstreamError
        if not self._received and self.reused:
            error = StaleConnectionError(self.origin, "closed an idle connection")
        elif not self._headers_done:
            why = "closed the connection before answering"
            error = UpstreamDisconnectError(self.origin, why, answered=self._received)
        else:
            why = "closed the connection before the answer ended"
            error = UpstreamDisconnectError(self.origin, why, answered=True)
        self._fail(error)

    # -- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        if response is not None:
            response.headers.append((name.lower(), value))
        else:
            self._unexpected = True

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None:
            self._unexpected = True
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim answer (e.g. 103 Early Hints): the final one follows.
            self._interim = True
            response.headers.clear()
            return
        response.status = status
        # Read now: llhttp resets its flags once the message is complete.
        self._keep_alive = self._parser.should_keep_alive()
        length: bytes | None = None
        chunked = False
        for key, value in response.headers:
            if key == b"content-length":
                length = value
            elif key == b"transfer-encoding":
                chunked = True
        if length is not None and not chunked:
            response.content_length = int(length)  # llhttp has checked that it is a number
        bodyless = status == 204 or status == 304
        self._close_delimited = not chunked and length is None and not bodyless
        self._headers_done = True
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def on_body(self, body: bytes) -> None:
        response = self._response
        if response is None:
            self._unexpected = True
            return
        response._chunks.append(body)
        if response._sink is not None:
            return  # handed over at the end of this read (data_received), or its end
        response._size += len(body)
        if response._size > self._pool.high_water_bytes and not self.reading_paused:
            self.pause()
        response._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self._response is None or not self._headers_done:
            self._unexpected = True
            return
        self._complete()
        self._finished = True

    # -- the exchange -------------------------------------------------------------------------

    async def exchange(
        self, data: bytes, body: bytes, read_timeout_s: float | None
    ) -> UpstreamResponse:
        """Send one request (``data``: its head, with the body unless ``body`` holds it) and
        wait for the head of its answer."""
        transport = self._transport
        assert transport is not None and not self._busy
        self._busy = True
        self._received = False
        self._headers_done = False
        self._close_delimited = False
        self._finished = False
        self._body_timeout_s = self._pool.read_timeout_s
        self._response = UpstreamResponse(self)
        waiter: asyncio.Future[UpstreamResponse] = self._loop.create_future()
        self._head_waiter = waiter
        transport.write(data)
        if body:
            transport.write(body)
        timer = (
            self._loop.call_later(read_timeout_s, self._head_timed_out, waiter, read_timeout_s)
            if read_timeout_s is not None
            else None
        )
        try:
            return await waiter
        except asyncio.CancelledError:
            # The client left. The connection may already carry another exchange: an answer
            # that arrived whole as this task was cancelled has put it back in the pool.
            if waiter.cancelled():
                # No head yet: the request is out, so the connection cannot be used again.
                self._response = None
                self._discard()
            elif waiter.exception() is None:
                waiter.result().close()
            raise
        finally:
            if self._head_waiter is waiter:
                self._head_waiter = None
            if timer is not None:
                timer.cancel()

    async def wait_for_body(self, response: UpstreamResponse) -> None:
        """Wait until ``response`` has new body bytes, has ended or has failed; raise
        nothing, but fail the answer with :class:`UpstreamTimeoutError` when the engine sends
        nothing for the body's read timeout during one wait (the pool's ``read_timeout_s``,
        or what :meth:`set_body_timeout` set)."""
        if self.reading_paused:
            self.resume()
        waiter = response._waiter = self._loop.create_future()
        self._waiting_since = now = self._loop.time()
        timeout_s = self._body_timeout_s
        if timeout_s is not None and self._body_timer is None:
            self._body_timer = self._loop.call_at(
                now + timeout_s, self._body_timed_out, response, timeout_s
            )
        try:
            await waiter
        finally:
            response._waiter = None

    def start_push(self, response: UpstreamResponse) -> None:
        """``response``'s body is pushed to its sink from now on: the read timeout runs
        from now, between the pieces, and only while reading is not paused."""
        if self.reading_paused:
            self.resume()
        self._waiting_since = now = self._loop.time()
        timeout_s = self._body_timeout_s
        if timeout_s is not None and self._body_timer is None:
            self._body_timer = self._loop.call_at(
                now + timeout_s, self._body_timed_out, response, timeout_s
            )

    def set_body_timeout(self, timeout_s: float | None) -> None:
        """The longest silence of the answer in flight from the next wait on (``None``: no
        limit), instead of the pool's read timeout: a timer armed for the old one is dropped,
        the next wait (or push) arms it anew."""
        self._body_timeout_s = timeout_s
        self._stop_body_timer()

    def resume_push(self) -> None:
        """Reading a pushed answer again after :meth:`pause`: its read timeout starts over."""
        response = self._response
        if response is not None and response._sink is not None:
            self.start_push(response)
        elif self.reading_paused:
            self.resume()

    @property
    def busy(self) -> bool:
        """An exchange is in flight on this connection."""
        return self._busy

    @property
    def awaiting_head(self) -> bool:
        """A request is out and the head of its answer has not arrived."""
        return self._busy and not self._headers_done

    def give_up(self, why: str) -> None:
        """Fail the exchange in flight and close the connection: its reader raises
        :class:`UpstreamDisconnectError`, ``answered`` saying whether the head had arrived
        (if not, the request may be sent elsewhere)."""
        self._fail(UpstreamDisconnectError(self.origin, why, answered=self._headers_done))

    def abandon(self) -> None:
        """The reader gave up on the answer in flight: close the connection."""
        self._stop_body_timer()
        self._response = None
        self._discard()

    def pause(self) -> None:
        self.reading_paused = True
        if self._transport is not None and not self.gone:
            self._transport.pause_reading()

    def resume(self) -> None:
        self.reading_paused = False
        if self._transport is not None and not self.gone:
            self._transport.resume_reading()

    def close(self) -> None:
        """Close the connection (idle or not)."""
        self._discard()

    # -- internals ----------------------------------------------------------------------------

    def _complete(self) -> None:
        """The answer in flight has all arrived: it no longer needs this connection."""
        self._stop_body_timer()
        response = self._response
        if response is not None:
            self._response = None
            response._complete = True
            response._conn = None
            sink = response._sink
            if sink is not None:
                response._sink = None
                response._push(sink)
            else:
                response._wake()

    def _finish(self) -> None:
        """After the answer ended cleanly: pool the connection, or close it."""
        self._busy = False
        self._finished = False
        if self.reading_paused:
            self.resume()
        if self._keep_alive and not self._close_delimited and not self.gone:
            self.reused = True
            self._pool.release(self)
        else:
            self._discard()

    def _fail(self, error: UpstreamError) -> None:
        self._stop_body_timer()
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        response = self._response
        if response is not None:
            self._response = None
            response._error = error
            response._conn = None
            sink = response._sink
            if sink is not None:
                response._sink = None
                if response._chunks:  # what arrived before the failure goes first
                    response._push(sink)
                sink.body_failed(error)
            else:
                response._wake()
        self._busy = False
        self._discard()

    def _head_timed_out(self, waiter: asyncio.Future[UpstreamResponse], timeout_s: float) -> None:
        if self._head_waiter is waiter and not waiter.done():
            self._fail(UpstreamTimeoutError(self.origin, timeout_s))

    def _body_timed_out(self, response: UpstreamResponse, timeout_s: float) -> None:
        self._body_timer = None
        if self._response is not response:
            return  # done
        if response._sink is None:
            if response._waiter is None:
                return  # nobody waits now: the next wait arms the timer again
        elif self.reading_paused:
            return  # pushed, and the client is slow, not the engine: resuming re-arms it
        due = self._waiting_since + timeout_s
        if self._loop.time() < due:  # this wait began after the timer was set
            self._body_timer = self._loop.call_at(due, self._body_timed_out, response, timeout_s)
            return
        self._fail(UpstreamTimeoutError(self.origin, timeout_s))

    def _stop_body_timer(self) -> None:
        timer = self._body_timer
        if timer is not None:
            self._body_timer = None
            timer.cancel()

    def _discard(self) -> None:
        self._stop_body_timer()
        if not self.gone:
            self.gone = True
            if self._transport is not None:
                self._transport.close()
            self._pool.forget(self)
