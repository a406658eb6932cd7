"""Eviction carried out by the lifecycle manager: a deployment allowed to evict stops the
idle deployment placement chose, under the placement lock, before it is created; one that
may not evict (``berth run``) is refused naming the eviction that would make room; a pinned
deployment is never chosen.

The real store, lifecycle manager and planner over an in-memory link on a node with one
simulated 2 GiB GPU; the SmolLM2 GGUF header gives the estimate (1.52 GiB: one per GPU).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from berth.cluster.leader.agent_link import NodeInventory
from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.deployments.placement_facts import ResidentUsage
from berth.errors import ConflictError
from berth.placement import EvictionPolicy
from berth.runtime.bundled import smollm2_gguf
from berth.runtime.gpu import SimulatedInventory
from berth.store import Store
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import DeploymentState
from support.fakes import FakeLink

pytestmark = pytest.mark.needs("smollm2")


class GpuLink(FakeLink):
    """The fake link on a node whose agent reports simulated GPUs of ``totals_mb``."""

    def __init__(self, totals_mb: tuple[int, ...]) -> None:
        super().__init__()
        self.gpus = tuple(SimulatedInventory(totals_mb).read())

    async def inventory(self) -> NodeInventory:
        return NodeInventory(self.node_id, "fakehost", 2, 1024, self.gpus)


class Uses:
    """The usage lookup placement's eviction choice reads: idle and unpinned unless set."""

    def __init__(self) -> None:
        self.by_id: dict[str, ResidentUsage] = {}

    def __call__(self, deployment_id: str) -> ResidentUsage:
        return self.by_id.get(deployment_id, ResidentUsage())


@pytest.fixture
def uses() -> Uses:
    return Uses()


@pytest.fixture
def gpus_mb() -> tuple[int, ...]:
    """The node's simulated GPUs (a test overrides it with ``parametrize``)."""
    return (2048,)


@pytest.fixture
async def evicting_manager(
    store: Store, uses: Uses, gpus_mb: tuple[int, ...]
) -> AsyncIterator[LifecycleManager]:
    gguf = smollm2_gguf()
    assert gguf is not None
    store.add_model("smol", str(gguf))
    lifecycle = LifecycleManager(
        store,
        LinkRegistry([GpuLink(gpus_mb)]),
        health_timeout_s=5,
        stop_grace_s=1,
        usage=uses,
        min_residency_s=0.0,
    )
    await lifecycle.start()
    try:
        yield lifecycle
    finally:
        for record in store.list_deployments(active_only=True):
            await lifecycle.stop(record.id)
        await lifecycle.shutdown()


async def ready(evicting_manager: LifecycleManager, served: str) -> DeploymentRecord:
    record = await evicting_manager.deploy(
        DeployOptions("smol", "llamacpp", served_model_name=served)
    )
    settled = await evicting_manager.wait_settled(record.id, 10)
    assert settled.state is DeploymentState.READY, settled.failure_reason
    return settled


#: When the tests' evictions are chosen: an hour from now, past every minimum residency.
LATER = time.time() + 3600


def evicting() -> EvictionPolicy:
    """Eviction allowed, as the scaling controller's starts have it, at :data:`LATER`."""
    return EvictionPolicy(LATER, 60.0, allowed=True)


async def test_a_start_allowed_to_evict_stops_the_idle_one_first_and_takes_its_gpu(
    evicting_manager: LifecycleManager, store: Store
) -> None:
    first = await ready(evicting_manager, "a")
    assert first.gpus == (0,)
    options = DeployOptions("smol", "llamacpp", served_model_name="b")

    with pytest.raises(ConflictError) as refused:
        await evicting_manager.deploy(options)  # no eviction allowed: refused, nothing stopped
    assert f"stopping idle {first.id} would make room" in str(refused.value)
    assert store.get_deployment(first.id).state is DeploymentState.READY

    told: list[tuple[str, str, DeploymentState]] = []

    def on_evict(deployment_id: str, reason: str) -> None:
        told.append((deployment_id, reason, store.get_deployment(deployment_id).state))

    second = await evicting_manager.deploy(options, eviction=evicting(), on_evict=on_evict)
    # told before the stop, with placement's reason line
    ((evicted, reason, state_then),) = told
    assert evicted == first.id and state_then is DeploymentState.READY
    assert reason.startswith(f"stop {first.id} (a): no request since it started")
    assert store.get_deployment(first.id).state is DeploymentState.STOPPED
    settled = await evicting_manager.wait_settled(second.id, 10)
    assert settled.state is DeploymentState.READY and settled.gpus == (0,)
    assert [d.id for d in store.list_deployments(active_only=True)] == [second.id]


async def test_a_pinned_or_busy_deployment_is_never_evicted(
    evicting_manager: LifecycleManager, store: Store, uses: Uses
) -> None:
    first = await ready(evicting_manager, "a")
    options = DeployOptions("smol", "llamacpp", served_model_name="b")
    told: list[str] = []
    for use, why in ((ResidentUsage(pinned=True), "pinned"),
                     (ResidentUsage(in_flight=2), "2 request(s) in flight"),
                     (ResidentUsage(queued=1), "1 request(s) queued")):  # fmt: skip
        uses.by_id[first.id] = use
        with pytest.raises(ConflictError) as refused:
            await evicting_manager.deploy(
                options, eviction=evicting(), on_evict=lambda d, _r: told.append(d)
            )
        assert "no eviction makes room" in str(refused.value)
        assert f"{first.id}: {why}" in str(refused.value)
    assert told == []
    assert store.get_deployment(first.id).state is DeploymentState.READY
    assert [d.id for d in store.list_deployments(active_only=True)] == [first.id]


@pytest.mark.parametrize("gpus_mb", [(2048, 2048)])
@pytest.mark.parametrize("older", ["a", "b"])
async def test_with_both_gpus_full_the_least_recently_used_one_is_evicted(
    evicting_manager: LifecycleManager, store: Store, uses: Uses, older: str
) -> None:
    placed = {served: await ready(evicting_manager, served) for served in ("a", "b")}
    assert sorted(d.gpus for d in placed.values()) == [(0,), (1,)]
    for served, record in placed.items():
        ago_s = 1000.0 if served == older else 10.0
        uses.by_id[record.id] = ResidentUsage(last_request_at=LATER - ago_s)
    told: list[str] = []
    third = await evicting_manager.deploy(
        DeployOptions("smol", "llamacpp", served_model_name="c"),
        eviction=evicting(),
        on_evict=lambda d, _r: told.append(d),
    )
    assert told == [placed[older].id]
    assert store.get_deployment(placed[older].id).state is DeploymentState.STOPPED
    settled = await evicting_manager.wait_settled(third.id, 10)
    assert settled.state is DeploymentState.READY and settled.gpus == placed[older].gpus
