"""Host inventory as it crosses the agent link: the runtime's ``GpuInfo`` <-> the wire's
``GpuState``, and the wire's ``Inventory`` -> the leader's ``NodeInventory`` (link API).

Agents import this module, so it stays free of the store (and SQLAlchemy)."""

from __future__ import annotations

from collections.abc import Sequence

from berth.cluster.leader.agent_link import NodeInventory
from berth.cluster.protocol.payloads import GpuState, Inventory
from berth.vocab.gpu import GpuInfo


def gpu_states(gpus: Sequence[GpuInfo]) -> list[GpuState]:
    """The agent's GPUs as Hello and heartbeats carry them."""
    return [
        GpuState(
            index=g.index,
            name=g.name,
            uuid=g.uuid,
            memory_total_mb=g.memory_total_mb,
            memory_used_mb=g.memory_used_mb,
            utilization_pct=g.utilization_pct,
        )
        for g in gpus
    ]


def gpu_infos(states: Sequence[GpuState]) -> tuple[GpuInfo, ...]:
    """GPUs received from an agent, as the rest of the leader handles them."""
    return tuple(
        GpuInfo(
            index=g.index,
            name=g.name,
            uuid=g.uuid,
            memory_total_mb=g.memory_total_mb,
            memory_used_mb=g.memory_used_mb,
            utilization_pct=g.utilization_pct,
        )
        for g in states
    )


def node_inventory(node_id: str, inventory: Inventory) -> NodeInventory:
    return NodeInventory(
        node_id=node_id,
        hostname=inventory.hostname,
        cpu_count=inventory.cpu_count,
        memory_total_mb=inventory.memory_total_mb,
        gpus=gpu_infos(inventory.gpus),
    )
