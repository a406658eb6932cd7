"""Where a deployment goes and what it runs with, decided from plain values.

:func:`plan_placement` is pure: no I/O, no clock, no shared state.  It takes the request
(:class:`PlacementRequest`: the model, engine, runtime, the node and GPUs asked for if any,
the VRAM estimate, the service's other replicas), the facts of the nodes that could run it
(:class:`NodeFacts`, which the lifecycle manager gathers from the store, each node's link
and its adopted endpoints) and the leader's image settings (:class:`PlacementPolicy`), all
in :mod:`berth.placement.request`, and returns either a :class:`Placement` (the node, the
runtime and image, the GPUs, where the model comes from, the deployments to evict first if
any, and a reason per decision) or a :class:`Refusal` (a typed reason and the message the
user sees), both in :mod:`berth.placement.result`.  The lifecycle manager only
carries the result out, so a dry run (``berth plan``) prints the same reasons a real
deployment acts on.

The checks, in this order (the first that fails is the refusal):

1. the image asked for: it must be an image reference, and only for the docker runtime;
2. the node: the one asked for, else every connected node that reports GPUs (none: the
   leader's own host, as before placement by fit, with no VRAM check); it must have a live
   link, must not be cordoned (``berth nodes cordon`` or ``drain``), and its agent must
   offer the runtime;
3. the model: on the leader's own host its registered path, unless that path is on other
   nodes only; elsewhere the path recorded for that node, else a download from the hub when
   the model came from there and the node's agent can pull; then the node's agent policy
   (:mod:`berth.placement.node_policy`: engine, image asked for, model path, extra
   arguments, GPUs asked for), and only the GPUs it hands out are chosen from;
4. the GPUs asked for: none may be reserved by an adopted endpoint, and each must exist;
5. VRAM (:mod:`berth.placement.fit`): GPUs asked for must fit the estimate (unless
   ``force``); otherwise the deployment goes to the GPUs that fit, replicas of one service
   spread over nodes first; when none fits, the least recently used idle deployments may be
   evicted (:mod:`berth.placement.eviction`) if the request allows it, and a refusal names
   the estimate, the most free VRAM seen and the eviction that would make room;
6. the image setting: the engine's GPU image when the deployment gets GPUs (llama.cpp's
   default image has no CUDA), else the engine's image; it must be an image reference, and
   the node's agent policy must allow it and the GPUs chosen.

A node without GPUs (a CPU host, or the leader's host with no simulated ones) gets no VRAM
check: the engine runs on its CPU, and the reasons say so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from berth.errors import ConfigError
from berth.placement.estimate import VramEstimate, mib
from berth.placement.eviction import Eviction, EvictionRefusal, choose_eviction, last_used_at
from berth.placement.fit import (
    GpuFacts,
    GpuOption,
    ReplicaAt,
    choose_gpus,
    gpu_options,
    most_free,
    replicas_on,
)
from berth.placement.node_policy import handed_out, node_policy_refusal
from berth.placement.request import NodeFacts, PlacementPolicy, PlacementRequest
from berth.placement.result import ModelAt, ModelPull, Placement, Refusal
from berth.vocab.engines import RuntimeName
from berth.vocab.images import check_image_reference
from berth.vocab.records import ModelRecord


@dataclass(frozen=True)
class _OnNode:
    """A node that passed the node and model checks, with the reasons so far."""

    node: NodeFacts
    model: ModelAt | ModelPull
    reasons: tuple[str, ...]


def plan_placement(
    request: PlacementRequest,
    nodes: Sequence[NodeFacts],
    policy: PlacementPolicy | None = None,
) -> Placement | Refusal:
    """Place ``request`` among ``nodes`` (see the module docstring for the checks and their
    order); a node asked for but missing from ``nodes`` counts as not connected.  ``nodes``
    are in the leader's order, which breaks ties."""
    policy = policy or PlacementPolicy()
    refused = _check_asked_image(request)
    if refused is not None:
        return refused
    node_id = request.node_id
    if node_id is None and request.gpus:
        node_id = next((n.node_id for n in nodes if n.leader_host), "local")
    if node_id is not None:
        node = next((n for n in nodes if n.node_id == node_id), None)
        on = _check_node(request, node, node_id, policy)
        if isinstance(on, Refusal):
            return on
        return _place_on_named(request, on, policy)
    return _place_anywhere(request, nodes, policy)


