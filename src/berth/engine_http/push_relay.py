"""The waits of a task that relays a pushed answer's body (:class:`PushRelay`).

A pushed answer (:class:`~berth.engine_http.answer.PushedAnswer`) hands each piece of its
body to a :class:`~berth.engine_http.answer.BodySink` from its connection's callback, and the
relaying task only waits: for the writer to drain while the body is paused (backpressure),
or for the sink's callbacks to wake it (the end, a failure, a pause). :class:`PushRelay` is
those two waits, shared by the leader's relay of an event stream to its client
(:class:`berth.gateway.push.StreamPush`) and the agent's relay of an engine's answer to the
leader (:class:`berth.agent.answer_push.EnginePush`); what each does with a piece and how
each ends stays its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from berth.engine_http.answer import PushedAnswer


class PushRelay:
    """The base of a pushed body's relay over ``answer``: ``_paused`` says the answer's body
    is paused (set, with ``answer.pause_body()``, by the subclass); :meth:`_wake` wakes the
    task parked in :meth:`_drain_or_wait`."""

    __slots__ = ("_answer", "_paused", "_waiter")

    def __init__(self, answer: PushedAnswer) -> None:
        self._answer = answer
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    async def _drain_or_wait(self, drain: Callable[[], Awaitable[None]]) -> None:
        """One wait of the relaying task: while the body is paused, until ``drain()``
        returns (the writer caught up), then the body resumes; else until :meth:`_wake`.
        Raises what ``drain()`` raises, and ``CancelledError``."""
        if self._paused:
            await drain()
            self._paused = False
            self._answer.resume_body()
            return
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
