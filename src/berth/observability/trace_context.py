"""W3C Trace Context on berth's byte headers (*Trace Context*, W3C Recommendation, sections
3.2 and 3.3: ``traceparent`` and ``tracestate``): the parent a request's headers name, and
headers that name another span as parent. Shared by the leader's tracer
(:mod:`berth.observability.tracing`) and the agent's (:mod:`berth.observability.relay_tracing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from opentelemetry.context import Context
from opentelemetry.trace import Span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["Headers", "parent_of", "with_context"]

#: Lower-case header name and value pairs, as the request path keeps them.
Headers = Sequence[tuple[bytes, bytes]]

_TRACE_HEADERS: Final = (b"traceparent", b"tracestate")
_PROPAGATOR: Final = TraceContextTextMapPropagator()


def _carrier(headers: Headers) -> dict[str, str]:
    """The W3C trace context headers of ``headers``, as the propagator reads them."""
    carrier: dict[str, str] = {}
    for name, value in headers:
        if name in _TRACE_HEADERS:
            carrier[name.decode()] = value.decode("latin-1")
    return carrier


def parent_of(headers: Headers) -> Context | None:
    """The context of the span ``headers`` name as parent, or ``None`` when they name
    none (a malformed ``traceparent`` names none either: the propagator ignores it)."""
    carrier = _carrier(headers)
    return _PROPAGATOR.extract(carrier) if carrier else None


def with_context(headers: Headers, span: Span) -> list[tuple[bytes, bytes]]:
    """``headers`` with their trace context replaced by ``span``'s (``traceparent``, and
    ``tracestate`` when it has one)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
    kept = [header for header in headers if header[0] not in _TRACE_HEADERS]
    kept.extend((name.encode(), value.encode("latin-1")) for name, value in carrier.items())
    return kept