def _check_asked_image(request: PlacementRequest) -> Refusal | None:
    if request.runtime != "docker":
        if request.image:
            message = "an image applies to the docker runtime only (--runtime docker)"
            return Refusal("image_without_docker", message)
        return None
    if request.image is not None:
        try:
            check_image_reference(request.image)
        except ConfigError as exc:
            return Refusal("image_invalid", str(exc))
    return None


def _check_node(
    request: PlacementRequest, node: NodeFacts | None, node_id: str, policy: PlacementPolicy
) -> _OnNode | Refusal:
    if node is None or not node.connected:
        label = node_id if node is None else node.label
        message = f"node {label} ({node_id}) is not connected"
        return Refusal("node_not_connected", message, node_id)
    if node.cordoned:
        message = (
            f"node {node.label} is cordoned: nothing new is placed there "
            f"(berth nodes uncordon {node.label})"
        )
        return Refusal("node_cordoned", message, node.node_id)
    if request.runtime not in node.runtimes:
        return Refusal("runtime_unavailable", _no_runtime(node, request.runtime), node.node_id)
    reasons = [f"node {node.label} is connected and offers the {request.runtime} runtime"]
    model = _model_source(request.model, node, reasons)
    if isinstance(model, Refusal):
        return model
    if policy.check_agent_policies:
        refused = node_policy_refusal(request, node, model=model)
        if refused is not None:
            return refused
    return _OnNode(node, model, tuple(reasons))


def _place_on_named(
    request: PlacementRequest, on: _OnNode, policy: PlacementPolicy
) -> Placement | Refusal:
    node = on.node
    reasons = list(on.reasons)
    if request.gpus:
        refused = _check_gpus(request.gpus, node, reasons)
        if refused is not None:
            return refused
        return _fit_asked_gpus(request, on, reasons, policy)
    if not node.gpus:
        reasons.append(
            f"node {node.label} reports no GPUs: no VRAM check (the engine runs on its CPU)"
        )
        return _finish(request, on, (), reasons, policy)
    if request.estimate is None:
        reasons.append(
            f"no VRAM check: {request.estimate_problem or 'no estimate'}; the engine is given "
            "no GPU list (it sees every GPU)"
        )
        return _finish(request, on, (), reasons, policy)
    options = gpu_options(request.estimate, node.node_id, node.label, _gpus_of(node, policy),
                          [r.index for r in node.reserved_gpus])  # fmt: skip
    return _choose(request, [on], options, reasons, policy)


def _fit_asked_gpus(
    request: PlacementRequest, on: _OnNode, reasons: list[str], policy: PlacementPolicy
) -> Placement | Refusal:
    node = on.node
    estimate = request.estimate
    if estimate is None:
        reasons.append(f"no VRAM check: {request.estimate_problem or 'no estimate'}")
        return _finish(request, on, request.gpus, reasons, policy)
    asked = [g for g in node.gpus if g.index in request.gpus]
    options = gpu_options(estimate, node.node_id, node.label, asked)
    misfits = [o for o in options if o.verdict != "fits"]
    if not misfits:
        reasons += [o.line() for o in options]
        return _finish(request, on, request.gpus, reasons, policy, estimate, options=options)
    if request.force:
        reasons += [f"forced (--force): {o.line()}" for o in misfits]
        return _finish(request, on, request.gpus, reasons, policy, estimate, options=options)
    gpus = ", ".join(str(g) for g in request.gpus)
    detail = "; ".join(f"GPU {o.index}: {o.detail}" for o in misfits)
    message = (
        f"model {request.model.name} does not fit GPU {gpus} on node {node.label}: {detail} "
        f"(estimate {estimate.summary()}); choose other GPUs, leave --gpu out to place it by "
        "fit, or --force"
    )
    if all(o.verdict == "too_small" for o in misfits):
        return Refusal("vram_too_large", message, node.node_id, estimate, tuple(options))
    found = _eviction_for(request, node, request.gpus, estimate)
    eviction = found if isinstance(found, Eviction) else None
    if eviction is not None and request.eviction is not None and request.eviction.allowed:
        reasons += [o.line() for o in options] + list(eviction.reasons)
        return _finish(request, on, request.gpus, reasons, policy, estimate, eviction, options)
    message += _eviction_hint(found)
    return Refusal("vram_no_room", message, node.node_id, estimate, tuple(options), eviction)


