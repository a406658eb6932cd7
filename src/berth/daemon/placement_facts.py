"""What placement needs to know of a node, read from the store, its link and the ready table.

:func:`berth.placement.plan_placement` decides from plain values; this is the I/O that
gathers them, kept apart so the decision stays pure and a dry run can gather the same facts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from berth.cluster.link import LOCAL_NODE_ID, AgentLink
from berth.cluster.protocol.ops import OP_CAPABILITIES, RUNTIME_CAPABILITIES
from berth.daemon.ready_table import ReadyTable
from berth.placement import NodeFacts
from berth.runtime.base import RuntimeName
from berth.store import ModelRecord, Store


def offered_runtimes(link: AgentLink) -> frozenset[RuntimeName]:
    """The runtimes ``link``'s agent offers: ``process`` always (agents from before runtime
    capabilities run only that), ``docker`` when it advertises ``runtime.docker``."""
    runtimes: set[RuntimeName] = {"process"}
    if RUNTIME_CAPABILITIES["docker"] in link.capabilities:
        runtimes.add("docker")
    return frozenset(runtimes)


async def gather_node_facts(
    store: Store,
    table: ReadyTable,
    link: AgentLink | None,
    *,
    node_id: str,
    label: str,
    model: ModelRecord,
    gpus_asked: bool,
) -> NodeFacts:
    """The facts of node ``node_id`` (``label``), reached by ``link`` (``None``: it has no
    live link), for a deployment of ``model``.

    The node's GPUs are asked of its link only when ``gpus_asked`` (one round trip to a
    remote agent).  Raises ``EngineError`` when that inventory call fails.
    """
    leader_host = node_id == LOCAL_NODE_ID
    if link is None:
        return NodeFacts(node_id, label, connected=False, leader_host=leader_host)
    location: str | None = None
    if not leader_host:
        location = await asyncio.to_thread(store.model_path_on_node, model.name, node_id)
    inventory = await link.inventory() if gpus_asked else None
    return NodeFacts(
        node_id,
        label,
        connected=True,
        leader_host=leader_host,
        runtimes=offered_runtimes(link),
        can_pull=OP_CAPABILITIES["pull"] in link.capabilities,
        model_location=None if location is None else Path(location),
        gpus=() if inventory is None else inventory.gpus,
        reserved_gpus=table.reserved_gpus(node_id),
    )
