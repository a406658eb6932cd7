"""Where a deployment goes and what it runs with, decided from plain values.

:func:`plan_placement` is pure: no I/O, no clock, no shared state.  It takes the request
(:class:`PlacementRequest`), the facts of the nodes that could run it (:class:`NodeFacts`,
which the lifecycle manager gathers from the store, each node's link and its adopted
endpoints) and the leader's image settings (:class:`PlacementPolicy`), and returns either a
:class:`Placement` (the node, the runtime and image, the GPUs, where the model comes from,
and a reason per decision) or a :class:`Refusal` (a typed reason and the message the user
sees).  The lifecycle manager only carries the result out, so a dry run (``berth plan``)
can print the same reasons a real deployment acts on.

The checks, in this order (the first that fails is the refusal):

1. the image: a docker deployment gets the one asked for, else the engine's GPU image when
   it is given GPUs (llama.cpp's default image has no CUDA), else the engine's image; each
   must be an image reference; an image with the process runtime is refused;
2. the node: it must have a live link, and its agent must offer the runtime;
3. the model: on the leader's own host its registered path, unless that path is on other
   nodes only; elsewhere the path recorded for that node, else a download from the hub when
   the model came from there and the node's agent can pull;
4. the GPUs asked for: none may be reserved by an adopted endpoint, and each must exist.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from berth.errors import BerthError, ConfigError, ConflictError
from berth.runtime.base import RuntimeName
from berth.runtime.engines import (
    DEFAULT_GPU_IMAGES,
    DEFAULT_IMAGES,
    EngineName,
    check_image_reference,
)
from berth.runtime.gpu import GpuInfo
from berth.store.records import ModelRecord

#: Why a placement was refused; :data:`CONFLICT_REASONS` says which are the cluster's state
#: (409) rather than a request that cannot work (400).
RefusalReason = Literal[
    "image_invalid",  # the image is no image reference
    "image_without_docker",  # an image was given for the process runtime
    "node_not_connected",  # the node has no live link
    "runtime_unavailable",  # the node's agent does not offer the runtime
    "model_elsewhere",  # on the leader's host, a model whose paths are on other nodes only
    "model_not_on_node",  # no path on the node, and no download it could make
    "gpu_reserved",  # a GPU asked for is declared by an adopted endpoint
    "gpu_missing",  # a GPU asked for does not exist on the node
]
CONFLICT_REASONS: frozenset[RefusalReason] = frozenset(
    {"node_not_connected", "runtime_unavailable", "gpu_reserved"}
)


@dataclass(frozen=True)
class PlacementRequest:
    """A deployment asked for: ``model`` on node ``node_id`` with ``engine`` and ``runtime``.

    ``gpus`` are device indexes (empty: none asked for); ``image`` the container image asked
    for (docker only; ``None``: the engine's image setting).
    """

    model: ModelRecord
    engine: EngineName
    runtime: RuntimeName
    node_id: str
    gpus: tuple[int, ...] = ()
    image: str | None = None


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
    recorded for this node (``None``: none).  ``gpus``: its GPUs as its agent reports them
    (asked for only when the request names GPUs).  ``reserved_gpus``: GPUs its adopted
    endpoints declare.
    """

    node_id: str
    label: str
    connected: bool
    leader_host: bool = False
    runtimes: frozenset[RuntimeName] = frozenset({"process"})
    can_pull: bool = False
    model_location: Path | None = None
    gpus: tuple[GpuInfo, ...] = ()
    reserved_gpus: tuple[GpuReservation, ...] = ()


@dataclass(frozen=True)
class PlacementPolicy:
    """The leader's settings placement follows: the container image per engine
    (``*_image`` settings) and the one used instead when a deployment gets GPUs."""

    images: Mapping[EngineName, str] = field(default_factory=lambda: dict(DEFAULT_IMAGES))
    gpu_images: Mapping[EngineName, str] = field(default_factory=lambda: dict(DEFAULT_GPU_IMAGES))


@dataclass(frozen=True)
class ModelAt:
    """The model is at ``path`` on the node."""

    path: Path


@dataclass(frozen=True)
class ModelPull:
    """The node downloads ``repo_id`` at ``revision`` (``None``: default branch) from the hub
    first; the deployment runs from where that lands."""

    repo_id: str
    revision: str | None


@dataclass(frozen=True)
class Placement:
    """Where and how to start the deployment; ``reasons`` say why, one line per decision."""

    node_id: str
    label: str
    runtime: RuntimeName
    #: the container image (docker only)
    image: str | None
    gpus: tuple[int, ...]
    model: ModelAt | ModelPull
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Refusal:
    """Why the deployment cannot be placed: ``reason`` for code, ``message`` for people;
    ``node_id`` names the node it concerns (``None``: the request itself)."""

    reason: RefusalReason
    message: str
    node_id: str | None = None

    def error(self) -> BerthError:
        """The error to raise for it: ``ConflictError`` for :data:`CONFLICT_REASONS`, else
        ``ConfigError``."""
        if self.reason in CONFLICT_REASONS:
            return ConflictError(self.message)
        return ConfigError(self.message)


def plan_placement(
    request: PlacementRequest,
    nodes: Sequence[NodeFacts],
    policy: PlacementPolicy | None = None,
) -> Placement | Refusal:
    """Place ``request`` on its node among ``nodes`` (see the module docstring for the
    checks and their order); a node missing from ``nodes`` counts as not connected."""
    policy = policy or PlacementPolicy()
    reasons: list[str] = []
    image = _choose_image(request, policy, reasons)
    if isinstance(image, Refusal):
        return image
    node = next((n for n in nodes if n.node_id == request.node_id), None)
    if node is None or not node.connected:
        label = request.node_id if node is None else node.label
        message = f"node {label} ({request.node_id}) is not connected"
        return Refusal("node_not_connected", message, request.node_id)
    if request.runtime not in node.runtimes:
        return Refusal("runtime_unavailable", _no_runtime(node, request.runtime), node.node_id)
    reasons.append(f"node {node.label} is connected and offers the {request.runtime} runtime")
    model = _model_source(request.model, node, reasons)
    if isinstance(model, Refusal):
        return model
    refused = _check_gpus(request.gpus, node, reasons)
    if refused is not None:
        return refused
    return Placement(
        node_id=node.node_id,
        label=node.label,
        runtime=request.runtime,
        image=image,
        gpus=request.gpus,
        model=model,
        reasons=tuple(reasons),
    )


def _choose_image(
    request: PlacementRequest, policy: PlacementPolicy, reasons: list[str]
) -> str | Refusal | None:
    if request.runtime != "docker":
        if request.image:
            message = "an image applies to the docker runtime only (--runtime docker)"
            return Refusal("image_without_docker", message)
        return None
    if request.image is not None:
        chosen, why = request.image, "as asked"
    elif request.gpus and request.engine in policy.gpu_images:
        chosen, why = policy.gpu_images[request.engine], f"the {request.engine} image for GPUs"
    else:
        chosen, why = policy.images[request.engine], f"the {request.engine} image setting"
    try:
        image = check_image_reference(chosen)
    except ConfigError as exc:
        return Refusal("image_invalid", str(exc))
    reasons.append(f"image {image} ({why})")
    return image


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
    if not gpus:
        reasons.append("no GPUs asked for")
        return None
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
