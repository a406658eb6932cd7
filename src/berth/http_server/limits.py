"""The bounds of one listener, and the gate that counts its connections.

Every value bounds what a client can make the leader hold before it has shown a key: the
head is read into memory before authentication, and a connection costs a file descriptor and
a TLS session whether or not it ever sends a request. The defaults, and where they come from
(nginx 1.26 and uvicorn 0.54 defaults, as documented by each):

======================== ========= ================================ ==========================
bound                    berth     nginx                            uvicorn
======================== ========= ================================ ==========================
request head size        32 KiB    4 x 8 KiB buffers                none (httptools), 16 KiB
                                   (``large_client_header_buffers``) (h11)
header lines             100       none (buffers only)              none
head arrival             10 s      60 s (``client_header_timeout``) none
idle keep-alive          15 s      75 s (``keepalive_timeout``)     5 s (``timeout_keep_alive``)
between body reads       30 s      60 s (``client_body_timeout``)   none
connections              4096      512 per worker                   none (``limit_concurrency``)
per source address       1024      none (``limit_conn`` opt-in)     none
bodies read and dropped  64 MiB/s  none (``lingering_time`` 30 s)   none
======================== ========= ================================ ==========================

Why each: 32 KiB is nginx's total for a head (a long bearer key and cookies fit; a 64 MiB
header does not), and 100 lines is Apache's ``LimitRequestFields``. A real client sends its
head in one write right after the TLS handshake, so 10 s (HAProxy's suggested
``timeout http-request``) is plenty, where 60 s lets a slow client hold a slot for a minute.
The idle timeout is longer than the 5 s keep-alive expiry of httpx (the OpenAI SDKs' client),
so that a client closes its idle connection before the leader does and never reuses one the
leader is closing. 30 s between body reads is half nginx's: a body follows its head at once.
4096 connections at about 50 KiB of TLS and buffer state each is about 200 MiB at worst;
1024 per address keeps one client from taking more than a quarter of that and still lets a
busy backend (or the 1,000-stream benchmark) hold its streams.

A body answered before it was read (refused: too large, too many elements, a bad key) is
read to its end and dropped, so that the client, which sends all of it before it reads the
answer, gets the answer and keeps its connection. Over TLS that costs the leader the
decryption of every byte: two clients sending 15 MB bodies refused after their first
megabyte had the leader's one loop decrypting 600-900 MB a second, 52-76 % of a core
(``docs/benchmarks.md``, issue 38). :class:`DiscardBudget` paces it: the listener's
connections together read and drop at most 64 MiB a second (a quarter of a second's worth at
once); a connection past it stops reading for as long as the budget needs, and TCP holds its
client back. A 16 MiB refused body then costs its client at most a quarter of a second more
on an idle listener; bodies being read for a request are never paced.
"""

from __future__ import annotations

from dataclasses import dataclass

from berth.http_server.errors import HttpServerError, ListenerFullError, TooManyConnectionsError

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class ListenerLimits:
    """One listener's bounds; see the module docstring for the defaults and their reasons.

    ``max_head_bytes``: request line plus headers, in bytes (431 beyond it);
    ``max_header_count``: header lines (431 beyond it); ``head_timeout_s``: from a
    connection's first byte, or a keep-alive request's first byte, to the end of its head
    (also the TLS handshake's limit; 408 when part of a head came, a silent close otherwise);
    ``keepalive_timeout_s``: an idle connection between requests is closed after it;
    ``body_timeout_s``: the longest wait for the next piece of an unfinished request body
    (408, or a close once the answer has begun); ``max_connections`` and
    ``max_connections_per_address``: open connections on the listener, and from one client
    address (503 and 429 with ``Retry-After: 1``, then the connection is closed);
    ``discard_bytes_per_s``: bytes of bodies answered unread that the listener's
    connections read and drop a second, all together (:class:`DiscardBudget`).
    """

    max_head_bytes: int = 32 * KiB
    max_header_count: int = 100
    head_timeout_s: float = 10.0
    keepalive_timeout_s: float = 15.0
    body_timeout_s: float = 30.0
    max_connections: int = 4096
    max_connections_per_address: int = 1024
    discard_bytes_per_s: int = 64 * MiB


class ConnectionGate:
    """Counts a listener's open connections, in all and per client address.

    :meth:`admit` takes a slot or says why not; :meth:`release` gives it back. ``address``
    is ``None`` for a Unix socket (only the total applies there).
    """

    def __init__(self, limits: ListenerLimits) -> None:
        self._max_total = limits.max_connections
        self._max_per_address = limits.max_connections_per_address
        self._per_address: dict[str, int] = {}
        self.open = 0

    def admit(self, address: str | None) -> HttpServerError | None:
        """Take a slot for a new connection from ``address``; ``None`` when admitted, else
        the refusal to answer it with (nothing is taken then)."""
        if self.open >= self._max_total:
            return ListenerFullError(
                f"the server holds its limit of {self._max_total} connections; retry shortly"
            )
        if address is not None:
            held = self._per_address.get(address, 0)
            if held >= self._max_per_address:
                return TooManyConnectionsError(
                    f"too many connections from {address} (limit {self._max_per_address}); "
                    "close idle ones or reuse them"
                )
            self._per_address[address] = held + 1
        self.open += 1
        return None

    def release(self, address: str | None) -> None:
        """Give back the slot an admitted connection from ``address`` held."""
        self.open -= 1
        if address is not None:
            left = self._per_address.get(address, 1) - 1
            if left > 0:
                self._per_address[address] = left
            else:
                self._per_address.pop(address, None)

    def held_by(self, address: str) -> int:
        """Connections ``address`` holds now."""
        return self._per_address.get(address, 0)


class DiscardBudget:
    """The bytes of bodies answered unread that a listener's connections may read and drop:
    ``bytes_per_s`` a second, a quarter of a second's worth at once (a token bucket; pure,
    times in seconds from the caller's monotonic clock). :meth:`take` counts what a
    connection read and says how long it must wait before it reads again; ``waits`` counts
    the times one had to."""

    __slots__ = ("_at", "_burst", "_level", "_rate", "waits")

    def __init__(self, bytes_per_s: float) -> None:
        self._rate = float(bytes_per_s)
        self._burst = self._level = self._rate / 4
        self._at: float | None = None
        self.waits = 0

    def take(self, size: int, now: float) -> float:
        """``size`` bytes were read and dropped at ``now``: the seconds to wait before
        reading more (0: none; the budget may go into debt, which the wait pays back)."""
        level = self._level
        if self._at is not None:
            level = min(self._burst, level + (now - self._at) * self._rate)
        self._at = now
        level -= size
        self._level = level
        if level >= 0:
            return 0.0
        self.waits += 1
        return -level / self._rate
