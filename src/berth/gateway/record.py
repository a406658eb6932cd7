"""What the proxy records of each completion request once it is over: its metrics
(:class:`~berth.observability.metrics.ProxyMetrics`), its row in the request log (no prompt
or answer text), and its key's ledger settlement (:meth:`berth.admission.Admission.settle`:
the usage the engine reported, else an estimate, :mod:`berth.admission.estimate`).

A request that reached no engine (refused, or its client left before one was chosen) is
:meth:`Records.unsent`; one that was planned is :meth:`Records.finished` with its
:class:`Flight` (where it went) and its :class:`~berth.gateway.relay.Exchange` (what
happened to it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from berth.admission import Admission, Ticket
from berth.admission import estimate as estimate_tokens
from berth.gateway.outcome import Exchange
from berth.gateway.request import PublicRequest
from berth.observability.metrics import ProxyMetrics, Target
from berth.observability.request_log import RequestLog
from berth.routing.resolver import Upstream

__all__ = ["Flight", "Records", "target_of"]

#: How much of a request's ``model`` the request log keeps (a client may send anything).
_MAX_LOGGED_MODEL_CHARS = 200


def target_of(upstream: Upstream) -> Target:
    """The metrics' labels of ``upstream``."""
    return Target(upstream.model, upstream.deployment_id, upstream.node_id)


class Flight:
    """Where one planned request went: ``upstream`` (the candidate counted for it: the
    plan's first, then the one that served it or failed last), ``held`` (the deployment
    whose fair-queue slot it holds, ``None``: none), ``reached`` (it passed the fair queue:
    an engine was asked, or would have been) and ``dispatched`` (an engine's answer came:
    ``upstream`` stays counted in flight in the router's signals until it is over)."""

    __slots__ = ("dispatched", "held", "reached", "upstream")

    def __init__(self, upstream: Upstream, *, reached: bool) -> None:
        self.upstream = upstream
        self.held: str | None = None
        self.reached = reached
        self.dispatched = False


class Records:
    """Records each request into ``metrics``, ``request_log`` and, when given,
    ``admission`` (times by ``clock``: seconds, the proxy's own)."""

    __slots__ = ("_admission", "_clock", "_metrics", "request_log")

    def __init__(
        self,
        metrics: ProxyMetrics,
        request_log: RequestLog,
        admission: Admission | None,
        clock: Callable[[], float],
    ) -> None:
        self._metrics = metrics
        self.request_log = request_log
        self._admission = admission
        self._clock = clock

    def unsent(
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

    def finished(
        self,
        request: PublicRequest,
        flight: Flight,
        exchange: Exchange,
        outcomes: Sequence[tuple[Upstream, str]],
        ticket: Ticket | None,
        started_at: float,
    ) -> None:
        """A planned request is over (answered, refused by the fair queue, failed, or its
        client left): its retries and its end counted, its request-log row, its ticket
        settled (``node_id`` ``None`` when it never passed the fair queue)."""
        metrics = self._metrics
        upstream = flight.upstream
        target = target_of(upstream)
        for left, reason in outcomes[:-1]:
            metrics.request_retried(target_of(left), reason)
        usage = exchange.usage
        duration_s = self._clock() - exchange.start
        metrics.request_finished(
            target,
            status=exchange.status or 499,
            duration_s=duration_s,
            ttfb_s=exchange.ttfb_s,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            error_reason=exchange.error_reason,
        )
        self.request_log.add(
            started_at=started_at,
            request_id=request.request_id.decode(),
            key_name=request.key_name,
            model=request.model[:_MAX_LOGGED_MODEL_CHARS],
            node_id=upstream.node_id,
            deployment_id=upstream.deployment_id,
            status=exchange.status or 499,
            ttfb_s=exchange.ttfb_s,
            duration_s=self._clock() - exchange.start,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            retries=tuple(reason for _, reason in outcomes[:-1]),
            error_reason=exchange.error_reason,
            cached_tokens=usage.cached_tokens if usage else 0,
        )
        if ticket is not None and self._admission is not None:
            node_id = upstream.node_id if flight.reached else None  # None: queued, never sent
            settle(self._admission, ticket, exchange, node_id, request.received_bytes)


def settle(
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
        cached_tokens=usage.cached_tokens if usage is not None else 0,
    )
