"""The leadership loop (``berth.store.leadership``) of two leaders on one database, on
SQLite and PostgreSQL: who is active, the fence it sets, a stalled active that comes back,
a clean stop that hands over at once.  The store's clock and the loop's monotonic clock are
the test's, moved by hand, and the loop's own task never fires (a long lease): each look at
the lease is an explicit ``tick``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from berth.store import Store
from berth.store.errors import FencedError
from berth.store.leadership import Leadership
from berth.store.lease import LeaseState
from support.clocks import HeldClock

pytestmark = pytest.mark.store_engines

LEASE_S = 600.0


class Monotonic:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def leadership_stores(db_url: str) -> Iterator[tuple[Store, Store, HeldClock]]:
    """Two leaders' stores on one migrated database with a model, sharing one wall clock."""
    clock = HeldClock()
    with Store(db_url, clock=clock) as a, Store(db_url, clock=clock) as b:
        a.migrate()
        a.ensure_local_node()
        a.add_model("tiny", "/models/tiny.gguf")
        yield a, b, clock


async def test_one_leads_the_other_waits_and_a_stalled_active_steps_down(
    leadership_stores: tuple[Store, Store, HeldClock],
) -> None:
    store_a, store_b, clock = leadership_stores
    mono_a, mono_b = Monotonic(), Monotonic()
    a = Leadership(store_a, me="a", address="https://a:11500", lease_s=LEASE_S, monotonic=mono_a)
    b = Leadership(store_b, me="b", address="https://b:11500", lease_s=LEASE_S, monotonic=mono_b)
    heard: list[LeaseState] = []
    a.subscribe(heard.append)
    await a.start()
    await b.start()
    try:
        assert a.is_active and not b.is_active
        assert (a.view().role, a.view().epoch, store_a.fence_epoch) == ("active", 1, 1)
        assert (b.view().role, b.view().active_address, store_b.fence_epoch) == (
            "standby", "https://a:11500", 0
        )  # fmt: skip
        with pytest.raises(FencedError):
            store_b.create_deployment("tiny", "llamacpp", "process", "local")
        store_a.create_deployment("tiny", "llamacpp", "process", "local")

        # a stalls past its lease (SIGSTOP): it knows by its own clock, b takes over.
        clock.advance(LEASE_S + 1)
        mono_a.now += LEASE_S + 1
        assert not a.is_active
        await b.tick()
        assert b.is_active and b.view().epoch == 2 and store_b.fence_epoch == 2
        with pytest.raises(FencedError):
            store_a.create_deployment("tiny", "llamacpp", "process", "local")
        await a.tick()  # a resumes (SIGCONT): its renewal is refused, it stands by
        assert [s.role for s in heard] == ["active", "standby"]
        assert (a.view().role, a.view().active_address) == ("standby", "https://b:11500")
        store_b.create_deployment("tiny", "llamacpp", "process", "local")
        await a.tick()
        assert not a.is_active
    finally:
        await b.stop()
        await a.stop()
    assert len(store_a.list_deployments()) == 2


async def test_a_clean_stop_hands_the_lease_over_at_once(
    leadership_stores: tuple[Store, Store, HeldClock],
) -> None:
    store_a, store_b, _clock = leadership_stores
    a = Leadership(store_a, me="a", address="https://a:11500", lease_s=LEASE_S)
    b = Leadership(store_b, me="b", address="https://b:11500", lease_s=LEASE_S)
    await a.start()
    await b.start()
    try:
        assert a.is_active
        await a.stop()
        assert not a.is_active
        await b.tick()
        assert b.is_active and b.view().epoch == 2
    finally:
        await b.stop()
        await a.stop()
    # b released too: the next leader takes epoch 3 without waiting.
    assert store_a.acquire_lease("c", "https://c:11500", LEASE_S).epoch == 3
