"""The OpenAI-compatible proxy: a raw ASGI app relaying ``/v1/*`` requests to engines.

A completion request is one :class:`~berth.gateway.request.PublicRequest`, parsed once and
handed through named stages, each of which takes the value and returns it (or what it
decided), each testable alone (``tests/test_request_stages.py``)::

    read_body (bounded in bytes and JSON elements as it arrives, its bytes held against
      its key's bound: 413, 429) -> parse_request: the value (its body parsed once, model,
      stream, key, adapter; 400; 413 for too many messages or parts) berth.gateway.request
    -> admit: the key's limits (403/429), its rate-limit headers    berth.gateway.stages
    -> ask_usage (a rewriter): a stream asks the engine for its usage
    -> Routing.route: ranked candidates and the affinity key (nothing ready: held by the
       on-demand stage until its service loads; a Messages request: only the engines that
       serve its path)
    -> take_slot: a slot at one of them, waiting in the fair queue if need be
    -> first_answer: the attempts along the plan, the next node's before the first byte if
       one fails (berth.gateway.dispatch); each an Attempts call: the EngineRequest
       for that upstream (the path, query, forwarded headers, and the body that engine
       must see: EngineBodies, the model-name and LoRA rewriter, written from the parsed
       body), opened over the engine client (pooled HTTP/1.1, or an agent's tunnel), a
       stream within its first-byte timeout                        berth.gateway.attempt
    -> AnswerRelay.relay, on the path relay_path chose once (push, pull, read-ahead): JSON
       whole, event streams event by event                          berth.gateway.relay
    -> Records.finished: ProxyMetrics, the request log, admission.settle (the ledger)
                                                                    berth.gateway.record

:class:`~berth.gateway.completions.Completions` runs that list (``serve`` up to the
routing, ``_dispatch`` from the slot on); this module is the app around it: the paths, the
methods, ``/v1/models``, the lifecycle.

Where the next features hook in: a router that hashes prompt prefixes reads the parsed body
(``request.body["messages"]``) in the routing stage; the tracer (``tracer``, when
tracing is on: :mod:`berth.observability.tracing`) is handed each request's trace in
``Completions.serve`` and ``Completions._dispatch`` (admission, routing, the slot), in each
attempt (:class:`~berth.gateway.attempt.Attempts`, which puts the attempt's
``traceparent`` in its engine request), and ends it with the records; a dialect
translator rewrites the request after routing (its body and raw bytes, and
``engine_path``, the path the engines are asked at) or per upstream
(:meth:`~berth.gateway.attempt.Attempts.engine_request`), and the answer in the attempt or
the relay.

There is no framework routing here: this module is called only after authentication, for the
paths it serves (``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/responses``, and Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``;
``GET /v1/models`` and ``/v1/models/{id}``), and it matches ``scope["path"]`` itself.
Errors are answered in the OpenAI shape (:mod:`berth.openai_errors`), or under
``/v1/messages`` in Anthropic's (:mod:`berth.anthropic_errors`, converted from the same
errors by :class:`~berth.gateway.refusals.Refusals`); the ones this module raises are drawn
in :mod:`berth.routing.errors`. A Messages request goes the same way as a chat completion,
only to the deployments whose engine serves its path (:mod:`berth.routing.capability`), or,
when none does, to all of them translated to a chat completion, its answer translated back
(:mod:`berth.gateway.messages_bridge`: the routing stage and the attempt call it).
What the proxy needs of the client's request and of the writer of its answer is in
:mod:`berth.gateway.exchange` (berth's own HTTP server gives both as they are;
:mod:`berth.gateway.asgi` adapts ASGI), the relaying of an engine's answer in
:mod:`berth.gateway.relay`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from berth.admission import Admission, SlotGate, SocketCaller
from berth.deployments.adapters import AdapterManager
from berth.engine_http.answer import HttpOpener
from berth.errors import NotFoundError
from berth.gateway.asgi import AsgiClientRequest, AsgiClientWriter
from berth.gateway.attempt import StreamLimits
from berth.gateway.body_limits import BodyLimits
from berth.gateway.completions import Completions
from berth.gateway.engine_client import EngineAuth, EngineClient
from berth.gateway.exchange import (
    ClientRequest,
    ClientWriter,
    Receive,
    Scope,
    Send,
    scan_headers,
    send_json,
)
from berth.gateway.read_ahead import DEFAULT_BUFFER_CHUNKS
from berth.gateway.record import Records
from berth.gateway.refusals import Refusals
from berth.gateway.relay import AnswerRelay
from berth.gateway.request import DIALECTS
from berth.gateway.stages import Routing
from berth.observability.metrics import ProxyMetrics
from berth.observability.request_log import RequestLog
from berth.routing.errors import InvalidRequestError
from berth.routing.resolver import UpstreamResolver
from berth.routing.retry import DEFAULT_MAX_ATTEMPTS
from berth.routing.router import Router
from berth.scaling.on_demand import OnDemandStage
from berth.vocab.records import ApiKeyRecord

if TYPE_CHECKING:  # imported only where tracing is on (berth.daemon.build opens it)
    from berth.observability.tracing import RequestTracer

__all__ = ["OpenAIProxy"]


MiB = 1024 * 1024

_MODELS_PATH = "/v1/models"
_MODEL_PREFIX = "/v1/models/"
#: The ``[server]`` settings' defaults (README, Engines and failures): a stream's first byte
#: (its head and first event: prefill) within 120 s, then no silence over 60 s; a
#: non-streamed answer, which comes whole once generation ends, within 600 s.
FIRST_BYTE_TIMEOUT_S = 120.0
STREAM_IDLE_TIMEOUT_S = 60.0
READ_TIMEOUT_S = 600.0


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

    ``max_body_bytes`` bounds a request body (413 beyond it), and ``body_limits`` what it
    may hold (JSON elements, counted as it arrives, messages and content parts: 413 beyond
    one; :mod:`berth.gateway.body_limits`). ``connect_timeout_s`` bounds
    connecting to an engine (502 when exceeded or refused). A streamed request (``"stream":
    true``) has its first byte within ``first_byte_timeout_s``: the engine's head and, for an
    event stream, its first bytes (nothing reaches the client before them); past it the
    exchange is closed (the engine stops) and the request goes to the next candidate, or
    ends 504 ``first_byte_timeout``; but while the engine begins answering other requests in
    each such period, the request is queued behind them, not hung, and waits on. Its stream
    then goes silent for at most ``stream_idle_timeout_s`` (while the client keeps up),
    after which it ends with an error event (``stream_idle_timeout``) and the exchange is
    closed. A deployment's service may set either for its deployments
    (``upstream.timeouts``). ``None`` (or 0 for a service) turns either off: only
    ``read_timeout_s`` bounds that wait then.
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
    (:meth:`berth.deployments.adapters.AdapterManager.gated`), and gives ``/v1/models`` each
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

    ``tracer``, when given (tracing is on), traces each completion request
    (:class:`berth.observability.tracing.RequestTracer`; docs/tracing.md); ``None`` costs a
    request one ``is not None`` test per hook.

    Call :meth:`startup` before serving and :meth:`shutdown` after (or let an ASGI server's
    lifespan protocol do it when this app is served directly).
    """

    def __init__(
        self,
        resolver: UpstreamResolver,
        metrics: ProxyMetrics,
        *,
        max_body_bytes: int = 16 * MiB,
        body_limits: BodyLimits | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = READ_TIMEOUT_S,
        first_byte_timeout_s: float | None = FIRST_BYTE_TIMEOUT_S,
        stream_idle_timeout_s: float | None = STREAM_IDLE_TIMEOUT_S,
        max_connections: int = 1024,
        max_buffered_response_bytes: int = 1 * MiB,
        max_event_bytes: int = 1 * MiB,
        clock: Callable[[], float] = time.perf_counter,
        tunnels: HttpOpener | None = None,
        router: Router | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        relay_buffer_chunks: int = DEFAULT_BUFFER_CHUNKS,
        engine_auth: EngineAuth | None = None,
        on_demand: OnDemandStage | None = None,
        request_log: RequestLog | None = None,
        admission: Admission | None = None,
        slots: SlotGate | None = None,
        adapters: AdapterManager | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self._resolver = resolver
        #: The recent requests (the console's requests view, ``GET /admin/requests``).
        self.request_log = request_log if request_log is not None else RequestLog()
        self._adapters = adapters
        #: the engine client (also the prefix policy's way to the engines' cache signals)
        self.engines = self._engines = engines = EngineClient(
            tunnels=tunnels,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            max_connections=max_connections,
            engine_auth=engine_auth,
        )
        self.router = router = router or Router(resolver)
        self._created = int(time.time())
        self._clock = clock
        self._refusals = refusals = Refusals(metrics, clock)
        self._completions = Completions(
            router=router,
            routing=Routing(router, on_demand),
            # an adapter request has its adapter loaded into the engine first (the gate)
            open_engine=engines.open if adapters is None else adapters.gated(engines.open),
            answers=AnswerRelay(
                read_timeout_s=read_timeout_s,
                max_buffered_response_bytes=max_buffered_response_bytes,
                max_event_bytes=max_event_bytes,
                clock=clock,
                read_ahead_chunks=relay_buffer_chunks,
            ),
            records=Records(metrics, self.request_log, admission, clock),
            refusals=refusals,
            metrics=metrics,
            clock=clock,
            stream_limits=StreamLimits(
                first_byte_timeout_s, stream_idle_timeout_s, router.signals.answers
            ),
            max_attempts=max_attempts,
            max_body_bytes=max_body_bytes,
            body_limits=body_limits,
            admission=admission,
            slots=slots,
            adapters=adapters,
            tracer=tracer,
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
        head = scan_headers(request.headers)
        request_id = head.request_id
        dialect = DIALECTS.get(path)
        if dialect is not None:
            if method == "POST":
                await self._completions.serve(request, head, writer, api_key, key_name, dialect)
                return
            allowed = "POST"
        elif path == _MODELS_PATH or path.startswith(_MODEL_PREFIX):
            if method == "GET":
                await self._models(path, request_id, writer)
                return
            allowed = "GET"
        else:
            await self._refusals.reject(
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
        await self._refusals.reject(
            writer, request_id, error, self._clock(), allow=allowed, path=path
        )

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
                await self._refusals.reject(
                    writer, request_id, NotFoundError("model", ident), start
                )
                return
            payload = self._model_card(ident)
        await send_json(writer, 200, json.dumps(payload).encode(), request_id)

    def _model_card(self, name: str) -> dict[str, object]:
        # OpenAI's Model object; "created" is unix seconds, here when the proxy started.
        card = {"id": name, "object": "model", "created": self._created, "owned_by": "berth"}
        adapter = self._adapters.entry(name) if self._adapters is not None else None
        return card if adapter is None else {**card, "parent": adapter.base}  # vLLM's field
