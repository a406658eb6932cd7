"""The leader's recent requests: a bounded ring in memory, for the console's requests view.

One :class:`RequestEntry` per ``/v1`` completion request the proxy answered (relayed or
refused): when, which key, which model, node and deployment, the status sent, time to first
byte, tokens, and each retry with its reason. Never the prompt or the answer: nothing of a
request's body but its ``model`` is kept. The ring holds the last ``capacity`` entries; older
ones are dropped as new ones arrive, so memory stays bounded whatever the traffic. Nothing is
written to disk: a restarted leader starts with an empty ring.

Each entry gets a sequence number (``seq``, from 1, increasing), so a poller asks for what
came after the last one it saw (:meth:`RequestLog.after`) and misses nothing the ring still
holds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import msgspec

#: Entries kept when no capacity is given.
DEFAULT_CAPACITY = 1000


class RequestEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One finished request (made once per request: a struct, about 1.5 µs cheaper to make
    than a frozen dataclass of as many fields).

    ``at`` is when it arrived (epoch seconds); ``key_name`` the name of the API key it came
    with (``""`` over the trusted Unix socket); ``node_id`` and ``deployment_id`` are ``""``
    when no deployment was chosen. ``status`` is the HTTP status sent (499: the client left
    first). ``ttfb_ms`` is the time to the answer's first byte (for a stream, its first event),
    ``None`` when none was sent; ``duration_ms`` the whole exchange. ``retries`` lists, for
    each attempt that did not serve the request, why it moved on (an error code such as
    ``engine_unreachable``, or ``status 503``). ``error_reason`` names what went wrong with the
    request itself, ``None`` when nothing did. ``cached_tokens``: of ``prompt_tokens``,
    those the engine read from its prompt cache, where it says (a Messages API answer's
    ``cache_read_input_tokens``).
    """

    seq: int
    at: float
    request_id: str
    key_name: str
    model: str
    node_id: str
    deployment_id: str
    status: int
    ttfb_ms: float | None
    duration_ms: float
    prompt_tokens: int
    completion_tokens: int
    retries: tuple[str, ...]
    error_reason: str | None
    cached_tokens: int = 0


class RequestLog:
    """The last ``capacity`` requests, newest last.

    Not thread-safe: the proxy adds from the event loop, the admin API reads from it too.
    """

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, *, clock: Callable[[], float] = time.time
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a request log holds at least 1 entry, not {capacity}")
        self._entries: deque[RequestEntry] = deque(maxlen=capacity)
        self._seq = 0
        self._clock = clock

    @property
    def capacity(self) -> int:
        """The most entries kept."""
        maxlen = self._entries.maxlen
        assert maxlen is not None
        return maxlen

    def add(
        self,
        *,
        started_at: float,
        request_id: str,
        key_name: str,
        model: str,
        node_id: str = "",
        deployment_id: str = "",
        status: int,
        ttfb_s: float | None = None,
        duration_s: float,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        retries: tuple[str, ...] = (),
        error_reason: str | None = None,
        cached_tokens: int = 0,
    ) -> RequestEntry:
        """Record one finished request (times in seconds, ``started_at`` epoch seconds);
        the oldest entry goes when the ring is full. Returns the entry."""
        self._seq += 1
        entry = RequestEntry(
            seq=self._seq,
            at=started_at,
            request_id=request_id,
            key_name=key_name,
            model=model,
            node_id=node_id,
            deployment_id=deployment_id,
            status=status,
            ttfb_ms=None if ttfb_s is None else round(ttfb_s * 1000.0, 1),
            duration_ms=round(duration_s * 1000.0, 1),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            retries=retries,
            error_reason=error_reason,
            cached_tokens=cached_tokens,
        )
        self._entries.append(entry)
        return entry

    def now(self) -> float:
        """The log's clock (epoch seconds), for ``started_at``."""
        return self._clock()

    def after(self, seq: int = 0, *, limit: int = 200) -> list[RequestEntry]:
        """The entries with a sequence number above ``seq``, oldest first, at most the
        ``limit`` newest of them."""
        if limit <= 0:
            return []
        found: list[RequestEntry] = []
        for entry in reversed(self._entries):
            if entry.seq <= seq or len(found) >= limit:
                break
            found.append(entry)
        found.reverse()
        return found

    @property
    def last_seq(self) -> int:
        """The sequence number of the newest entry (0 before the first)."""
        return self._seq
