"""The leadership loop (``berth.store.leadership``) of two leaders on one database, on
SQLite and PostgreSQL: who is active, the fence it sets, a stalled active that comes back,
a clean stop that hands over at once.  The store's clock and the loop's monotonic clock are
the test's, moved by hand, and the loop's own task never fires (a long lease): each look at
the lease is an explicit ``tick``."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator

import pytest

from berth.store import Store
from berth.store.errors import FencedError
from berth.store.leadership import Leadership
from berth.store.lease import LeaseState
from support.clocks import HeldClock
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

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


class HungRenewals(Store):
    """A store whose lease renewals wait for :attr:`release` first: a renewal stuck on a
    database that stopped answering (the real cut comes from the store's deadlines)."""

    def __init__(self, url: str, clock: HeldClock) -> None:
        super().__init__(url, clock=clock)
        self.release = threading.Event()
        self.hung = threading.Event()

    def renew_lease(self, me: str, epoch: int, lease_s: float) -> LeaseState:
        self.hung.set()
        self.release.wait(EVENT_TIMEOUT_S)
        return super().renew_lease(me, epoch, lease_s)


#: A lease short enough to run out during the test, by the real monotonic clock.
SHORT_LEASE_S = 0.6


async def test_the_lease_runs_out_by_the_leaders_own_clock_while_a_renewal_hangs(
    db_url: str,
) -> None:
    """The renewal never returns, yet the leader stands by at the end of its lease (its
    listeners hear it, its store stays fenced with the old epoch); the renewal's answer,
    when it comes after the lease ran out, does not make it active again."""
    clock = HeldClock()  # the database's clock stands still: the renewal would succeed there
    with HungRenewals(db_url, clock) as store:
        store.migrate()
        a = Leadership(store, me="a", address="https://a:11500", lease_s=SHORT_LEASE_S)
        heard: list[str] = []
        a.subscribe(lambda state: heard.append(state.role))
        await a.tick()  # takes the lease (no loop: each look is explicit)
        assert a.is_active and heard == ["active"]
        renewal = asyncio.create_task(a.tick())
        try:
            await asyncio.to_thread(store.hung.wait, EVENT_TIMEOUT_S)
            hung_at = time.monotonic()  # the renewal began before this
            await wait_for_async(lambda: heard == ["active", "standby"], EVENT_TIMEOUT_S,
                                 "the leader to stand by")  # fmt: skip
            assert not renewal.done(), "the renewal returned: nothing was left hanging"
            assert a.view().role == "standby" and a.view().active_address is None
            assert store.fence_epoch == 1  # fenced: its own writes wait for a new epoch
            # The answer comes a whole lease after the renewal began.
            await wait_for_async(lambda: time.monotonic() - hung_at > SHORT_LEASE_S,
                                 EVENT_TIMEOUT_S, "a lease to pass")  # fmt: skip
        finally:
            store.release.set()
            await renewal
        assert heard == ["active", "standby"] and not a.is_active
        await a.stop(release=False)


class SlowRenewals(Store):
    """A store whose renewals each take :attr:`delay_s` (a database far away), recording
    when each began (monotonic seconds)."""

    def __init__(self, url: str, delay_s: float) -> None:
        super().__init__(url)
        self.delay_s = delay_s
        self.began: list[float] = []
        self.ended = 0

    def renew_lease(self, me: str, epoch: int, lease_s: float) -> LeaseState:
        self.began.append(time.monotonic())
        time.sleep(self.delay_s)
        try:
            return super().renew_lease(me, epoch, lease_s)
        finally:
            self.ended += 1


@pytest.mark.slow
async def test_renewals_that_take_long_still_keep_the_lease(db_url: str) -> None:
    """Renewals begin a third of a lease apart however long each takes: timed from the end
    of the last one, renewals taking 0.4 of the lease came every 0.73 of it, each ending
    1.13 leases after the one before began, and the lease ran out between them."""
    lease_s = 3.0
    with SlowRenewals(db_url, delay_s=0.4 * lease_s) as store:
        store.migrate()
        a = Leadership(store, me="a", address="https://a:11500", lease_s=lease_s)
        roles: list[str] = []
        a.subscribe(lambda state: roles.append(state.role))
        await a.start()
        try:
            await wait_for_async(lambda: len(store.began) >= 4, EVENT_TIMEOUT_S, "4 renewals")
        finally:
            await a.stop(release=False)
            # A renewal cut off by the stop goes on in its thread: let it end first.
            await wait_for_async(lambda: store.ended == len(store.began), EVENT_TIMEOUT_S,
                                 "the last renewal's thread")  # fmt: skip
        gaps = [later - earlier for earlier, later in itertools.pairwise(store.began)]
        print("renewals began apart by", [round(gap, 2) for gap in gaps], "s")
        assert roles == ["active", "standby"]  # the standby is the stop's, not a lapse
        assert max(gaps) < 0.4 * lease_s + lease_s / 3


async def test_the_lease_is_renewed_while_every_shared_worker_thread_is_busy(db_url: str) -> None:
    """A slow database fills the default executor's few threads with the leader's other
    calls; the lease's calls run on a thread of their own and do not queue behind them."""
    with Store(db_url) as store:
        store.migrate()
        a = Leadership(store, me="a", address="https://a:11500", lease_s=LEASE_S)
        await a.tick()
        busy = threading.Event()
        workers = [asyncio.create_task(asyncio.to_thread(busy.wait, EVENT_TIMEOUT_S))
                   for _ in range(64)]  # fmt: skip
        try:
            await asyncio.wait_for(a.tick(), EVENT_TIMEOUT_S / 2)  # a renewal, not queued
            assert a.is_active
        finally:
            busy.set()
            await asyncio.gather(*workers)
            await a.stop()
