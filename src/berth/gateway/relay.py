"""Relaying an engine's answer to the client, for the proxy (:mod:`berth.gateway.proxy`).

JSON is sent whole when small, otherwise chunk by chunk; an event stream is relayed event by
event; an engine's own 4xx/5xx becomes an OpenAI-shaped error. What happened to the request
(status, time to first byte, usage, why it failed) is kept in its :class:`Exchange` for the
proxy's metrics.

An event stream whose answer can be pushed (:class:`~berth.engine_http.answer.PushedAnswer`:
a local engine's, or one tunneled from an agent) to a writer that can be written without
waiting (:class:`~berth.gateway.exchange.PushWriter`: berth's own server) is relayed with no
task wake-up per event (:class:`StreamPush`): the answer hands each piece of its body to the
sink from the callback that received it (the engine connection's ``data_received``, the
agent link's reader dispatching a data frame), and the piece is split into events, counted,
stripped of the usage event berth asked for and written to the client's transport there and
then. The relaying task waits only for the end, a failure, or backpressure: when a write
leaves the client's transport above its high-water mark the sink pauses the answer (the
engine connection stops reading its socket; a tunnel stream stops granting credit) and the
task resumes it once the client has drained. Cancelling the task (the client left) closes
the answer, after which nothing reaches the sink. Any other pairing (the ASGI writer, the
read-ahead buffer) is read chunk by chunk by the task, with the same bytes to the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from berth.anthropic_errors import anthropic_body, stream_error_event
from berth.engine_http.answer import EngineAnswer, PushedAnswer, can_push
from berth.engine_http.errors import UpstreamError, UpstreamTimeoutError
from berth.gateway.exchange import ClientWriter, PushWriter, can_write_now, send_json
from berth.gateway.sse import (
    SSEEventSplitter,
    Usage,
    find_usage,
    has_usage_object,
    last_usage,
    messages_stream_usage,
    messages_usage,
    take_usage_event,
)
from berth.openai_errors import error_body, stream_error_events
from berth.routing.errors import EngineTimeoutError, EngineUnreachableError

if TYPE_CHECKING:
    from berth.routing.resolver import Upstream

_log = logging.getLogger(__name__)

# How much of the end of a large, unbuffered JSON answer is kept to find its usage in.
_USAGE_TAIL_BYTES = 16 * 1024
_MAX_ENGINE_ERROR_BYTES = 64 * 1024


class Exchange:
    """What happened to one relayed request, for its metrics, its key's usage and the
    disconnect watcher.

    ``answer_headers`` go on the answer whatever it is (a key's rate-limit headers);
    ``strip_usage`` says berth asked the engine for a stream's usage on the client's behalf,
    so the usage event is taken out of what the client receives. ``answer_bytes`` and
    ``events`` measure the answer, for a token estimate when the engine reports no usage.
    ``dialect`` is the API the request spoke: ``""`` for OpenAI's, ``"messages"`` for
    Anthropic's Messages (its usage form, its error shape), ``"count_tokens"`` for its
    token count (an answer that used no tokens).
    """

    __slots__ = (
        "answer_bytes",
        "answer_headers",
        "client_gone",
        "dialect",
        "done",
        "error_reason",
        "events",
        "start",
        "status",
        "streamed",
        "strip_usage",
        "ttfb_s",
        "usage",
    )

    def __init__(
        self,
        start: float,
        answer_headers: list[tuple[bytes, bytes]] | None = None,
        *,
        strip_usage: bool = False,
        dialect: str = "",
    ) -> None:
        self.start = start
        self.dialect = dialect
        self.status = 0
        self.ttfb_s: float | None = None
        self.usage: Usage | None = None
        self.error_reason: str | None = None
        self.answer_headers = answer_headers or []
        self.strip_usage = strip_usage
        self.answer_bytes = 0
        self.events = 0
        self.streamed = False
        # Set just before the final body message: from then on a disconnect is not an abort.
        self.done = False
        self.client_gone = False


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
    ) -> None:
        self._read_timeout_s = read_timeout_s
        self._max_buffered_response_bytes = max_buffered_response_bytes
        self._max_event_bytes = max_event_bytes
        self._clock = clock

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
    ) -> None:
        """An event stream: relay each complete event as soon as it arrives.

        Reads one chunk, sends it, then reads the next, so a slow client slows the reading
        from the engine (the writer waits while the client's buffer is full).
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
        if can_push(response) and can_write_now(writer):
            push = StreamPush(
                response, writer, exchange, splitter, strip, self._max_event_bytes, self._clock
            )
            failure = await push.run()
            if failure is not None:
                ending = _broken_stream(failure, request_id, exchange)
                exchange.done = True
                writer.end_now(ending if splitter is not None else b"")
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
                        if strip:
                            chunk, usage = take_usage_event(chunk)
                        elif exchange.dialect:
                            usage = messages_stream_usage(chunk, exchange.usage)
                        else:
                            usage = last_usage(chunk)
                        exchange.usage = usage or exchange.usage
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


class StreamPush:
    """Relays a pushed event stream to ``writer`` (see the module docstring): the
    :class:`~berth.engine_http.answer.BodySink` of ``answer``, and :meth:`run` for the task
    that waits on it.

    What it does with each piece is what :meth:`AnswerRelay.relay_stream` does when it
    reads: ``splitter`` (``None`` for a compressed stream) holds back a partial event, at
    most ``max_event_bytes``; ``exchange`` counts the events and takes the usage (``strip``:
    and takes the usage event out); the first event times ``exchange.ttfb_s`` by ``clock``;
    the last piece ends the answer in the same write.
    """

    __slots__ = (
        "_answer",
        "_bug",
        "_clock",
        "_ended",
        "_exchange",
        "_failure",
        "_max_event_bytes",
        "_paused",
        "_splitter",
        "_strip",
        "_waiter",
        "_writer",
    )

    def __init__(
        self,
        answer: PushedAnswer,
        writer: PushWriter,
        exchange: Exchange,
        splitter: SSEEventSplitter | None,
        strip: bool,
        max_event_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        self._answer = answer
        self._writer = writer
        self._exchange = exchange
        self._splitter = splitter
        self._strip = strip
        self._max_event_bytes = max_event_bytes
        self._clock = clock
        self._ended = False
        self._paused = False
        self._failure: UpstreamError | None = None
        self._bug: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    async def run(self) -> UpstreamError | None:
        """Push the answer's body to the client until it ends: ``None`` once the answer
        is complete (and ended), the engine's failure when it broke off (the answer is left
        for the caller to end). Raises a bug of the sink's, and ``CancelledError``."""
        answer = self._answer
        answer.push_body(self)
        loop = asyncio.get_running_loop()
        while True:
            if self._bug is not None:
                raise self._bug
            if self._ended:
                return None
            if self._failure is not None:
                return self._failure
            if self._paused:
                await self._writer.drain()
                self._paused = False
                answer.resume_body()
                continue
            waiter = self._waiter = loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    # -- BodySink: called from the answer's connection ------------------------------------

    def body_received(self, data: bytes, end: bool) -> None:
        if self._ended or self._failure is not None or self._bug is not None:
            return
        try:
            self._relay(data, end)
        except Exception as exc:  # a bug: kept for the task, which raises it
            self._bug = exc
            self._wake()

    def body_failed(self, error: UpstreamError) -> None:
        if not self._ended and self._failure is None:
            self._failure = error
            self._wake()

    def _relay(self, chunk: bytes, end: bool) -> None:
        exchange = self._exchange
        splitter = self._splitter
        if splitter is not None:
            chunk = splitter.feed(chunk)
            if splitter.pending_bytes > self._max_event_bytes:
                chunk += splitter.take_pending()
            if chunk:
                exchange.events += chunk.count(b"\n\n")
                # Usage comes once, last; two substring tests skip every other event.
                if has_usage_object(chunk):
                    if self._strip:
                        chunk, usage = take_usage_event(chunk)
                    elif exchange.dialect:
                        usage = messages_stream_usage(chunk, exchange.usage)
                    else:
                        usage = last_usage(chunk)
                    exchange.usage = usage or exchange.usage
                if exchange.ttfb_s is None:
                    exchange.ttfb_s = self._clock() - exchange.start
            if end:
                chunk += splitter.take_pending()
        elif chunk and exchange.ttfb_s is None:
            exchange.ttfb_s = self._clock() - exchange.start
        writer = self._writer
        if end:
            # The engine's answer is complete: this piece ends ours too, in one write.
            self._ended = True
            exchange.done = True
            writer.end_now(chunk)
            self._wake()
            return
        if chunk:  # empty when it held only the usage event taken out
            writer.write_now(chunk)
            if writer.write_paused and not self._paused:
                self._paused = True
                self._answer.pause_body()
                self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


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
