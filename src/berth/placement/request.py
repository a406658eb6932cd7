"""What a placement is asked and told: the request (:class:`PlacementRequest`, with its
:class:`EvictionPolicy`), the facts of each node that could take it (:class:`NodeFacts`,
:class:`GpuReservation`) and the leader's image settings (:class:`PlacementPolicy`).

Plain frozen values, gathered by the lifecycle manager (``deployments/placement_facts.py``) and
read by :func:`berth.placement.plan.plan_placement`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from berth.placement.estimate import VramEstimate
from berth.placement.fit import GpuFacts, ReplicaAt
from berth.vocab.agent_policy import AgentPolicy
from berth.vocab.engines import EngineName, RuntimeName
from berth.vocab.images import DEFAULT_GPU_IMAGES, DEFAULT_IMAGES
from berth.vocab.records import ModelRecord


@dataclass(frozen=True)
class EvictionPolicy:
    """Whether placement may evict idle deployments to make room (``allowed``), at time
    ``now`` (epoch seconds) with the minimum residency ``min_residency_s``.  When not
    allowed, a refusal still names the eviction that would have made room."""

    now: float
    min_residency_s: float
    allowed: bool = False


@dataclass(frozen=True)
class PlacementRequest:
    """A deployment asked for: ``model`` with ``engine`` and ``runtime``.

    ``node_id``: the node asked for (``None``: placement chooses; with ``gpus`` but no node,
    the leader's own host, as GPU indexes name one host's GPUs).  ``gpus`` are device
    indexes (empty: placement chooses on a node that has GPUs); ``image`` the container
    image asked for (docker only; ``None``: the engine's image setting).  ``estimate`` is
    the deployment's VRAM (``None``: unknown, ``estimate_problem`` says why); ``force``
    places GPUs asked for, or the GPU with the most free memory, even where the estimate
    does not fit.  ``replicas`` are the active deployments of the same served model name;
    ``eviction`` (``None``: never looked at) whether idle deployments may be evicted.
    """

    model: ModelRecord
    engine: EngineName
    runtime: RuntimeName
    node_id: str | None = None
    gpus: tuple[int, ...] = ()
    image: str | None = None
    estimate: VramEstimate | None = None
    estimate_problem: str | None = None
    force: bool = False
    replicas: tuple[ReplicaAt, ...] = ()
    eviction: EvictionPolicy | None = None
    #: the engine's extra arguments, checked against each node's agent policy
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuReservation:
    """GPU ``index`` declared by the adopted endpoint ``holder``: nothing else goes there."""

    index: int
    holder: str


@dataclass(frozen=True)
class NodeFacts:
    """What the leader knows of one node, for one request.

    ``connected``: it has a live link (the other facts are empty when not).
    ``leader_host``: it is the leader's own host (node ``local``), where a model's registered
    path is a path on the node.  ``runtimes``: those its agent offers.  ``can_pull``: its
    agent downloads models from the hub.  ``model_location``: the request's model's path
    recorded for this node (``None``: none).  ``gpus``: its GPUs as its agent reports them,
    with berth's deployments on each.  ``reserved_gpus``: GPUs its adopted endpoints declare.
    ``cordoned``: its operator took it out of placement (``berth nodes cordon`` or
    ``drain``): nothing new goes there.  ``policy``: what its agent lets berth start there
    (``None``: it reported none, an older agent).
    """

    node_id: str
    label: str
    connected: bool
    leader_host: bool = False
    runtimes: frozenset[RuntimeName] = frozenset({"process"})
    can_pull: bool = False
    model_location: Path | None = None
    gpus: tuple[GpuFacts, ...] = ()
    reserved_gpus: tuple[GpuReservation, ...] = ()
    cordoned: bool = False
    policy: AgentPolicy | None = None


@dataclass(frozen=True)
class PlacementPolicy:
    """The leader's settings placement follows: the container image per engine
    (``*_image`` settings) and the one used instead when a deployment gets GPUs.
    ``check_agent_policies``: leave out nodes whose agent policy would refuse (off only in
    tests that show the agent refusing by itself)."""

    check_agent_policies: bool = True
    images: Mapping[EngineName, str] = field(default_factory=lambda: dict(DEFAULT_IMAGES))
    gpu_images: Mapping[EngineName, str] = field(default_factory=lambda: dict(DEFAULT_GPU_IMAGES))
