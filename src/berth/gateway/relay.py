"""Relaying an engine's answer to the client, for the proxy (:mod:`berth.gateway.proxy`).

JSON is sent whole when small, otherwise chunk by chunk; an event stream is relayed event by
event; an engine's own 4xx/5xx becomes an OpenAI-shaped error. What happened to the request
(status, time to first byte, usage, why it failed) is kept in its
:class:`~berth.gateway.outcome.Exchange` for the proxy's records.

Which way an answer's body goes is decided once per answer, in one place
(:func:`relay_path`, a :class:`RelayPath`). An event stream whose answer can be pushed
(:class:`~berth.engine_http.answer.PushedAnswer`: a local engine's, or one tunneled from an
agent) to a writer that can be written without waiting
(:class:`~berth.gateway.exchange.PushWriter`: berth's own server) is relayed with no task
wake-up per event (:attr:`RelayPath.PUSH`, :class:`~berth.gateway.push.StreamPush`): the
answer hands each piece of its body to the sink from the callback that received it (the
engine connection's ``data_received``, the agent link's reader dispatching a data frame),
and the piece is split into events, counted, stripped of the usage event berth asked for
and written to the client's transport there and then. The relaying task waits only for the
end, a failure, or backpressure: when a write leaves the client's transport above its
high-water mark the sink pauses the answer (the engine connection stops reading its socket;
a tunnel stream stops granting credit) and the task resumes it once the client has drained.
Cancelling the task (the client left) closes the answer, after which nothing reaches the
sink. Any other pairing is read chunk by chunk by the task (:attr:`RelayPath.PULL`), with
the same bytes to the client; for a writer that waits on every write (ASGI) through a
bounded read-ahead buffer (:attr:`RelayPath.READ_AHEAD`).
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from berth.anthropic_errors import anthropic_body, stream_error_event
from berth.engine_http.answer import EngineAnswer, PushedAnswer, can_push
from berth.engine_http.errors import UpstreamError, UpstreamTimeoutError
from berth.gateway.exchange import ClientWriter, PushWriter, can_write_now, send_json
from berth.gateway.outcome import Exchange
from berth.gateway.push import StreamPush
from berth.gateway.read_ahead import ReadAhead
from berth.gateway.sse import (
    SSEEventSplitter,
    Usage,
    find_usage,
    has_usage_object,
    messages_usage,
)
from berth.openai_errors import error_body, stream_error_events
from berth.routing.errors import EngineTimeoutError, EngineUnreachableError

if TYPE_CHECKING:
    from berth.routing.resolver import Upstream

_log = logging.getLogger(__name__)

# How much of the end of a large, unbuffered JSON answer is kept to find its usage in.
_USAGE_TAIL_BYTES = 16 * 1024
_MAX_ENGINE_ERROR_BYTES = 64 * 1024


class RelayPath(enum.Enum):
    """How an answer's body reaches the client, decided once per answer
    (:func:`relay_path`)."""

    #: the answer hands each piece of its body to the client's transport from the callback
    #: that received it (:class:`~berth.gateway.push.StreamPush`): an event stream from a
    #: pushed answer to berth's own server
    PUSH = "push"
    #: the relaying task reads the answer chunk by chunk and writes each
    PULL = "pull"
    #: :attr:`PULL` through a bounded buffer that reads the engine ahead of a writer that
    #: waits on every write (ASGI), for a streamed or long answer
    READ_AHEAD = "read_ahead"


def relay_path(
    answer: EngineAnswer, writer: ClientWriter, *, streamed: bool, max_buffered_bytes: int
) -> RelayPath:
    """The relay path of ``answer`` to ``writer`` (``streamed``: an event stream; a
    non-streamed answer announced at most ``max_buffered_bytes`` long is read whole). An
    engine's error answer is read whole (:attr:`RelayPath.PULL`)."""
    if answer.status >= 400:
        return RelayPath.PULL
    if not writer.buffers_writes:
        # A writer that waits on every piece: a bounded buffer lets the engine run a little
        # ahead of the client, and stops reading it when the client stalls. (berth's own
        # server needs none: its writes wait only while the client's transport buffer is
        # full, which is the same bound.)
        length = answer.content_length
        if streamed or length is None or length > max_buffered_bytes:
            return RelayPath.READ_AHEAD
        return RelayPath.PULL
    if streamed and can_push(answer) and can_write_now(writer):
        return RelayPath.PUSH
    return RelayPath.PULL


