"""Changes other leaders must hear of at once: a counter per topic, and PostgreSQL's
``NOTIFY``.

A write that changes what every leader caches (an API key created, changed or revoked:
topic ``keys``) calls :func:`record_change` inside its transaction.  That adds one to the
topic's row of ``change_counters`` and, on PostgreSQL, sends ``NOTIFY berth_<topic>`` with
``"<counter> <id>"`` as payload; both take effect at commit, together with the change.

A leader follows a topic with a :class:`ChangeFeed`.  On PostgreSQL it holds a connection of
its own that ``LISTEN``\\ s, and hears each change within milliseconds, with its id.  On
SQLite (leaders on one host) it reads the counter every ``poll_s`` seconds and hears "some
change" (ids ``None``) when it moved.  The counter is read on PostgreSQL too, at each
(re)connection and every :data:`LISTEN_POLL_S`, so a change made while the listening
connection was down is not missed: it is heard as "some change".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Final

import psycopg
from sqlalchemy import Engine, select, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from berth.errors import StoreError
from berth.store.db import POSTGRES_CONNECT_TIMEOUT_S
from berth.store.deadlines import StoreDeadlines
from berth.store.tables import ChangeCounterRow

_log = logging.getLogger(__name__)

#: The topic of API keys and their limits.
KEYS_TOPIC: Final = "keys"
#: Seconds between looks at the counter on SQLite: the delay of a change there.
DEFAULT_POLL_S: Final = 0.25
#: Seconds between looks at the counter on PostgreSQL: the safety net behind ``LISTEN``.
LISTEN_POLL_S: Final = 5.0
#: Seconds the listening thread waits for a notification before it looks at its stop flag.
_LISTEN_WAKE_S: Final = 0.2
#: Seconds :meth:`ChangeFeed.start` waits for ``LISTEN`` to hold.
_LISTEN_START_S: Final = 10.0
#: Seconds before a lost listening connection is opened again.
_RECONNECT_S: Final = 1.0

#: Hears changed ids (a set), or ``None`` for "something changed: read it all again".
ChangeListener = Callable[[frozenset[str] | None], None]


def channel(topic: str) -> str:
    """The ``NOTIFY`` channel of ``topic``."""
    return f"berth_{topic}"


def record_change(session: Session, topic: str, ident: str) -> None:
    """Count a change of ``topic`` (row ``ident`` changed) in ``session``'s write
    transaction, and notify PostgreSQL listeners of it at commit."""
    row = session.get(ChangeCounterRow, topic)
    if row is None:
        row = ChangeCounterRow(topic=topic, counter=1)
        session.add(row)
    else:
        row.counter += 1
    if session.get_bind().dialect.name == "postgresql":
        payload = f"{row.counter} {ident}"
        session.execute(
            text("SELECT pg_notify(:channel, :payload)"),
            {"channel": channel(topic), "payload": payload},
        )


def read_counter(session: Session, topic: str) -> int:
    """How many changes of ``topic`` were recorded (0: none yet)."""
    value = session.scalar(select(ChangeCounterRow.counter).where(ChangeCounterRow.topic == topic))
    return int(value or 0)


def libpq_url(url: URL) -> str:
    """``url`` (``postgresql+psycopg://...``) as a URL psycopg connects to."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class ChangeFeed:
    """Follow one topic of the store (see the module doc) and call ``listener`` on the event
    loop with what changed.

    ``counter`` reads the topic's counter (``Store.change_counter``), ``listen_url`` is the
    PostgreSQL URL to ``LISTEN`` on (``None`` on SQLite: counter only), with the libpq
    ``connect_parameters`` (the store's connect timeout and TCP keepalives:
    :meth:`berth.store.deadlines.StoreDeadlines.libpq_parameters`).
    """

    def __init__(
        self,
        topic: str,
        counter: Callable[[], int],
        listener: ChangeListener,
        *,
        listen_url: URL | None = None,
        poll_s: float = DEFAULT_POLL_S,
        connect_parameters: Mapping[str, Any] | None = None,
    ) -> None:
        self._connect_parameters = dict(
            connect_parameters or {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S}
        )
        self._topic = topic
        self._counter = counter
        self._listener = listener
        self._listen_url = listen_url
        self._poll_s = poll_s
        self._seen: int | None = None
        self._stopping = threading.Event()
        self._listening = threading.Event()  # set once LISTEN holds the first time
        self._tasks: list[asyncio.Task[None]] = []
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        """Start listening (PostgreSQL: returns once ``LISTEN`` holds, or after
        :data:`_LISTEN_START_S` if the server does not answer: the counter covers), then
        read the counter (what is already there is not a change), then follow."""
        loop = asyncio.get_running_loop()
        if self._listen_url is not None:
            # A thread of its own: it blocks for the feed's life, and must not hold one of
            # the default executor's few workers (the store's calls need them).
            self._thread = threading.Thread(
                target=self._listen,
                args=(loop, self._listen_url),
                name=f"listen-{self._topic}",
                daemon=True,
            )
            self._thread.start()
            if not await asyncio.to_thread(self._listening.wait, _LISTEN_START_S):
                _log.warning("changes of %s: not listening yet; reading the counter", self._topic)
        self._seen = await asyncio.to_thread(self._counter)
        self._tasks.append(asyncio.create_task(self._poll(), name=f"changes-{self._topic}"))

    async def stop(self) -> None:
        """Stop following (the listening thread ends within a fraction of a second)."""
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, _LISTEN_WAKE_S + _RECONNECT_S + 1.0)
            self._thread = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                counter = await asyncio.to_thread(self._counter)
            except StoreError as exc:
                _log.warning("changes of %s: cannot read the counter: %s", self._topic, exc)
                continue
            if counter != self._seen:
                self._seen = counter
                self._listener(None)

    def _heard(self, payload: str) -> None:
        counter, _, ident = payload.partition(" ")
        if counter.isdigit() and self._seen is not None:
            self._seen = max(self._seen, int(counter))  # the poll need not hear it again
        self._listener(frozenset({ident}))

    def _listen(self, loop: asyncio.AbstractEventLoop, url: URL) -> None:
        """The listening thread: ``LISTEN``, hand each notification to the loop, reconnect
        after a failure (and report "some change": one may have been missed meanwhile)."""
        first = True
        while not self._stopping.is_set():
            try:
                with psycopg.connect(
                    libpq_url(url), autocommit=True, **self._connect_parameters
                ) as conn:
                    conn.execute(f'LISTEN "{channel(self._topic)}"')
                    self._listening.set()
                    if not first:
                        loop.call_soon_threadsafe(self._listener, None)
                    first = False
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=_LISTEN_WAKE_S):
                            loop.call_soon_threadsafe(self._heard, note.payload)
            except psycopg.Error as exc:
                if self._stopping.is_set():
                    return
                _log.warning("changes of %s: listening failed, again in 1 s: %s", self._topic, exc)
                first = False
                self._stopping.wait(_RECONNECT_S)


class ChangeMethods:
    """Store methods for change counters and feeds (see the module doc)."""

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    deadlines: StoreDeadlines

    @property
    def engine(self) -> Engine:
        raise NotImplementedError

    def change_counter(self, topic: str) -> int:
        """How many changes of ``topic`` were recorded (0: none yet)."""
        with self._read() as session:
            return read_counter(session, topic)

    def change_feed(
        self, topic: str, listener: ChangeListener, *, poll_s: float | None = None
    ) -> ChangeFeed:
        """A :class:`ChangeFeed` of ``topic`` on this store: ``LISTEN`` on PostgreSQL and
        the counter every ``poll_s`` (default :data:`LISTEN_POLL_S`); the counter only on
        SQLite (default every :data:`DEFAULT_POLL_S`)."""
        url = self.engine.url
        listen_url = url if url.get_backend_name() == "postgresql" else None
        if poll_s is None:
            poll_s = DEFAULT_POLL_S if listen_url is None else LISTEN_POLL_S
        return ChangeFeed(
            topic,
            lambda: self.change_counter(topic),
            listener,
            listen_url=listen_url,
            poll_s=poll_s,
            connect_parameters=self.deadlines.libpq_parameters(),
        )
