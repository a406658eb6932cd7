"""Key changes reach every leader at once (``berth.auth.key_sync``,
``berth.store.changes``): a key revoked or limited through one leader's store is refused, or
limited, by another leader's authenticator and admission on the same database.  On
PostgreSQL the news comes by ``LISTEN/NOTIFY``: the counter poll and the authenticator's
cache both last an hour there, so only the notification can bring it; on SQLite by the
counter, polled often."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from berth.admission import Admission, ManualClock, UsageLedger
from berth.auth.authenticator import Authenticator
from berth.auth.key_sync import KeySync
from berth.config import TierTable
from berth.errors import AuthError
from berth.keys import hash_secret, load_or_create_pepper
from berth.store import Store
from berth.store.changes import KEYS_TOPIC
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import UsageRecord
from support.waiting import wait_for_async

pytestmark = pytest.mark.store_engines

#: Longest wait for a change to arrive (a bound for a loaded machine, not the target: the
#: measured delay is printed; PostgreSQL's is milliseconds).
ARRIVAL_BOUND_S = 10.0
SECRET = "bk-" + "s" * 40


class NoSink:
    """A usage ledger sink that keeps nothing."""

    def add_usage(self, batch: list[UsageRecord]) -> int:
        return len(batch)


@dataclass
class OtherLeader:
    """Leader B's key caches on its own store, following the keys' change feed."""

    store: Store
    authenticator: Authenticator
    admission: Admission
    sync: KeySync


@pytest.fixture
def key_stores(db_url: str) -> Iterator[tuple[Store, Store]]:
    """Leaders A and B's stores on one migrated database."""
    with Store(db_url) as a, Store(db_url) as b:
        a.migrate()
        yield a, b


@pytest.fixture
async def other_leader(
    key_stores: tuple[Store, Store], tmp_path: Path
) -> AsyncIterator[OtherLeader]:
    _a, b = key_stores
    postgres = b.engine.dialect.name == "postgresql"
    poll_s = 3600.0 if postgres else 0.05
    authenticator = Authenticator(b, load_or_create_pepper(tmp_path / "pepper"), cache_ttl_s=3600)
    admission = Admission(TierTable(), UsageLedger(NoSink()), clock=ManualClock())
    sync = KeySync(b, authenticator, admission, poll_s=poll_s)
    await sync.start()
    try:
        yield OtherLeader(b, authenticator, admission, sync)
    finally:
        await sync.stop()


async def _until_heard(sync: KeySync, changes: int) -> None:
    def heard() -> bool:
        return sync.changes >= changes and not sync.reloading

    await wait_for_async(heard, ARRIVAL_BOUND_S, f"{changes} key change(s) to arrive")


async def _until_refused(authenticator: Authenticator) -> float:
    began = time.monotonic()
    while time.monotonic() - began < ARRIVAL_BOUND_S:
        try:
            await authenticator.authenticate(SECRET)
        except AuthError:
            return time.monotonic() - began
        await asyncio.sleep(0.01)
    raise AssertionError(f"the revoked key was still served after {ARRIVAL_BOUND_S} s")


async def test_a_key_revoked_through_a_is_refused_by_b(
    key_stores: tuple[Store, Store], other_leader: OtherLeader, tmp_path: Path
) -> None:
    a, _b = key_stores
    pepper = load_or_create_pepper(tmp_path / "pepper")
    key = a.add_api_key("app", "standard", hash_secret(SECRET, pepper), "bk-sss")
    await _until_heard(other_leader.sync, 1)  # the creation's news: B's cache is emptied
    assert (await other_leader.authenticator.authenticate(SECRET)).id == key.id
    reads = other_leader.authenticator.counts.key_reads
    assert (await other_leader.authenticator.authenticate(SECRET)).id == key.id
    assert other_leader.authenticator.counts.key_reads == reads  # served from B's cache

    await asyncio.to_thread(a.revoke_api_key, key.id)
    delay_s = await _until_refused(other_leader.authenticator)
    print(f"revocation reached leader B in {delay_s * 1000:.1f} ms")
    assert other_leader.sync.changes >= 1


async def test_a_limit_changed_through_a_is_applied_by_b(
    key_stores: tuple[Store, Store], other_leader: OtherLeader
) -> None:
    a, b = key_stores
    key = a.add_api_key("app", "standard", "hash-1", "bk-1")
    other_leader.admission.load(b.list_api_keys(), {})
    await _until_heard(other_leader.sync, 1)
    a.update_api_key(key.id, limits=LimitOverrides(rpm=7))
    await _until_heard(other_leader.sync, 2)
    assert other_leader.admission.use_of(key.id).requests_remaining == 7  # a full minute of 7


def test_each_key_change_counts_once(key_stores: tuple[Store, Store]) -> None:
    a, b = key_stores
    assert b.change_counter(KEYS_TOPIC) == 0
    key = a.add_api_key("app", "standard", "hash-1", "bk-1")
    a.update_api_key(key.id, limits=LimitOverrides(rpm=7))
    a.revoke_api_key(key.id)
    a.revoke_api_key(key.id)  # already revoked: no change
    assert b.change_counter(KEYS_TOPIC) == 3
