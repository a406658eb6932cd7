"""Deadlines on every database call: a call that hangs is cut, never waited on.

A leader in shared leadership acts on its lease by its own clock (:mod:`berth.store.leadership`),
and nothing else it does may wait without end on a database that stopped answering either:
a network that drops packets without a reset leaves a blocked socket read for the kernel's
retransmission timeout (about 15 minutes with Linux's defaults).  So on PostgreSQL each
limit has its enforcer (:class:`StoreDeadlines` holds the numbers):

- **connect**: psycopg's ``connect_timeout`` (whole seconds, at least 2: libpq's rule) covers
  the TCP connection, TLS and the startup exchange;
- **pool checkout**: SQLAlchemy's ``pool_timeout``: a call that waits longer for a free
  pooled connection fails;
- **the call**: from the moment a connection is checked out (its liveness ping first) until
  it is returned, a :class:`CallWatchdog` holds a deadline for it; past it, the watchdog shuts
  the connection's socket down.  Whatever the calling thread waits on (a statement, a
  commit, the ping) fails at once, SQLAlchemy sees a disconnect and discards the connection:
  it is never reused.  This is the one limit that holds when something on the way still
  acknowledges the packets (a proxy, a NAT, a relay) while nothing answers;
- **the server**: ``statement_timeout`` and ``idle_in_transaction_session_timeout`` on every
  connection, so the server itself ends a statement stuck on a lock, and the session of a
  client that vanished inside a transaction (with the store's write lock, which another
  leader needs to take the lease) is ended and its locks released;
- **the kernel**: TCP keepalives and ``tcp_user_timeout``: a peer that stops acknowledging
  (a cable pulled, a host gone) fails the socket of an idle pooled connection or of a write
  that is not acknowledged.

:meth:`CallWatchdog.unbounded` lifts the call's limit for the calling thread (the schema
migrations, which may take long on a big database; they lift the server's limits too).
SQLite needs none of this: it is a local file, and its busy timeout bounds lock waits.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import psycopg

_log = logging.getLogger(__name__)

#: A store's call limit when no lease says otherwise (the CLI, a leader without
#: ``leader_ha``), in seconds.
DEFAULT_CALL_S: Final = 10.0
#: The least time libpq waits for a connection, in seconds (a smaller ``connect_timeout``
#: is read as this).
LIBPQ_MIN_CONNECT_S: Final = 2
#: The share of the lease a leader's database call may take (:meth:`StoreDeadlines.within_lease`).
LEASE_SHARE: Final = 0.8


@dataclass(frozen=True)
class StoreDeadlines:
    """Every database call's limits, in seconds (see the module doc).

    ``call_s`` bounds one use of a connection, from checkout to return; ``checkout_s`` the
    wait for a free pooled connection; ``connect_s`` opening a new one (whole seconds, at
    least 2).  The server-side limits and the TCP settings follow from ``call_s``.
    """

    call_s: float = DEFAULT_CALL_S
    checkout_s: float = DEFAULT_CALL_S
    connect_s: int = int(DEFAULT_CALL_S)

    def __post_init__(self) -> None:
        if not (self.call_s > 0 and self.checkout_s > 0):
            raise ValueError(f"deadlines must be positive: {self}")
        if self.connect_s < LIBPQ_MIN_CONNECT_S:
            raise ValueError(f"connect_s must be at least {LIBPQ_MIN_CONNECT_S}: {self}")

    @classmethod
    def within_lease(cls, lease_s: float) -> StoreDeadlines:
        """The limits of a leader whose lease lasts ``lease_s`` seconds:
        :data:`LEASE_SHARE` of it for a call and for a checkout, so a call that hangs is cut
        before the lease runs out (the lease is kept by the leader's own clock whatever the
        call does; this frees the threads and connections, and the write lock a vanished
        session held, for the next renewal and for a standby's takeover), while a renewal
        on a slow database still fits (five round trips: 2 s at 200 ms each way)."""
        share_s = lease_s * LEASE_SHARE
        return cls(
            call_s=share_s,
            checkout_s=share_s,
            connect_s=max(LIBPQ_MIN_CONNECT_S, math.floor(share_s)),
        )

    def server_settings(self) -> dict[str, int]:
        """The PostgreSQL settings every connection gets, in milliseconds."""
        call_ms = max(1, round(self.call_s * 1000))
        return {"statement_timeout": call_ms, "idle_in_transaction_session_timeout": call_ms}

    def libpq_parameters(self) -> dict[str, Any]:
        """The libpq connection parameters: the connect timeout, TCP keepalives (first
        probe after a call's time idle, then every second, three unanswered end it) and
        ``tcp_user_timeout`` (unacknowledged data for a call's time ends it)."""
        idle_s = max(1, math.ceil(self.call_s))
        return {
            "connect_timeout": self.connect_s,
            "keepalives": 1,
            "keepalives_idle": idle_s,
            "keepalives_interval": 1,
            "keepalives_count": 3,
            "tcp_user_timeout": max(1, round(self.call_s * 1000)),
        }


@dataclass
class _Armed:
    deadline: float
    connection: Any
    timeout_s: float


class CallWatchdog:
    """Cuts the connections whose use outlived its deadline (see the module doc).

    :meth:`arm` a DB-API connection when it is checked out, :meth:`disarm` it when it is
    returned, closed or discarded; a thread of its own (started at the first :meth:`arm`)
    shuts the socket of every connection still armed at its deadline.  A cut is counted in
    :attr:`cuts` and logged, and :meth:`was_cut` tells the store's error handler why the
    call failed.  ``name`` names the thread and the log lines.
    """

    def __init__(self, name: str = "store") -> None:
        self._name = name
        self._changed = threading.Condition()
        self._armed: dict[int, _Armed] = {}
        self._cut: weakref.WeakSet[Any] = weakref.WeakSet()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._local = threading.local()
        #: connections cut so far
        self.cuts = 0

    def arm(self, connection: Any, timeout_s: float) -> None:
        """From now, ``connection`` must be returned within ``timeout_s`` seconds (unless
        this thread runs :meth:`unbounded`)."""
        if getattr(self._local, "unbounded", False):
            return
        with self._changed:
            if self._closed:
                return
            self._armed[id(connection)] = _Armed(
                time.monotonic() + timeout_s, connection, timeout_s
            )
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"{self._name}-deadlines", daemon=True
                )
                self._thread.start()
            self._changed.notify()

    def disarm(self, connection: Any) -> None:
        """``connection`` was returned (or closed): no deadline holds for it any more."""
        with self._changed:
            self._armed.pop(id(connection), None)

    def was_cut(self, connection: Any) -> bool:
        """Whether this watchdog cut ``connection`` at its deadline."""
        with self._changed:
            return connection in self._cut

    @contextlib.contextmanager
    def unbounded(self) -> Iterator[None]:
        """Within this block, the calling thread's connections have no call limit."""
        self._local.unbounded = True
        try:
            yield
        finally:
            self._local.unbounded = False

    def close(self) -> None:
        """Stop the watchdog's thread (the store is closed)."""
        with self._changed:
            self._closed = True
            self._armed.clear()
            self._changed.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def _run(self) -> None:
        with self._changed:
            while not self._closed:
                now = time.monotonic()
                due = [key for key, armed in self._armed.items() if armed.deadline <= now]
                for key in due:
                    self._cut_one(self._armed.pop(key))
                following = min((a.deadline for a in self._armed.values()), default=None)
                self._changed.wait(None if following is None else max(0.0, following - now))

    def _cut_one(self, armed: _Armed) -> None:
        """Shut ``armed``'s socket down (with the lock held, so it cannot be returned and
        checked out again meanwhile)."""
        try:
            fd = armed.connection.fileno()
            cutter = socket.socket(fileno=os.dup(fd))
        except (psycopg.Error, OSError, ValueError) as exc:  # closed already: nothing to cut
            _log.debug("%s: a connection past its deadline was already closed: %s", self._name,
                       exc)  # fmt: skip
            return
        with cutter, contextlib.suppress(OSError):
            cutter.shutdown(socket.SHUT_RDWR)
        self._cut.add(armed.connection)
        self.cuts += 1
        _log.warning(
            "%s: a database call outlived its %g s deadline; its connection was cut and is "
            "discarded",
            self._name,
            armed.timeout_s,
        )
