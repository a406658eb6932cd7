"""Planning a deployment: the facts gathered, the estimate made, placement asked.

:class:`Planner` is the I/O around :func:`berth.placement.plan_placement`: it resolves the
model, engine and node, asks every candidate node's link for its GPUs (all at once), counts
berth's deployments already on them with their estimates, estimates the new one, and asks
placement.  The lifecycle manager calls it for every deployment (under its placement lock)
and for ``berth plan``'s dry run, so both give the same answer with the same reasons.

The estimate is made from the model's files on the leader's host; a model with paths only on
other nodes is read by the agent of the node asked for, else of the first candidate node
with a copy whose agent can read it (:class:`~berth.deployments.estimates.NodeCopy`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from berth.cluster.leader.agent_link import LOCAL_NODE_ID, AgentLink
from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.estimates import EstimateResult, NodeCopy, VramEstimator
from berth.deployments.placement_facts import (
    UsageLookup,
    gather_node_facts,
    gather_residents,
    inventories,
    no_usage,
    replicas_of,
)
from berth.deployments.ready_table import ReadyTable
from berth.errors import ConfigError, EngineError, NotFoundError
from berth.placement import (
    EvictionPolicy,
    NodeFacts,
    Placement,
    PlacementPolicy,
    PlacementRequest,
    Refusal,
    Resident,
    plan_placement,
)
from berth.store import Store
from berth.vocab.engines import EngineName, RuntimeName, parse_engine_name, parse_runtime_name
from berth.vocab.gpu import GpuInfo
from berth.vocab.policies import DEFAULT_RESTART_POLICY, RestartPolicy
from berth.vocab.records import ModelRecord

log = logging.getLogger(__name__)

#: Seconds a deployment stays resident before it may be evicted, until the scaling
#: controller's setting replaces it (issue 14: "a minimum residency (a setting, default 60 s)").
DEFAULT_MIN_RESIDENCY_S = 60.0


@dataclass(frozen=True)
class DeployOptions:
    """A request to deploy ``model_name`` on ``node_id`` (an id or label; ``None``: where
    placement finds room, see :mod:`berth.placement.plan`).

    ``force`` places GPUs asked for (or, with none asked for, the GPU with the most free
    memory) even where the VRAM estimate does not fit.
    """

    model_name: str
    engine: str
    node_id: str | None = None
    runtime: str = "process"
    gpus: tuple[int, ...] = ()
    ctx: int | None = None
    extra_args: tuple[str, ...] = ()
    served_model_name: str | None = None
    #: the container image (docker runtime only); ``None``: the engine's image setting
    image: str | None = None
    force: bool = False
    #: vLLM/SGLang: LoRA adapter slots (``None``: 1 when the base has adapters, else off)
    max_adapters: int | None = None
    #: whether its engine is started again when it ends (:mod:`berth.deployments.restarts`)
    restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY


@dataclass(frozen=True)
class PlannedDeployment:
    """What :meth:`Planner.plan` decided: the model and engine it resolved, the
    VRAM estimate (or why there is none), the request placement was asked and its answer."""

    model: ModelRecord
    engine: EngineName
    runtime: RuntimeName
    estimate: EstimateResult
    request: PlacementRequest
    result: Placement | Refusal


class Planner:
    """Plans deployments over the leader's store, links and ready table.

    ``estimator`` keeps model shapes and the estimates deployments were placed with;
    ``usage`` says how each deployment is used (for the eviction choice);
    ``min_residency_s`` is the eviction choice's minimum residency.
    """

    def __init__(
        self,
        store: Store,
        links: LinkRegistry,
        table: ReadyTable,
        policy: PlacementPolicy,
        *,
        estimator: VramEstimator,
        usage: UsageLookup = no_usage,
        min_residency_s: float = DEFAULT_MIN_RESIDENCY_S,
    ) -> None:
        self._store = store
        self._links = links
        self._table = table
        self._policy = policy
        self._estimator = estimator
        self._usage = usage
        self._min_residency_s = min_residency_s

    async def plan(
        self, options: DeployOptions, *, eviction: EvictionPolicy | None = None
    ) -> PlannedDeployment:
        """Where a deployment of ``options`` would go, and why: a dry run (nothing changes).

        ``eviction`` says whether idle deployments may be evicted to make room (default: not
        allowed, with the planner's minimum residency, so a refusal names the eviction that
        would make room).  Raises ``NotFoundError`` for an unknown model or node,
        ``ConfigError`` for an unknown engine or runtime, a context that is not a positive
        number of tokens and engine flags the estimate cannot read, and ``EngineError`` when
        a named node's inventory call fails.
        """
        engine = parse_engine_name(options.engine)
        runtime = parse_runtime_name(options.runtime)
        if options.ctx is not None and options.ctx <= 0:
            raise ConfigError(f"--ctx must be a positive number of tokens, not {options.ctx}")
        node_id = await self._resolve_node(options.node_id)
        model = await asyncio.to_thread(self._store.get_model, options.model_name)
        labels = {n.id: n.label for n in await asyncio.to_thread(self._store.list_nodes)}
        cordoned = {d.node_id for d in await asyncio.to_thread(self._store.node_drains)}
        if node_id is not None:
            targets = [node_id]
        elif options.gpus:
            targets = [LOCAL_NODE_ID]  # GPU indexes without a node name the leader's own
        else:
            targets = sorted(
                self._links.node_ids(), key=lambda n: (n != LOCAL_NODE_ID, labels.get(n, n))
            )
        links = {n: self._links.get(n) for n in targets}
        asked = await inventories([link for link in links.values() if link is not None])
        gpus: dict[str, tuple[GpuInfo, ...]] = {}
        for target, answer in asked.items():
            if isinstance(answer, EngineError):
                if node_id is not None:
                    raise answer
                log.warning("placement leaves node %s out: %s", target, answer)
                links[target] = None
                continue
            gpus[target] = answer
        if node_id is None:  # a node that cannot be asked is no candidate
            links = {n: link for n, link in links.items() if link is not None}
        active = await asyncio.to_thread(self._store.list_deployments, active_only=True)
        estimate = EstimateResult(None, "no connected node reports GPUs")
        residents: dict[str, dict[int, list[Resident]]] = {}
        if any(gpus.values()):
            estimate = await self._estimator.estimate(
                model,
                engine,
                ctx=options.ctx,
                extra_args=options.extra_args,
                gpu_count=max(1, len(options.gpus)),
                copies=await self._copies(model, links, labels),
            )
            totals = {(n, g.index): g.memory_total_mb for n, found in gpus.items() for g in found}
            residents = await gather_residents(
                self._store,
                self._estimator,
                totals,
                usage=self._usage,
                active=active,
                links=self._links,
            )
        facts: list[NodeFacts] = []
        for target, link in links.items():
            facts.append(
                await gather_node_facts(
                    self._store,
                    self._table,
                    link,
                    node_id=target,
                    label=labels.get(target, target),
                    model=model,
                    gpus=gpus.get(target, ()),
                    residents=residents.get(target, {}),
                    cordoned=target in cordoned,
                )
            )
        served = options.served_model_name or model.name
        request = PlacementRequest(
            model,
            engine,
            runtime,
            node_id,
            gpus=options.gpus,
            image=options.image,
            estimate=estimate.estimate,
            estimate_problem=estimate.problem,
            force=options.force,
            replicas=replicas_of(served, active),
            eviction=eviction or EvictionPolicy(time.time(), self._min_residency_s),
            extra_args=options.extra_args,
        )
        result = plan_placement(request, facts, self._policy)
        return PlannedDeployment(model, engine, runtime, estimate, request, result)

    async def _copies(
        self,
        model: ModelRecord,
        links: dict[str, AgentLink | None],
        labels: dict[str, str],
    ) -> list[NodeCopy]:
        """Where the agents can read ``model``'s header, when the leader cannot (a model with
        paths only on other nodes): its copy on each candidate node with a live link, in
        the candidates' order (the node asked for, else the leader's order)."""
        if model.source != "remote":
            return []
        found = await asyncio.to_thread(self._store.list_model_locations, model.name)
        paths = {location.node_id: location.path for location in found}
        return [
            NodeCopy(link, labels.get(node_id, node_id), paths[node_id])
            for node_id, link in links.items()
            if link is not None and node_id in paths
        ]

    async def _resolve_node(self, node: str | None) -> str | None:
        """The node id of ``node`` (an id or label; ``None`` stays ``None``); a removed node
        is ``NotFoundError``."""
        if node is None or node == LOCAL_NODE_ID:
            return node
        record = await asyncio.to_thread(self._store.lookup_node, node)
        if record.status == "removed":
            raise NotFoundError("node", node)
        return record.id