class AnswerRelay:
    """Sends an engine's answer to the client; its limits are
    :class:`~berth.gateway.proxy.OpenAIProxy`'s.

    ``max_buffered_response_bytes``: a non-streamed answer announced at most this long is read
    whole and sent with a ``Content-Length``. ``max_event_bytes`` bounds how much of one
    unfinished SSE event is held back. ``read_timeout_s`` is only named in errors; ``clock``
    times the first byte.
    """

    def __init__(
        self,
        *,
        read_timeout_s: float | None,
        max_buffered_response_bytes: int,
        max_event_bytes: int,
        clock: Callable[[], float],
        read_ahead_chunks: int,
    ) -> None:
        self._read_timeout_s = read_timeout_s
        self._max_buffered_response_bytes = max_buffered_response_bytes
        self._max_event_bytes = max_event_bytes
        self._clock = clock
        self._read_ahead_chunks = read_ahead_chunks

    async def relay(
        self,
        upstream: Upstream,
        response: EngineAnswer,
        request_id: bytes,
        writer: ClientWriter,
        exchange: Exchange,
    ) -> None:
        """Relay ``response`` (``upstream``'s engine's answer) to ``writer`` on its path
        (:func:`relay_path`): an engine error as an error, an event stream event by event,
        anything else as a body; the answer is closed at the end, whatever happened."""
        try:
            content_type = response.header(b"content-type") or b"application/json"
            encoding = response.header(b"content-encoding")
            streamed = content_type.startswith(b"text/event-stream")
            path = relay_path(
                response,
                writer,
                streamed=streamed,
                max_buffered_bytes=self._max_buffered_response_bytes,
            )
            if path is RelayPath.READ_AHEAD:
                response = ReadAhead(response, self._read_ahead_chunks)
            if response.status >= 400:
                await self.relay_engine_error(response, content_type, request_id, writer, exchange)
            elif streamed:
                push = path is RelayPath.PUSH
                await self.relay_stream(
                    response, content_type, encoding, request_id, writer, exchange, push=push
                )
            else:
                await self.relay_body(
                    response, upstream, content_type, encoding, request_id, writer, exchange
                )
        finally:
            # An answer read to its end has already put its connection back in the pool; one
            # that was not (the client left, the engine failed) closes it, which is what tells
            # the engine to stop generating.
            response.close()

    async def relay_body(
        self,
        response: EngineAnswer,
        upstream: Upstream,
        content_type: bytes,
        encoding: bytes | None,
        request_id: bytes,
        writer: ClientWriter,
        exchange: Exchange,
    ) -> None:
        """A non-streamed answer: whole when small, else chunk by chunk (never as SSE)."""
        status = response.status
        headers = [(b"content-type", content_type), (b"x-request-id", request_id)]
        if encoding:
            headers.append((b"content-encoding", encoding))
        headers += exchange.answer_headers
        length = response.content_length
        if length is not None and length <= self._max_buffered_response_bytes:
            try:
                data = await response.read()
            except UpstreamTimeoutError as exc:
                raise EngineTimeoutError(upstream, self._read_timeout_s) from exc
            except UpstreamError as exc:
                why = f"failed while answering ({exc.why})"
                raise EngineUnreachableError(upstream, why) from exc
            headers.append((b"content-length", b"%d" % len(data)))
            exchange.answer_bytes = len(data)
            exchange.status = status
            exchange.done = True
            await writer.start(status, headers)
            exchange.ttfb_s = self._clock() - exchange.start
            await writer.end(data)
            if encoding is None:
                usage = _body_usage(data, exchange) if exchange.dialect else find_usage(data)
                exchange.usage = usage
            return

        exchange.status = status
        await writer.start(status, headers)
        tail = b""
        last = b""
        try:
            while chunk := await response.read_chunk():
                if exchange.ttfb_s is None:
                    exchange.ttfb_s = self._clock() - exchange.start
                exchange.answer_bytes += len(chunk)
                keep = _USAGE_TAIL_BYTES - len(chunk)
                tail = tail[-keep:] + chunk if keep > 0 else chunk[-_USAGE_TAIL_BYTES:]
                if response.at_eof:
                    last = chunk
                    break
                await writer.write(chunk)
        except UpstreamError as exc:
            # Leave the answer unfinished: the server then drops the connection, so the client
            # sees a truncated body instead of a complete-looking one.
            exchange.error_reason = "engine_aborted"
            _log.warning("request %s: engine failed mid-answer: %r", request_id.decode(), exc)
            return
        exchange.done = True
        await writer.end(last)
        if encoding is None:
            exchange.usage = _body_usage(tail, exchange) if exchange.dialect else find_usage(tail)

    async def relay_stream(
        self,
        response: EngineAnswer,
        content_type: bytes,
        encoding: bytes | None,
        request_id: bytes,
        writer: ClientWriter,
        exchange: Exchange,
        *,
        push: bool = False,
    ) -> None:
        """An event stream: relay each complete event as soon as it arrives.

        Reads one chunk, sends it, then reads the next, so a slow client slows the reading
        from the engine (the writer waits while the client's buffer is full); with ``push``
        (:attr:`RelayPath.PUSH`: ``response`` is a pushed answer, ``writer`` a push writer)
        the answer hands each piece over instead (:class:`StreamPush`).
        Whole events are relayed, so that a failure can end the stream with a clean error
        event; a partial event is held back at most ``max_event_bytes``.
        """
        headers = [
            (b"content-type", content_type),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            (b"x-request-id", request_id),
        ]
        if encoding:
            headers.append((b"content-encoding", encoding))
        headers += exchange.answer_headers
        exchange.status = response.status
        exchange.streamed = True
        await writer.start(response.status, headers)
        # Compressed bytes cannot be split into events; relay them as they come.
        splitter = SSEEventSplitter() if encoding is None else None
        strip = exchange.strip_usage and splitter is not None
        if push:
            pusher = cast(PushWriter, writer)
            pushed = StreamPush(
                cast(PushedAnswer, response),
                pusher,
                exchange,
                splitter,
                strip,
                self._max_event_bytes,
                self._clock,
            )
            failure = await pushed.run()
            if failure is not None:
                ending = _broken_stream(failure, request_id, exchange)
                exchange.done = True
                pusher.end_now(ending if splitter is not None else b"")
            return
        last = b""
        try:
            while chunk := await response.read_chunk():
                if splitter is not None:
                    chunk = splitter.feed(chunk)
                    if splitter.pending_bytes > self._max_event_bytes:
                        chunk += splitter.take_pending()
                    if not chunk:
                        continue
                    exchange.events += chunk.count(b"\n\n")
                    # Usage comes once, last; two substring tests skip every other event.
                    if has_usage_object(chunk):
                        chunk = exchange.note_stream_usage(chunk, strip=strip)
                if exchange.ttfb_s is None:
                    exchange.ttfb_s = self._clock() - exchange.start
                if response.at_eof:
                    # The engine's answer is complete: this chunk ends ours too, in one write.
                    last = chunk
                    break
                if chunk:  # empty when it held only the usage event taken out
                    await writer.write(chunk)
        except UpstreamError as exc:
            ending = _broken_stream(exc, request_id, exchange)
            if splitter is not None:
                last = ending
        else:
            if splitter is not None:
                last += splitter.take_pending()
        exchange.done = True
        await writer.end(last)

    async def relay_engine_error(
        self,
        response: EngineAnswer,
        content_type: bytes,
        request_id: bytes,
        writer: ClientWriter,
        exchange: Exchange,
    ) -> None:
        """The engine's own 4xx/5xx: same status, its message, in the OpenAI error shape."""
        status = response.status
        try:
            data = await response.read(_MAX_ENGINE_ERROR_BYTES)
        except UpstreamError:
            data = b""
        body = _as_openai_error(data, content_type, status)
        if exchange.dialect:
            body = anthropic_body(body, status)
        exchange.status = status
        exchange.error_reason = "engine_status"
        exchange.done = True
        extra = _relayed_error_headers(response) + exchange.answer_headers
        await send_json(writer, status, body, request_id, extra)


