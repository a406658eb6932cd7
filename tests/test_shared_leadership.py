"""Shared leadership as a Leader owns it (``berth.daemon.ha``): two leaders' graphs on one
database, on SQLite and PostgreSQL, with the real lease loop on a short lease.  The first
leads at once, the second stands by (its loops not started, ``/v1`` refused with the
active's address) and leads once the first stops; a leader that loses the lease steps down
when given a ``stop_leading`` (and leads again once the lease is free), else asks to stop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from berth.admission import Admission, ManualClock, UsageLedger
from berth.auth.authenticator import Authenticator
from berth.config import TierTable
from berth.daemon.ha import SharedLeadership, build_shared_leadership
from berth.keys import load_or_create_pepper
from berth.store import Store
from berth.store.errors import StandbyError
from berth.vocab.records import UsageRecord
from support.waiting import wait_for_async

pytestmark = pytest.mark.store_engines

#: A short lease (the loop looks every third of it), long enough that a loaded machine does
#: not let it lapse while the test looks.
LEASE_S = 2.0
#: Longest wait for a takeover (a bound for a loaded machine, not a target).
TAKEOVER_BOUND_S = 20.0


class NoSink:
    def add_usage(self, batch: list[UsageRecord]) -> int:
        return len(batch)


def _graph(db_url: str, tmp_path: Path, name: str) -> Any:
    store = Store(db_url)
    return SimpleNamespace(
        store=store,
        authenticator=Authenticator(store, load_or_create_pepper(tmp_path / f"pepper-{name}")),
        admission=Admission(TierTable(), UsageLedger(NoSink()), clock=ManualClock()),
        cluster_url=f"https://{name}.lan:11501",
        hub=SimpleNamespace(agent_gate=None),
        enrollment=SimpleNamespace(leaders=None),
    )


def _shared(graph: Any, address: str) -> SharedLeadership:
    """``graph``'s leader's part in shared leadership, as the daemon builds it."""
    return build_shared_leadership(
        graph.store,
        graph.authenticator,
        graph.admission,
        graph.hub,
        graph.enrollment,
        address=address,
        cluster_url=graph.cluster_url,
        lease_s=LEASE_S,
    )


@pytest.fixture
def ha_graphs(db_url: str, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """Leaders A and B's graphs (what SharedLeadership reads of them) on one database."""
    a, b = _graph(db_url, tmp_path, "a"), _graph(db_url, tmp_path, "b")
    a.store.migrate()
    yield a, b
    a.store.close()
    b.store.close()


async def test_the_standby_leads_once_the_active_stops(ha_graphs: tuple[Any, Any]) -> None:
    graph_a, graph_b = ha_graphs
    led: list[str] = []
    lost: list[str] = []

    def leading(name: str) -> Any:
        async def start_leading() -> None:
            led.append(name)

        return start_leading

    a = _shared(graph_a, "https://a:11500")
    b = _shared(graph_b, "https://b:11500")
    await a.start(leading("a"), on_lost=lambda: lost.append("a"))
    await b.start(leading("b"), on_lost=lambda: lost.append("b"))
    try:
        assert led == ["a"] and a.leading and not b.leading
        assert not b.leadership.is_active
        refusal = b.leadership.refusal()
        assert isinstance(refusal, StandbyError) and "https://a:11500" in str(refusal)
        assert refusal.retry_after_s > 0
        # Agents: the active takes them and lists both leaders; the standby names the
        # active's cluster URL (docs/ha.md, Agents fail over).
        assert graph_a.hub.agent_gate.refusal() is None
        assert graph_b.hub.agent_gate.refusal() == "active=https://a.lan:11501"
        both = ["https://a.lan:11501", "https://b.lan:11501"]
        await a.roster.refresh()  # a read the members before b noted itself
        assert sorted(graph_a.hub.agent_gate.leaders()) == both
        assert sorted(graph_b.enrollment.leaders()) == both

        await a.stop()  # a clean stop hands the lease over
        await wait_for_async(lambda: b.leading, TAKEOVER_BOUND_S, "b to lead")
        assert led == ["a", "b"] and lost == []
        assert b.leadership.view().epoch == 2
        assert graph_b.hub.agent_gate.refusal() is None
    finally:
        await b.stop()
        await a.stop()
    assert lost == []


async def test_a_leader_that_loses_the_lease_asks_to_stop(ha_graphs: tuple[Any, Any]) -> None:
    graph_a, graph_b = ha_graphs
    lost: list[str] = []

    async def nothing() -> None:
        return None

    a = _shared(graph_a, "https://a:11500")
    await a.start(nothing, on_lost=lambda: lost.append("a"))
    try:
        assert a.leading
        # Another leader takes the lease as if a had stalled past it.
        epoch = a.leadership.state.epoch
        graph_b.store.release_lease(a.leadership.me, epoch)
        graph_b.store.acquire_lease("b", "https://b:11500", 60.0)
        await wait_for_async(lambda: lost == ["a"], TAKEOVER_BOUND_S, "a to hear it lost")
        assert not a.leadership.is_active
        assert a.leadership.view().active_address == "https://b:11500"
    finally:
        await a.stop()


async def test_a_leader_that_loses_the_lease_steps_down_and_leads_again_later(
    ha_graphs: tuple[Any, Any],
) -> None:
    """Given a ``stop_leading``, a leader whose lease was taken (as if it stalled past it)
    steps down once, stands by naming the new active, and leads again under a new epoch
    when the lease is free: twice over."""
    graph_a, graph_b = ha_graphs
    calls: list[str] = []
    lost: list[str] = []

    async def start_leading() -> None:
        calls.append("start")

    async def stop_leading() -> None:
        calls.append("stop")

    a = _shared(graph_a, "https://a:11500")
    await a.start(start_leading, stop_leading, on_lost=lambda: lost.append("a"))
    try:
        for round_ in (1, 2):
            assert a.leading and calls == ["start", "stop"] * (round_ - 1) + ["start"]
            epoch = a.leadership.state.epoch
            graph_b.store.release_lease(a.leadership.me, epoch)
            taken = graph_b.store.acquire_lease("b", "https://b:11500", 60.0)
            await wait_for_async(lambda: not a.leading and calls[-1] == "stop",
                                 TAKEOVER_BOUND_S, "a to step down")  # fmt: skip
            view = a.leadership.view()
            assert (view.role, view.active_address) == ("standby", "https://b:11500")
            assert graph_a.hub.agent_gate.refusal() == "active="  # b noted no cluster URL
            assert isinstance(a.leadership.refusal(), StandbyError)
            # b lets go; a takes the lease like any standby, one epoch up, and leads again.
            graph_b.store.release_lease("b", taken.epoch)
            await wait_for_async(lambda: a.leading, TAKEOVER_BOUND_S, "a to lead again")
            assert a.leadership.state.epoch == taken.epoch + 1
        assert calls == ["start", "stop", "start", "stop", "start"]
        assert lost == []  # it stood by; nobody was asked to stop
    finally:
        await a.stop()
    assert calls[-1] == "start"  # a clean stop is the Leader's, not a demotion
