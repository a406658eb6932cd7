"""The pushed relay of an event stream (:class:`StreamPush`), for
:meth:`berth.gateway.relay.AnswerRelay.relay_stream` when the relay path is
:attr:`~berth.gateway.relay.RelayPath.PUSH` (see :mod:`berth.gateway.relay`).
"""

from __future__ import annotations

from collections.abc import Callable

from berth.engine_http.answer import PushedAnswer
from berth.engine_http.errors import UpstreamError
from berth.engine_http.push_relay import PushRelay
from berth.gateway.exchange import PushWriter
from berth.gateway.outcome import Exchange
from berth.gateway.sse import (
    SSEEventSplitter,
    has_usage_object,
)

__all__ = ["StreamPush"]


class StreamPush(PushRelay):
    """Relays a pushed event stream to ``writer`` (see the module docstring): the
    :class:`~berth.engine_http.answer.BodySink` of ``answer``, and :meth:`run` for the task
    that waits on it.

    What it does with each piece is what :meth:`AnswerRelay.relay_stream` does when it
    reads: ``splitter`` (``None`` for a compressed stream) holds back a partial event, at
    most ``max_event_bytes``; ``exchange`` counts the events and takes the usage (``strip``:
    and takes the usage event out); the first event times ``exchange.ttfb_s`` by ``clock``;
    the last piece ends the answer in the same write.
    """

    __slots__ = (
        "_bug",
        "_clock",
        "_ended",
        "_exchange",
        "_failure",
        "_max_event_bytes",
        "_splitter",
        "_strip",
        "_writer",
    )

    def __init__(
        self,
        answer: PushedAnswer,
        writer: PushWriter,
        exchange: Exchange,
        splitter: SSEEventSplitter | None,
        strip: bool,
        max_event_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        super().__init__(answer)
        self._writer = writer
        self._exchange = exchange
        self._splitter = splitter
        self._strip = strip
        self._max_event_bytes = max_event_bytes
        self._clock = clock
        self._ended = False
        self._failure: UpstreamError | None = None
        self._bug: Exception | None = None

    async def run(self) -> UpstreamError | None:
        """Push the answer's body to the client until it ends: ``None`` once the answer
        is complete (and ended), the engine's failure when it broke off (the answer is left
        for the caller to end). Raises a bug of the sink's, and ``CancelledError``."""
        self._answer.push_body(self)
        drain = self._writer.drain
        while True:
            if self._bug is not None:
                raise self._bug
            if self._ended:
                return None
            if self._failure is not None:
                return self._failure
            await self._drain_or_wait(drain)

    # -- BodySink: called from the answer's connection ------------------------------------

    def body_received(self, data: bytes, end: bool) -> None:
        if self._ended or self._failure is not None or self._bug is not None:
            return
        try:
            self._relay(data, end)
        except Exception as exc:  # a bug: kept for the task, which raises it
            self._bug = exc
            self._wake()

    def body_failed(self, error: UpstreamError) -> None:
        if not self._ended and self._failure is None:
            self._failure = error
            self._wake()

    def _relay(self, chunk: bytes, end: bool) -> None:
        exchange = self._exchange
        splitter = self._splitter
        if splitter is not None:
            chunk = splitter.feed(chunk)
            if splitter.pending_bytes > self._max_event_bytes:
                chunk += splitter.take_pending()
            if chunk:
                exchange.events += chunk.count(b"\n\n")
                # Usage comes once, last; two substring tests skip every other event.
                if has_usage_object(chunk):
                    chunk = exchange.note_stream_usage(chunk, strip=self._strip)
                if exchange.ttfb_s is None:
                    exchange.ttfb_s = self._clock() - exchange.start
            if end:
                chunk += splitter.take_pending()
        elif chunk and exchange.ttfb_s is None:
            exchange.ttfb_s = self._clock() - exchange.start
        writer = self._writer
        if end:
            # The engine's answer is complete: this piece ends ours too, in one write.
            self._ended = True
            exchange.done = True
            writer.end_now(chunk)
            self._wake()
            return
        if chunk:  # empty when it held only the usage event taken out
            writer.write_now(chunk)
            if writer.write_paused and not self._paused:
                self._paused = True
                self._answer.pause_body()
                self._wake()