def _broken_stream(failure: UpstreamError, request_id: bytes, exchange: Exchange) -> bytes:
    """Record why a stream broke off after it began (``exchange.error_reason``: the
    engine's silence past the stream's idle timeout, ``stream_idle_timeout``, or another
    failure, ``stream_aborted``), and return the error event (then ``[DONE]``) that ends
    the client's stream."""
    rid = request_id.decode()
    if isinstance(failure, UpstreamTimeoutError):
        exchange.error_reason = code = "stream_idle_timeout"
        message = f"the engine sent nothing for {failure.timeout_s:g} s while streaming"
        _log.warning("request %s: %s; the stream ends", rid, message)
    else:
        exchange.error_reason = code = "stream_aborted"
        message = "the engine failed while streaming the answer"
        _log.warning("request %s: engine failed mid-stream: %r", rid, failure)
    if exchange.dialect:
        return stream_error_event(message)
    return stream_error_events(message, code=code)


def _body_usage(data: bytes, exchange: Exchange) -> Usage | None:
    """The usage of a non-streamed Messages API answer (``data``: it whole, or its last
    bytes); a token count's answer used none."""
    if exchange.dialect == "count_tokens":
        return Usage(prompt_tokens=0, completion_tokens=0)
    return messages_usage(data)


def _as_openai_error(data: bytes, content_type: bytes, status: int) -> bytes:
    """An engine's error body in the OpenAI shape, unchanged when it already is one.

    Some engines (vLLM, SGLang) answer ``{"object": "error", "message": ...}``; plain-text
    bodies happen too. Their message is kept, wrapped in ``{"error": {...}}``.
    """
    default_type = "invalid_request_error" if status < 500 else "server_error"
    message = ""
    if b"json" in content_type:
        try:
            payload = json.loads(data)
        except ValueError:
            payload = None
        if isinstance(payload, dict):
            if isinstance(payload.get("error"), dict):
                return data
            found = payload.get("message")
            message = found if isinstance(found, str) else ""
    else:
        message = data.decode("utf-8", errors="replace").strip()[:2000]
    return error_body(
        message or f"the engine answered HTTP {status}", type=default_type, code="engine_error"
    )


def _relayed_error_headers(response: EngineAnswer) -> list[tuple[bytes, bytes]]:
    retry_after = response.header(b"retry-after")
    return [(b"retry-after", retry_after)] if retry_after else []