def _place_anywhere(
    request: PlacementRequest, nodes: Sequence[NodeFacts], policy: PlacementPolicy
) -> Placement | Refusal:
    with_gpus = [n for n in nodes if n.connected and n.gpus]
    if not with_gpus:
        leader = next((n for n in nodes if n.leader_host), None)
        if leader is None:
            message = (
                "no connected node reports GPUs, and this leader runs no engines (leader_only is "
                "set): name a node "
                "with --node LABEL (`berth nodes ls` lists them)"
            )
            return Refusal("no_node", message)
        on = _check_node(request, leader, leader.node_id, policy)
        if isinstance(on, Refusal):
            return on
        first = ["no connected node reports GPUs: the leader's own host, no VRAM check "
                 "(the engine runs on its CPU)", *on.reasons]  # fmt: skip
        return _finish(request, on, (), first, policy)
    if request.estimate is None:
        message = (
            f"cannot place model {request.model.name} by free VRAM: "
            f"{request.estimate_problem or 'no estimate'}; name a node with --node LABEL to "
            "run it there without a VRAM check"
        )
        return Refusal("estimate_unknown", message)
    ons: list[_OnNode] = []
    refusals: list[Refusal] = []
    options: list[GpuOption] = []
    for node in with_gpus:
        on = _check_node(request, node, node.node_id, policy)
        if isinstance(on, Refusal):
            refusals.append(on)
            continue
        ons.append(on)
        options += gpu_options(request.estimate, node.node_id, node.label,
                               _gpus_of(node, policy),
                               [r.index for r in node.reserved_gpus])  # fmt: skip
    if not ons:
        lines = "; ".join(r.message for r in refusals)
        message = f"no node with GPUs can run model {request.model.name}: {lines}"
        if any(n.leader_host and n.connected and not n.gpus for n in nodes):
            message += " (or run it on the leader's CPU with --node local)"
        return Refusal("no_node", message)
    reasons: list[str] = []
    if refusals:
        reasons.append("left out: " + "; ".join(r.message for r in refusals))
    return _choose(request, ons, options, reasons, policy)


