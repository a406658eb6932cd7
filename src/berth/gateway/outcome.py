"""What happened to one relayed request (:class:`Exchange`): written by the attempt stage,
the relay and the disconnect watcher, read by the records (:mod:`berth.gateway.record`).
"""

from __future__ import annotations

from berth.gateway.sse import Usage, last_usage, messages_stream_usage, take_usage_event

__all__ = ["Exchange"]


class Exchange:
    """What happened to one relayed request, for its metrics, its key's usage and the
    disconnect watcher.

    ``answer_headers`` go on the answer whatever it is (a key's rate-limit headers);
    ``strip_usage`` says berth asked the engine for a stream's usage on the client's behalf,
    so the usage event is taken out of what the client receives. ``answer_bytes`` and
    ``events`` measure the answer, for a token estimate when the engine reports no usage.
    ``dialect`` is the API the request spoke: ``""`` for OpenAI's, ``"messages"`` for
    Anthropic's Messages (its usage form, its error shape), ``"count_tokens"`` for its
    token count (an answer that used no tokens).
    """

    __slots__ = (
        "answer_bytes",
        "answer_headers",
        "client_gone",
        "dialect",
        "done",
        "error_reason",
        "events",
        "start",
        "status",
        "streamed",
        "strip_usage",
        "ttfb_s",
        "usage",
    )

    def __init__(
        self,
        start: float,
        answer_headers: list[tuple[bytes, bytes]] | None = None,
        *,
        strip_usage: bool = False,
        dialect: str = "",
    ) -> None:
        self.start = start
        self.dialect = dialect
        self.status = 0
        self.ttfb_s: float | None = None
        self.usage: Usage | None = None
        self.error_reason: str | None = None
        self.answer_headers = answer_headers or []
        self.strip_usage = strip_usage
        self.answer_bytes = 0
        self.events = 0
        self.streamed = False
        # Set just before the final body message: from then on a disconnect is not an abort.
        self.done = False
        self.client_gone = False

    def note_stream_usage(self, events: bytes, *, strip: bool) -> bytes:
        """Note the usage that ``events`` (complete SSE events, one of them holding a usage
        object) report, and return them as the client receives them: with the usage event
        taken out when ``strip`` (berth asked the engine for it, the client did not).
        OpenAI's usage comes once, last; a Messages stream's counts are cumulative."""
        if strip:
            events, usage = take_usage_event(events)
        elif self.dialect:
            usage = messages_stream_usage(events, self.usage)
        else:
            usage = last_usage(events)
        self.usage = usage or self.usage
        return events
