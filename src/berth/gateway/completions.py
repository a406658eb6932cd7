"""A completion request through the proxy's stages (:class:`Completions`), from its body
read to its records; :class:`~berth.gateway.proxy.OpenAIProxy` hands it each ``POST`` to a
completion path (:data:`~berth.gateway.request.DIALECTS`).

:meth:`Completions.serve` is the list of the stages, in order:

1. :func:`~berth.gateway.request.read_body` and :func:`~berth.gateway.request.parse_request`:
   the :class:`~berth.gateway.request.PublicRequest` (400; 413 for a body over its size,
   elements, messages or content parts; 429 for a key whose bodies in flight are over its
   bound; a client that leaves while sending is counted 499);
2. :func:`~berth.gateway.stages.admit`, then :func:`~berth.gateway.stages.ask_usage`, when
   there is admission (403, 429);
3. :meth:`~berth.gateway.stages.Routing.route` (404, 503; held while its service loads);
4. in :meth:`Completions._dispatch`: :func:`~berth.gateway.stages.take_slot` (the fair
   queue); in :meth:`Completions._relay`: :func:`~berth.gateway.dispatch.first_answer` over
   :class:`~berth.gateway.attempt.Attempts` (each attempt, 502/504 when none answered), the
   answer relayed (:mod:`berth.gateway.relay`);
5. :meth:`~berth.gateway.record.Records.finished` (or ``unsent`` for a request refused before
   it was planned): metrics, the request log, the key's ledger.

Each stage that takes something gives it back in a ``finally`` of its own, so no way out of
the request (an answer, a refusal, the client leaving, a failure of a later stage, a bug)
can keep it: the key's body bytes and ticket in :meth:`Completions.serve`, the fair queue's
slot in :meth:`Completions._dispatch`, the engine's answer (its connection or tunnel
stream, its adapter lease) in :meth:`Completions._relay`, the router's in-flight count and
the proxy's metrics in :meth:`Completions._forward` (``tests/test_admission_scope.py``
injects a failure at each stage and finds every counter back at zero).

A request refused before it was planned is answered by
:class:`~berth.gateway.refusals.Refusals`; one refused or failed after (the queue, the
engines, before the answer started) is answered in :meth:`Completions._forward`. Only a
:class:`~berth.errors.BerthError` is answered; anything else is a bug and goes up to the
server (a 500).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from berth.admission import Admission, QueueRefusedError, SlotGate, SocketCaller, Ticket
from berth.deployments.adapters import AdapterManager
from berth.errors import BerthError
from berth.gateway.attempt import Attempts, EngineOpener, StreamLimits
from berth.gateway.body_limits import BodyLimits
from berth.gateway.dispatch import first_answer
from berth.gateway.exchange import ClientHead, ClientRequest, ClientWriter
from berth.gateway.outcome import Exchange
from berth.gateway.record import Flight, Records, target_of
from berth.gateway.refusals import Refusals, reason, refusal_headers
from berth.gateway.relay import AnswerRelay
from berth.gateway.request import PublicRequest, parse_request, read_body
from berth.gateway.stages import Routing, admit, ask_usage, take_slot
from berth.observability.metrics import ProxyMetrics
from berth.routing.errors import EngineTimeoutError, EngineUnreachableError, ProxyError
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from berth.vocab.records import ApiKeyRecord

if TYPE_CHECKING:  # imported only where tracing is on (berth.daemon.build opens it)
    from berth.observability.tracing import RequestTrace, RequestTracer

__all__ = ["Completions"]

_log = logging.getLogger(__name__)


class Completions:
    """The completion request path: the stages' parts, each given by the proxy that owns
    it (:class:`~berth.gateway.proxy.OpenAIProxy` documents the settings).

    ``router`` and ``routing`` plan; ``admission`` and ``slots``, when given, admit and
    hold; ``open_engine`` sends each attempt (within ``stream_limits`` for a stream, at most
    ``max_attempts``); ``answers`` relays; ``records`` and ``refusals`` count and
    answer; ``adapters`` names the adapters; ``clock`` times it all (seconds).
    """

    def __init__(
        self,
        *,
        router: Router,
        routing: Routing,
        open_engine: EngineOpener,
        answers: AnswerRelay,
        records: Records,
        refusals: Refusals,
        metrics: ProxyMetrics,
        clock: Callable[[], float],
        stream_limits: StreamLimits,
        max_attempts: int,
        max_body_bytes: int,
        body_limits: BodyLimits | None = None,
        admission: Admission | None = None,
        slots: SlotGate | None = None,
        adapters: AdapterManager | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.router = router
        self._tracer = tracer
        self._routing = routing
        self._open = open_engine
        self._answers = answers
        self._records = records
        self._refusals = refusals
        self._metrics = metrics
        self._clock = clock
        self._stream_limits = stream_limits
        self._max_attempts = max_attempts
        self._max_body_bytes = max_body_bytes
        self._body_limits = body_limits if body_limits is not None else BodyLimits()
        self._admission = admission
        self._slots = slots
        self._adapters = adapters
        self.request_log = records.request_log

    async def serve(
        self,
        client: ClientRequest,
        head: ClientHead,
        writer: ClientWriter,
        api_key: ApiKeyRecord | SocketCaller | None,
        key_name: str = "",
        dialect: str = "",
    ) -> None:
        """Serve one completion request of ``api_key`` (named ``key_name`` in the request
        log) for ``client.path``, whose API is ``dialect`` (see
        :data:`~berth.gateway.request.DIALECTS`) and whose headers said ``head``: read and
        parse it (its body's bytes held against its key's bound from the first byte),
        admit it, then :meth:`_admitted`.

        What admission takes is given back in the ``finally`` of this one stage, whatever
        way the request ends (an answer, a refusal, the client leaving, a failure in any
        later stage, a bug): the body's bytes (:class:`~berth.admission.BodyHold`) and the
        ticket (:meth:`Admission.release <berth.admission.Admission.release>`, which does
        nothing to a ticket the records settled with the engine's usage). Later stages take
        and give back their own the same way: the fair queue's slot in :meth:`_dispatch`,
        the engine's answer (and its adapter lease) in :meth:`_relay`, the router's
        in-flight count and the records in :meth:`_forward`.
        """
        request_id = head.request_id
        start = self._clock()
        started_at = self.request_log.now()
        request: PublicRequest | None = None
        # tracing off: None, and every hook is one "is not None" test (docs/tracing.md)
        trace = None
        if self._tracer is not None:
            trace = self._tracer.begin(client.method, client.path, client.headers, request_id)
        admission = self._admission
        hold = admission.hold_body(api_key) if admission is not None else None
        try:
            try:
                raw = await read_body(
                    client,
                    head.content_length,
                    self._max_body_bytes,
                    max_elements=self._body_limits.max_elements,
                    hold=hold,
                )
                if raw is None:  # the client left while sending it
                    self._refusals.count("", 499, start, "client_disconnected")
                    if trace is not None:
                        trace.finish(0, error_reason="client_disconnected")
                    return
                request = parse_request(
                    raw,
                    path=client.path,
                    dialect=dialect,
                    query=client.query,
                    request_id=request_id,
                    headers=client.headers,
                    forward=head.forward,
                    key=api_key,
                    key_name=key_name,
                    is_adapter=self._is_adapter,
                    limits=self._body_limits,
                )
                if trace is not None:
                    trace.request(request.model, request.stream)
                ticket = admit(admission, request) if admission is not None else None
            except BerthError as exc:
                model = request.model if request is not None else ""
                await self._refuse(exc, None, client, writer, request_id, key_name, model,
                                   start, started_at, trace)  # fmt: skip
                return
            try:
                await self._admitted(request, ticket, client, writer, start, started_at, trace)
            finally:
                if ticket is not None and admission is not None:
                    admission.release(ticket)
        finally:
            if hold is not None:
                hold.release()

    async def _admitted(
        self,
        request: PublicRequest,
        ticket: Ticket | None,
        client: ClientRequest,
        writer: ClientWriter,
        start: float,
        started_at: float,
        trace: RequestTrace | None,
    ) -> None:
        """An admitted request (its ticket is released by :meth:`serve`): asked for its
        stream's usage, routed, then :meth:`_forward`."""
        try:
            if ticket is not None:
                if trace is not None:
                    trace.admitted(ticket.priority)
                request = ask_usage(request)
            routed = await self._routing.route(request, client, trace)
        except BerthError as exc:
            self._release(ticket)  # before the answer: a client that retries finds it free
            await self._refuse(
                exc,
                ticket,
                client,
                writer,
                request.request_id,
                request.key_name,
                request.model,
                start,
                started_at,
                trace,
            )
            return
        if routed is None:  # the client left while its service loaded
            if trace is not None:
                trace.finish(0, error_reason="client_disconnected")
            self._release(ticket)
            self._refusals.count(request.model, 499, start, "client_disconnected")
            self._records.unsent(started_at, start, request.request_id, request.key_name,
                                 request.model, 499, "client_disconnected")  # fmt: skip
            return
        request, plan = routed
        await self._forward(request, plan, ticket, client, writer, start, started_at, trace)

    async def _refuse(
        self,
        exc: BerthError,
        ticket: Ticket | None,
        client: ClientRequest,
        writer: ClientWriter,
        request_id: bytes,
        key_name: str,
        model: str,
        start: float,
        started_at: float,
        trace: RequestTrace | None,
    ) -> None:
        """Answer a request refused before it was planned, and record it."""
        extra = refusal_headers(exc, ticket)
        status = await self._refusals.reject(
            writer, request_id, exc, start, extra=extra, path=client.path
        )
        self._records.unsent(started_at, start, request_id, key_name, model, status, reason(exc))
        if trace is not None:
            trace.finish(status, error_reason=reason(exc))

    def _release(self, ticket: Ticket | None) -> None:
        if ticket is not None and self._admission is not None:
            self._admission.release(ticket)

    async def _forward(
        self,
        request: PublicRequest,
        plan: list[Upstream],
        ticket: Ticket | None,
        client: ClientRequest,
        writer: ClientWriter,
        start: float,
        started_at: float,
        trace: RequestTrace | None = None,
    ) -> None:
        """A planned request: its slot, its attempts, its answer relayed, and its records
        (its trace's end too), whatever happened (the client may leave at any point: the
        engine request is closed)."""
        flight = Flight(plan[0], reached=self._slots is None)
        headers = ticket.headers if ticket is not None else []
        exchange = Exchange(
            start, headers, strip_usage=request.strip_usage, dialect=request.dialect
        )
        attempts = Attempts(request, self._open, self._stream_limits, exchange, trace)
        task = asyncio.current_task()
        assert task is not None, "requests are served in a task"

        def client_left() -> None:
            # Cancelling the relay closes the engine request: it stops generating for nobody.
            if not exchange.done:
                exchange.client_gone = True
                task.cancel()

        # Counted in flight from here to the records, in the finally below (moved if a
        # retry goes elsewhere).
        self._metrics.request_started(target_of(flight.upstream))
        try:
            client.watch_disconnect(client_left)
            await self._dispatch(request, plan, ticket, attempts, writer, exchange, flight, trace)
        except asyncio.CancelledError:
            # Ours if the client left (the engine request is closed by now); anyone else's
            # (a server shutting down) goes on up.
            if not exchange.client_gone or task.uncancel() > 0:
                raise
            exchange.error_reason = "client_disconnected"
        except (ProxyError, QueueRefusedError) as exc:  # raised only before the answer started
            exchange.done = True
            reply = await self._refusals.send_error(
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
            self._records.finished(request, flight, exchange, attempts.outcomes, ticket, started_at)
            if trace is not None:
                _finish_trace(trace, flight, exchange)

    async def _dispatch(
        self,
        request: PublicRequest,
        plan: list[Upstream],
        ticket: Ticket | None,
        attempts: Attempts,
        writer: ClientWriter,
        exchange: Exchange,
        flight: Flight,
        trace: RequestTrace | None = None,
    ) -> None:
        """The fair queue's slot (when there is a gate), held until the answer is over and
        given back here whatever happened, then :meth:`_relay`; ``flight`` keeps where the
        request went at each step, for the records."""
        gate = self._slots
        if gate is None:
            await self._relay(request, plan, attempts, writer, exchange, flight, trace)
            return
        flight.held, plan = await take_slot(gate, request, ticket, plan, trace)
        try:
            flight.reached = True
            if plan[0] is not flight.upstream:  # a slot was free at another deployment
                self._metrics.request_moved(target_of(flight.upstream), target_of(plan[0]))
                flight.upstream = plan[0]
            await self._relay(request, plan, attempts, writer, exchange, flight, trace)
        finally:
            if flight.held is not None:  # where it is held now (a retry moves it)
                gate.release(flight.held)
                flight.held = None

    async def _relay(
        self,
        request: PublicRequest,
        plan: list[Upstream],
        attempts: Attempts,
        writer: ClientWriter,
        exchange: Exchange,
        flight: Flight,
        trace: RequestTrace | None,
    ) -> None:
        """The attempts along the plan until an engine answers (:func:`first_answer`), and
        its answer relayed, then closed whatever happened (which also gives back its
        adapter lease, where it holds one)."""
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
        try:
            if chosen is not upstream:  # a retry served it elsewhere
                self._metrics.request_moved(target_of(upstream), target_of(chosen))
                gate = self._slots
                if flight.held is not None and gate is not None:
                    flight.held = gate.move(flight.held, chosen)
            flight.upstream = chosen
            self.router.succeeded(request.affinity_key, chosen)
            if trace is not None:
                trace.relaying(request.stream)
            await self._answers.relay(chosen, response, request.request_id, writer, exchange)
        finally:
            response.close()  # the relay closes it too; a close is idempotent

    def _is_adapter(self, model: str) -> bool:
        adapters = self._adapters
        return adapters is not None and adapters.entry(model) is not None


def _finish_trace(trace: RequestTrace, flight: Flight, exchange: Exchange) -> None:
    """End a request's trace with what its exchange measured (as its records do)."""
    usage = exchange.usage
    served = flight.dispatched
    trace.finish(
        exchange.status,
        node_id=flight.upstream.node_id if served else None,
        deployment_id=flight.upstream.deployment_id if served else None,
        ttfb_s=exchange.ttfb_s,
        error_reason=exchange.error_reason,
        input_tokens=usage.prompt_tokens if usage else None,
        output_tokens=usage.completion_tokens if usage else None,
        cached_tokens=usage.cached_tokens if usage else None,
        events=exchange.events,
        answer_bytes=exchange.answer_bytes,
    )