def _choose(
    request: PlacementRequest,
    ons: Sequence[_OnNode],
    options: Sequence[GpuOption],
    reasons: list[str],
    policy: PlacementPolicy,
) -> Placement | Refusal:
    """Pick GPUs among ``options`` (of the nodes in ``ons``) for the request's estimate."""
    estimate = request.estimate
    assert estimate is not None
    count = estimate.gpu_count
    order = [on.node.node_id for on in ons]
    chosen = choose_gpus(options, count, request.replicas, order)
    considered = tuple(options)
    if chosen is not None:
        on = next(o for o in ons if o.node.node_id == chosen[0].node_id)
        spread = _spread_line(request.replicas, ons)
        picked = [*reasons, *on.reasons, *([spread] if spread else []),
                  *(o.line() for o in chosen)]  # fmt: skip
        gpus = tuple(o.index for o in chosen)
        return _finish(request, on, gpus, picked, policy, estimate, options=considered)
    best = most_free(options)
    if request.force and best is not None and count == 1:
        on = next(o for o in ons if o.node.node_id == best.node_id)
        picked = [*reasons, *on.reasons, f"forced (--force), the most free VRAM: {best.line()}"]
        return _finish(request, on, (best.index,), picked, policy, estimate, options=considered)
    seen = (
        f"; the most free VRAM seen is {mib(best.free_mb)} (node {best.label} GPU {best.index})"
        if best
        else ""
    )
    message = f"no GPU can take model {request.model.name}: it needs {estimate.summary()}{seen}"
    node_id = ons[0].node.node_id if len(ons) == 1 else None
    if not any(o.verdict == "no_room" for o in options):
        return Refusal("vram_too_large", message + "; ask for a smaller --ctx, a smaller "
                       "quantisation, or more GPUs", node_id, estimate, considered)  # fmt: skip
    eviction_at: tuple[GpuOption, Eviction] | None = None
    blocked: EvictionRefusal | None = None
    by_id = {o.node.node_id: o.node for o in ons}
    for option in options if count == 1 else ():
        if option.verdict != "no_room":
            continue
        on = next(o for o in ons if o.node.node_id == option.node_id)
        found = _eviction_for(request, on.node, (option.index,), estimate)
        if isinstance(found, EvictionRefusal):
            blocked = blocked or found
        elif found is not None and (
            eviction_at is None
            or _eviction_cost(on.node, found)
            < _eviction_cost(by_id[eviction_at[0].node_id], eviction_at[1])
        ):
            eviction_at = (option, found)
    if eviction_at is not None and request.eviction is not None and request.eviction.allowed:
        option, eviction = eviction_at
        on = next(o for o in ons if o.node.node_id == option.node_id)
        picked = [*reasons, *on.reasons, option.line(), *eviction.reasons]
        return _finish(request, on, (option.index,), picked, policy, estimate, eviction, considered)
    if eviction_at is None:
        message += _eviction_hint(blocked)
        return Refusal("vram_no_room", message, node_id, estimate, considered)
    option, eviction = eviction_at
    message += f"; on node {option.label} GPU {option.index}{_eviction_hint(eviction)}"
    return Refusal("vram_no_room", message, node_id, estimate, considered, eviction)


def _eviction_for(
    request: PlacementRequest, node: NodeFacts, indexes: tuple[int, ...], estimate: VramEstimate
) -> Eviction | EvictionRefusal | None:
    """The eviction that would make room for ``estimate`` on ``node``'s GPUs ``indexes``, or
    why none would; ``None`` when the request looks at no evictions or no berth deployment
    is there."""
    policy = request.eviction
    gpus = [g for g in node.gpus if g.index in indexes]
    if policy is None or not any(g.residents for g in gpus):
        return None
    need = {g.index: estimate.holds_mb(g.total_mb) for g in gpus}
    found = choose_eviction(gpus, need, now=policy.now, min_residency_s=policy.min_residency_s)
    if isinstance(found, Eviction) and not found.deployment_ids:
        return None
    return found


def _eviction_cost(node: NodeFacts, eviction: Eviction) -> tuple[int, float]:
    """How much an eviction costs, lower first: the fewest deployments stopped, then the
    least recently used (the latest use among those it stops, earliest first)."""
    chosen = set(eviction.deployment_ids)
    used = [last_used_at(r) for g in node.gpus for r in g.residents if r.deployment_id in chosen]
    return len(chosen), max(used, default=0.0)


def _eviction_hint(found: Eviction | EvictionRefusal | None) -> str:
    if isinstance(found, Eviction):
        return f"; stopping idle {', '.join(found.deployment_ids)} would make room"
    if isinstance(found, EvictionRefusal):
        return f"; no eviction makes room: {found.message}"
    return ""


def _spread_line(replicas: Sequence[ReplicaAt], ons: Sequence[_OnNode]) -> str | None:
    if not replicas:
        return None
    counts = ", ".join(f"{on.node.label} {replicas_on(replicas, on.node.node_id)}" for on in ons)
    return f"replicas of this service per node: {counts}; the fewest first"


