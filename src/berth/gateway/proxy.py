"""The OpenAI-compatible proxy: a raw ASGI app relaying ``/v1/*`` requests to engines.

One request, on the hot path::

    read the body (bounded) -> its JSON "model" -> admission.admit(key, model): the key's
      limits (403/429), its rate-limit headers -> Router.plan(model): ranked candidates
      (nothing ready: held by the on-demand stage until its service loads, then planned)
      -> slots.acquire(...): a slot at one of them, waiting in the fair queue if need be
      -> POST the same bytes to the best engine, the next node's before the first byte if it
         fails (dispatch; engine_client: pooled HTTP/1.1, or an agent's tunnel)
      -> relay the answer: JSON whole, event streams event by event -> ProxyMetrics, and
         admission.settle(ticket, usage): the ledger

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
:mod:`berth.gateway.exchange` (berth's own HTTP server gives both as they are;
:mod:`berth.gateway.asgi` adapts ASGI), the relaying of an engine's answer in
:mod:`berth.gateway.relay`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence

from berth.admission import (
    MUST_WAIT,
    SOCKET_KEY_ID,
    Admission,
    AdmissionError,
    QueueRefusedError,
    QuotaExceededError,
    SlotGate,
    SocketCaller,
    Ticket,
)
from berth.admission import estimate as estimate_tokens
from berth.anthropic_errors import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    is_messages_path,
    to_anthropic,
)
from berth.deployments.adapters import AdapterManager
from berth.engine_http.answer import EngineAnswer, TimedAnswer, can_time
from berth.errors import BerthError, NotFoundError
from berth.gateway.adapter_resolver import with_lora
from berth.gateway.asgi import AsgiClientRequest, AsgiClientWriter
from berth.gateway.dispatch import first_answer
from berth.gateway.engine_client import EngineAuth, EngineClient, TunnelOpener
from berth.gateway.exchange import (
    ClientRequest,
    ClientWriter,
    Receive,
    Scope,
    Send,
    model_in,
    payload_of,
    scan_headers,
    send_json,
    with_model,
)
from berth.gateway.read_ahead import DEFAULT_BUFFER_CHUNKS, ReadAhead
from berth.gateway.relay import AnswerRelay, Exchange
from berth.gateway.usage import asking_for_usage
from berth.http_server.errors import HttpServerError
from berth.observability.metrics import ProxyMetrics, Target
from berth.observability.request_log import RequestLog
from berth.openai_errors import ErrorResponse, error_from_exception
from berth.routing.capability import serving
from berth.routing.errors import (
    EngineTimeoutError,
    EngineUnreachableError,
    FirstByteTimeoutError,
    InvalidRequestError,
    NoReadyDeploymentError,
    ProxyError,
    RequestTooLargeError,
)
from berth.routing.resolver import Upstream, UpstreamResolver
from berth.routing.retry import DEFAULT_MAX_ATTEMPTS
from berth.routing.router import Router
from berth.scaling.on_demand import OnDemandStage
from berth.store.records import ApiKeyRecord

__all__ = ["OpenAIProxy"]


_log = logging.getLogger(__name__)

MiB = 1024 * 1024

#: The paths relayed to engines, and the API each speaks (:class:`Exchange`'s ``dialect``):
#: OpenAI's, or Anthropic's Messages (passed through to the engines that serve it).
_DIALECTS = {
    "/v1/chat/completions": "",
    "/v1/completions": "",
    "/v1/embeddings": "",
    "/v1/responses": "",
    MESSAGES_PATH: "messages",
    COUNT_TOKENS_PATH: "count_tokens",
}
_MODELS_PATH = "/v1/models"
#: How much of a request's ``model`` the request log keeps (a client may send anything).
_MAX_LOGGED_MODEL_CHARS = 200
_MODEL_PREFIX = "/v1/models/"
#: The ``[server]`` settings' defaults (README, Engines and failures): a stream's first byte
#: (its head and first event: prefill) within 120 s, then no silence over 60 s; a
#: non-streamed answer, which comes whole once generation ends, within 600 s.
FIRST_BYTE_TIMEOUT_S = 120.0
STREAM_IDLE_TIMEOUT_S = 60.0
READ_TIMEOUT_S = 600.0


class _Bodies:
    """The request body as each upstream's engine must see it: as sent, or with its
    ``"model"`` rewritten to the engine's name (done once per name, not per attempt)."""

    def __init__(self, body: bytes) -> None:
        self._body = body
        self._rewritten: dict[str, bytes] = {}

    def get(self, upstream: Upstream) -> bytes:
        name, scales = upstream.engine_model, upstream.lora_scales
        if name is None and not scales:
            return self._body
        key = f"{name}\0lora={scales}"  # llama.cpp with adapters: their scales per request
        rewritten = self._rewritten.get(key)
        if rewritten is None:
            if scales:
                rewritten = with_lora(self._body, name, scales)
            else:
                assert name is not None  # checked above
                rewritten = with_model(self._body, name)
            self._rewritten[key] = rewritten
        return rewritten


