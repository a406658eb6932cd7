"""OpenTelemetry traces of the requests berth serves: the leader's spans of a ``/v1`` request
(:class:`RequestTracer`), the agent's span of its relay to the engine
(:class:`~berth.observability.relay_tracing.RelayTracer`, built here by :meth:`Tracing.relays`),
exported over OTLP/HTTP by the SDK (:func:`build_tracing`; docs/tracing.md).

Built only when tracing is on (:func:`berth.observability.tracing_config.tracing_config`
returned a config); with it off the proxy and the agent hold ``None`` and this module is
never imported. Nothing here touches the global tracer provider or OpenTelemetry's implicit
context: each process (and each test) has its own provider, and every span is given its
parent explicitly. Between processes the parent travels as W3C ``traceparent``: the leader
puts its attempt span's into the request it sends (through an agent's tunnel or straight to
an engine), the agent reads it and sends its own relay span's on to the engine.

A leader's trace of a streamed chat request that was retried once::

    POST /v1/chat/completions        SERVER  gen_ai.request.model, http.route, the route's
                                             candidates and reason, usage ...
      event: berth.first_byte
      berth.queue_wait               INTERNAL  (only when it waited for a slot)
      berth.attempt                  CLIENT  berth.attempt=1, node, deployment, outcome (error)
      berth.attempt                  CLIENT  berth.attempt=2 ... outcome "status 200"
        berth.agent.relay            SERVER  (the agent's process, through the tunnel)
          (the engine's own spans, an engine that traces: vLLM)
      berth.stream                   INTERNAL  from the first byte to the answer's end

Export: :class:`~berth.observability.span_export.BoundedSpanProcessor` in front of the SDK's
batch processor (a thread of its own): a span that finds the queue full is dropped and
counted (``berth_tracing_spans_dropped_total``), never waited for.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Final

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.util.types import AttributeValue

from berth import __version__
from berth.observability.relay_tracing import RelayTracer
from berth.observability.span_export import (
    BoundedSpanProcessor,
    CountingExporter,
    SpanExportCollector,
)
from berth.observability.trace_context import Headers, parent_of, with_context
from berth.observability.tracing_config import TracingConfig

__all__ = [
    "AttemptTrace",
    "RequestTrace",
    "RequestTracer",
    "Tracing",
    "build_tracing",
]

#: ``gen_ai.operation.name`` of each relayed path (OpenTelemetry GenAI semantic conventions;
#: a token count is berth's own name: the conventions have none).
_OPERATIONS: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
    "/v1/messages/count_tokens": "count_tokens",
}
_NS: Final = 1_000_000_000
#: How much of a request's ``model`` a span keeps (a client may send anything).
_MAX_MODEL_CHARS: Final = 200


def _sampler(config: TracingConfig) -> Sampler:
    match config.sampler:
        case "always_on":
            return ALWAYS_ON
        case "always_off":
            return ALWAYS_OFF
        case "traceidratio":
            return TraceIdRatioBased(config.ratio)
        case "parentbased_always_on":
            return ParentBased(ALWAYS_ON)
        case "parentbased_always_off":
            return ParentBased(ALWAYS_OFF)
        case "parentbased_traceidratio":
            return ParentBased(TraceIdRatioBased(config.ratio))


class AttemptTrace:
    """One attempt's span (CLIENT): :meth:`headers` for the request it sends, then
    :meth:`answered` or :meth:`failed`. A failed attempt, or one answered 5xx, ends at once;
    an answered one when its request's trace finishes (it spans the relayed answer)."""

    __slots__ = ("_span", "ended")

    def __init__(self, span: Span) -> None:
        self._span = span
        self.ended = False

    def headers(self, forward: Headers) -> list[tuple[bytes, bytes]]:
        """``forward`` with this attempt's ``traceparent`` (the engine's, or the agent's,
        parent)."""
        return with_context(forward, self._span)

    def answered(self, status: int) -> None:
        span = self._span
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("berth.attempt.outcome", f"status {status}")
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"answered {status}"))
            self.end()

    def failed(self, reason: str) -> None:
        """The attempt ended without an answer for ``reason`` (an error code of
        :mod:`berth.routing.errors`, ``given_up``, ``client_disconnected``)."""
        span = self._span
        span.set_attribute("berth.attempt.outcome", reason)
        span.set_attribute("error.type", reason)
        span.set_status(Status(StatusCode.ERROR, reason))
        self.end()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self._span.end()


