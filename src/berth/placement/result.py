"""What a placement answers: a :class:`Placement` (where the deployment goes, what it runs
with, where its model comes from: :class:`ModelAt` or :class:`ModelPull`, and why) or a
:class:`Refusal` (a typed :data:`RefusalReason` and the message the user sees).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from berth.errors import BerthError, ConfigError, ConflictError, PolicyError
from berth.placement.estimate import VramEstimate
from berth.placement.eviction import Eviction
from berth.placement.fit import GpuOption
from berth.vocab.engines import RuntimeName

#: Why a placement was refused; :data:`CONFLICT_REASONS` says which are the cluster's state
#: (409) rather than a request that cannot work (400).
RefusalReason = Literal[
    "image_invalid",  # the image is no image reference
    "image_without_docker",  # an image was given for the process runtime
    "node_not_connected",  # the node has no live link
    "node_cordoned",  # the node is cordoned or drained (berth nodes uncordon)
    "runtime_unavailable",  # the node's agent does not offer the runtime
    "model_elsewhere",  # on the leader's host, a model whose paths are on other nodes only
    "model_not_on_node",  # no path on the node, and no download it could make
    "gpu_reserved",  # a GPU asked for is declared by an adopted endpoint
    "gpu_missing",  # a GPU asked for does not exist on the node
    "estimate_unknown",  # GPUs to choose from, but no VRAM estimate to choose by
    "vram_too_large",  # the estimate exceeds every GPU looked at, even an empty one
    "vram_no_room",  # it would fit an empty GPU, but none has that much free now
    "no_node",  # no connected node can take it (each node's reason is in the message)
    "node_policy",  # the node's agent policy refuses it (the rule is in the message)
]
CONFLICT_REASONS: frozenset[RefusalReason] = frozenset(
    {
        "node_not_connected",
        "node_cordoned",
        "runtime_unavailable",
        "gpu_reserved",
        "vram_no_room",
        "no_node",
    }
)


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
    """Where and how to start the deployment; ``reasons`` say why, one line per decision.

    ``estimate`` is the VRAM it was placed by (``None``: no VRAM check); ``eviction`` names
    the deployments to stop first (``None``: none); ``considered`` every GPU looked at.
    """

    node_id: str
    label: str
    runtime: RuntimeName
    #: the container image (docker only)
    image: str | None
    gpus: tuple[int, ...]
    model: ModelAt | ModelPull
    reasons: tuple[str, ...]
    estimate: VramEstimate | None = None
    eviction: Eviction | None = None
    considered: tuple[GpuOption, ...] = ()


@dataclass(frozen=True)
class Refusal:
    """Why the deployment cannot be placed: ``reason`` for code, ``message`` for people;
    ``node_id`` names the node it concerns (``None``: the request itself).  ``considered``
    are the GPUs looked at, ``eviction`` one that would make room (when evicting was not
    allowed)."""

    reason: RefusalReason
    message: str
    node_id: str | None = None
    estimate: VramEstimate | None = None
    considered: tuple[GpuOption, ...] = ()
    eviction: Eviction | None = None
    #: the agent policy rule broken (``node_policy`` only)
    rule: str | None = None

    def error(self) -> BerthError:
        """The error to raise for it: ``PolicyError`` for ``node_policy``, ``ConflictError``
        for :data:`CONFLICT_REASONS`, else ``ConfigError``."""
        if self.reason == "node_policy":
            return PolicyError(self.message, rule=self.rule or "", node_id=self.node_id)
        if self.reason in CONFLICT_REASONS:
            return ConflictError(self.message)
        return ConfigError(self.message)
