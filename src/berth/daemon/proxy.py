"""The OpenAI-compatible proxy: a raw ASGI app relaying ``/v1/*`` requests to engines.

One completion request is one :class:`~berth.daemon.request.PublicRequest`, parsed once and
handed through named stages, each of which takes the value and returns it (or what it
decided), and each testable alone (``tests/test_request_stages.py``)::

    read_body (bounded: 413) -> parse_request: the value (body parsed once, model, stream,
      key, adapter; 400)                                          berth.daemon.request
    -> admit: the key's limits (403/429), its rate-limit headers  berth.daemon.stages
    -> ask_usage: a stream asks the engine for its usage (rewriter)
    -> Routing.route: ranked candidates and the affinity key (nothing ready: held by the
       on-demand stage until its service loads; a Messages request: only the engines that
       serve its path)
    -> take_slot: a slot at one of them, waiting in the fair queue if need be
    -> first_answer: the attempts along the plan, the next node's before the first byte if
       one fails (berth.daemon.proxy_dispatch), each an Attempts call: the engine request
       for that upstream (its path, query, headers, and the body that engine must see:
       EngineBodies, the model-name and LoRA rewriter), opened over engine_client (pooled
       HTTP/1.1, or an agent's tunnel), a stream within its first-byte timeout
                                                                  berth.daemon.attempt
    -> relay the answer: JSON whole, event streams event by event (berth.daemon.proxy_relay)
    -> Records.finished: ProxyMetrics, the request log, admission.settle (the ledger)
                                                                  berth.daemon.record

Hooks for what comes next: a router that hashes prompt prefixes reads the parsed body
(``request.body["messages"]``) in the routing stage; a tracer wraps each stage call in
:meth:`OpenAIProxy._proxy` and :meth:`OpenAIProxy._dispatch` (admission, routing, the slot,
each attempt: :class:`~berth.daemon.attempt.Attempts`, the first byte: ``exchange.ttfb_s``,
the stream); a dialect translator rewrites the engine request per upstream
(:meth:`~berth.daemon.attempt.Attempts.engine_request` knows the target path and the
upstream's engine).

There is no framework routing here: this module is called only after authentication, for the
paths it serves (``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/responses``, and Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``;
``GET /v1/models`` and ``/v1/models/{id}``), and it matches ``scope["path"]`` itself.
Errors are answered in the OpenAI shape (:mod:`berth.openai_errors`), or under
``/v1/messages`` in Anthropic's (:mod:`berth.anthropic_errors`, converted from the same
errors at :meth:`OpenAIProxy._send_error`); the ones this module raises are drawn in
:mod:`berth.routing.errors`. A Messages request goes the same way as a chat completion,
only to the deployments whose engine serves its path (:mod:`berth.routing.capability`).
What the proxy needs of the client's request and of the writer of its answer is in
:mod:`berth.daemon.proxy_http` (berth's own HTTP server gives both as they are;
:mod:`berth.daemon.proxy_asgi` adapts ASGI), the relaying of an engine's answer in
:mod:`berth.daemon.proxy_relay`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence

from berth.admission import (
    Admission,
    AdmissionError,
    QueueRefusedError,
    QuotaExceededError,
    SlotGate,
    SocketCaller,
    Ticket,
)
from berth.anthropic_errors import is_messages_path, to_anthropic
from berth.daemon.adapters import AdapterManager
from berth.daemon.attempt import Attempts, StreamLimits
from berth.daemon.engine_client import EngineAuth, EngineClient, TunnelOpener
from berth.daemon.proxy_asgi import AsgiClientRequest, AsgiClientWriter
from berth.daemon.proxy_dispatch import first_answer
from berth.daemon.proxy_http import (
    ClientRequest,
    ClientWriter,
    Receive,
    Scope,
    Send,
    scan_headers,
    send_json,
)
from berth.daemon.proxy_relay import AnswerRelay, Exchange
from berth.daemon.read_ahead import DEFAULT_BUFFER_CHUNKS, ReadAhead
from berth.daemon.record import Flight, Records, target_of
from berth.daemon.request import DIALECTS, PublicRequest, parse_request, read_body
from berth.daemon.stages import Routing, admit, ask_usage, take_slot
from berth.engine_http.answer import EngineAnswer
from berth.errors import BerthError, NotFoundError
from berth.observability.metrics import ProxyMetrics
from berth.observability.request_log import RequestLog
from berth.openai_errors import ErrorResponse, error_from_exception
from berth.routing.errors import (
    EngineTimeoutError,
    EngineUnreachableError,
    InvalidRequestError,
    NoReadyDeploymentError,
    ProxyError,
)
from berth.routing.resolver import Upstream, UpstreamResolver
from berth.routing.retry import DEFAULT_MAX_ATTEMPTS
from berth.routing.router import Router
from berth.scaling.on_demand import OnDemandStage
from berth.store.records import ApiKeyRecord

__all__ = ["OpenAIProxy"]


_log = logging.getLogger(__name__)

MiB = 1024 * 1024

_MODELS_PATH = "/v1/models"
_MODEL_PREFIX = "/v1/models/"
#: The ``[server]`` settings' defaults (README, Engines and failures): a stream's first byte
#: (its head and first event: prefill) within 120 s, then no silence over 60 s; a
#: non-streamed answer, which comes whole once generation ends, within 600 s.
FIRST_BYTE_TIMEOUT_S = 120.0
STREAM_IDLE_TIMEOUT_S = 60.0
READ_TIMEOUT_S = 600.0


def _reason(exc: BerthError) -> str:
    """The short reason a refused request is counted and logged under."""
    if isinstance(exc, ProxyError | AdmissionError):
        return exc.error_code
    if isinstance(exc, NotFoundError):
        return exc.not_found_code
    return "error"


class OpenAIProxy:
    """The OpenAI-compatible ``/v1`` routes: :meth:`handle` for berth's HTTP server, and an
    ASGI app (``__call__``).

    The body of a POST is forwarded byte for byte to ``upstream.base_url + path`` of the
    deployment ``resolver.resolve(body["model"])`` picks (called on the event loop for every
    request: it must not block), or with its ``model`` set to ``upstream.engine_model`` when
    that is given. The answer comes back with the engine's status and content type: JSON as
    JSON, an event stream (``text/event-stream``) event by event with
    ``X-Accel-Buffering: no``. Only ``Content-Type``, ``Accept``, ``traceparent``,
    ``tracestate`` and ``baggage`` reach the engine, plus ``X-Request-Id``, which every answer
    echoes (the client's, or 32 random hex digits). When the client disconnects, the engine
    request is closed at once. Error bodies follow the OpenAI error shape; see
    :mod:`berth.routing.errors` for the statuses. ``GET /v1/models`` lists
    ``resolver.models()`` as OpenAI ``Model`` objects (``created`` is the proxy's start time,
    ``owned_by`` is ``"berth"``).

    ``max_body_bytes`` bounds a request body (413 beyond it). ``connect_timeout_s`` bounds
    connecting to an engine (502 when exceeded or refused). A streamed request (``"stream":
    true``) has its first byte within ``first_byte_timeout_s``: the engine's head and, for an
    event stream, its first bytes (nothing reaches the client before them); past it the
    exchange is closed (the engine stops) and the request goes to the next candidate, or
    ends 504 ``first_byte_timeout``. Its stream then goes silent for at most
    ``stream_idle_timeout_s`` (while the client keeps up), after which it ends with an error
    event (``stream_idle_timeout``) and the exchange is closed. A deployment's service may
    set either for its deployments (``upstream.timeouts``). ``None`` (or 0 for a service)
    turns either off: only ``read_timeout_s`` bounds that wait then.
    ``read_timeout_s`` bounds every other wait for an engine: a non-streamed answer, which
    comes whole only once the engine has generated it, is waited for that long (504 before
    the answer began). ``max_connections`` caps pooled
    connections to all engines together. ``max_buffered_response_bytes``: a non-streamed answer
    announced at most this long is read whole and sent with a ``Content-Length``; a longer one
    is relayed chunk by chunk. ``max_event_bytes`` bounds how much of one unfinished SSE event
    is held back before it is relayed anyway. ``engine_auth(deployment_id)`` gives the
    ``authorization`` header of an engine reached directly (node ``local``'s own API key);
    a client's credentials never reach an engine. Every completion request answered (relayed
    or refused) is recorded in ``request_log`` (:attr:`request_log`, a bounded ring of recent
    requests with no prompt or answer text; a new one when none is given). ``adapters``, when
    given, loads a LoRA adapter into the chosen engine before an attempt that needs it
    (:meth:`berth.daemon.adapters.AdapterManager.gated`), and gives ``/v1/models`` each
    adapter's base as ``parent`` (vLLM's field for it).

    ``on_demand``, when given, holds a request for a route whose services have nothing ready
    until one of them is loaded (:mod:`berth.scaling.on_demand`); nothing is sent to the
    client meanwhile, and a client that leaves is dropped from the wait at once.
    ``admission``, when given, admits each completion request against its key's limits
    (:mod:`berth.admission`; the key record is the ``api_key`` given to :meth:`handle`, none
    over the Unix socket) before the router sees it, sends the key's rate-limit headers on
    every answer, asks the engine for a stream's usage when the client did not (and keeps
    that event from the client), and settles the request's tokens when the answer ends.

    ``slots``, when given, holds each completion request to its deployments' slots after
    the router planned it (:class:`berth.admission.SlotGate`: the fair admission queue).

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
        read_timeout_s: float | None = READ_TIMEOUT_S,
        first_byte_timeout_s: float | None = FIRST_BYTE_TIMEOUT_S,
        stream_idle_timeout_s: float | None = STREAM_IDLE_TIMEOUT_S,
        max_connections: int = 1024,
        max_buffered_response_bytes: int = 1 * MiB,
        max_event_bytes: int = 1 * MiB,
        clock: Callable[[], float] = time.perf_counter,
        tunnels: TunnelOpener | None = None,
        router: Router | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        relay_buffer_chunks: int = DEFAULT_BUFFER_CHUNKS,
        engine_auth: EngineAuth | None = None,
        on_demand: OnDemandStage | None = None,
        request_log: RequestLog | None = None,
        admission: Admission | None = None,
        slots: SlotGate | None = None,
        adapters: AdapterManager | None = None,
    ) -> None:
        self._resolver = resolver
        self._admission = admission
        self._slots = slots
        #: The recent requests (the console's requests view, ``GET /admin/requests``).
        self.request_log = request_log if request_log is not None else RequestLog()
        self._adapters = adapters
        self._engines = engines = EngineClient(
            tunnels=tunnels,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            max_connections=max_connections,
            engine_auth=engine_auth,
        )
        # an adapter request has its adapter loaded into the engine first
        self._open = engines.open if adapters is None else adapters.gated(engines.open)
        self.router = router or Router(resolver)
        self._routing = Routing(self.router, on_demand)
        self._records = Records(metrics, self.request_log, admission, clock)
        self._max_attempts = max_attempts
        self._stream_limits = StreamLimits(first_byte_timeout_s, stream_idle_timeout_s)
        self._relay_buffer_chunks = relay_buffer_chunks
        self._max_buffered_response_bytes = max_buffered_response_bytes
        self._metrics = metrics
        self._max_body_bytes = max_body_bytes
        self._clock = clock
        self._created = int(time.time())
        self._answers = AnswerRelay(
            read_timeout_s=read_timeout_s,
            max_buffered_response_bytes=max_buffered_response_bytes,
            max_event_bytes=max_event_bytes,
            clock=clock,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def startup(self) -> None:
        """Open the pool of HTTP connections to engines. Idempotent."""
        await self._engines.startup()

    async def shutdown(self) -> None:
        """Close the connections to engines. Idempotent."""
        await self._engines.shutdown()

    # -- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI ``http`` request (``scope["path"]`` is the full ``/v1/...`` path), or
        run the ``lifespan`` protocol (startup/shutdown) when served directly."""
        kind = scope["type"]
        if kind == "http":
            request = AsgiClientRequest(scope, receive)
            await self.handle(request, AsgiClientWriter(send, request))
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

    async def handle(
        self,
        request: ClientRequest,
        writer: ClientWriter,
        api_key: ApiKeyRecord | SocketCaller | None = None,
        *,
        key_name: str = "",
    ) -> None:
        """Serve one request (``request.path`` is the full ``/v1/...`` path) of ``api_key``
        (the listener's authentication found it; over the Unix socket, no key: its caller
        there, ``None`` for the CLI);
        ``key_name`` names that key for :attr:`request_log`."""
        path = request.path
        method = request.method
        request_id, forward, content_length = scan_headers(request.headers)
        dialect = DIALECTS.get(path)
        if dialect is not None:
            if method == "POST":
                await self._proxy(
                    request,
                    request_id,
                    forward,
                    content_length,
                    writer,
                    api_key,
                    key_name,
                    dialect,
                )
                return
            allowed = "POST"
        elif path == _MODELS_PATH or path.startswith(_MODEL_PREFIX):
            if method == "GET":
                await self._models(path, request_id, writer)
                return
            allowed = "GET"
        else:
            await self._reject(
                writer,
                request_id,
                InvalidRequestError(
                    f"Invalid URL ({method} {path})", code="unknown_url", status=404
                ),
                self._clock(),
                path=path,
            )
            return
        error = InvalidRequestError(
            f"{method} is not allowed on {path}; use {allowed}",
            code="method_not_allowed",
            status=405,
        )
        await self._reject(writer, request_id, error, self._clock(), allow=allowed, path=path)

    # -- /v1/models ---------------------------------------------------------------------------

    async def _models(self, path: str, request_id: bytes, writer: ClientWriter) -> None:
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
                await self._reject(writer, request_id, NotFoundError("model", ident), start)
                return
            payload = self._model_card(ident)
        await send_json(writer, 200, json.dumps(payload).encode(), request_id)

    def _model_card(self, name: str) -> dict[str, object]:
        # OpenAI's Model object; "created" is unix seconds, here when the proxy started.
        card = {"id": name, "object": "model", "created": self._created, "owned_by": "berth"}
        adapter = self._adapters.entry(name) if self._adapters is not None else None
        return card if adapter is None else {**card, "parent": adapter.base}  # vLLM's field

    # -- completions --------------------------------------------------------------------------

    async def _proxy(
        self,
        client: ClientRequest,
        request_id: bytes,
        forward: list[tuple[bytes, bytes]],
        content_length: bytes | None,
        writer: ClientWriter,
        api_key: ApiKeyRecord | SocketCaller | None,
        key_name: str = "",
        dialect: str = "",
    ) -> None:
        """A completion request, stage by stage (see the module docstring)."""
        start = self._clock()
        started_at = self.request_log.now()
        request: PublicRequest | None = None
        ticket: Ticket | None = None
        try:
            raw = await read_body(client, content_length, self._max_body_bytes)
            if raw is None:  # the client left while sending it
                self._rejected("", 499, start, "client_disconnected")
                return
            request = parse_request(
                raw,
                path=client.path,
                dialect=dialect,
                query=client.query,
                request_id=request_id,
                headers=client.headers,
                forward=forward,
                key=api_key,
                key_name=key_name,
                is_adapter=self._is_adapter,
            )
            if self._admission is not None:
                ticket = admit(self._admission, request)
                request = ask_usage(request)
            routed = await self._routing.route(request, client)
            if routed is None:  # the client left while its service loaded
                self._records.settle_unsent(ticket)
                self._rejected(request.model, 499, start, "client_disconnected")
                self._records.unsent(started_at, start, request_id, key_name, request.model,
                                     499, "client_disconnected")  # fmt: skip
                return
        except BerthError as exc:
            model = request.model if request is not None else ""
            extra = _refusal_headers(exc, ticket)
            self._records.settle_unsent(ticket)
            status = await self._reject(
                writer, request_id, exc, start, extra=extra, path=client.path
            )
            self._records.unsent(started_at, start, request_id, key_name, model, status,
                                 _reason(exc))  # fmt: skip
            return
        request, plan = routed
        await self._forward(request, plan, ticket, client, writer, start, started_at)

    async def _forward(
        self,
        request: PublicRequest,
        plan: list[Upstream],
        ticket: Ticket | None,
        client: ClientRequest,
        writer: ClientWriter,
        start: float,
        started_at: float,
    ) -> None:
        """A planned request: its slot, its attempts, its answer relayed, and its records,
        whatever happened (the client may leave at any point: the engine request is closed)."""
        flight = Flight(plan[0], reached=self._slots is None)
        self._metrics.request_started(target_of(flight.upstream))  # moved if a retry goes elsewhere
        headers = ticket.headers if ticket is not None else []
        exchange = Exchange(
            start, headers, strip_usage=request.strip_usage, dialect=request.dialect
        )
        task = asyncio.current_task()
        assert task is not None, "requests are served in a task"

        def client_left() -> None:
            # Cancelling the relay closes the engine request: it stops generating for nobody.
            if not exchange.done:
                exchange.client_gone = True
                task.cancel()

        client.watch_disconnect(client_left)
        attempts = Attempts(request, self._open, self._stream_limits, exchange)
        try:
            await self._dispatch(request, plan, ticket, attempts, writer, exchange, flight)
        except asyncio.CancelledError:
            # Ours if the client left (the engine request is closed by now); anyone else's
            # (a server shutting down) goes on up.
            if not exchange.client_gone or task.uncancel() > 0:
                raise
            exchange.error_reason = "client_disconnected"
        except (ProxyError, QueueRefusedError) as exc:  # raised only before the answer started
            exchange.done = True
            reply = await self._send_error(
                writer, request.request_id, exc, exchange.answer_headers, path=request.path
            )
            exchange.status = reply.status
            exchange.error_reason = exc.error_code
            _log.warning("request %s: %s", request.request_id.decode(), exc)
        finally:
            client.watch_disconnect(None)
            upstream = flight.upstream
            if flight.dispatched:
                self.router.signals.finished(upstream.deployment_id, upstream.node_id)
            if flight.held is not None and self._slots is not None:
                self._slots.release(flight.held)
            self._records.finished(request, flight, exchange, attempts.outcomes, ticket, started_at)

    async def _dispatch(
        self,
        request: PublicRequest,
        plan: list[Upstream],
        ticket: Ticket | None,
        attempts: Attempts,
        writer: ClientWriter,
        exchange: Exchange,
        flight: Flight,
    ) -> None:
        """The fair queue's slot (when there is a gate), the attempts along the plan until
        an engine answers (:func:`first_answer`), and its answer relayed; ``flight`` keeps
        where the request went at each step, for the records."""
        gate = self._slots
        if gate is not None:
            flight.held, plan = await take_slot(gate, request, ticket, plan)
            flight.reached = True
            if plan[0] is not flight.upstream:  # a slot was free at another deployment
                self._metrics.request_moved(target_of(flight.upstream), target_of(plan[0]))
                flight.upstream = plan[0]
        upstream = flight.upstream
        try:
            chosen, response = await first_answer(
                plan,
                attempts,
                max_attempts=self._max_attempts,
                signals=self.router.signals,
                clock=self._clock,
                request_id=request.request_id.decode(),
                waiting=self.router.waiting,
            )
        except (EngineUnreachableError, EngineTimeoutError) as exc:
            # Counted against the engine that failed last, as the client is told.
            self._metrics.request_moved(target_of(upstream), target_of(exc.upstream))
            flight.upstream = exc.upstream
            raise
        flight.dispatched = True
        if chosen is not upstream:  # a retry served it elsewhere
            self._metrics.request_moved(target_of(upstream), target_of(chosen))
            if flight.held is not None and gate is not None:
                flight.held = gate.move(flight.held, chosen)
        flight.upstream = chosen
        self.router.succeeded(request.affinity_key, chosen)
        await self._relay(chosen, response, request.request_id, writer, exchange)

    def _rejected(self, model: str, status: int, start: float, reason: str) -> None:
        """Count a request answered ``status`` before any deployment was chosen."""
        self._metrics.request_rejected(
            model=model, status=status, duration_s=self._clock() - start, error_reason=reason
        )

    def _is_adapter(self, model: str) -> bool:
        return self._adapters is not None and self._adapters.entry(model) is not None

    async def _relay(
        self,
        upstream: Upstream,
        response: EngineAnswer,
        request_id: bytes,
        writer: ClientWriter,
        exchange: Exchange,
    ) -> None:
        try:
            content_type = response.header(b"content-type") or b"application/json"
            encoding = response.header(b"content-encoding")
            length = response.content_length
            streamed = content_type.startswith(b"text/event-stream")
            if (
                not writer.buffers_writes
                and response.status < 400
                and (streamed or length is None or length > self._max_buffered_response_bytes)
            ):
                # Relayed piece by piece to a writer that waits on every piece: a bounded
                # buffer lets the engine run a little ahead of the client, and stops reading
                # it when the client stalls. (berth's own server needs none: its writes wait
                # only while the client's transport buffer is full, which is the same bound.)
                response = ReadAhead(response, self._relay_buffer_chunks)
            if response.status >= 400:
                await self._answers.relay_engine_error(
                    response, content_type, request_id, writer, exchange
                )
            elif streamed:
                await self._answers.relay_stream(
                    response, content_type, encoding, request_id, writer, exchange
                )
            else:
                await self._answers.relay_body(
                    response, upstream, content_type, encoding, request_id, writer, exchange
                )
        finally:
            # An answer read to its end has already put its connection back in the pool; one
            # that was not (the client left, the engine failed) closes it, which is what tells
            # the engine to stop generating.
            response.close()

    # -- errors -------------------------------------------------------------------------------

    async def _reject(
        self,
        writer: ClientWriter,
        request_id: bytes,
        exc: BerthError,
        start: float,
        *,
        allow: str | None = None,
        extra: Sequence[tuple[bytes, bytes]] = (),
        path: str = "",
    ) -> int:
        """Answer a request no deployment was chosen for, and count it; the status sent."""
        headers = [(b"allow", allow.encode())] if allow else []
        headers += extra
        reply = await self._send_error(writer, request_id, exc, headers, path=path)
        reason = _reason(exc)
        # Only a model berth knows may become a label value.
        model = exc.model if isinstance(exc, NoReadyDeploymentError) else ""
        self._metrics.request_rejected(
            model=model, status=reply.status, duration_s=self._clock() - start, error_reason=reason
        )
        return reply.status

    async def _send_error(
        self,
        writer: ClientWriter,
        request_id: bytes,
        exc: BerthError,
        extra: Sequence[tuple[bytes, bytes]] = (),
        *,
        path: str = "",
    ) -> ErrorResponse:
        """Answer ``exc``: OpenAI-shaped, or Anthropic-shaped for a ``path`` under
        ``/v1/messages``."""
        reply = error_from_exception(exc)
        if is_messages_path(path):  # the Anthropic error shape for its paths
            reply = to_anthropic(reply)
        headers = [(name.lower().encode(), value.encode()) for name, value in reply.headers.items()]
        headers.extend(extra)
        # No "Connection: close" on a 413: closing a socket with unread request bytes makes the
        # kernel reset the connection, and the client may lose the answer. The server reads
        # and drops the rest of the body instead.
        await send_json(writer, reply.status, reply.body, request_id, headers)
        return reply


def _refusal_headers(exc: BerthError, ticket: Ticket | None) -> list[tuple[bytes, bytes]]:
    """The key's rate-limit headers for an answer refused before any engine was asked, and
    ``retry-after-ms`` on a 429 (the OpenAI SDKs prefer it to ``Retry-After``)."""
    if isinstance(exc, QuotaExceededError):
        ms = max(0, round(exc.retry_after_s * 1000))
        return [*exc.headers, (b"retry-after-ms", b"%d" % ms)]
    return list(ticket.headers) if ticket is not None else []
