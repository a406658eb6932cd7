"""Whether a node's agent policy would refuse a deployment, asked before placing it there.

Each agent reports its policy in Hello (:class:`berth.vocab.agent_policy.AgentPolicy`); the
leader's own node has its ``[agent_policy]`` settings.  Placement leaves out a node whose
policy would refuse and says why (``node gpu-a refuses it by its policy (images): image ...
is not allowed (images: ...)``), so ``berth plan`` shows it and a deployment is not sent
where it cannot start.  The agent checks again at the start itself, with paths resolved on
its host (symlinks included); here they are compared as written (``..`` folded), since the
leader cannot see another host's files, except on the leader's own node (``local``,
``leader_host``): that host is this one, so paths are resolved as the agent core there
would (``os.path.realpath``), and a symlink that leaves the roots is refused before the
deployment is created.

Pure, like the rest of :mod:`berth.placement`, but for reading symlinks of the leader's own
host.
"""

from __future__ import annotations

import os

from berth.placement.fit import GpuFacts
from berth.placement.request import NodeFacts, PlacementRequest
from berth.placement.result import ModelAt, ModelPull, Refusal
from berth.vocab.agent_policy import (
    AgentPolicy,
    PolicyRefusal,
    Resolve,
    check_args,
    check_engine,
    check_gpus,
    check_image,
    check_path,
)


def handed_out(node: NodeFacts) -> tuple[GpuFacts, ...]:
    """``node``'s GPUs that its policy lets berth hand out."""
    allowed = None if node.policy is None else node.policy.gpus
    return node.gpus if allowed is None else tuple(g for g in node.gpus if g.index in allowed)


def node_policy_refusal(
    request: PlacementRequest,
    node: NodeFacts,
    *,
    model: ModelAt | ModelPull | None = None,
    image: str | None = None,
    gpus: tuple[int, ...] = (),
) -> Refusal | None:
    """Refusal ``node_policy`` when ``node``'s policy refuses ``request`` with what is
    known so far (the model's path there, the image, the GPUs), else ``None`` (also for a
    node that reported no policy)."""
    policy = node.policy
    if policy is None:
        return None
    resolve = os.path.realpath if node.leader_host else os.path.normpath
    found = _first_refusal(request, policy, model, image, gpus, resolve)
    if found is None:
        return None
    message = f"node {node.label} refuses it by its policy ({found.rule}): {found.message}"
    return Refusal("node_policy", message, node.node_id, rule=found.rule)


def _first_refusal(
    request: PlacementRequest,
    policy: AgentPolicy,
    model: ModelAt | ModelPull | None,
    image: str | None,
    gpus: tuple[int, ...],
    resolve: Resolve,
) -> PolicyRefusal | None:
    asked_image = image or (request.image if request.runtime == "docker" else None)
    return (
        check_engine(request.engine, policy)
        or (check_image(asked_image, policy) if asked_image else None)
        or (
            check_path("model path", str(model.path), policy, resolve)
            if isinstance(model, ModelAt)
            else None
        )
        or check_args(request.engine, request.extra_args, policy, resolve)
        or check_gpus(gpus or request.gpus, policy)
    )
