"""An engine's answer as the proxy reads it, whichever way it came (:class:`EngineAnswer`), so
local and tunneled engines share one relay path.

A token stream is relayed without a task wake-up per event when its answer can be *pushed*
(:class:`PushedAnswer`): the connection it arrives on hands each piece of the body to a
:class:`BodySink` from its own callback (``data_received``, or the link reader's dispatch of a
data frame), and the relaying task only waits for the end, a failure or backpressure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

from berth.conforms import conforms

if TYPE_CHECKING:
    from berth.engine_http.errors import UpstreamError
    from berth.engine_http.request import EngineRequest


class EngineAnswer(Protocol):
    """How the proxy reads an engine's answer, local
    (:class:`berth.engine_http.response.UpstreamResponse`) or tunneled through an agent
    (:class:`berth.cluster.leader.remote_link.TunnelResponse`).

    ``status``; ``headers`` as lower-case ``(name, value)`` bytes pairs; ``content_length``
    (``None`` when not announced). :meth:`read_chunk` and :meth:`read` raise
    :class:`UpstreamError` subclasses; :meth:`close` ends the exchange (an unfinished one
    tells the engine to stop).
    """

    status: int
    headers: list[tuple[bytes, bytes]]
    content_length: int | None

    def header(self, name: bytes) -> bytes | None: ...

    @property
    def at_eof(self) -> bool: ...

    async def read_chunk(self) -> bytes: ...

    async def read(self, limit_bytes: int | None = None) -> bytes: ...

    def close(self) -> None: ...


class BodySink(Protocol):
    """Where a pushed answer's body goes, as it arrives, called from the connection's own
    callbacks (so it must not block, and must not raise: a sink keeps its own failures for
    the task that waits on it).

    ``body_received(data, end)``: the next body bytes (possibly empty when ``end``), ``end``
    when they are the last. ``body_failed(error)``: the answer broke off (the engine closed
    the connection, sent something malformed, or sent nothing for the read timeout); nothing
    more comes after either ``end`` or a failure.
    """

    def body_received(self, data: bytes, end: bool) -> None: ...

    def body_failed(self, error: UpstreamError) -> None: ...


@runtime_checkable
class PushedAnswer(EngineAnswer, Protocol):
    """An answer whose body can be pushed to a :class:`BodySink` instead of read.

    :meth:`push_body` hands over what has arrived already at once (and the end or the
    failure, if it came), then each piece as it arrives; from then on :meth:`read_chunk`
    may not be used. :meth:`pause_body` stops taking more from the engine (the client is
    slow: backpressure), :meth:`resume_body` goes on; the read timeout runs only while not
    paused. :meth:`close` still ends the exchange, and nothing reaches the sink after it.
    """

    def push_body(self, sink: BodySink) -> None: ...

    def pause_body(self) -> None: ...

    def resume_body(self) -> None: ...


@runtime_checkable
class TimedAnswer(EngineAnswer, Protocol):
    """An answer whose first body bytes can be waited for, and whose read timeout can be
    changed once they came: how the proxy bounds a stream's time to its first event and
    then its longest silence (:mod:`berth.gateway.proxy`).

    :meth:`wait_for_body` returns once body bytes, the end or a failure have arrived, and
    takes nothing (the next read, or the push, has them). :meth:`set_read_timeout` is the
    longest silence between two pieces of the body from then on (``None``: no limit).
    """

    async def wait_for_body(self) -> None: ...

    def set_read_timeout(self, timeout_s: float | None) -> None: ...


def can_time(answer: EngineAnswer) -> TypeGuard[TimedAnswer]:
    """``answer`` is a :class:`TimedAnswer` (decided once per class)."""
    return conforms(answer, TimedAnswer)


def can_push(answer: EngineAnswer) -> TypeGuard[PushedAnswer]:
    """``answer`` is a :class:`PushedAnswer` (decided once per class)."""
    return conforms(answer, PushedAnswer)


async def read_body(answer: EngineAnswer, limit_bytes: int | None = None) -> bytes:
    """The rest of ``answer``'s body, or at most its first ``limit_bytes`` bytes, read chunk
    by chunk; raises what ``answer.read_chunk`` raises."""
    parts: list[bytes] = []
    size = 0
    while limit_bytes is None or size < limit_bytes:
        chunk = await answer.read_chunk()
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    data = b"".join(parts)
    return data if limit_bytes is None else data[:limit_bytes]


class HttpOpener(Protocol):
    """Opens one HTTP exchange with a deployment's engine on a remote node: the tunnel
    through its node's link (:meth:`berth.cluster.leader.hub.NodeHub.open_http`), or the data paths
    that go direct when they can (:meth:`berth.cluster.leader.direct_path.DataPaths.open_http`).
    The proxy's engine client reaches remote engines through one."""

    async def open_http(
        self, node_id: str, deployment_id: str, request: EngineRequest, read_timeout_s: float | None
    ) -> EngineAnswer:
        """Send ``request`` to ``deployment_id``'s engine on ``node_id``; its answer once
        the head is in (within ``read_timeout_s``, ``None``: no bound). Raises the
        ``UpstreamError`` subclasses ``UpstreamPool.request`` raises."""
        ...
