"""The cluster's nodes: enrollment and the node registry, ``/admin/nodes``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, WithJsonSchema

from berth.api.base import ApiInput, ApiModel, Timestamp
from berth.vocab.drains import MoveStep
from berth.vocab.records import NodeStatus

#: How the leader reaches a node's engines: on its own host (``local``), straight to the
#: agent's ingress (``direct``), or through the agent's link (``tunnel``).
DataPathName = Literal["local", "direct", "tunnel"]


#: A new node's label, as the schema states it: an RFC 1123 host label, lowercase, that
#: neither looks like a node id (``n-`` and 8 hex digits) nor is ``local``. The leader checks
#: it with :func:`berth.cluster.pki.enrollment.validate_node_label`, whose refusals say which
#: rule a label broke (``tests/test_admin_input.py`` keeps the two in step).
NODE_LABEL_PATTERN = r"^(?!n-[0-9a-f]{8}$)(?!local$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"


class EnrollIn(ApiInput):
    """``POST /admin/nodes/enroll``: a single-use enrollment URI for a new node ``label``."""

    label: Annotated[
        str,
        WithJsonSchema({"type": "string", "pattern": NODE_LABEL_PATTERN, "examples": ["gpu-1"]}),
    ]


class EnrollmentIssued(ApiModel):
    """The enrollment URI (``berth://…``, single use) and when it expires (epoch seconds)."""

    uri: str
    expires_at: float
    label: str


class Gpu(ApiModel):
    """One GPU as the node's agent last reported it; memory in MiB.  ``utilization_pct``
    is ``None`` where the device does not report it (e.g. MIG-enabled GPUs)."""

    index: int
    name: str
    uuid: str
    memory_total_mb: int
    memory_used_mb: int
    utilization_pct: int | None


class AdoptedEndpoint(ApiModel):
    """An OpenAI-compatible server berth did not start, adopted on a node: where it answers
    on that node's host, the name clients use for it and the one it serves, the GPUs and
    memory (MiB) it declares, and whether its last probe answered."""

    name: str
    served_model_name: str
    engine_model: str
    host: str
    port: int
    gpus: list[int]
    vram_mb: int | None
    alive: bool


#: A drain's default grace for requests in flight on a deployment it stops (seconds).
DEFAULT_DRAIN_GRACE_S = 300.0

#: Where a node stands in maintenance: ``cordoned`` (nothing new is placed there),
#: ``draining`` (its deployments are being moved), ``drained`` (nothing left to move).
MaintenanceState = Literal["cordoned", "draining", "drained"]
#: What a drain does about one deployment now (:mod:`berth.placement.drain`).
DrainActionKind = Literal["done", "wait", "replace", "retire", "stop", "leave"]


class DrainIn(ApiInput):
    """``POST /admin/nodes/{id}/drain``: cordon the node and move its deployments off it;
    ``grace_s`` (seconds, default 5 minutes) is how long a deployment's requests in flight
    may take before it is stopped anyway; ``force`` stops the deployments that cannot move
    (pinned to the node, or fitting nowhere else) instead of leaving them."""

    grace_s: float = Field(default=DEFAULT_DRAIN_GRACE_S, ge=0)
    force: bool = False


class DrainMoveOut(ApiModel):
    """One deployment a drain moves: the ``step`` it is at (``replacing``, ``retired``: its
    replacement is ready and it gets no new requests since ``retired_at``, ``stopped``,
    ``left``), its replacement, and ``note``: what happened, in words."""

    deployment_id: str
    step: MoveStep
    replacement_id: str | None
    retired_at: float | None
    note: str | None
    updated_at: float


class DrainActionOut(ApiModel):
    """What the drain does about a deployment on the node at its last look, and why."""

    deployment_id: str
    action: DrainActionKind
    reason: str


class NodeMaintenance(ApiModel):
    """A cordoned node and its drain: ``state``, ``summary`` (one line: ``draining: 1 of 2
    moved``), since when it is cordoned and the drain began and finished (epoch seconds),
    its grace and ``force``, the moves as the store holds them and, on the active leader,
    the drain's last look (``actions``; empty elsewhere)."""

    state: MaintenanceState
    summary: str
    cordoned_at: float
    drain_started_at: float | None
    grace_s: float | None
    force: bool
    finished_at: float | None
    moves: list[DrainMoveOut]
    actions: list[DrainActionOut] = Field(default_factory=list)


class Uncordoned(ApiModel):
    """``DELETE /admin/nodes/{id}/cordon``: the node takes placements again; ``was`` its
    maintenance until then (``None``: it was not cordoned)."""

    node_id: str
    label: str
    was: NodeMaintenance | None


class NodeSummary(ApiModel):
    """A row of ``GET /admin/nodes``.

    ``connected``: its agent's link is up (node ``local``: the leader runs engines);
    ``hostname`` is ``None`` before the agent's first Hello; ``vram_total_mb`` is every GPU's
    memory in MiB; ``last_heartbeat_at`` epoch seconds.  ``data_path`` is how its requests
    travel now (``None`` while it is not connected) and ``data_path_reason`` why, in words.
    """

    id: str
    label: str
    status: NodeStatus
    connected: bool
    hostname: str | None
    gpu_count: int
    vram_total_mb: int
    agent_version: str | None
    last_heartbeat_at: float | None
    data_path: DataPathName | None = None
    data_path_reason: str | None = None
    #: when the node's current client certificate expires (epoch seconds; ``None``: node
    #: ``local``, or enrolled before certificates were recorded)
    cert_not_after: float | None = None
    #: why the leader refused the node's last renewal (``None``: it did not)
    cert_renewal_error: str | None = None
    #: cordoned or drained: nothing new is placed on it (``None``: it takes placements)
    maintenance: NodeMaintenance | None = None


class NodeDetail(NodeSummary):
    """One node with its hardware (memory in MiB), capabilities and versions; the answer of
    ``DELETE /admin/nodes/{id}``.  ``cert_fingerprint`` is ``sha256:<hex>`` of the agent's
    client certificate (``None`` for ``local``).  ``advertised_address`` is the
    ``HOST:PORT`` its agent advertised for the direct data path (``None``: none, or not
    connected); ``data_path_since`` when the data path last changed (epoch seconds)."""

    cpu_count: int | None
    memory_total_mb: int | None
    gpus: list[Gpu]
    capabilities: list[str]
    protocol_version: int | None
    cert_fingerprint: str | None
    created_at: Timestamp
    advertised_address: str | None = None
    data_path_since: float | None = None


class AgentPolicyView(ApiModel):
    """What a node's agent lets berth start there, as it reported it
    (:class:`berth.vocab.agent_policy.AgentPolicy`; ``gpus`` ``None``: every GPU)."""

    engines: list[str]
    images: list[str]
    model_roots: list[str]
    gpus: list[int] | None
    allow_args: list[str]
    refuse_args: list[str]
    #: the policy in one line, as ``berth nodes show`` prints it
    summary: str


class NodeDetailWithAdopted(NodeDetail):
    """``GET /admin/nodes/{id}``: the node, the servers adopted on it, and its agent policy
    (``None``: not connected, or an agent from before policies)."""

    adopted: list[AdoptedEndpoint]
    policy: AgentPolicyView | None = None
