"""The agent's span of each relay to an engine (:class:`RelayTracer`), under the leader's
attempt: its parent is the ``traceparent`` the tunnel (or the direct ingress) carried, and the
engine is sent the relay span's own, so an engine that traces (vLLM) joins the trace there.
Built by :meth:`berth.observability.tracing.Tracing.relays` when tracing is on; the agent's
service holds ``None`` otherwise (docs/tracing.md).
"""

from __future__ import annotations

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from berth.observability.trace_context import Headers, parent_of, with_context

__all__ = ["RelayTrace", "RelayTracer"]


class RelayTrace:
    """The agent's span of one relay to an engine: :attr:`headers` are the request's with
    this span's ``traceparent`` (for the engine), :meth:`end` once it is over."""

    __slots__ = ("_span", "headers")

    def __init__(self, span: Span, headers: list[tuple[bytes, bytes]]) -> None:
        self._span = span
        self.headers = headers

    def end(self, status: int | None, *, completed: bool, withdrawn: bool) -> None:
        """The relay is over: the engine answered ``status`` (``None``: it did not), the
        answer was relayed whole (``completed``), or the leader gave up on it before the
        engine answered (``withdrawn``)."""
        span = self._span
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if withdrawn:
            outcome = "withdrawn"
        elif status is None:
            outcome = "engine_unreachable"
        elif not completed:
            outcome = "engine_disconnect"
        else:
            outcome = f"status {status}"
        span.set_attribute("berth.relay.outcome", outcome)
        if not withdrawn and (status is None or not completed or status >= 500):
            span.set_attribute("error.type", outcome)
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()


class RelayTracer:
    """Begins a :class:`RelayTrace` per request an agent relays to an engine."""

    def __init__(self, tracer: Tracer, node_id: str | None = None) -> None:
        self._tracer = tracer
        self._node_id = node_id

    def begin(
        self, deployment_id: str, method: bytes, target: bytes, headers: Headers
    ) -> RelayTrace:
        """The relay's span, begun now under the leader's attempt (the ``traceparent`` in
        ``headers``), and the headers to send the engine."""
        attributes: dict[str, AttributeValue] = {
            "berth.deployment": deployment_id,
            "http.request.method": method.decode("latin-1"),
            "url.path": target.decode("latin-1"),
        }
        if self._node_id is not None:
            attributes["berth.node"] = self._node_id
        span = self._tracer.start_span(
            "berth.agent.relay",
            context=parent_of(headers),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        return RelayTrace(span, with_context(headers, span))