def _finish(
    request: PlacementRequest,
    on: _OnNode,
    gpus: tuple[int, ...],
    reasons: list[str],
    policy: PlacementPolicy,
    estimate: VramEstimate | None = None,
    eviction: Eviction | None = None,
    options: Sequence[GpuOption] = (),
) -> Placement | Refusal:
    image = _choose_image(request, gpus, policy, reasons)
    if isinstance(image, Refusal):
        return image
    if policy.check_agent_policies:
        refused = node_policy_refusal(request, on.node, image=image, gpus=gpus)
        if refused is not None:
            return refused
    return Placement(
        node_id=on.node.node_id,
        label=on.node.label,
        runtime=request.runtime,
        image=image,
        gpus=gpus,
        model=on.model,
        reasons=tuple(reasons),
        estimate=estimate,
        eviction=eviction,
        considered=tuple(options),
    )


def _choose_image(
    request: PlacementRequest, gpus: tuple[int, ...], policy: PlacementPolicy, reasons: list[str]
) -> str | Refusal | None:
    if request.runtime != "docker":
        return None
    if request.image is not None:
        chosen, why = request.image, "as asked"
    elif gpus and request.engine in policy.gpu_images:
        chosen, why = policy.gpu_images[request.engine], f"the {request.engine} image for GPUs"
    else:
        chosen, why = policy.images[request.engine], f"the {request.engine} image setting"
    try:
        image = check_image_reference(chosen)
    except ConfigError as exc:
        return Refusal("image_invalid", str(exc))
    reasons.insert(0, f"image {image} ({why})")
    return image


def _gpus_of(node: NodeFacts, policy: PlacementPolicy) -> tuple[GpuFacts, ...]:
    """The GPUs placement may choose on ``node``: those its agent policy hands out."""
    return handed_out(node) if policy.check_agent_policies else node.gpus


def _no_runtime(node: NodeFacts, runtime: RuntimeName) -> str:
    if runtime == "docker":
        found = "its agent found no Docker engine when it connected"
    else:
        found = f"its agent offered no {runtime} runtime when it connected"
    return (
        f"node {node.label} offers no {runtime} runtime ({found}; `berth doctor` on that "
        "host says why)"
    )


def _model_source(
    model: ModelRecord, node: NodeFacts, reasons: list[str]
) -> ModelAt | ModelPull | Refusal:
    if node.leader_host:
        if model.source == "remote":
            message = (
                f"model {model.name} has a path only on other nodes (berth models ls); run it "
                "there with --node LABEL"
            )
            return Refusal("model_elsewhere", message, node.node_id)
        reasons.append(f"model {model.name} at {model.path} on the leader's host")
        return ModelAt(Path(model.path))
    if node.model_location is not None:
        reasons.append(f"model {model.name} at {node.model_location} on node {node.label}")
        return ModelAt(node.model_location)
    if model.repo_id is not None and node.can_pull:
        at = f" at {model.revision}" if model.revision else ""
        reasons.append(
            f"node {node.label} has no path for model {model.name}: it downloads "
            f"{model.repo_id}{at} from the hub first"
        )
        return ModelPull(model.repo_id, model.revision)
    message = (
        f"model {model.name} has no path on node {node.label}; add one with "
        f"'berth models add {model.name} PATH --node {node.label}'"
    )
    return Refusal("model_not_on_node", message, node.node_id)


def _check_gpus(gpus: tuple[int, ...], node: NodeFacts, reasons: list[str]) -> Refusal | None:
    reserved = {r.index: r.holder for r in node.reserved_gpus}
    taken = [f"GPU {g} by {reserved[g]}" for g in gpus if g in reserved]
    if taken:
        message = (
            f"node {node.label} reserves {', '.join(taken)} (an adopted endpoint): "
            "choose other GPUs or unadopt it"
        )
        return Refusal("gpu_reserved", message, node.node_id)
    available = sorted(gpu.index for gpu in node.gpus)
    missing = sorted(set(gpus) - set(available))
    if missing:
        have = ", ".join(map(str, available)) or "none"
        message = f"node {node.node_id} has no GPU {', '.join(map(str, missing))} (GPUs: {have})"
        return Refusal("gpu_missing", message, node.node_id)
    reasons.append(f"GPU {', '.join(map(str, gpus))} on node {node.label}, none reserved")
    return None
