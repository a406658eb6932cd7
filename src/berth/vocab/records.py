"""Frozen records the store returns: plain values, safe to pass between threads and layers.

Timestamps are timezone-aware UTC datetimes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Literal

from berth.vocab.gpu import GpuInfo
from berth.vocab.limits import LimitOverrides
from berth.vocab.policies import DEFAULT_RESTART_POLICY, RestartPolicy, RoutingPolicy
from berth.vocab.roles import Role
from berth.vocab.signed_spec import SignedSpec
from berth.vocab.states import TERMINAL_STATES, DeploymentState

#: ``remote``: registered only with a path on an agent's host (``models add --node``).
ModelSource = Literal["local", "hub", "remote"]
#: ``ready``: the agent said Hello and its link is up; ``unreachable``: enrolled (or once
#: connected) but no live link; ``removed``: removed by the operator, its certificate refused.
NodeStatus = Literal["ready", "unreachable", "removed"]
NODE_STATUSES: tuple[NodeStatus, ...] = ("ready", "unreachable", "removed")
MODEL_SOURCES: tuple[ModelSource, ...] = ("local", "hub", "remote")


@dataclass(frozen=True)
class ModelRecord:
    """A registered model.

    ``path`` is the GGUF file or Hugging Face style directory; ``source`` says whether the
    user registered a local path or ``berth pull`` downloaded it (then ``repo_id`` and
    ``revision`` name what was pulled).  ``size_bytes`` is the size on disk.
    """

    name: str
    path: Path
    source: ModelSource
    repo_id: str | None
    revision: str | None
    size_bytes: int
    created_at: datetime


@dataclass(frozen=True)
class DeploymentRecord:
    """One deployment of a model on a node, as last written.

    ``port`` and ``pid`` are the engine's once started (``None`` before).  ``gpus`` are device
    indexes for ``CUDA_VISIBLE_DEVICES``; ``ctx`` is the context length in tokens, ``None``
    for the engine's default.  ``failure_reason`` is kept once the deployment failed.
    ``image`` is the container image of a ``docker`` deployment (``None`` for ``process``).
    ``restart_policy`` says whether its engine is started again when it ends;
    ``restart_count`` is how many times it was; ``last_exit`` how its engine last ended
    (``exit code 1``, ``SIGKILL``, ``3 failed health probes``; ``None`` before) and
    ``last_exit_log`` the engine log's last lines then.  ``signed_spec`` is the spec the
    cluster signed when the admin API or CLI accepted the deployment (``None``: never signed,
    so it is never started).
    """

    id: str
    model_name: str
    engine: str
    runtime: str
    node_id: str
    state: DeploymentState
    port: int | None
    pid: int | None
    gpus: tuple[int, ...]
    ctx: int | None
    extra_args: tuple[str, ...]
    served_model_name: str
    failure_reason: str | None
    created_at: datetime
    updated_at: datetime
    image: str | None = None
    #: LoRA slots a vLLM/SGLang engine was started with (``None``: adapters not enabled)
    adapter_slots: int | None = None
    #: llama.cpp: the adapters it was started with (``--lora``), in order: their ids
    lora_adapters: tuple[str, ...] = ()
    restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY
    restart_count: int = 0
    last_exit: str | None = None
    last_exit_log: str | None = None
    signed_spec: SignedSpec | None = field(default=None, repr=False, compare=False)

    @property
    def is_active(self) -> bool:
        """Whether the deployment is not yet in a terminal state (stopped or failed)."""
        return self.state not in TERMINAL_STATES


@dataclass(frozen=True)
class ApiKeyRecord:
    """An API key's metadata; the secret itself is never stored.

    ``tier`` names its tier (``admin``, ``standard`` or one of ``config.toml``'s);
    ``prefix`` is the first characters of the secret, for display; ``revoked_at`` is set
    once the key was revoked, after which it no longer authenticates.  ``limits`` are the
    key's own values over its tier's; from ``expires_at`` on it no longer authenticates.
    ``role`` is an ``admin`` key's role (:class:`berth.vocab.roles.Role`), ``None`` for other tiers.
    """

    id: str
    name: str
    tier: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    limits: LimitOverrides = field(default_factory=LimitOverrides)
    expires_at: datetime | None = None
    role: Role | None = None

    @property
    def is_revoked(self) -> bool:
        """Whether the key was revoked."""
        return self.revoked_at is not None


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """Usage of one key (``""``: the leader's Unix socket) on one model or route (the name
    the client asked for) and node, in one UTC ``day``: a row of the usage ledger, or what
    one flush adds to it.

    ``errors`` counts the requests whose answer was an error or broke off;
    ``estimated_tokens`` is the part of ``prompt_tokens + completion_tokens`` that berth
    estimated because the engine reported no usage, for ``estimated_requests`` requests;
    ``cached_tokens`` the part of ``prompt_tokens`` the engine read from its cache, as it
    reported (a Messages answer's ``cache_read_input_tokens``).
    """

    day: date
    key_id: str
    model: str
    node_id: str
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated_requests: int = 0
    estimated_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class NodeHardware:
    """A node's hardware as its agent last reported it; memory in MiB."""

    hostname: str
    cpu_count: int
    memory_total_mb: int
    gpus: tuple[GpuInfo, ...] = ()

    @property
    def vram_total_mb(self) -> int:
        """The sum of every GPU's memory, in MiB."""
        return sum(gpu.memory_total_mb for gpu in self.gpus)


@dataclass(frozen=True)
class NodeRecord:
    """A node: the leader's own host (id and label ``local``) or an enrolled agent host.

    ``cert_fingerprint`` is ``sha256:<hex>`` of the DER client certificate the agent
    authenticates with (``None`` for ``local``).  ``agent_version``, ``protocol_version``,
    ``capabilities`` and ``inventory`` come from the agent's last Hello (``None``/empty
    before the first); ``last_heartbeat_at`` is epoch seconds.
    """

    id: str
    label: str
    status: NodeStatus
    cert_fingerprint: str | None
    agent_version: str | None
    protocol_version: int | None
    capabilities: tuple[str, ...]
    inventory: NodeHardware | None
    last_heartbeat_at: float | None
    created_at: datetime


@dataclass(frozen=True)
class ModelLocation:
    """Where one model's weights are on one node's host."""

    model_name: str
    node_id: str
    path: str


@dataclass(frozen=True)
class ScalingSettings:
    """How many replicas of a service run, and when they start and stop.

    ``min_replicas`` are kept running (0: none until a request asks, *on demand*);
    ``max_replicas`` bounds what berth starts by itself (0: it starts none, on demand or
    not).  A replica with no request for ``idle_timeout_s`` seconds is stopped, down to
    ``min_replicas`` (``None``: never for idleness).  ``pinned`` replicas are never evicted
    to make room for another service; a start evicts only deployments of services whose
    ``priority`` is at most its own.  ``capacity`` is how many requests one replica serves at
    once (``None``: the engine's slots, from its arguments); every replica having that many
    in flight or waiting for a while is what starts another.
    """

    min_replicas: int = 0
    max_replicas: int = 1
    idle_timeout_s: float | None = None
    pinned: bool = False
    priority: int = 0
    capacity: int | None = None


#: The longest stream timeout a service may set, in seconds (a day: far beyond any answer).
MAX_STREAM_TIMEOUT_S = 86400.0


@dataclass(frozen=True)
class StreamTimeouts:
    """A service's own bounds on its streamed answers, in seconds; ``None`` takes the
    leader's setting of the same name (``[server]``), 0 turns the bound off.

    ``first_byte_timeout_s``: from sending a streamed request to the first byte of its
    answer (the head and first event: prefill), past which the request goes to another
    deployment. ``stream_idle_timeout_s``: the longest silence inside the stream after it,
    past which the stream ends with an error event.
    """

    first_byte_timeout_s: float | None = None
    stream_idle_timeout_s: float | None = None


@dataclass(frozen=True)
class ServiceProfileRecord:
    """A service profile: a model and how to deploy it.

    ``engine`` and ``runtime`` are berth's names (``llamacpp``, ``process``, …); ``gpus``
    are device indexes, ``ctx`` the context length in tokens (``None``: the engine's
    default); ``image`` the container image of a ``docker`` profile (``None``: the engine's
    image setting); ``node_label`` the node its deployments run on (``None``: chosen at
    deploy time, ``local`` by default).  Its deployments serve the profile's ``name``.
    ``scaling`` says how many of them run and when (:class:`ScalingSettings`).
    ``max_adapters`` is their LoRA slot count (vLLM, SGLang; ``None``: 1 when the model has
    adapters, else LoRA off, as ``berth run --max-adapters``). ``timeouts`` bound their
    streamed answers (:class:`StreamTimeouts`). ``routing_policy`` is how the router picks
    among its deployments (``None``: the leader's ``routing_policy`` setting).
    """

    name: str
    model_name: str
    engine: str
    runtime: str
    gpus: tuple[int, ...]
    ctx: int | None
    extra_args: tuple[str, ...]
    image: str | None
    node_label: str | None
    created_at: datetime
    scaling: ScalingSettings = ScalingSettings()
    max_adapters: int | None = None
    restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY
    timeouts: StreamTimeouts = StreamTimeouts()
    routing_policy: RoutingPolicy | None = None


@dataclass(frozen=True)
class RouteTarget:
    """A service profile behind a route; a higher ``priority`` is tried first."""

    service: str
    priority: int


@dataclass(frozen=True)
class RouteRecord:
    """A public model name: its targets, highest priority first (then by service name), and
    the route tried when none of them has a ready deployment (``fallback``)."""

    name: str
    targets: tuple[RouteTarget, ...]
    fallback: str | None
    created_at: datetime


#: ``peft``: a PEFT folder (vLLM, SGLang); ``gguf``: a GGUF LoRA file (llama.cpp).
AdapterFormatName = Literal["peft", "gguf"]


@dataclass(frozen=True)
class AdapterRecord:
    """A registered LoRA adapter of ``base_model``, served under ``name``.

    ``locations`` maps node ids to the adapter's path on that node's host. ``rank`` and
    ``target_modules`` are read from the files when the leader could read them (``None``
    and empty for a path only on another node's host). ``source`` is ``hub`` for one
    ``berth pull`` fetched (``repo_id``, ``revision``), ``local`` otherwise.
    """

    name: str
    base_model: str
    format: AdapterFormatName
    rank: int | None
    target_modules: tuple[str, ...]
    source: ModelSource
    repo_id: str | None
    revision: str | None
    created_at: datetime
    locations: dict[str, str]


@dataclass(frozen=True)
class NodeCertificate:
    """A client certificate the leader issued to a node: ``fingerprint`` (``sha256:<hex>``
    of the DER), the ``serial`` in hex, ``not_after`` and ``issued_at`` in epoch seconds, and
    the fingerprint of the CA certificate that signed it."""

    node_id: str
    fingerprint: str
    serial: str
    not_after: float
    issuer_fingerprint: str
    issued_at: float
