"""Engine creation for the state database.

The URL is the ``database_url`` setting; SQLite is the default and PostgreSQL
(``postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB``, psycopg 3) works by URL alone, so
everything engine-specific lives here, in connection events, and the rest of the store
speaks portable SQLAlchemy.

For SQLite each new connection gets ``journal_mode=WAL`` (readers never block the writer),
``foreign_keys=ON`` and a busy timeout.  SQLAlchemy, not the ``sqlite3`` module, emits
``BEGIN``, so DDL in migrations is transactional and a write transaction can take the write
lock up front (``BEGIN IMMEDIATE``) instead of failing to upgrade a read lock under contention;
see the SQLAlchemy SQLite dialect docs, "Enabling Non-Legacy SQLite Transactional Modes".

On PostgreSQL a write transaction starts by taking one transaction-scoped advisory lock,
:data:`WRITE_LOCK_KEY` (``pg_advisory_xact_lock``), released at commit or rollback.  That
makes writers take turns exactly as SQLite's single write lock does, so every
read-check-write of the store (a usage counter added, a key revoked, a deployment moved
out of a state, a lease taken over) means the same with several leaders on one database as
with one: under ``READ COMMITTED`` each statement after the lock sees every write committed
before it.  Readers never wait for it.  The store writes little (batches, state changes),
so one lock costs nothing measurable; advisory locks are per database, so two berth
clusters on one server do not share it.

Every PostgreSQL call has a deadline (:mod:`berth.store.deadlines`): the connect timeout,
TCP keepalives and ``tcp_user_timeout`` as connection parameters, the server's
``statement_timeout`` and ``idle_in_transaction_session_timeout`` set on each new
connection, the pool's checkout timeout, and the call's own limit, kept by a
:class:`~berth.store.deadlines.CallWatchdog` from checkout (the liveness ping, which berth
sends itself so that it falls under the limit) to return.  A call the watchdog cut fails
with :class:`~berth.store.errors.StoreDeadlineError`, and its connection is discarded.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any, Final

import psycopg
from sqlalchemy import Connection, Engine, create_engine, event, make_url
from sqlalchemy.engine import URL, ExceptionContext
from sqlalchemy.exc import ArgumentError, DisconnectionError
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection, StaticPool

from berth.errors import StoreError
from berth.redact import mask_url_password, quoted_url
from berth.store.deadlines import CallWatchdog, StoreDeadlines
from berth.store.errors import StoreDeadlineError

#: Seconds a SQLite connection waits for another writer before giving up.
SQLITE_BUSY_TIMEOUT_S: Final = 30.0

#: Execution option naming the SQLite ``BEGIN`` flavour of a transaction.
SQLITE_BEGIN_OPTION: Final = "berth_sqlite_begin"

#: Execution options for a transaction that will write (``BEGIN IMMEDIATE`` on SQLite, the
#: write lock on PostgreSQL).
WRITE_OPTIONS: Final[dict[str, Any]] = {SQLITE_BEGIN_OPTION: "IMMEDIATE"}

#: The PostgreSQL advisory lock every write transaction holds (a constant: "berth" in ASCII).
WRITE_LOCK_KEY: Final = 0x6265727468

#: Seconds a PostgreSQL connection attempt waits before failing (a dead server is an error,
#: not a hang), where no deadlines say otherwise.
POSTGRES_CONNECT_TIMEOUT_S: Final = 10
#: Marks a pooled connection made since its last checkout (it needs no liveness ping).
_FRESH: Final = "berth_fresh"


def parse_database_url(url: str) -> URL:
    """Parse ``url``; :class:`StoreError` when SQLAlchemy cannot read it (its password
    masked in the message)."""
    try:
        return make_url(url)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        # SQLAlchemy's message repeats the URL, password and all: never passed on.
        raise StoreError(
            f"invalid database URL {quoted_url(url)}: expected DRIVER://USER:PASSWORD@HOST"
            f"[:PORT]/DATABASE or sqlite:///PATH ({type(exc).__name__})"
        ) from None


def is_sqlite(url: URL) -> bool:
    """Whether ``url`` names a SQLite database."""
    return url.get_backend_name() == "sqlite"


def is_postgresql(url: URL) -> bool:
    """Whether ``url`` names a PostgreSQL database."""
    return url.get_backend_name() == "postgresql"


def _is_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"


def create_store_engine(
    url: str,
    deadlines: StoreDeadlines | None = None,
    watchdog: CallWatchdog | None = None,
) -> Engine:
    """Create the engine for ``url``, with the SQLite connection settings described above,
    or on PostgreSQL the ``deadlines`` (default :class:`StoreDeadlines`), whose call limit
    ``watchdog`` keeps (a new one when not given).

    A file-backed SQLite database's folder is created if missing.  An in-memory SQLite
    database is shared by every thread of this engine (one connection, ``StaticPool``).
    Raises :class:`StoreError` for a URL SQLAlchemy cannot use (bad syntax, missing driver).
    """
    parsed = parse_database_url(url)
    deadlines = deadlines or StoreDeadlines()
    kwargs: dict[str, Any] = {}
    if is_sqlite(parsed):
        connect_args: dict[str, Any] = {"timeout": SQLITE_BUSY_TIMEOUT_S}
        if _is_memory(parsed):
            connect_args["check_same_thread"] = False
            kwargs["poolclass"] = StaticPool
        elif parsed.database:
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = connect_args
    elif is_postgresql(parsed):
        # No pool_pre_ping: berth pings at checkout itself, under the call's deadline.
        kwargs["connect_args"] = deadlines.libpq_parameters()
        kwargs["pool_timeout"] = deadlines.checkout_s
    try:
        engine = create_engine(parsed, **kwargs)
    except (ArgumentError, ImportError) as exc:
        raise StoreError(
            f"cannot use database URL {quoted_url(url)}: {mask_url_password(str(exc))} "
            "(berth's store is sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST/DB)"
        ) from None
    if is_sqlite(parsed):
        _install_sqlite_events(engine)
    elif is_postgresql(parsed):
        _install_postgresql_events(engine)
        _install_postgresql_deadlines(engine, deadlines, watchdog or CallWatchdog())
    return engine


def _install_sqlite_events(engine: Engine) -> None:
    busy_timeout_ms = int(SQLITE_BUSY_TIMEOUT_S * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module; _on_begin emits BEGIN.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
            _enter_wal(cursor, SQLITE_BUSY_TIMEOUT_S)
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        mode = connection.get_execution_options().get(SQLITE_BEGIN_OPTION, "DEFERRED")
        if mode not in ("DEFERRED", "IMMEDIATE", "EXCLUSIVE"):
            raise StoreError(f"unknown SQLite transaction mode {mode!r}")
        connection.exec_driver_sql(f"BEGIN {mode}")


def _enter_wal(cursor: sqlite3.Cursor, timeout_s: float) -> None:
    """Switch the database to write-ahead logging, retrying for up to ``timeout_s`` while
    another connection holds it. SQLite does not always call the busy handler for this
    pragma: on a new database that another process (or thread) is creating or switching at
    the same moment, it answers "database is locked" at once (two leaders migrating one
    fresh file). Raises ``sqlite3.OperationalError`` when it is still locked at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def _install_postgresql_events(engine: Engine) -> None:
    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        mode = connection.get_execution_options().get(SQLITE_BEGIN_OPTION, "DEFERRED")
        if mode != "DEFERRED":
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY})")


