"""The OpenAI-compatible proxy: a raw ASGI app relaying ``/v1/*`` requests to engines.

One request, on the hot path::

    read the body (bounded) -> its JSON "model" -> UpstreamResolver.resolve(model)
      -> POST the same bytes to the engine (berth.daemon.upstream: pooled keep-alive HTTP/1.1)
      -> relay the answer: JSON whole, event streams event by event -> ProxyMetrics

There is no framework routing here: this module is called only after authentication, for the
paths it serves (``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/responses``; ``GET /v1/models`` and ``/v1/models/{id}``), and it matches ``scope["path"]``
itself. Errors are answered in the OpenAI shape (:mod:`berth.daemon.openai_errors`); the ones
this module raises are::

    BerthError
    └── ProxyError                 carries error_code (the OpenAI "code" and the metrics reason)
        ├── InvalidRequestError    400 bad JSON / no model; 404 unknown URL; 405 wrong method
        ├── RequestTooLargeError   413 body over max_body_bytes
        ├── NoReadyDeploymentError 503 + Retry-After: the model exists, nothing serves it yet
        ├── EngineUnreachableError 502 connection refused, or closed before an answer
        └── EngineTimeoutError     504 the engine sent nothing for read_timeout_s

An unknown model is the resolver's :class:`berth.errors.NotFoundError` (404).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from berth.daemon.openai_errors import (
    ErrorResponse,
    error_body,
    error_from_exception,
    stream_error_events,
)
from berth.daemon.sse import (
    SSEEventSplitter,
    Usage,
    find_usage,
    last_usage,
)
from berth.daemon.upstream import (
    Origin,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeoutError,
    parse_origin,
)
from berth.errors import BerthError, NotFoundError
from berth.observability.metrics import ProxyMetrics, Target

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_log = logging.getLogger(__name__)

MiB = 1024 * 1024

_COMPLETION_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"}
)
_MODELS_PATH = "/v1/models"
_MODEL_PREFIX = "/v1/models/"

# Request headers an engine may see. Credentials (Authorization, Cookie, x-api-key, api-key)
# and everything else stay at the proxy. W3C Trace Context / Baggage headers pass for tracing.
_FORWARDED_HEADERS = frozenset(
    {b"content-type", b"accept", b"traceparent", b"tracestate", b"baggage"}
)
_VALID_REQUEST_ID = re.compile(rb"[0-9A-Za-z._:/+=-]{1,128}")
_USAGE_KEY = b'"usage"'
# How much of the end of a large, unbuffered JSON answer is kept to find its usage in.
_USAGE_TAIL_BYTES = 16 * 1024
_MAX_ENGINE_ERROR_BYTES = 64 * 1024
_MAX_CACHED_TARGETS = 4096
_POST = b"POST"


@dataclass(frozen=True)
class Upstream:
    """Where one request goes: an engine serving the public model name ``model``."""

    base_url: str  # http://127.0.0.1:PORT of the engine
    deployment_id: str
    node_id: str
    model: str  # the public model name the client asked for


class UpstreamResolver(Protocol):
    """Chooses an engine for a model; implemented from the table of ready deployments."""

    def resolve(self, model: str) -> Upstream:
        """The engine to use for ``model``.

        Raises :class:`berth.errors.NotFoundError` for a model berth does not know (404) and
        :class:`NoReadyDeploymentError` when none of its deployments is ready (503).
        """
        ...

    def models(self) -> list[str]:
        """Public model names with at least one deployment."""
        ...


class ProxyError(BerthError):
    """An error the proxy answers itself; ``error_code`` is the OpenAI ``code`` field."""

    error_code: str = "proxy_error"
    param: str | None = None


class InvalidRequestError(ProxyError):
    """The request cannot be relayed as sent: 400, or 404/405 for an unknown URL or method."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(
        self, message: str, *, code: str, param: str | None = None, status: int = 400
    ) -> None:
        self.http_status = status
        self.error_code = code
        self.param = param
        super().__init__(message)


class RequestTooLargeError(ProxyError):
    """The request body is over ``limit_bytes`` (413)."""

    http_status = 413
    error_type = "invalid_request_error"
    error_code = "request_too_large"

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        super().__init__(f"request body is larger than the limit of {limit_bytes} bytes")


class NoReadyDeploymentError(ProxyError):
    """``model`` is known but none of its deployments is ready (503 with ``Retry-After``).

    ``retry_after_s`` is the client's suggested wait in seconds, e.g. while an engine loads.
    """

    http_status = 503
    error_type = "server_error"
    error_code = "no_ready_deployment"

    def __init__(self, model: str, *, retry_after_s: float = 5.0, detail: str = "") -> None:
        self.model = model
        self.retry_after_s = retry_after_s
        message = f"model {model!r} has no ready deployment"
        super().__init__(f"{message}: {detail}" if detail else message)


