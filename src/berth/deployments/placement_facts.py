"""What placement needs to know of the nodes, read from the store, the links and the ready
table.

:func:`berth.placement.plan_placement` decides from plain values; this is the I/O that
gathers them, kept apart so the decision stays pure and a dry run (``berth plan``) gathers
the same facts as a real deployment.  For each node: its link's capabilities, the model's
recorded path there, its GPUs (asked of its link) with berth's own deployments on each and
their estimates (:class:`berth.placement.Resident`), and the GPUs adopted endpoints reserve.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from berth.cluster.leader.agent_link import LOCAL_NODE_ID, AgentLink
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.protocol.ops import OP_CAPABILITIES, RUNTIME_CAPABILITIES
from berth.deployments.estimates import NodeCopy, VramEstimator
from berth.deployments.ready_table import ReadyTable
from berth.errors import ConfigError, EngineError
from berth.placement import GpuFacts, NodeFacts, ReplicaAt, Resident
from berth.store import Store
from berth.vocab.engines import RuntimeName, parse_engine_name
from berth.vocab.gpu import GpuInfo
from berth.vocab.records import DeploymentRecord, ModelRecord
from berth.vocab.states import DeploymentState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResidentUsage:
    """How a deployment is used, for the eviction choice: epoch seconds of its last request
    (``None``: none since it started), requests in flight and queued, and whether its
    service is pinned."""

    last_request_at: float | None = None
    in_flight: int = 0
    queued: int = 0
    pinned: bool = False


#: Looks up a deployment's use by id (the scaling controller's signals); the default knows
#: nothing of it.
UsageLookup = Callable[[str], ResidentUsage]
#: States whose deployment has not allocated its GPU memory yet.
_STARTING = (DeploymentState.PENDING, DeploymentState.LOADING)


def no_usage(_deployment_id: str) -> ResidentUsage:
    """The usage of a deployment nothing reports on: idle, unpinned, never asked."""
    return ResidentUsage()


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
    gpus: Sequence[GpuInfo] | None = None,
    residents: Mapping[int, Sequence[Resident]] | None = None,
    cordoned: bool = False,
) -> NodeFacts:
    """The facts of node ``node_id`` (``label``), reached by ``link`` (``None``: it has no
    live link), for a deployment of ``model``; ``cordoned``: it is in maintenance.

    ``gpus`` are the node's GPUs when already asked (:func:`inventories`), else they are
    asked of its link (one round trip to a remote agent); ``residents`` are berth's
    deployments on each GPU index.  Raises ``EngineError`` when that inventory call fails.
    """
    leader_host = node_id == LOCAL_NODE_ID
    if link is None:
        return NodeFacts(
            node_id, label, connected=False, leader_host=leader_host, cordoned=cordoned
        )
    location: str | None = None
    if not leader_host:
        location = await asyncio.to_thread(store.model_path_on_node, model.name, node_id)
    if gpus is None:
        gpus = (await link.inventory()).gpus
    on_gpu = residents or {}
    return NodeFacts(
        node_id,
        label,
        connected=True,
        leader_host=leader_host,
        runtimes=offered_runtimes(link),
        can_pull=OP_CAPABILITIES["pull"] in link.capabilities,
        model_location=None if location is None else Path(location),
        gpus=tuple(gpu_facts(gpu, on_gpu.get(gpu.index, ())) for gpu in gpus),
        reserved_gpus=table.reserved_gpus(node_id),
        cordoned=cordoned,
        policy=link.agent_policy,
    )


def gpu_facts(gpu: GpuInfo, residents: Sequence[Resident]) -> GpuFacts:
    """A GPU as its node reports it, with berth's deployments on it."""
    return GpuFacts(
        index=gpu.index,
        name=gpu.name,
        total_mb=gpu.memory_total_mb,
        reported_free_mb=gpu.memory_free_mb,
        residents=tuple(residents),
        simulated=gpu.simulated,
    )


async def gather_residents(
    store: Store,
    estimator: VramEstimator,
    gpu_totals: Mapping[tuple[str, int], int],
    *,
    usage: UsageLookup = no_usage,
    active: Sequence[DeploymentRecord] | None = None,
    links: LinkRegistry | None = None,
) -> dict[str, dict[int, list[Resident]]]:
    """berth's active deployments on GPUs, by node id and GPU index, each with what its
    estimate holds on that GPU (``gpu_totals`` gives each ``(node, index)``'s total, in
    MiB: vLLM holds a fraction of it).  A deployment of a model with paths only on other
    nodes is estimated from its node's copy, read by that node's agent over ``links``.

    A deployment without GPUs recorded, or whose estimate is unknown, is left out: on a
    real GPU the node's report counts what it uses.
    """
    if active is None:
        active = await asyncio.to_thread(store.list_deployments, active_only=True)
    models = {m.name: m for m in await asyncio.to_thread(store.list_models)}
    paths: dict[tuple[str, str], str] = {}
    if links is not None and any(m.source == "remote" for m in models.values()):
        located = await asyncio.to_thread(store.list_model_locations)
        paths = {(x.model_name, x.node_id): x.path for x in located}
    found: dict[str, dict[int, list[Resident]]] = {}
    for record in active:
        if not record.gpus or not any((record.node_id, g) in gpu_totals for g in record.gpus):
            continue
        try:
            engine = parse_engine_name(record.engine)
        except ConfigError:
            continue
        link = links.get(record.node_id) if links is not None else None
        path = paths.get((record.model_name, record.node_id))
        copy = NodeCopy(link, record.node_id, path) if link and path else None
        result = await estimator.of_deployment(record, models.get(record.model_name), engine, copy)
        if result.estimate is None:
            log.debug("deployment %s holds no counted VRAM: %s", record.id, result.problem)
            continue
        used = usage(record.id)
        for index in record.gpus:
            total = gpu_totals.get((record.node_id, index))
            if total is None:
                continue
            resident = Resident(
                deployment_id=record.id,
                served_model_name=record.served_model_name,
                vram_mb=result.estimate.holds_mb(total),
                starting=record.state in _STARTING,
                # resident since it became ready (its last write), else since it was placed
                started_at=(
                    record.updated_at
                    if record.state is DeploymentState.READY
                    else record.created_at
                ).timestamp(),
                last_request_at=used.last_request_at,
                in_flight=used.in_flight,
                queued=used.queued,
                pinned=used.pinned,
            )
            found.setdefault(record.node_id, {}).setdefault(index, []).append(resident)
    return found


def replicas_of(
    served_model_name: str, active: Sequence[DeploymentRecord]
) -> tuple[ReplicaAt, ...]:
    """Where the active deployments serving ``served_model_name`` run."""
    return tuple(
        ReplicaAt(r.node_id, r.gpus) for r in active if r.served_model_name == served_model_name
    )


async def inventories(
    links: Sequence[AgentLink],
) -> dict[str, tuple[GpuInfo, ...] | EngineError]:
    """Each link's GPUs, asked of all at once; a link whose inventory call fails maps to the
    error."""

    async def one(link: AgentLink) -> tuple[GpuInfo, ...] | EngineError:
        try:
            return (await link.inventory()).gpus
        except EngineError as exc:
            return exc

    answers = await asyncio.gather(*(one(link) for link in links))
    return {link.node_id: answer for link, answer in zip(links, answers, strict=True)}
