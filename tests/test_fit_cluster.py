"""Placement by fit in an in-process leader: a real agent core with simulated GPUs behind a
real link (``RemoteLink`` and ``AgentService`` over an in-memory WebSocket pair), real engine
processes (the fake llama-server), the SmolLM2 GGUF header for the estimate.

The leader's own host has no GPUs, so every deployment goes to the agent: two fill its two
simulated GPUs, a third is refused with the estimate and the most free VRAM seen, and once
one stops its GPU takes the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from berth.agent.core import AgentCore
from berth.agent.service import AgentService
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.remote_link import RemoteLink
from berth.cluster.link.connection import LinkConnection
from berth.cluster.protocol.handshake import WelcomeTerms
from berth.cluster.protocol.session import Role
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.errors import ConflictError
from berth.placement import Placement, Refusal
from berth.runtime.bundled import smollm2_gguf
from berth.runtime.engines import EngineBinaries
from berth.runtime.gpu import SimulatedInventory
from berth.runtime.process import ProcessRuntime
from berth.store import Store
from berth.vocab.gpu import parse_simulated_gpus
from berth.vocab.states import DeploymentState
from support.cluster_harness import fake_engine_wrapper
from support.fakes import FakeLink, memory_socket_pair
from support.link_pair import LeaderSide

pytestmark = pytest.mark.needs("smollm2")


@dataclass
class Leader:
    manager: LifecycleManager
    store: Store
    agent_id: str


@pytest.fixture
async def fit_leader(store: Store, tmp_path: Path) -> AsyncIterator[Leader]:
    gguf = smollm2_gguf()
    assert gguf is not None
    agent_id = store.enroll_node("gpu-a", "ab" * 32).id
    store.add_model("smol", str(gguf))
    store.set_model_location("smol", agent_id, str(gguf))
    core = AgentCore(
        ProcessRuntime(),
        EngineBinaries(str(fake_engine_wrapper(tmp_path)), None, ""),
        SimulatedInventory(parse_simulated_gpus("2GiB,2GiB")),
        logs_dir=tmp_path,
    )
    service = AgentService(core, read_timeout_s=10.0)
    agent_ws, leader_ws = memory_socket_pair()
    agent = LinkConnection(Role.AGENT, agent_ws, service, peer="leader")
    conn = LinkConnection(Role.LEADER, leader_ws, LeaderSide(), peer=agent_id)
    _welcome, hello = await asyncio.gather(
        agent.handshake(service.hello(), timeout_s=5.0),
        conn.handshake(WelcomeTerms(node_id=agent_id, leader_version="test"), timeout_s=5.0),
    )
    tasks = [asyncio.create_task(agent.run()), asyncio.create_task(conn.run())]
    remote = RemoteLink(agent_id, conn, service.inventory(), hello.capabilities)
    manager = LifecycleManager(
        store, LinkRegistry([FakeLink(), remote]), health_timeout_s=30, stop_grace_s=2
    )
    await manager.start()
    try:
        yield Leader(manager, store, agent_id)
    finally:
        for record in store.list_deployments(active_only=True):
            await manager.stop(record.id)
        await manager.shutdown()
        await conn.close(1000, "test over")
        await asyncio.gather(*tasks)
        await service.close()


async def test_two_deployments_fill_the_simulated_gpus_and_a_third_is_refused(
    fit_leader: Leader,
) -> None:
    manager = fit_leader.manager
    placed = []
    for served in ("smol-1", "smol-2"):
        record = await manager.deploy(DeployOptions("smol", "llamacpp", served_model_name=served))
        settled = await manager.wait_settled(record.id, 30)
        assert settled.state is DeploymentState.READY, settled.failure_reason
        placed.append((settled.node_id, settled.gpus))
    # SmolLM2 needs 94 + 180 + 1280 = 1554 MiB: one per 2048 MiB GPU, each on its own GPU
    assert placed == [(fit_leader.agent_id, (0,)), (fit_leader.agent_id, (1,))]

    planned = await manager.plan(DeployOptions("smol", "llamacpp", served_model_name="smol-3"))
    assert isinstance(planned.result, Refusal)
    assert [(o.index, o.free_mb, o.verdict) for o in planned.result.considered] == [
        (0, 2048 - 1554, "no_room"),
        (1, 2048 - 1554, "no_room"),
    ]
    with pytest.raises(ConflictError) as refused:
        await manager.deploy(DeployOptions("smol", "llamacpp", served_model_name="smol-3"))
    assert str(refused.value).startswith(
        "no GPU can take model smol: it needs 1.52 GiB (weights 94 MiB + KV cache 180 MiB + "
        "overhead 1.25 GiB at ctx 8192, f16); the most free VRAM seen is 494 MiB (node gpu-a "
        "GPU 0)"
    )
    # nothing was created for the refusal
    assert len(fit_leader.store.list_deployments(active_only=True)) == 2
    # at ctx 512 the KV cache is 12 MiB: 94 + 12 + 1280 = 1386 MiB, still more than 494 free
    small = await manager.plan(DeployOptions("smol", "llamacpp", ctx=512))
    assert isinstance(small.result, Refusal) and small.result.reason == "vram_no_room"
    # a stopped deployment gives its GPU back
    await manager.stop(fit_leader.store.list_deployments(active_only=True)[-1].id)
    again = await manager.plan(DeployOptions("smol", "llamacpp", served_model_name="smol-3"))
    assert isinstance(again.result, Placement)
    assert again.result.node_id == fit_leader.agent_id and len(again.result.gpus) == 1
