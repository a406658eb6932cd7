"""The relay of one HTTP exchange to an engine on this host, for tunneled and direct requests.

:class:`EngineRelay` sends a request to a deployment's engine with berth's pooled HTTP/1.1
client, carrying the engine's own API key in place of any credential in the leader's headers,
and its answer to an :class:`AnswerSink` as it arrives: a tunnel stream
(:class:`berth.agent.service.AgentService` relays ``http`` streams here) or the direct
ingress's HTTP reply (:mod:`berth.agent.ingress`), so bounds, metering, tracing and
cancellation are the same either way. A leader that gives up closes the engine connection,
so the engine stops generating.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

from berth.agent.answer_push import EnginePush, can_write_nowait
from berth.agent.core import AgentCore
from berth.cluster.link.tunnel_stream import StreamResetError
from berth.cluster.protocol.frames import ResetCode
from berth.engine_http.auth import with_engine_key
from berth.engine_http.errors import UpstreamConnectError, UpstreamError, UpstreamTimeoutError
from berth.engine_http.origin import Origin
from berth.engine_http.pool import UpstreamPool
from berth.engine_http.request import EngineRequest
from berth.engine_http.response import UpstreamResponse
from berth.observability.window import RequestMeter, is_error

if TYPE_CHECKING:  # imported only where tracing is on (berth.agent.runner builds it)
    from berth.observability.relay_tracing import RelayTracer

#: Largest request body an agent accepts on one tunneled exchange, in bytes.
MAX_REQUEST_BODY_BYTES = 64 * 1024 * 1024
#: Response headers that describe one HTTP/1.1 connection and are not relayed.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer",
                         b"upgrade", b"proxy-connection"})  # fmt: skip


class AnswerSink(Protocol):
    """Where :meth:`EngineRelay.relay_exchange` sends an engine's answer: a tunnel stream
    (:class:`~berth.cluster.link.tunnel_stream.TunnelStream`) or the ingress's HTTP reply
    (:mod:`berth.agent.ingress`).

    ``send_head`` once (status, headers without hop-by-hop ones as the engine sent them:
    lower-case byte pairs, the first body bytes, and whether they are all of it), then
    ``write`` until ``end``; ``reset`` instead when the exchange fails (before the head: the
    leader tries elsewhere; after: the answer is cut off). Writes wait while the leader
    reads slowly (backpressure); a leader that gave up
    makes them raise (``StreamResetError``) or cancels the relaying task.
    """

    async def send_head(
        self, status: int, headers: list[tuple[bytes, bytes]], payload: bytes, end: bool
    ) -> None: ...

    async def write(self, data: bytes, end: bool = False) -> None: ...

    def reset(self, code: ResetCode = ResetCode.CANCELLED, message: str = "") -> None: ...


class EngineRelay:
    """Relays exchanges to the engines ``core`` runs (or the endpoints it adopted).

    ``read_timeout_s`` bounds each read from an engine (seconds); ``meter`` counts the
    exchanges served here (the agent's heartbeat reports it); ``tracer``, when tracing is on,
    traces each relay (:mod:`berth.observability.tracing`).
    """

    def __init__(
        self,
        core: AgentCore,
        meter: RequestMeter,
        *,
        read_timeout_s: float,
        tracer: RelayTracer | None = None,
    ) -> None:
        self._core = core
        self._meter = meter
        self._tracer = tracer
        self._pool = UpstreamPool(read_timeout_s=read_timeout_s)

    async def close(self) -> None:
        """Close the pooled engine connections."""
        await self._pool.close()

    async def relay_exchange(
        self, deployment_id: str, request: EngineRequest, sink: AnswerSink
    ) -> None:
        """Send ``request`` to ``deployment_id``'s engine on this host and its answer to
        ``sink``, as it arrives: the relay of tunneled and direct exchanges alike.

        A credential among ``request.headers`` is replaced by the engine's own key. A failure
        before the head becomes ``sink.reset`` with ``engine_timeout`` or
        ``engine_unreachable``, one mid-answer ``engine_disconnect``. Raises
        :class:`~berth.errors.NotFoundError` for a deployment this agent does not run, and
        what ``sink`` raises when the leader gives up (the engine connection is closed then).
        """
        host, port = self._core.engine_origin(deployment_id)
        # Whatever credential came with it (the leader forwards none), the engine gets its own.
        method, target = request.method, request.target
        headers = with_engine_key(request.headers, self._core.engine_auth(deployment_id))
        # tracing on: a span under the leader's attempt, its traceparent sent to the engine
        trace = None
        if self._tracer is not None:
            trace = self._tracer.begin(deployment_id, method, target, headers)
            headers = trace.headers
        # Measured here, where the request is served (docs/metrics.md): from the body's
        # arrival to the answer's last byte. A GET is the leader reading the engine's cache
        # signal (/slots, /metrics), not a client's request: not metered.
        metered = method != b"GET"
        if metered:
            self._meter.started(deployment_id)
        started_at = time.monotonic()
        status: int | None = None
        completed = withdrawn = False
        try:
            try:
                response = await self._pool.request(
                    Origin(host, port), method, target, headers, request.body
                )
            except UpstreamTimeoutError as exc:
                sink.reset(ResetCode.ENGINE_TIMEOUT, exc.why)
                return
            except UpstreamConnectError as exc:
                sink.reset(ResetCode.ENGINE_UNREACHABLE, exc.why)
                return
            except UpstreamError as exc:
                why = f"failed before answering ({exc.why})"
                sink.reset(ResetCode.ENGINE_UNREACHABLE, why)
                return
            status = response.status
            try:
                completed = await self._relay_answer(sink, response)
            finally:
                response.close()
        except (StreamResetError, asyncio.CancelledError):
            # The leader gave up: mid-answer, its client left (counted, not an error); before
            # the engine answered, the request went to another node or its client left, and
            # it is not counted here (the leader counts it once, where it ended).
            withdrawn = status is None
            completed = True
            raise
        finally:
            if trace is not None:
                trace.end(status, completed=completed, withdrawn=withdrawn)
            if metered and withdrawn:
                self._meter.withdrawn(deployment_id)
            elif metered:
                self._meter.finished(
                    deployment_id,
                    latency_ms=(time.monotonic() - started_at) * 1000.0,
                    error=is_error(status, failed=not completed),
                )

    async def _relay_answer(self, stream: AnswerSink, response: UpstreamResponse) -> bool:
        """Send the engine's answer to ``stream``; ``False`` when the engine broke it off."""
        head_headers = [header for header in response.headers if header[0] not in _HOP_BY_HOP]
        try:
            chunk = await response.read_chunk()
        except UpstreamError as exc:
            stream.reset(ResetCode.ENGINE_DISCONNECT, exc.why)
            return False
        # The head frame carries the first bytes too: a small answer is one frame.
        await stream.send_head(response.status, head_headers, chunk, end=response.at_eof)
        if response.at_eof:
            return True
        if can_write_nowait(stream):
            # Each piece sent from the engine connection's callback, no task wake-up per piece.
            return await EnginePush(response, stream).run()
        while True:
            try:
                chunk = await response.read_chunk()
            except UpstreamError as exc:
                stream.reset(ResetCode.ENGINE_DISCONNECT, exc.why)
                return False
            if not chunk:
                await stream.write(b"", end=True)
                return True
            await stream.write(chunk, end=response.at_eof)
            if response.at_eof:
                return True
