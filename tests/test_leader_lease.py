"""Leadership through the store (``berth.store.lease``): the pure rule of who is active,
and the lease row and fence on both engines with two stores on one database, as two
leaders have."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from berth.store import Store
from berth.store.errors import FencedError
from berth.store.lease import LeaseDecision, LeaseRecord, decide
from berth.vocab.states import DeploymentState
from support.clocks import HeldClock

# The database tests run on SQLite (one file, two stores) and on PostgreSQL (conftest.py).
pytestmark = pytest.mark.store_engines

LEASE_S = 5.0


def _lease(holder: str, epoch: int, expires_at: float) -> LeaseRecord:
    return LeaseRecord(holder, f"{holder}.example:11500", epoch, 0.0, 0.0, expires_at)


@pytest.mark.parametrize(
    ("now", "lease", "expected"),
    [
        pytest.param(10.0, None, LeaseDecision("take", 1, "me"), id="never-taken"),
        pytest.param(10.0, _lease("me", 3, 12.0), LeaseDecision("renew", 3, "me"), id="own-live"),
        pytest.param(
            12.0, _lease("me", 3, 12.0), LeaseDecision("take", 4, "me"), id="own-expired-new-epoch"
        ),
        pytest.param(
            11.9, _lease("other", 3, 12.0), LeaseDecision("wait", 3, "other"), id="other-live"
        ),
        pytest.param(
            12.0, _lease("other", 3, 12.0), LeaseDecision("take", 4, "me"), id="other-expired"
        ),
        pytest.param(
            99.0, _lease("other", 41, 12.0), LeaseDecision("take", 42, "me"), id="long-gone"
        ),
    ],
)
def test_who_is_active(now: float, lease: LeaseRecord | None, expected: LeaseDecision) -> None:
    assert decide(now, lease, "me") == expected


# -- on a database -------------------------------------------------------------------------------


@pytest.fixture
def lease_pair(db_url: str) -> Iterator[tuple[Store, Store, HeldClock]]:
    """Leaders ``a`` and ``b``'s stores on one migrated database, one clock, a model."""
    clock = HeldClock()
    with Store(db_url, clock=clock) as a, Store(db_url, clock=clock) as b:
        a.migrate()
        a.ensure_local_node()
        a.add_model("tiny", "/models/tiny.gguf")
        yield a, b, clock


def test_the_first_takes_the_second_waits_and_takes_over_when_it_expires(
    lease_pair: tuple[Store, Store, HeldClock],
) -> None:
    a, b, clock = lease_pair
    assert a.read_lease() is None
    first = a.acquire_lease("a", "a:11500", LEASE_S)
    assert (first.role, first.epoch, first.active, first.active_address) == (
        "active", 1, "a", "a:11500"
    )  # fmt: skip
    waiting = b.acquire_lease("b", "b:11500", LEASE_S)
    assert (waiting.role, waiting.epoch, waiting.active_address) == ("standby", 1, "a:11500")

    clock.advance(LEASE_S / 2)
    assert a.renew_lease("a", 1, LEASE_S).role == "active"
    clock.advance(LEASE_S - 0.1)
    assert b.acquire_lease("b", "b:11500", LEASE_S).role == "standby"  # renewed: still a's

    clock.advance(0.2)
    taken = b.acquire_lease("b", "b:11500", LEASE_S)
    assert (taken.role, taken.epoch, taken.active) == ("active", 2, "b")
    lost = a.renew_lease("a", 1, LEASE_S)
    assert (lost.role, lost.epoch, lost.active_address) == ("standby", 2, "b:11500")
    assert a.lease_state("a").role == "standby"
    assert b.lease_state("b").role == "active"


def test_a_released_lease_is_taken_at_once_with_a_new_epoch(
    lease_pair: tuple[Store, Store, HeldClock],
) -> None:
    a, b, _clock = lease_pair
    a.acquire_lease("a", "a:11500", LEASE_S)
    assert not b.release_lease("b", 1)  # not b's to end
    assert a.release_lease("a", 1)
    taken = b.acquire_lease("b", "b:11500", LEASE_S)
    assert (taken.role, taken.epoch) == ("active", 2)
    assert not a.release_lease("a", 1)


def test_the_stale_leaders_writes_are_fenced_and_the_new_ones_go_through(
    lease_pair: tuple[Store, Store, HeldClock],
) -> None:
    a, b, clock = lease_pair
    a.fence(a.acquire_lease("a", "a:11500", LEASE_S).epoch)
    deployment = a.create_deployment("tiny", "llamacpp", "process", "local")
    a.transition_deployment(deployment.id, DeploymentState.LOADING)

    clock.advance(LEASE_S + 1)  # a stalls (SIGSTOP) past its lease; b takes over
    b.fence(b.acquire_lease("b", "b:11500", LEASE_S).epoch)
    with pytest.raises(FencedError) as caught:
        a.transition_deployment(deployment.id, DeploymentState.READY, port=8080, pid=42)
    assert (caught.value.epoch, caught.value.current) == (1, 2)
    assert caught.value.active_address == "b:11500"
    for write in (
        lambda: a.create_deployment("tiny", "llamacpp", "process", "local"),
        lambda: a.update_deployment_runtime(deployment.id, port=1, pid=1),
        lambda: a.create_service_profile("chat", "tiny", "llamacpp", "process"),
    ):
        with pytest.raises(FencedError):
            write()
    assert a.get_deployment(deployment.id).state is DeploymentState.LOADING
    assert len(a.list_deployments()) == 1

    moved = b.transition_deployment(deployment.id, DeploymentState.READY, port=8080, pid=42)
    assert moved.state is DeploymentState.READY
    b.create_service_profile("chat", "tiny", "llamacpp", "process")
    # Usage and keys are not cluster state: a stale leader's served requests still count.
    a.add_api_key("ops", "standard", "hash-1", "bk-1")


def test_an_expired_lease_fences_its_holder_before_anyone_takes_it(
    lease_pair: tuple[Store, Store, HeldClock],
) -> None:
    a, _b, clock = lease_pair
    a.fence(a.acquire_lease("a", "a:11500", LEASE_S).epoch)
    clock.advance(LEASE_S)
    with pytest.raises(FencedError, match="not held by anyone"):
        a.create_deployment("tiny", "llamacpp", "process", "local")
    assert a.renew_lease("a", 1, LEASE_S).role == "standby"
    again = a.acquire_lease("a", "a:11500", LEASE_S)
    assert (again.role, again.epoch) == ("active", 2)
    a.fence(again.epoch)
    a.create_deployment("tiny", "llamacpp", "process", "local")


def test_an_unfenced_store_writes_as_before(lease_pair: tuple[Store, Store, HeldClock]) -> None:
    a, b, _clock = lease_pair
    b.acquire_lease("b", "b:11500", LEASE_S)
    assert a.fence_epoch is None
    a.create_deployment("tiny", "llamacpp", "process", "local")
