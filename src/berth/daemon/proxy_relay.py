"""Relaying an engine's answer to the client, for the proxy (:mod:`berth.daemon.proxy`).

JSON is sent whole when small, otherwise chunk by chunk; an event stream is relayed event by
event; an engine's own 4xx/5xx becomes an OpenAI-shaped error. What happened to the request
(status, time to first byte, usage, why it failed) is kept in its :class:`Exchange` for the
proxy's metrics.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from berth.daemon.proxy_http import ClientWriter, send_json
from berth.daemon.sse import (
    SSEEventSplitter,
    Usage,
    find_usage,
    has_usage_object,
    last_usage,
    take_usage_event,
)
from berth.engine_http.answer import EngineAnswer
from berth.engine_http.errors import UpstreamError, UpstreamTimeoutError
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
    """

    __slots__ = (
        "answer_bytes",
        "answer_headers",
        "client_gone",
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
    ) -> None:
        self.start = start
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
    :class:`~berth.daemon.proxy.OpenAIProxy`'s.

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
                exchange.usage = find_usage(data)
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
            exchange.usage = find_usage(tail)

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
            exchange.error_reason = "stream_aborted"
            _log.warning("request %s: engine failed mid-stream: %r", request_id.decode(), exc)
            if splitter is not None:
                last = stream_error_events(
                    "the engine failed while streaming the answer", code="stream_aborted"
                )
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
        exchange.status = status
        exchange.error_reason = "engine_status"
        exchange.done = True
        extra = _relayed_error_headers(response) + exchange.answer_headers
        await send_json(writer, status, body, request_id, extra)


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