def _reason(exc: BerthError) -> str:
    """The short reason a refused request is counted and logged under."""
    if isinstance(exc, ProxyError | AdmissionError):
        return exc.error_code
    if isinstance(exc, NotFoundError):
        return exc.not_found_code
    return "error"


def _target(upstream: Upstream) -> Target:
    return Target(upstream.model, upstream.deployment_id, upstream.node_id)


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
        self._on_demand = on_demand
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
        self._max_attempts = max_attempts
        self._first_byte_timeout_s = first_byte_timeout_s
        self._stream_idle_timeout_s = stream_idle_timeout_s
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
        dialect = _DIALECTS.get(path)
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
        request: ClientRequest,
        request_id: bytes,
        forward: list[tuple[bytes, bytes]],
        content_length: bytes | None,
        writer: ClientWriter,
        api_key: ApiKeyRecord | SocketCaller | None,
        key_name: str = "",
        dialect: str = "",
    ) -> None:
        start = self._clock()
        started_at = self.request_log.now()
        model = ""
        admission = self._admission
        ticket: Ticket | None = None
        strip_usage = False
        path = request.path
        try:
            body = await self._read_body(request, content_length)
            if body is None:
                self._metrics.request_rejected(
                    model="",
                    status=499,
                    duration_s=self._clock() - start,
                    error_reason="client_disconnected",
                )
                return
            request_bytes = len(body)
            payload = payload_of(body)
            model = model_in(payload)
            streamed = payload.get("stream") is True
            if admission is not None:
                # Limits first: a request its key may not make never reaches the router.
                ticket = admission.admit(api_key, model, request_bytes)
                asked = asking_for_usage(path, body, payload)
                if asked is not None:
                    body, strip_usage = asked, True
            try:
                plan, key = self.router.plan_request(model, request.headers)
            except NoReadyDeploymentError:
                if self._on_demand is None:
                    raise
                loaded = await self._hold(self._on_demand, model, request)
                if loaded is None:  # the client left while its service loaded
                    self._settle_unsent(ticket)
                    self._metrics.request_rejected(
                        model=model,
                        status=499,
                        duration_s=self._clock() - start,
                        error_reason="client_disconnected",
                    )
                    self._log_unsent(
                        started_at, start, request_id, key_name, model, 499, "client_disconnected"
                    )
                    return
                plan, key = loaded
            if dialect:  # only the engines that serve the path, in the router's order
                plan = serving(plan, path)
        except BerthError as exc:
            extra = _refusal_headers(exc, ticket)
            self._settle_unsent(ticket)
            status = await self._reject(writer, request_id, exc, start, extra=extra, path=path)
            self._log_unsent(started_at, start, request_id, key_name, model, status, _reason(exc))
            return

        upstream = plan[0]
        self._metrics.request_started(_target(upstream))  # moved if a retry goes elsewhere
        headers = ticket.headers if ticket is not None else []
        exchange = Exchange(start, headers, strip_usage=strip_usage, dialect=dialect)
        task = asyncio.current_task()
        assert task is not None, "requests are served in a task"

        def client_left() -> None:
            # Cancelling the relay closes the engine request: it stops generating for nobody.
            if not exchange.done:
                exchange.client_gone = True
                task.cancel()

        request.watch_disconnect(client_left)
        signals = self.router.signals
        query = request.query
        dispatched = False
        gate = self._slots
        held: str | None = None  # the deployment this request holds a slot at
        reached = gate is None  # whether it passed the fair admission queue
        # Where each attempt went and how it ended; all but the last moved on (retries).
        outcomes: list[tuple[Upstream, str]] = []
        bodies = _Bodies(body)  # rewritten at most once per engine model
        open_answer = self._open_stream if streamed else self._open

        async def attempt(target: Upstream) -> EngineAnswer:
            try:
                answer = await open_answer(target, path, query, forward, bodies.get(target))
            except ProxyError as exc:
                outcomes.append((target, exc.error_code))
                raise
            except asyncio.CancelledError:
                # Its engine given up (the request may go on elsewhere), or the client left.
                outcomes.append((target, "client_disconnected" if exchange.client_gone
                                 else "given_up"))  # fmt: skip
                raise
            outcomes.append((target, f"status {answer.status}"))
            return answer

        try:
            if gate is not None:
                # Fair admission: a slot at one of the planned deployments, taken at once
                # when one is free (no await), else waited for in the fair queue.
                taken = gate.take_free(plan)
                if taken is MUST_WAIT:
                    key_id = ticket.key_id if ticket is not None else SOCKET_KEY_ID
                    priority = ticket.priority if ticket is not None else 0
                    taken = await gate.wait(key_id, priority, model, plan)
                held = taken
                reached = True
                if held is not None and held != upstream.deployment_id:
                    plan = _first(plan, held)
                    self._metrics.request_moved(_target(upstream), _target(plan[0]))
                    upstream = plan[0]
            try:
                chosen, response = await first_answer(
                    plan,
                    attempt,
                    max_attempts=self._max_attempts,
                    signals=signals,
                    clock=self._clock,
                    request_id=request_id.decode(),
                    waiting=self.router.waiting,
                )
            except (EngineUnreachableError, EngineTimeoutError) as exc:
                # Counted against the engine that failed last, as the client is told.
                self._metrics.request_moved(_target(upstream), _target(exc.upstream))
                upstream = exc.upstream
                raise
            dispatched = True
            if chosen is not upstream:  # a retry served it elsewhere
                self._metrics.request_moved(_target(upstream), _target(chosen))
                if held is not None and gate is not None:
                    held = gate.move(held, chosen)
            upstream = chosen
            self.router.succeeded(key, upstream)
            await self._relay(upstream, response, request_id, writer, exchange)
        except asyncio.CancelledError:
            # Ours if the client left (the engine request is closed by now); anyone else's
            # (a server shutting down) goes on up.
            if not exchange.client_gone or task.uncancel() > 0:
                raise
            exchange.error_reason = "client_disconnected"
        except (ProxyError, QueueRefusedError) as exc:  # raised only before the answer started
            exchange.done = True
            reply = await self._send_error(
                writer, request_id, exc, exchange.answer_headers, path=path
            )
            exchange.status = reply.status
            exchange.error_reason = exc.error_code
            _log.warning("request %s: %s", request_id.decode(), exc)
        finally:
            request.watch_disconnect(None)
            target = _target(upstream)
            for left, reason in outcomes[:-1]:
                self._metrics.request_retried(_target(left), reason)
            if dispatched:
                signals.finished(upstream.deployment_id, upstream.node_id)
            if held is not None and gate is not None:
                gate.release(held)
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
            self.request_log.add(
                started_at=started_at,
                request_id=request_id.decode(),
                key_name=key_name,
                model=model[:_MAX_LOGGED_MODEL_CHARS],
                node_id=upstream.node_id,
                deployment_id=upstream.deployment_id,
                status=exchange.status or 499,
                ttfb_s=exchange.ttfb_s,
                duration_s=self._clock() - start,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                completion_tokens=usage.completion_tokens if usage else 0,
                retries=tuple(reason for _, reason in outcomes[:-1]),
                error_reason=exchange.error_reason,
                cached_tokens=usage.cached_tokens if usage else 0,
            )
            if ticket is not None and admission is not None:
                node_id = upstream.node_id if reached else None  # None: queued, never sent
                _settle(admission, ticket, exchange, node_id, request_bytes)

    async def _open_stream(
        self,
        upstream: Upstream,
        path: str,
        query: bytes,
        forward: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> EngineAnswer:
        """Open a streamed request's exchange: its answer once the first byte is in (the
        head and, for an event stream, its first bytes), with the stream's idle timeout set.

        Raises what opening raises, and :class:`FirstByteTimeoutError` when the first byte
        did not come within the first-byte timeout; the exchange is closed then (the pooled
        connection dropped, or the tunnel stream reset, on which the agent closes its own),
        so the engine stops generating for nobody.
        """
        first_byte_s = self._first_byte_timeout_s
        idle_s = self._stream_idle_timeout_s
        timeouts = upstream.timeouts  # its service's, where it set them (0: none)
        if timeouts is not None:
            if timeouts.first_byte_timeout_s is not None:
                first_byte_s = timeouts.first_byte_timeout_s or None
            if timeouts.stream_idle_timeout_s is not None:
                idle_s = timeouts.stream_idle_timeout_s or None
        answer: EngineAnswer | None = None
        timed: TimedAnswer | None = None  # an event stream whose first bytes are awaited
        deadline = asyncio.timeout(first_byte_s)
        try:
            async with deadline:
                answer = await self._open(upstream, path, query, forward, body)
                if answer.status < 400 and can_time(answer) and _is_event_stream(answer):
                    timed = answer
                    await timed.wait_for_body()
        except TimeoutError:
            if answer is not None:
                answer.close()
            if not deadline.expired():
                raise
            assert first_byte_s is not None  # only a deadline expires
            raise FirstByteTimeoutError(upstream, first_byte_s) from None
        except BaseException:
            if answer is not None:
                answer.close()
            raise
        if timed is not None and idle_s is not None:
            timed.set_read_timeout(idle_s)
        return answer

    def _settle_unsent(self, ticket: Ticket | None) -> None:
        """Settle the ticket of a request that reached no engine (refused, or its client
        left before one was chosen): an error that used no tokens, and no ledger row."""
        if ticket is not None and self._admission is not None:
            self._admission.settle(
                ticket,
                node_id=None,
                error=True,
                prompt_tokens=0,
                completion_tokens=0,
                estimated=False,
            )

    def _log_unsent(
        self,
        started_at: float,
        start: float,
        request_id: bytes,
        key_name: str,
        model: str,
        status: int,
        reason: str,
    ) -> None:
        """Put a request that reached no engine in the request log, answered ``status``
        for ``reason`` (``started_at``: wall clock, ``start``: the proxy's clock)."""
        self.request_log.add(
            started_at=started_at,
            request_id=request_id.decode(),
            key_name=key_name,
            model=model[:_MAX_LOGGED_MODEL_CHARS],
            status=status,
            duration_s=self._clock() - start,
            error_reason=reason,
        )

    async def _hold(
        self, on_demand: OnDemandStage, model: str, request: ClientRequest
    ) -> tuple[list[Upstream], str | None] | None:
        """The on-demand stage: the plan once ``model`` has a ready deployment (raising what
        the stage raises: 503 for a load that timed out, was refused or failed), ``None``
        when the client left while it waited (it leaves the stage's queue at once)."""
        task = asyncio.current_task()
        assert task is not None, "requests are served in a task"
        left = False

        def client_left() -> None:
            nonlocal left
            left = True
            task.cancel()

        request.watch_disconnect(client_left)
        try:
            return await on_demand.until_ready(
                model, lambda: self.router.plan_request(model, request.headers)
            )
        except asyncio.CancelledError:
            # Ours if the client left; anyone else's (a server shutting down) goes on up.
            if not left or task.uncancel() > 0:
                raise
            return None
        finally:
            request.watch_disconnect(None)

    async def _read_body(
        self, request: ClientRequest, content_length: bytes | None
    ) -> bytes | None:
        """The request body, or ``None`` if the client left while sending it."""
        limit = self._max_body_bytes
        if content_length is not None:
            if not content_length.isdigit():
                raise InvalidRequestError("invalid Content-Length header", code="invalid_request")
            if int(content_length) > limit:
                raise RequestTooLargeError(limit)
        parts: list[bytes] = []
        size = 0
        try:
            while chunk := await request.read_chunk():
                size += len(chunk)
                if size > limit:
                    raise RequestTooLargeError(limit)
                parts.append(chunk)
        except HttpServerError:
            return None
        return parts[0] if len(parts) == 1 else b"".join(parts)

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


def _is_event_stream(answer: EngineAnswer) -> bool:
    content_type = answer.header(b"content-type")
    return content_type is not None and content_type.startswith(b"text/event-stream")


def _first(plan: Sequence[Upstream], deployment_id: str) -> list[Upstream]:
    """``plan`` with the upstream of ``deployment_id`` moved to its front."""
    chosen = [u for u in plan if u.deployment_id == deployment_id]
    return chosen + [u for u in plan if u.deployment_id != deployment_id]


def _settle(
    admission: Admission,
    ticket: Ticket,
    exchange: Exchange,
    node_id: str | None,
    request_bytes: int,
) -> None:
    """Settle ``ticket`` with the usage the engine reported, or with an estimate
    (:mod:`berth.admission.estimate`) when an answer was made without one. An error answer
    without usage used no tokens worth counting."""
    status = exchange.status
    error = status == 0 or status >= 400 or exchange.error_reason is not None
    usage = exchange.usage
    if usage is not None:
        prompt, completion, estimated = usage.prompt_tokens, usage.completion_tokens, False
    elif status == 0 or status >= 400:
        prompt, completion, estimated = 0, 0, False
    else:
        prompt = estimate_tokens.prompt_tokens(request_bytes)
        completion = estimate_tokens.completion_tokens(
            answer_bytes=exchange.answer_bytes, events=exchange.events, streamed=exchange.streamed
        )
        estimated = True
    admission.settle(
        ticket,
        node_id=node_id,
        error=error,
        prompt_tokens=prompt,
        completion_tokens=completion,
        estimated=estimated,
    )
