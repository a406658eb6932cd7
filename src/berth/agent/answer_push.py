"""An engine's answer pushed from its connection's callback to the leader, with no task wake-up
per piece (:class:`EnginePush`), for the agent's relay (:mod:`berth.agent.relay`).

A token stream through an agent is one small piece of body per token. Read by the relaying
task, each piece costs that task a wake-up and a chain of coroutines (the read, the stream's
write, the link's send) before its frame is written. Here the engine connection hands each
piece to :class:`EnginePush` from its ``data_received``
(:class:`~berth.engine_http.answer.PushedAnswer`), which sends it at once
(:meth:`PushAnswerSink.write_nowait`: one frame within the stream's credit on the link, or a
write to the direct ingress's client). What cannot go at once (no credit left, a piece
larger than one frame) is held, the engine connection stops reading, and the task sends it
with the waiting ``write``, then reads on; when the link or the leader's connection is
backlogged the task waits for it to drain, the engine connection paused meanwhile. The task
is cancelled when the leader resets the stream (or leaves the ingress), which closes the
engine connection as before.
"""

from __future__ import annotations

from typing import Protocol, TypeGuard, runtime_checkable

from berth.cluster.protocol.frames import ResetCode
from berth.conforms import conforms
from berth.engine_http.answer import PushedAnswer
from berth.engine_http.errors import UpstreamError
from berth.engine_http.push_relay import PushRelay


@runtime_checkable
class PushAnswerSink(Protocol):
    """An :class:`~berth.agent.relay.AnswerSink` that can also take a piece without
    waiting (a tunnel stream, the ingress's reply): ``write_nowait`` sends it now and returns
    ``True``, or returns ``False`` when it cannot (then ``write`` it, which waits);
    ``backlogged`` says the leader reads slowly (``drain`` waits until it has caught up)."""

    async def write(self, data: bytes, end: bool = False) -> None: ...

    def reset(self, code: ResetCode = ResetCode.CANCELLED, message: str = "") -> None: ...

    def write_nowait(self, data: bytes, end: bool = False) -> bool: ...

    @property
    def backlogged(self) -> bool: ...

    async def drain(self) -> None: ...


def can_write_nowait(sink: object) -> TypeGuard[PushAnswerSink]:
    """``sink`` is a :class:`PushAnswerSink` (decided once per class)."""
    return conforms(sink, PushAnswerSink)


class EnginePush(PushRelay):
    """Relays ``answer``'s body (its head already sent) to ``sink`` as it arrives: the
    answer's :class:`~berth.engine_http.answer.BodySink`, and :meth:`run` for the task."""

    __slots__ = ("_ended", "_failure", "_held", "_held_end", "_sink")

    def __init__(self, answer: PushedAnswer, sink: PushAnswerSink) -> None:
        super().__init__(answer)
        self._sink = sink
        self._held: list[bytes] = []  # what could not be sent at once, in order
        self._held_end = False
        self._ended = False
        self._failure: UpstreamError | None = None

    async def run(self) -> bool:
        """Relay until the answer ends: ``True`` when it was sent whole, ``False`` when the
        engine broke it off (the sink is reset with ``engine_disconnect``). Raises what the
        sink's waiting ``write`` raises when the leader gave up, and ``CancelledError``."""
        answer = self._answer
        sink = self._sink
        answer.push_body(self)
        while True:
            held = self._held
            if held:
                data = held[0] if len(held) == 1 else b"".join(held)
                held.clear()
                end = self._held_end
                await sink.write(data, end=end)
                if end:
                    return True
                if not self._held:  # nothing came meanwhile: read on
                    self._paused = False
                    answer.resume_body()
                continue
            if self._ended:
                return True
            if self._failure is not None:
                sink.reset(ResetCode.ENGINE_DISCONNECT, self._failure.why)
                return False
            await self._drain_or_wait(sink.drain)

    # -- BodySink: called from the engine connection --------------------------------------

    def body_received(self, data: bytes, end: bool) -> None:
        if self._held or not self._sink.write_nowait(data, end):
            # The task sends it, waiting for credit; the engine waits meanwhile.
            self._held.append(data)
            self._held_end = end
            self._pause()
            return
        if end:
            self._ended = True
            self._wake()
        elif self._sink.backlogged:
            self._pause()

    def body_failed(self, error: UpstreamError) -> None:
        self._failure = error
        self._wake()

    def _pause(self) -> None:
        if not self._paused:
            self._paused = True
            self._answer.pause_body()
        self._wake()
