"""A slow database: a real PostgreSQL 200 ms away each way (a TCP relay that delays every
chunk), under the authenticator's key cache (issue 37).  Keys are read again in the
background while requests go on; no request with a key found valid waits for such a read,
however long it takes (here longer than the cache's whole lifetime).  This asserts what
happened, not how fast: ``scripts/bench_slow_store.py`` measures the latency a leader adds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from berth.auth.authenticator import Authenticator
from berth.keys import generate_secret, hash_secret, key_prefix
from berth.store import Store
from berth.store.deadlines import StoreDeadlines
from support.postgres import PostgresServer
from support.tcp_relay import TcpRelay

pytestmark = pytest.mark.slow

PEPPER = b"p" * 32
#: Each way, as in the issue.
DELAY_S = 0.2
#: A short cache life, so that several re-reads happen in a few seconds; one read (a ping at
#: checkout, the query, the rollback: three round trips) takes longer than it.
TTL_S = 1.0
RUN_S = 5.0


@pytest.fixture
def slow_store(postgres_server: PostgresServer) -> Iterator[tuple[Store, str]]:
    """The store 200 ms away, and the secret of a key in it (made directly, with the
    migrations: dozens of statements that would take 0.4 s each through the relay)."""
    url = postgres_server.create_database()
    secret = generate_secret()
    with Store(url) as direct:
        direct.migrate()
        direct.add_api_key("app", "standard", hash_secret(secret, PEPPER), key_prefix(secret))
    relay = TcpRelay("127.0.0.1", postgres_server.port, delay_s=DELAY_S).start()
    try:
        with Store(
            url.replace(f":{postgres_server.port}/", f":{relay.port}/"),
            deadlines=StoreDeadlines(call_s=10.0, checkout_s=10.0, connect_s=10),
        ) as store:
            yield store, secret
    finally:
        relay.close()
        postgres_server.drop_database(url)


async def test_no_request_waits_for_a_key_read_on_a_slow_database(
    slow_store: tuple[Store, str],
) -> None:
    store, secret = slow_store
    authenticator = Authenticator(store, PEPPER, cache_ttl_s=TTL_S)
    began = time.monotonic()
    await authenticator.authenticate(secret)  # the first use reads, and waits
    first_s = time.monotonic() - began
    requests = 0
    slowest_s = 0.0
    ends = time.monotonic() + RUN_S
    while time.monotonic() < ends:
        asked = time.monotonic()
        await authenticator.authenticate(secret)
        slowest_s = max(slowest_s, time.monotonic() - asked)
        requests += 1
        await asyncio.sleep(0.01)
    while authenticator.reads_in_flight:
        await asyncio.sleep(0.01)
    counts = authenticator.counts
    print(f"first read {first_s:.2f} s; {requests} requests over {RUN_S:g} s, "
          f"{counts.key_reads - 1} re-reads in the background, slowest request "
          f"{slowest_s * 1000:.1f} ms; waits {counts.waits}")  # fmt: skip
    assert first_s > 2 * DELAY_S  # the relay did slow the store
    assert counts.key_reads >= 3, "no key was read again: the test tested nothing"
    assert counts.waits == {"new": 1}, "a request waited for a key read"