class EngineUnreachableError(ProxyError):
    """The engine refused the connection or closed it before answering (502)."""

    http_status = 502
    error_type = "engine_error"
    error_code = "engine_unreachable"

    def __init__(self, upstream: Upstream, why: str) -> None:
        self.deployment_id = upstream.deployment_id
        super().__init__(f"the engine of deployment {upstream.deployment_id} {why}")


class EngineTimeoutError(ProxyError):
    """The engine sent nothing for the read timeout (504)."""

    http_status = 504
    error_type = "engine_error"
    error_code = "engine_timeout"

    def __init__(self, upstream: Upstream, timeout_s: float | None) -> None:
        self.deployment_id = upstream.deployment_id
        super().__init__(
            f"the engine of deployment {upstream.deployment_id} sent nothing for {timeout_s} s"
        )


class _Exchange:
    """What happened to one relayed request, for its metrics and for the disconnect watcher."""

    __slots__ = (
        "client_gone",
        "done",
        "error_reason",
        "start",
        "status",
        "ttfb_s",
        "usage",
    )

    def __init__(self, start: float) -> None:
        self.start = start
        self.status = 0
        self.ttfb_s: float | None = None
        self.usage: Usage | None = None
        self.error_reason: str | None = None
        # Set just before the final body message: from then on a disconnect is not an abort.
        self.done = False
        self.client_gone = False