def _install_postgresql_deadlines(
    engine: Engine, deadlines: StoreDeadlines, watchdog: CallWatchdog
) -> None:
    call_s = deadlines.call_s
    settings = deadlines.server_settings()

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        watchdog.arm(dbapi_connection, call_s)
        try:
            with dbapi_connection.cursor() as cursor:
                for name, value_ms in settings.items():
                    cursor.execute(f"SET {name} = {int(value_ms)}")
            dbapi_connection.commit()
        finally:
            watchdog.disarm(dbapi_connection)
        record.info[_FRESH] = True

    @event.listens_for(engine, "checkout")
    def _on_checkout(
        dbapi_connection: Any, record: ConnectionPoolEntry, _proxy: PoolProxiedConnection
    ) -> None:
        watchdog.arm(dbapi_connection, call_s)
        if record.info.pop(_FRESH, False):
            return
        try:  # what pool_pre_ping does, but under the deadline
            engine.dialect.do_ping(dbapi_connection)
        except psycopg.Error as exc:
            watchdog.disarm(dbapi_connection)
            # The pool discards this connection and opens another (SQLAlchemy's rule).
            raise DisconnectionError(f"the pooled connection is gone: {exc}") from exc

    @event.listens_for(engine, "checkin")
    def _on_checkin(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
        if dbapi_connection is not None:
            watchdog.disarm(dbapi_connection)

    @event.listens_for(engine, "close")
    def _on_close(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
        watchdog.disarm(dbapi_connection)

    @event.listens_for(engine, "handle_error")
    def _on_error(context: ExceptionContext) -> BaseException | None:
        proxied = context.connection.connection if context.connection is not None else None
        dbapi_connection = proxied.dbapi_connection if proxied is not None else None
        if dbapi_connection is None or not watchdog.was_cut(dbapi_connection):
            return None
        context.is_disconnect = True  # never reused
        return StoreDeadlineError(call_s)
