"""Every database call has a deadline (``berth.store.deadlines``), on a real PostgreSQL behind
a TCP relay the test turns into a black hole: packets swallowed, nothing reset or closed, as
in a silent network partition.

- a connection that hangs mid-query is cut at its call's deadline, the call fails with
  ``StoreDeadlineError`` and the connection is discarded (the next call opens another);
- a store call made while the network is silent fails within its deadlines, never hangs;
- a client that vanished inside a write transaction does not keep the write lock: the
  server ends its session, and another leader's store takes the lease;
- the limits themselves: derived from the lease, set on the server for each connection.

The times are printed; the only time asserted is a bound that tells a cut from a hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from berth.errors import StoreError
from berth.store import Store
from berth.store.db import WRITE_OPTIONS
from berth.store.deadlines import StoreDeadlines
from berth.store.errors import StoreDeadlineError
from support.postgres import PostgresServer
from support.tcp_relay import TcpRelay

#: The call limit under test (a lease of 2 s).
DEADLINES = StoreDeadlines.within_lease(2.0)
#: Longer than every limit put together: a call still waiting then hangs.
HANG_S = DEADLINES.call_s + DEADLINES.checkout_s + DEADLINES.connect_s + 10.0


@pytest.fixture
def relayed(postgres_server: PostgresServer) -> Iterator[tuple[str, TcpRelay]]:
    """A fresh database's URL and the relay in front of the server (the URL goes through
    it); the database is migrated directly."""
    url = postgres_server.create_database()
    with Store(url) as direct:
        direct.migrate()
    relay = TcpRelay("127.0.0.1", postgres_server.port).start()
    try:
        yield url.replace(f":{postgres_server.port}/", f":{relay.port}/"), relay
    finally:
        relay.close()
        postgres_server.drop_database(url)


def test_the_limits_follow_the_lease_and_reach_the_server(postgres_server: PostgresServer) -> None:
    assert StoreDeadlines.within_lease(5.0) == StoreDeadlines(4.0, 4.0, 4)
    assert StoreDeadlines.within_lease(2.0).connect_s == 2  # libpq's least
    assert DEADLINES.libpq_parameters()["tcp_user_timeout"] == 1600
    with pytest.raises(ValueError, match="connect_s"):
        StoreDeadlines(1.0, 1.0, 1)
    url = postgres_server.create_database()
    try:
        with Store(url, deadlines=DEADLINES) as store, store.engine.connect() as conn:
            shown = {
                name: conn.execute(text(f"SHOW {name}")).scalar()
                for name in ("statement_timeout", "idle_in_transaction_session_timeout")
            }
            assert shown == {
                "statement_timeout": "1600ms",
                "idle_in_transaction_session_timeout": "1600ms",
            }
    finally:
        postgres_server.drop_database(url)


def test_a_connection_that_hangs_mid_query_is_cut_and_discarded(
    relayed: tuple[str, TcpRelay],
) -> None:
    url, relay = relayed
    with Store(url, deadlines=DEADLINES) as store:
        assert store.lease_state("a").role == "standby"  # a pooled connection, answering
        connections_before = relay.accepted
        began = time.monotonic()
        with store.engine.connect() as conn:
            # The query is on its way when the network goes silent.
            threading.Timer(0.3, relay.black_hole).start()
            with pytest.raises(StoreDeadlineError, match=r"1.6 s deadline") as raised:
                conn.execute(text("SELECT pg_sleep(0.6)"))
            took_s = time.monotonic() - began
            assert conn.invalidated, "the cut connection would be reused"
        print(f"a query hung mid-way was cut {took_s:.2f} s after it began "
              f"(deadline {DEADLINES.call_s:g} s)")  # fmt: skip
        assert took_s < HANG_S
        assert store.watchdog.cuts == 1
        assert isinstance(raised.value, StoreError)

        relay.heal()  # connections made from now on are forwarded again
        assert store.lease_state("a").role == "standby"
        assert relay.accepted > connections_before, "no new connection: the cut one was reused"


def test_a_store_call_on_a_silent_network_fails_within_its_deadlines(
    relayed: tuple[str, TcpRelay],
) -> None:
    url, relay = relayed
    with Store(url, deadlines=DEADLINES) as store:
        store.acquire_lease("a", "https://a:11500", 2.0)
        relay.black_hole()
        began = time.monotonic()
        with pytest.raises(StoreError):
            store.renew_lease("a", 1, 2.0)  # the ping at checkout is cut, then the connect
        took_s = time.monotonic() - began
        print(f"a renewal on a silent network failed after {took_s:.2f} s")
        assert took_s < HANG_S


def test_a_client_gone_inside_a_write_does_not_keep_the_write_lock(
    relayed: tuple[str, TcpRelay], postgres_server: PostgresServer
) -> None:
    url, relay = relayed
    direct_url = url.replace(f":{relay.port}/", f":{postgres_server.port}/")
    with Store(url, deadlines=DEADLINES) as cut_off, Store(direct_url) as other:
        cut_off.acquire_lease("a", "https://a:11500", 0.5)
        conn = cut_off.engine.connect().execution_options(**WRITE_OPTIONS)
        transaction = conn.begin()  # takes the write lock (pg_advisory_xact_lock)
        conn.execute(text("SELECT 1"))
        relay.black_hole()  # ... and the client is cut off holding it
        began = time.monotonic()
        taken = other.acquire_lease("b", "https://b:11500", 5.0)  # a write: needs the lock
        took_s = time.monotonic() - began
        print(f"the other store took the lease {took_s:.2f} s after the client went silent")
        assert (taken.role, taken.epoch) == ("active", 2)
        assert took_s < HANG_S
        with pytest.raises((StoreError, DBAPIError)):
            transaction.commit()
        assert conn.invalidated
        conn.close()