class OpenAIProxy:
    """ASGI app for the OpenAI-compatible ``/v1`` routes.

    The body of a POST is forwarded byte for byte to ``upstream.base_url + path`` of the
    deployment ``resolver.resolve(body["model"])`` picks (called on the event loop for every
    request: it must not block). The answer comes back with the engine's status and content
    type: JSON as JSON, an event stream (``text/event-stream``) event by event with
    ``X-Accel-Buffering: no``. Only ``Content-Type``, ``Accept``, ``traceparent``,
    ``tracestate`` and ``baggage`` reach the engine, plus ``X-Request-Id``, which every answer
    echoes (the client's, or 32 random hex digits). When the client disconnects, the engine
    request is closed at once. Error bodies follow the OpenAI error shape; see the module
    docstring for the statuses. ``GET /v1/models`` lists ``resolver.models()`` as OpenAI
    ``Model`` objects (``created`` is the proxy's start time, ``owned_by`` is ``"berth"``).

    ``max_body_bytes`` bounds a request body (413 beyond it). ``connect_timeout_s`` bounds
    connecting to an engine (502 when exceeded or refused); ``read_timeout_s`` bounds every wait
    for the engine, including the wait for its first byte, i.e. prefill (504 before the answer
    began; after that the stream ends with an error event). ``max_connections`` caps pooled
    connections to all engines together. ``max_buffered_response_bytes``: a non-streamed answer
    announced at most this long is read whole and sent with a ``Content-Length``; a longer one
    is relayed chunk by chunk. ``max_event_bytes`` bounds how much of one unfinished SSE event
    is held back before it is relayed anyway.

    Call :meth:`startup` before serving and :meth:`shutdown` after (or let an ASGI server's
    lifespan protocol do it when this app is served directly).
    """

    def __init__(
        self,
        resolver: UpstreamResolver,
        metrics: ProxyMetrics,
        *,
        max_body_bytes: int = 16 * MiB,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = 600.0,
        max_connections: int = 1024,
        max_buffered_response_bytes: int = 1 * MiB,
        max_event_bytes: int = 1 * MiB,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._resolver = resolver
        self._metrics = metrics
        self._max_body_bytes = max_body_bytes
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_connections = max_connections
        self._max_buffered_response_bytes = max_buffered_response_bytes
        self._max_event_bytes = max_event_bytes
        self._clock = clock
        self._created = int(time.time())
        self._pool: UpstreamPool | None = None
        self._targets: dict[tuple[str, str], tuple[Origin, bytes]] = {}

    # -- lifecycle ----------------------------------------------------------------------------

    async def startup(self) -> None:
        """Open the pool of HTTP connections to engines. Idempotent."""
        if self._pool is not None:
            return
        # No cookie jar and no decompression: engines' cookies never travel from one client's
        # request to another's, and bytes are relayed as the engine sent them.
        self._pool = UpstreamPool(
            connect_timeout_s=self._connect_timeout_s,
            read_timeout_s=self._read_timeout_s,
            max_connections=self._max_connections,
        )

    async def shutdown(self) -> None:
        """Close the connections to engines. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    # -- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI ``http`` request (``scope["path"]`` is the full ``/v1/...`` path), or
        run the ``lifespan`` protocol (startup/shutdown) when served directly."""
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:
            raise RuntimeError(f"OpenAIProxy serves HTTP only, not {kind!r}")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        request_id, forward, content_length = _scan_headers(scope["headers"])
        if path in _COMPLETION_PATHS:
            if method == "POST":
                await self._proxy(scope, request_id, forward, content_length, receive, send)
                return
            allowed = "POST"
        elif path == _MODELS_PATH or path.startswith(_MODEL_PREFIX):
            if method == "GET":
                await self._models(path, request_id, send)
                return
            allowed = "GET"
        else:
            await self._reject(
                send,
                request_id,
                InvalidRequestError(
                    f"Invalid URL ({method} {path})", code="unknown_url", status=404
                ),
                self._clock(),
            )
            return
        error = InvalidRequestError(
            f"{method} is not allowed on {path}; use {allowed}",
            code="method_not_allowed",
            status=405,
        )
        await self._reject(send, request_id, error, self._clock(), allow=allowed)

    # -- /v1/models ---------------------------------------------------------------------------

    async def _models(self, path: str, request_id: bytes, send: Send) -> None:
        start = self._clock()
        names = self._resolver.models()
        if path == _MODELS_PATH:
            payload: dict[str, object] = {
                "object": "list",
                "data": [self._model_card(name) for name in names],
            }
        else:
            ident = path[len(_MODEL_PREFIX) :]
            if ident not in names:
                await self._reject(send, request_id, NotFoundError("model", ident), start)
                return
            payload = self._model_card(ident)
        await _send_json(send, 200, json.dumps(payload).encode(), request_id)

    def _model_card(self, name: str) -> dict[str, object]:
        # OpenAI's Model object; "created" is unix seconds, here when the proxy started.
        return {"id": name, "object": "model", "created": self._created, "owned_by": "berth"}

    # -- completions --------------------------------------------------------------------------

    async def _proxy(
        self,
        scope: Scope,
        request_id: bytes,
        forward: list[tuple[bytes, bytes]],
        content_length: bytes | None,
        receive: Receive,
        send: Send,
    ) -> None:
        start = self._clock()
        try:
            body = await self._read_body(receive, content_length)
            if body is None:
                self._metrics.request_rejected(
                    model="",
                    status=499,
                    duration_s=self._clock() - start,
                    error_reason="client_disconnected",
                )
                return
            upstream = self._resolver.resolve(_model_of(body))
        except BerthError as exc:
            await self._reject(send, request_id, exc, start)
            return

        target = Target(upstream.model, upstream.deployment_id, upstream.node_id)
        exchange = _Exchange(start)
        task = asyncio.current_task()
        assert task is not None, "ASGI apps run in a task"
        watcher = task.get_loop().create_task(_watch_disconnect(receive, exchange, task))
        self._metrics.request_started(target)
        try:
            await self._relay(scope, upstream, body, request_id, forward, send, exchange)
        except asyncio.CancelledError:
            # Ours if the client left (the engine request is closed by now); anyone else's
            # (a server shutting down) goes on up.
            if not exchange.client_gone or task.uncancel() > 0:
                raise
            exchange.error_reason = "client_disconnected"
        except ProxyError as exc:  # raised only before the answer started
            exchange.done = True
            reply = await self._send_error(send, request_id, exc)
            exchange.status = reply.status
            exchange.error_reason = exc.error_code
            _log.warning("request %s: %s", request_id.decode(), exc)
        finally:
            if not exchange.done:
                watcher.cancel()
            # else the watcher ends by itself: ASGI servers answer receive() with
            # "http.disconnect" once the response is complete.
            usage = exchange.usage
            self._metrics.request_finished(
                target,
                status=exchange.status or 499,
                duration_s=self._clock() - start,
                ttfb_s=exchange.ttfb_s,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                completion_tokens=usage.completion_tokens if usage else 0,
                error_reason=exchange.error_reason,
            )

    async def _read_body(self, receive: Receive, content_length: bytes | None) -> bytes | None:
        """The request body, or ``None`` if the client left while sending it."""
        limit = self._max_body_bytes
        if content_length is not None:
            if not content_length.isdigit():
                raise InvalidRequestError("invalid Content-Length header", code="invalid_request")
            if int(content_length) > limit:
                raise RequestTooLargeError(limit)
        message = await receive()
        if message["type"] != "http.request":
            return None
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise RequestTooLargeError(limit)
            return body
        parts = [body]
        size = len(body)
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError(limit)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _relay(
        self,
        scope: Scope,
        upstream: Upstream,
        body: bytes,
        request_id: bytes,
        forward: list[tuple[bytes, bytes]],
        send: Send,
        exchange: _Exchange,
    ) -> None:
        pool = self._pool
        if pool is None:
            raise RuntimeError("OpenAIProxy.startup() was not awaited")
        origin, target = self._engine_target(upstream.base_url, scope["path"])
        query: bytes = scope.get("query_string", b"")
        if query:
            target += b"?" + query
        try:
            response = await pool.request(origin, _POST, target, forward, body)
        except UpstreamConnectError as exc:
            raise EngineUnreachableError(upstream, exc.why) from exc
        except UpstreamTimeoutError as exc:
            raise EngineTimeoutError(upstream, self._read_timeout_s) from exc
        except UpstreamError as exc:
            raise EngineUnreachableError(upstream, f"failed before answering ({exc.why})") from exc
        try:
            content_type = response.header(b"content-type") or b"application/json"
            encoding = response.header(b"content-encoding")
            if response.status >= 400:
                await self._relay_engine_error(response, content_type, request_id, send, exchange)
            elif content_type.startswith(b"text/event-stream"):
                await self._relay_stream(
                    response, content_type, encoding, request_id, send, exchange
                )
            else:
                await self._relay_body(
                    response, upstream, content_type, encoding, request_id, send, exchange
                )
        finally:
            # An answer read to its end has already put its connection back in the pool; one
            # that was not (the client left, the engine failed) closes it, which is what tells
            # the engine to stop generating.
            response.close()

    def _engine_target(self, base_url: str, path: str) -> tuple[Origin, bytes]:
        """The engine's origin and the request target for ``path``; cached (a handful of
        entries per deployment)."""
        key = (base_url, path)
        found = self._targets.get(key)
        if found is None:
            if len(self._targets) >= _MAX_CACHED_TARGETS:
                self._targets.clear()
            prefix = base_url.split("://", 1)[-1].partition("/")[2].rstrip("/")
            target = (f"/{prefix}{path}" if prefix else path).encode("latin-1")
            found = self._targets[key] = (parse_origin(base_url), target)
        return found

    async def _relay_body(
        self,
        response: UpstreamResponse,
        upstream: Upstream,
        content_type: bytes,
        encoding: bytes | None,
        request_id: bytes,
        send: Send,
        exchange: _Exchange,
    ) -> None:
        """A non-streamed answer: whole when small, else chunk by chunk (never as SSE)."""
        status = response.status
        headers = [(b"content-type", content_type), (b"x-request-id", request_id)]
        if encoding:
            headers.append((b"content-encoding", encoding))
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
            exchange.status = status
            exchange.done = True
            await send({"type": "http.response.start", "status": status, "headers": headers})
            exchange.ttfb_s = self._clock() - exchange.start
            await send({"type": "http.response.body", "body": data})
            if encoding is None:
                exchange.usage = find_usage(data)
            return

        exchange.status = status
        await send({"type": "http.response.start", "status": status, "headers": headers})
        tail = b""
        last = b""
        try:
            while chunk := await response.read_chunk():
                if exchange.ttfb_s is None:
                    exchange.ttfb_s = self._clock() - exchange.start
                keep = _USAGE_TAIL_BYTES - len(chunk)
                tail = tail[-keep:] + chunk if keep > 0 else chunk[-_USAGE_TAIL_BYTES:]
                if response.at_eof:
                    last = chunk
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            # Leave the answer unfinished: the server then drops the connection, so the client
            # sees a truncated body instead of a complete-looking one.
            exchange.error_reason = "engine_aborted"
            _log.warning("request %s: engine failed mid-answer: %r", request_id.decode(), exc)
            return
        exchange.done = True
        await send({"type": "http.response.body", "body": last})
        if encoding is None:
            exchange.usage = find_usage(tail)

    async def _relay_stream(
        self,
        response: UpstreamResponse,
        content_type: bytes,
        encoding: bytes | None,
        request_id: bytes,
        send: Send,
        exchange: _Exchange,
    ) -> None:
        """An event stream: relay each complete event as soon as it arrives.

        Reads one chunk, sends it, then reads the next, so a slow client slows the reading
        from the engine (ASGI servers wait in ``send`` while their write buffer is full).
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
        exchange.status = response.status
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        # Compressed bytes cannot be split into events; relay them as they come.
        splitter = SSEEventSplitter() if encoding is None else None
        last = b""
        try:
            while chunk := await response.read_chunk():
                if splitter is not None:
                    chunk = splitter.feed(chunk)
                    if splitter.pending_bytes > self._max_event_bytes:
                        chunk += splitter.take_pending()
                    if not chunk:
                        continue
                    if _USAGE_KEY in chunk:
                        exchange.usage = last_usage(chunk) or exchange.usage
                if exchange.ttfb_s is None:
                    exchange.ttfb_s = self._clock() - exchange.start
                if response.at_eof:
                    # The engine's answer is complete: this chunk ends ours too, in one write.
                    last = chunk
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
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
        await send({"type": "http.response.body", "body": last})

    async def _relay_engine_error(
        self,
        response: UpstreamResponse,
        content_type: bytes,
        request_id: bytes,
        send: Send,
        exchange: _Exchange,
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
        await _send_json(send, status, body, request_id, _relayed_error_headers(response))

    # -- errors -------------------------------------------------------------------------------

    async def _reject(
        self,
        send: Send,
        request_id: bytes,
        exc: BerthError,
        start: float,
        *,
        allow: str | None = None,
    ) -> None:
        """Answer a request no deployment was chosen for, and count it."""
        extra = [(b"allow", allow.encode())] if allow else []
        reply = await self._send_error(send, request_id, exc, extra)
        if isinstance(exc, ProxyError):
            reason = exc.error_code
        elif isinstance(exc, NotFoundError):
            reason = f"{exc.kind}_not_found"
        else:
            reason = "error"
        # Only a model berth knows may become a label value.
        model = exc.model if isinstance(exc, NoReadyDeploymentError) else ""
        self._metrics.request_rejected(
            model=model, status=reply.status, duration_s=self._clock() - start, error_reason=reason
        )

    async def _send_error(
        self,
        send: Send,
        request_id: bytes,
        exc: BerthError,
        extra: Sequence[tuple[bytes, bytes]] = (),
    ) -> ErrorResponse:
        reply = error_from_exception(exc)
        headers = [(name.lower().encode(), value.encode()) for name, value in reply.headers.items()]
        headers.extend(extra)
        # No "Connection: close" on a 413: closing a socket with unread request bytes makes the
        # kernel reset the connection, and the client may lose the answer. The server reads
        # and drops the rest of the body instead.
        await _send_json(send, reply.status, reply.body, request_id, headers)
        return reply


async def _watch_disconnect(receive: Receive, exchange: _Exchange, task: asyncio.Task[Any]) -> None:
    """Cancel the relaying ``task`` as soon as the client disconnects before the answer ends.

    Cancelling it closes the engine request, which stops the engine generating for nobody.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not exchange.done:
                exchange.client_gone = True
                task.cancel()
            return


def _scan_headers(
    raw: Sequence[tuple[bytes, bytes]],
) -> tuple[bytes, list[tuple[bytes, bytes]], bytes | None]:
    """``(request id, headers for the engine, Content-Length)`` from the ASGI headers."""
    request_id: bytes | None = None
    content_length: bytes | None = None
    forward: list[tuple[bytes, bytes]] = []
    content_type = False
    for header in raw:
        name = header[0]
        if name in _FORWARDED_HEADERS:
            forward.append(header)
            content_type = content_type or name == b"content-type"
        elif name == b"content-length":
            content_length = header[1]
        elif name == b"x-request-id" and _VALID_REQUEST_ID.fullmatch(header[1]):
            request_id = header[1]
    if request_id is None:
        request_id = os.urandom(16).hex().encode()  # as uuid4().hex, at a fifth of the cost
    forward.append((b"x-request-id", request_id))
    forward.append((b"accept-encoding", b"identity"))
    if not content_type:
        forward.append((b"content-type", b"application/json"))
    return request_id, forward, content_length


def _model_of(body: bytes) -> str:
    """The ``model`` of an OpenAI request body; :class:`InvalidRequestError` if it has none."""
    try:
        payload = json.loads(body)
    except ValueError as exc:  # also invalid UTF-8
        raise InvalidRequestError(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from exc
    if not isinstance(payload, dict):
        raise InvalidRequestError("the request body must be a JSON object", code="invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError(
            "you must provide a model parameter", code="missing_model", param="model"
        )
    return model


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


def _relayed_error_headers(response: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    retry_after = response.header(b"retry-after")
    return [(b"retry-after", retry_after)] if retry_after else []


async def _send_json(
    send: Send,
    status: int,
    body: bytes,
    request_id: bytes,
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", request_id),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
