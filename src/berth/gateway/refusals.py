"""Answering a request the proxy refuses or cannot serve: OpenAI-shaped errors
(:mod:`berth.openai_errors`), Anthropic-shaped under ``/v1/messages``
(:mod:`berth.anthropic_errors`), and the refusal counted in the proxy's metrics.

The errors themselves are drawn in :mod:`berth.routing.errors` and :mod:`berth.admission`;
each carries its status, code and headers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from berth.admission import AdmissionError, QuotaExceededError, Ticket
from berth.anthropic_errors import is_messages_path, to_anthropic
from berth.errors import BerthError, NotFoundError
from berth.gateway.exchange import ClientWriter, send_json
from berth.observability.metrics import ProxyMetrics
from berth.openai_errors import ErrorResponse, error_from_exception
from berth.routing.errors import NoReadyDeploymentError, ProxyError

__all__ = ["Refusals", "reason", "refusal_headers"]


def reason(exc: BerthError) -> str:
    """The short reason a refused request is counted and logged under."""
    if isinstance(exc, ProxyError | AdmissionError):
        return exc.error_code
    if isinstance(exc, NotFoundError):
        return exc.not_found_code
    return "error"


def refusal_headers(exc: BerthError, ticket: Ticket | None) -> list[tuple[bytes, bytes]]:
    """The key's rate-limit headers for an answer refused before any engine was asked, and
    ``retry-after-ms`` on a 429 (the OpenAI SDKs prefer it to ``Retry-After``)."""
    if isinstance(exc, QuotaExceededError):
        ms = max(0, round(exc.retry_after_s * 1000))
        return [*exc.headers, (b"retry-after-ms", b"%d" % ms)]
    return list(ticket.headers) if ticket is not None else []


class Refusals:
    """Sends error answers, and counts the refusals in ``metrics`` (durations by ``clock``,
    in seconds)."""

    __slots__ = ("_clock", "_metrics")

    def __init__(self, metrics: ProxyMetrics, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._clock = clock

    async def reject(
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
        reply = await self.send_error(writer, request_id, exc, headers, path=path)
        # Only a model berth knows may become a label value.
        model = exc.model if isinstance(exc, NoReadyDeploymentError) else ""
        self.count(model, reply.status, start, reason(exc))
        return reply.status

    def count(self, model: str, status: int, start: float, why: str) -> None:
        """Count a request answered ``status`` before any deployment was chosen (``start``:
        when it began, by the clock)."""
        self._metrics.request_rejected(
            model=model, status=status, duration_s=self._clock() - start, error_reason=why
        )

    async def send_error(
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
