"""The attempt stage: one request sent to one engine, as the dispatch loop asks
(:func:`berth.gateway.dispatch.first_answer` calls an :class:`Attempts` once per
candidate).

Each attempt builds the :class:`~berth.engine_http.request.EngineRequest` for its upstream
(:meth:`Attempts.engine_request`: the request's path, query and forwarded headers, and the
body that engine must see, :class:`EngineBodies`), opens it, and records how it ended
(:attr:`Attempts.outcomes`: all but the last are the request's retries). A streamed request
(``"stream": true``) gets its answer only once the first byte is in (the head and, for an
event stream, its first bytes), within the first-byte timeout; its stream's idle timeout is
set then (:func:`open_stream`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from berth.engine_http.answer import EngineAnswer, TimedAnswer, can_time
from berth.engine_http.request import EngineRequest
from berth.gateway.messages_bridge import translated_answer
from berth.gateway.outcome import Exchange
from berth.gateway.request import PublicRequest
from berth.routing.errors import FirstByteTimeoutError, ProxyError
from berth.routing.resolver import Upstream

if TYPE_CHECKING:  # imported only where tracing is on (berth.daemon.build opens it)
    from berth.observability.tracing import RequestTrace

__all__ = [
    "AnswerCount",
    "Attempts",
    "EngineBodies",
    "EngineOpener",
    "FirstByteWatch",
    "StreamLimits",
    "open_stream",
]

#: Sends one engine request to an upstream; its answer once the head is in (the engine
#: client's ``open``, behind the adapter gate when there are adapters).
EngineOpener = Callable[[Upstream, EngineRequest], Awaitable[EngineAnswer]]


#: How many answers a deployment has begun so far (a count that only grows):
#: :meth:`berth.routing.signals.SignalBoard.answers`.
AnswerCount = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """The proxy's bounds on a streamed answer, in seconds: its first byte, then its longest
    silence (``None``: no bound; a service's own, ``upstream.timeouts``, win).

    With ``answers`` (the router's signal board), the first-byte timeout tells a hung engine
    from a queued one: a period in which the engine began answering another request only
    means this one is waiting its turn, so the wait goes on for another period; the timeout
    ends an attempt after a whole period in which the engine began no answer at all.
    Without it, the first period ends the attempt.
    """

    first_byte_timeout_s: float | None
    stream_idle_timeout_s: float | None
    answers: AnswerCount | None = None


class EngineBodies:
    """The body rewriter per engine: ``request``'s body as each upstream's engine must see
    it: its bytes as they are (``raw``), or with its ``"model"`` set to the engine's name
    and, for llama.cpp with adapters, the ``lora`` scales of the request
    (``upstream.engine_model``, ``upstream.lora_scales``). Written from the parsed body, at
    most once per name and scales, never per attempt."""

    __slots__ = ("_body", "_raw", "_rewritten")

    def __init__(self, request: PublicRequest) -> None:
        self._body = request.body
        self._raw = request.raw
        self._rewritten: dict[tuple[str | None, tuple[float, ...]], bytes] = {}

    def get(self, upstream: Upstream) -> bytes:
        name, scales = upstream.engine_model, upstream.lora_scales
        if name is None and not scales:
            return self._raw
        key = (name, scales)
        rewritten = self._rewritten.get(key)
        if rewritten is None:
            rewritten = self._rewritten[key] = engine_body(self._body, name, scales)
        return rewritten


def engine_body(body: dict[str, Any], model: str | None, scales: tuple[float, ...]) -> bytes:
    """``body`` written compactly with its ``model`` set to ``model`` (when given) and, when
    ``scales`` are given, a ``lora`` field giving llama-server each adapter's scale by id (a
    client's own ``lora`` is replaced: berth decides which adapter a name means). Every
    other field keeps its value and its place; ``body`` itself is not changed."""
    payload = dict(body)
    if model is not None:
        payload["model"] = model
    if scales:
        payload["lora"] = [{"id": index, "scale": scale} for index, scale in enumerate(scales)]
    # allow_nan=False: a rewritten body is JSON or nothing (the edge refuses non-finite
    # numbers already).
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class Attempts:
    """The attempt stage of one request: ``await attempts(upstream)`` sends ``request`` to
    ``upstream`` with ``open_engine`` and returns the answer once its head (streamed: its
    first byte) is in, raising what opening raises (a :class:`ProxyError`: nothing reached
    the client). Each attempt's end goes in :attr:`outcomes` as ``(upstream, reason)``:
    the error code, ``"status N"`` for an answer, ``"given_up"`` (its engine given up while
    it waited) or ``"client_disconnected"`` (per ``exchange.client_gone``). With ``trace``
    (tracing on) each attempt is a span, whose ``traceparent`` its engine request carries."""

    __slots__ = ("_bodies", "_exchange", "_limits", "_open", "_request", "_trace", "outcomes")

    def __init__(
        self,
        request: PublicRequest,
        open_engine: EngineOpener,
        limits: StreamLimits,
        exchange: Exchange,
        trace: RequestTrace | None = None,
    ) -> None:
        self._request = request
        self._trace = trace
        self._open = open_engine
        self._limits = limits
        self._exchange = exchange
        self._bodies = EngineBodies(request)
        #: Where each attempt went and how it ended; all but the last moved on (retries).
        self.outcomes: list[tuple[Upstream, str]] = []

    def engine_request(self, upstream: Upstream) -> EngineRequest:
        """What ``upstream``'s engine is sent: the path the client asked for (or the one a
        rewriter translated it to, ``engine_path``), its query and forwarded headers, and
        the body that engine must see."""
        request = self._request
        path = request.engine_path or request.path
        return EngineRequest(path, request.query, request.forward, self._bodies.get(upstream))

    async def __call__(self, upstream: Upstream) -> EngineAnswer:
        sent = self.engine_request(upstream)
        trace = self._trace
        traced = None if trace is None else trace.attempt(upstream.node_id, upstream.deployment_id)
        if traced is not None:  # the engine's (or the agent's) parent: this attempt's span
            sent = sent._replace(headers=traced.headers(sent.headers))
        try:
            if self._request.stream:
                answer = await open_stream(self._open, upstream, sent, self._limits)
            else:
                answer = await self._open(upstream, sent)
        except ProxyError as exc:
            self.outcomes.append((upstream, exc.error_code))
            if traced is not None:
                traced.failed(exc.error_code)
            raise
        except asyncio.CancelledError:
            # Its engine given up (the request may go on elsewhere), or the client left.
            gone = self._exchange.client_gone
            self.outcomes.append((upstream, "client_disconnected" if gone else "given_up"))
            if traced is not None:
                traced.failed(self.outcomes[-1][1])
            raise
        try:
            self.outcomes.append((upstream, f"status {answer.status}"))
            if traced is not None:
                traced.answered(answer.status)
            if self._request.engine_path is None:
                return answer
            return translated_answer(self._request, answer, upstream)  # a Messages translation
        except BaseException:
            answer.close()  # returned to nobody: the engine's exchange ends here
            raise


async def open_stream(
    open_engine: EngineOpener, upstream: Upstream, request: EngineRequest, limits: StreamLimits
) -> EngineAnswer:
    """Open a streamed request's exchange: its answer once the first byte is in (the head
    and, for an event stream, its first bytes), with the stream's idle timeout set.

    Raises what opening raises, and :class:`FirstByteTimeoutError` when the first byte did
    not come within the first-byte timeout, and the engine began no other answer in that
    time either (``limits.answers``: a busy engine's queue is not a hang); the exchange is
    closed then (the pooled connection dropped, or the tunnel stream reset, on which the
    agent closes its own), so the engine stops generating for nobody.
    """
    first_byte_s = limits.first_byte_timeout_s
    idle_s = limits.stream_idle_timeout_s
    timeouts = upstream.timeouts  # its service's, where it set them (0: none)
    if timeouts is not None:
        if timeouts.first_byte_timeout_s is not None:
            first_byte_s = timeouts.first_byte_timeout_s or None
        if timeouts.stream_idle_timeout_s is not None:
            idle_s = timeouts.stream_idle_timeout_s or None
    answer: EngineAnswer | None = None
    timed: TimedAnswer | None = None  # an event stream whose first bytes are awaited
    deadline = asyncio.timeout(None)
    watch: FirstByteWatch | None = None
    try:
        async with deadline:
            if first_byte_s is not None:
                watch = FirstByteWatch(deadline, first_byte_s, limits.answers, upstream)
            answer = await open_engine(upstream, request)
            if answer.status < 400 and can_time(answer) and is_event_stream(answer):
                timed = answer
                await timed.wait_for_body()
    except TimeoutError:
        if answer is not None:
            answer.close()
        if watch is None or not deadline.expired():
            raise
        raise FirstByteTimeoutError(upstream, watch.waited_s()) from None
    except BaseException:
        if answer is not None:
            answer.close()
        raise
    finally:
        if watch is not None:
            watch.cancel()
    if timed is not None and idle_s is not None:
        timed.set_read_timeout(idle_s)
    return answer


class FirstByteWatch:
    """The first-byte timeout of one attempt: every ``period_s`` seconds it looks at how
    many answers ``upstream``'s deployment has begun (``answers``) and expires ``deadline``
    (an entered :func:`asyncio.timeout` of no deadline) when that count has not moved since
    the last look: a whole period in which the engine began answering nobody is a hang; one
    in which it answered others means this request is queued behind them, and the wait goes
    on. Without ``answers``, the first period expires it. :meth:`cancel` it once the wait is
    over."""

    __slots__ = ("_answers", "_deadline", "_deployment_id", "_handle", "_loop", "_period_s",
                 "_periods", "_seen")  # fmt: skip

    def __init__(
        self,
        deadline: asyncio.Timeout,
        period_s: float,
        answers: AnswerCount | None,
        upstream: Upstream,
    ) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._deadline = deadline
        self._period_s = period_s
        self._answers = answers
        self._deployment_id = upstream.deployment_id
        self._seen = 0 if answers is None else answers(upstream.deployment_id)
        self._periods = 1
        self._handle = loop.call_later(period_s, self._look)

    def _look(self) -> None:
        if self._answers is not None:
            seen = self._answers(self._deployment_id)
            if seen != self._seen:  # it answered others meanwhile: queued, not hung
                self._seen = seen
                self._periods += 1
                self._handle = self._loop.call_later(self._period_s, self._look)
                return
        self._deadline.reschedule(self._loop.time())  # expires now: cancels the wait

    def waited_s(self) -> float:
        """Seconds the attempt has been given so far: its periods (whole ones, on expiry)."""
        return self._periods * self._period_s

    def cancel(self) -> None:
        self._handle.cancel()


def is_event_stream(answer: EngineAnswer) -> bool:
    """Whether ``answer`` is an event stream (``text/event-stream``)."""
    content_type = answer.header(b"content-type")
    return content_type is not None and content_type.startswith(b"text/event-stream")