class WaitTrace:
    """A wait of a request's (``berth.queue_wait``, ``berth.load_wait``): :meth:`end` it."""

    __slots__ = ("_span", "ended")

    def __init__(self, span: Span) -> None:
        self._span = span
        self.ended = False

    def end(self, error: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        if error is not None:
            self._span.set_attribute("error.type", error)
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


class RequestTrace:
    """The spans of one ``/v1`` request at the leader; the proxy calls, in order,
    :meth:`request` (its body was read), :meth:`admitted`, :meth:`waiting` (a wait's span),
    :meth:`routed`, :meth:`attempt` per attempt, :meth:`relaying` (its answer's first byte is
    in) and :meth:`finish` once, whatever happened. Every call is cheap and none blocks."""

    __slots__ = (
        "_attempts",
        "_context",
        "_recording",
        "_span",
        "_start_ns",
        "_stream",
        "_tracer",
        "_waits",
    )

    def __init__(self, tracer: Tracer, span: Span, start_ns: int) -> None:
        self._tracer = tracer
        self._span = span
        # Not sampled: no child spans are made (they would record nothing either); the
        # engine is handed the request's own span as parent, its sampled flag off.
        self._recording = span.is_recording()
        self._context = set_span_in_context(span)
        self._start_ns = start_ns
        self._attempts: list[AttemptTrace] = []
        self._waits: list[WaitTrace] = []
        self._stream: Span | None = None

    @property
    def span(self) -> Span:
        """The request's server span."""
        return self._span

    def request(self, model: str, streamed: bool) -> None:
        """The request's body was read: it asks for ``model``, streamed or not."""
        self._span.set_attribute("gen_ai.request.model", model[:_MAX_MODEL_CHARS])
        self._span.set_attribute("berth.streamed", streamed)

    def admitted(self, priority: int) -> None:
        """Admission let it through at ``priority`` (its key's tier)."""
        self._span.set_attribute("berth.priority", priority)

    def waiting(self, name: str) -> WaitTrace:
        """A wait begins now (``berth.queue_wait``: for a slot in the fair admission queue;
        ``berth.load_wait``: for its service to load); :meth:`WaitTrace.end` it."""
        if not self._recording:
            return WaitTrace(self._span)  # its calls do nothing to a span that records nothing
        span = self._tracer.start_span(name, context=self._context, kind=SpanKind.INTERNAL)
        wait = WaitTrace(span)
        self._waits.append(wait)
        return wait

    def routed(self, deployments: Sequence[str], reason: str) -> None:
        """The router's plan: ``deployments`` best first, and why the first leads
        (attributes of the request's span, not an event: a backend can search them, and
        they cost less)."""
        attributes: dict[str, AttributeValue] = {
            "berth.route.candidates": list(deployments),
            "berth.route.reason": reason,
        }
        self._span.set_attributes(attributes)

    def attempt(self, node_id: str, deployment_id: str) -> AttemptTrace:
        """An attempt at ``deployment_id`` on ``node_id`` begins now."""
        if not self._recording:
            return AttemptTrace(self._span)  # as for a wait; the request's own traceparent
        number = len(self._attempts) + 1
        attributes: dict[str, AttributeValue] = {
            "berth.attempt": number,
            "berth.node": node_id,
            "berth.deployment": deployment_id,
        }
        span = self._tracer.start_span(
            "berth.attempt", context=self._context, kind=SpanKind.CLIENT, attributes=attributes
        )
        attempt = AttemptTrace(span)
        self._attempts.append(attempt)
        return attempt

    def relaying(self, streamed: bool) -> None:
        """The answer's first byte is in: its relay to the client begins."""
        if not self._recording:
            return
        name = "berth.stream" if streamed else "berth.answer"
        self._stream = self._tracer.start_span(name, context=self._context)

    def finish(
        self,
        status: int,
        *,
        node_id: str | None = None,
        deployment_id: str | None = None,
        ttfb_s: float | None = None,
        error_reason: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_tokens: int | None = None,
        events: int = 0,
        answer_bytes: int = 0,
    ) -> None:
        """The request is over, answered ``status`` (0: nothing was sent, a 499 in the
        metrics) by ``deployment_id`` on ``node_id`` (``None``: no engine served it):
        every span of it still open ends now."""
        span = self._span
        if not self._recording:
            span.end()
            return
        attributes: dict[str, AttributeValue] = {
            "http.response.status_code": status or 499,
            "berth.attempts": len(self._attempts),
        }
        if node_id is not None and deployment_id is not None:
            attributes["berth.node"] = node_id
            attributes["berth.deployment"] = deployment_id
        if input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = input_tokens
        if output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = output_tokens
        if cached_tokens:
            attributes["gen_ai.usage.cache_read.input_tokens"] = cached_tokens
        if error_reason is not None:
            attributes["error.type"] = error_reason
        span.set_attributes(attributes)
        if ttfb_s is not None:
            at_ns = self._start_ns + int(ttfb_s * _NS)
            span.add_event("berth.first_byte", {"berth.ttfb_s": ttfb_s}, timestamp=at_ns)
        # a server error, or an answer that broke off after it began (a client that left,
        # status 0, is not the server's failure)
        failed = status >= 500 or (error_reason is not None and 0 < status < 400)
        stream = self._stream
        if stream is not None:
            if events:  # an event stream's are counted, a body's bytes
                stream.set_attribute("berth.events", events)
            if answer_bytes:
                stream.set_attribute("berth.answer_bytes", answer_bytes)
            if error_reason is not None:
                stream.set_attribute("error.type", error_reason)
                if failed:
                    stream.set_status(Status(StatusCode.ERROR, error_reason))
            stream.end()
        for wait in self._waits:
            wait.end(error_reason)
        for attempt in self._attempts:
            attempt.end()
        if failed:
            span.set_status(Status(StatusCode.ERROR, error_reason or f"answered {status}"))
        span.end()


class RequestTracer:
    """Begins a :class:`RequestTrace` per ``/v1`` request at the leader."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def begin(self, method: str, path: str, headers: Headers, request_id: bytes) -> RequestTrace:
        """A request's server span, begun now: a child of the caller's ``traceparent`` when
        ``headers`` carry one, else the root of a new trace."""
        start_ns = time.time_ns()
        attributes: dict[str, AttributeValue] = {
            "http.request.method": method,
            "http.route": path,
            "url.path": path,
            "berth.request_id": request_id.decode("latin-1"),
        }
        operation = _OPERATIONS.get(path)
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
        span = self._tracer.start_span(
            f"{method} {path}",
            context=parent_of(headers),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=start_ns,
        )
        return RequestTrace(self._tracer, span, start_ns)


class Tracing:
    """A process's tracer provider and its export; :meth:`shutdown` when the process stops
    (it exports what is held, for up to ``timeout_s``: call it off the event loop)."""

    def __init__(
        self, provider: TracerProvider, processor: BoundedSpanProcessor, exporter: CountingExporter
    ) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("berth", __version__)
        self._processor = processor
        self._exporter = exporter

    def requests(self) -> RequestTracer:
        return RequestTracer(self.tracer)

    def relays(self, node_id: str | None = None) -> RelayTracer:
        return RelayTracer(self.tracer, node_id)

    def collector(self) -> SpanExportCollector:
        """The tracing series of ``/metrics``, to register in the process's registry."""
        return SpanExportCollector(self._processor, self._exporter)

    @property
    def dropped(self) -> int:
        return self._processor.dropped

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export every span held now (blocks: call it off the event loop)."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is held and stop the export thread (blocks)."""
        self.provider.shutdown()


def build_tracing(
    config: TracingConfig,
    *,
    exporter: SpanExporter | None = None,
    attributes: Mapping[str, str] | None = None,
) -> Tracing:
    """The tracing ``config`` describes: OTLP/HTTP to ``config.endpoint`` (or ``exporter``,
    a test's), the resource's ``service.name`` and ``attributes`` merged over what
    ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` say (the SDK reads them)."""
    if exporter is None:
        exporter = OTLPSpanExporter(endpoint=config.endpoint, headers=dict(config.headers))
    resource_attributes: dict[str, AttributeValue] = {"service.version": __version__}
    if config.service_name is not None:
        resource_attributes["service.name"] = config.service_name
    resource_attributes.update(attributes or {})
    counting = CountingExporter(exporter)
    batch = BatchSpanProcessor(
        counting,
        max_queue_size=config.queue_spans,
        max_export_batch_size=min(512, config.queue_spans),
    )
    processor = BoundedSpanProcessor(batch, counting, config.queue_spans)
    provider = TracerProvider(
        sampler=_sampler(config),
        resource=Resource.create(resource_attributes),
        shutdown_on_exit=False,
    )
    provider.add_span_processor(processor)
    return Tracing(provider, processor, counting)
