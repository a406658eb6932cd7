"""ORM tables of the state database (SQLAlchemy 2 typed declarative mapping).

These classes describe the schema at the *latest* migration and are used only inside the
store; callers get the frozen records of :mod:`berth.vocab.records`.  A schema change adds a
migration in :mod:`berth.store.migrations` and updates the class here; a test checks the two
agree.
"""

from __future__ import annotations

from datetime import UTC, date, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAME_LENGTH = 255


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC and always read back timezone-aware (UTC).

    SQLite has no timezone-aware type, so values are stored as naive UTC there and tagged on
    the way out; PostgreSQL gets ``timestamp with time zone``.  Naive input is refused, since
    its zone is unknowable.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the store only accepts aware ones")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base of the store's tables."""


class SchemaVersionRow(Base):
    """One applied migration."""

    __tablename__ = "schema_version"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    description: Mapped[str] = mapped_column(String(NAME_LENGTH))
    applied_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ModelRow(Base):
    """A registered model: a GGUF file or a Hugging Face style directory."""

    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    source: Mapped[str] = mapped_column(String(16))
    repo_id: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    revision: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class DeploymentRow(Base):
    """One deployment of a model on a node, with its lifecycle state.

    ``model_name`` is deliberately not a foreign key: deployment history outlives a removed
    model, and the store refuses to remove a model an active deployment uses.
    """

    __tablename__ = "deployments"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    model_name: Mapped[str] = mapped_column(String(NAME_LENGTH), index=True)
    engine: Mapped[str] = mapped_column(String(32))
    runtime: Mapped[str] = mapped_column(String(32))
    image: Mapped[str | None] = mapped_column(String(512), nullable=True)
    node_id: Mapped[str] = mapped_column(String(NAME_LENGTH), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    port: Mapped[int | None] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer)
    gpus: Mapped[list[int]] = mapped_column(JSON)
    ctx: Mapped[int | None] = mapped_column(Integer)
    extra_args: Mapped[list[str]] = mapped_column(JSON)
    served_model_name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    failure_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    #: LoRA slots of a vLLM/SGLang engine started with adapters enabled (``None``: none)
    adapter_slots: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: llama.cpp: the adapters given with ``--lora``, in that order (their ids)
    lora_adapters: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    #: ``on-failure``, ``always`` or ``never`` (:data:`berth.vocab.records.RestartPolicy`)
    restart_policy: Mapped[str] = mapped_column(String(16), default="on-failure")
    #: how many times its engine was started again by the restart policy
    restart_count: Mapped[int] = mapped_column(Integer, default=0)
    #: how its engine last ended (``exit code 1``, ``SIGKILL``, …) and its log's tail then
    last_exit: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_exit_log: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: the spec the cluster signed when the admin API or CLI accepted the deployment
    #: (canonical JSON, :mod:`berth.cluster.protocol.spec_signing`), the Ed25519 signature
    #: over it (base64) and the signing key's id; ``NULL``: never signed, never started
    signed_spec: Mapped[str | None] = mapped_column(Text, nullable=True)
    spec_signature: Mapped[str | None] = mapped_column(String(128), nullable=True)
    spec_key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)


class ApiKeyRow(Base):
    """An API key, stored only as its peppered hash.

    ``limits`` holds the key's overrides of its tier's limits
    (:meth:`berth.vocab.limits.LimitOverrides.to_json`; ``NULL`` for none); ``expires_at`` the
    moment it stops authenticating (``NULL``: never); ``role`` what an admin key may do on
    the admin API (:class:`berth.vocab.roles.Role`; ``NULL`` for keys of other tiers).
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    tier: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(128), unique=True)
    prefix: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    limits: Mapped[dict[str, object] | None] = mapped_column(JSON, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    role: Mapped[str | None] = mapped_column(String(16), nullable=True)


class UsageRow(Base):
    """What one key asked of one model (or route) on one node in one UTC day.

    ``key_id`` is ``""`` for requests over the leader's Unix socket (no key); it is not a
    foreign key, so usage outlives a key.  ``estimated_tokens`` is the part of the prompt
    and completion tokens berth estimated (the engine reported no usage), over
    ``estimated_requests`` requests.  ``cached_tokens`` is the part of the prompt tokens the
    engine read from its cache, where it said so.
    """

    __tablename__ = "usage_ledger"

    day: Mapped[date] = mapped_column(Date, primary_key=True)
    key_id: Mapped[str] = mapped_column(String(16), primary_key=True, index=True)
    model: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    node_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    estimated_requests: Mapped[int] = mapped_column(BigInteger)
    estimated_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class NodeRow(Base):
    """A node of the cluster: the leader's own host (``local``) or an enrolled agent host."""

    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    label: Mapped[str] = mapped_column(String(63), unique=True)
    status: Mapped[str] = mapped_column(String(16))
    cert_fingerprint: Mapped[str | None] = mapped_column(String(80), index=True)
    agent_version: Mapped[str | None] = mapped_column(String(64))
    protocol_version: Mapped[int | None] = mapped_column(Integer)
    capabilities: Mapped[list[str]] = mapped_column(JSON)
    inventory: Mapped[dict[str, object] | None] = mapped_column(JSON)
    last_heartbeat_at: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class EnrollmentTokenRow(Base):
    """A single-use enrollment token, stored only as its peppered hash."""

    __tablename__ = "enrollment_tokens"

    token_hash: Mapped[str] = mapped_column(String(128), primary_key=True)
    label: Mapped[str] = mapped_column(String(63))
    expires_at: Mapped[float] = mapped_column(Float)
    used_at: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ModelLocationRow(Base):
    """Where a model's weights live on one node (a path on that node's host)."""

    __tablename__ = "model_locations"

    model_name: Mapped[str] = mapped_column(
        String(NAME_LENGTH), ForeignKey("models.name", ondelete="CASCADE"), primary_key=True
    )
    node_id: Mapped[str] = mapped_column(
        String(16), ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    path: Mapped[str] = mapped_column(Text)


class ServiceProfileRow(Base):
    """A service profile: how to deploy a model (engine, runtime, settings, where).

    Its deployments serve the profile's name (``served_model_name``); clients reach them
    through routes (:class:`RouteRow`).
    """

    __tablename__ = "service_profiles"

    name: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    model_name: Mapped[str] = mapped_column(
        String(NAME_LENGTH), ForeignKey("models.name"), index=True
    )
    engine: Mapped[str] = mapped_column(String(32))
    runtime: Mapped[str] = mapped_column(String(32))
    gpus: Mapped[list[int]] = mapped_column(JSON)
    ctx: Mapped[int | None] = mapped_column(Integer)
    extra_args: Mapped[list[str]] = mapped_column(JSON)
    image: Mapped[str | None] = mapped_column(String(512))
    node_label: Mapped[str | None] = mapped_column(String(63))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    min_replicas: Mapped[int] = mapped_column(Integer, default=0)
    max_replicas: Mapped[int] = mapped_column(Integer, default=1)
    idle_timeout_s: Mapped[float | None] = mapped_column(Float)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    capacity: Mapped[int | None] = mapped_column(Integer)
    #: vLLM/SGLang: LoRA adapter slots of its deployments (``None``: berth's default)
    max_adapters: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: its deployments' restart policy (``on-failure``, ``always`` or ``never``)
    restart_policy: Mapped[str] = mapped_column(String(16), default="on-failure")
    #: its streamed answers' bounds, seconds (``None``: the leader's settings; 0: none)
    first_byte_timeout_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    stream_idle_timeout_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: how the router picks among its deployments (``None``: the leader's routing_policy)
    routing_policy: Mapped[str | None] = mapped_column(String(16), nullable=True)


class RouteRow(Base):
    """A public model name clients use, with the route tried when none of its targets is
    ready (``fallback``, another route's public name)."""

    __tablename__ = "routes"

    public_name: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    fallback: Mapped[str | None] = mapped_column(
        String(NAME_LENGTH), ForeignKey("routes.public_name")
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class RouteTargetRow(Base):
    """One service profile behind a route, with its priority (higher is tried first)."""

    __tablename__ = "route_targets"

    public_name: Mapped[str] = mapped_column(
        String(NAME_LENGTH),
        ForeignKey("routes.public_name", ondelete="CASCADE"),
        primary_key=True,
    )
    profile_name: Mapped[str] = mapped_column(
        String(NAME_LENGTH), ForeignKey("service_profiles.name"), primary_key=True, index=True
    )
    priority: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AdapterRow(Base):
    """A LoRA adapter of a base model, served under its own name."""

    __tablename__ = "adapters"

    name: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    base_model: Mapped[str] = mapped_column(
        String(NAME_LENGTH), ForeignKey("models.name"), index=True
    )
    format: Mapped[str] = mapped_column(String(16))
    rank: Mapped[int | None] = mapped_column(Integer)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    source: Mapped[str] = mapped_column(String(16))
    repo_id: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    revision: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AdapterLocationRow(Base):
    """Where an adapter's files are on one node (a path on that node's host)."""

    __tablename__ = "adapter_locations"

    adapter_name: Mapped[str] = mapped_column(
        String(NAME_LENGTH), ForeignKey("adapters.name", ondelete="CASCADE"), primary_key=True
    )
    node_id: Mapped[str] = mapped_column(
        String(16), ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    path: Mapped[str] = mapped_column(Text)


class LeaderLeaseRow(Base):
    """The leadership lease (one row, ``name`` ``leader``): who is active, under which
    epoch, until when (Unix seconds of the holder's clock)."""

    __tablename__ = "leader_lease"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str] = mapped_column(String(NAME_LENGTH))
    address: Mapped[str] = mapped_column(String(512))
    epoch: Mapped[int] = mapped_column(BigInteger)
    acquired_at: Mapped[float] = mapped_column(Float)
    renewed_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)


class LeaderMemberRow(Base):
    """One leader sharing the database (``leader_ha``): the cluster URL agents dial it at,
    the id of the process that last said so, and when (Unix seconds)."""

    __tablename__ = "leader_members"

    cluster_url: Mapped[str] = mapped_column(String(512), primary_key=True)
    holder: Mapped[str] = mapped_column(String(NAME_LENGTH))
    seen_at: Mapped[float] = mapped_column(Float)


class ClusterBootstrapRow(Base):
    """The cluster's sealed CA and key pepper (row ``cluster``; migration 15) and its spec
    signing key (row ``spec-signing``, :mod:`berth.cluster.pki.signing_key`):
    the key derivation's salt, the AES-GCM nonce and ciphertext, and when it was published
    (Unix seconds); :mod:`berth.store.bootstrap`."""

    __tablename__ = "cluster_bootstrap"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    salt: Mapped[bytes] = mapped_column(LargeBinary)
    nonce: Mapped[bytes] = mapped_column(LargeBinary)
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[float] = mapped_column(Float)


class ChangeCounterRow(Base):
    """How many changes of one kind (``topic``: ``keys``) were written, for leaders that
    poll for them (:mod:`berth.store.changes`)."""

    __tablename__ = "change_counters"

    topic: Mapped[str] = mapped_column(String(32), primary_key=True)
    counter: Mapped[int] = mapped_column(BigInteger)


class NodeCertificateRow(Base):
    """A client certificate the leader issued to a node (at enrollment or a renewal): what
    ``berth ca status`` and ``berth nodes ls`` read, and the older fingerprints a node may
    still dial with until they expire."""

    __tablename__ = "node_certificates"

    fingerprint: Mapped[str] = mapped_column(String(80), primary_key=True)
    node_id: Mapped[str] = mapped_column(
        String(16), ForeignKey("nodes.id", ondelete="CASCADE"), index=True
    )
    serial: Mapped[str] = mapped_column(String(48))
    not_after: Mapped[float] = mapped_column(Float)
    issuer_fingerprint: Mapped[str] = mapped_column(String(80))
    issued_at: Mapped[float] = mapped_column(Float)


class NodeDrainRow(Base):
    """A cordoned node (migration 16): since when, and the drain asked of it if any (when it
    began, the grace for requests in flight, ``--force``, when it finished)."""

    __tablename__ = "node_drains"

    node_id: Mapped[str] = mapped_column(
        String(16), ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    cordoned_at: Mapped[float] = mapped_column(Float)
    drain_started_at: Mapped[float | None] = mapped_column(Float)
    grace_s: Mapped[float | None] = mapped_column(Float)
    force: Mapped[bool] = mapped_column(Boolean)
    finished_at: Mapped[float | None] = mapped_column(Float)


class DrainMoveRow(Base):
    """One deployment a drain moves off its node (migration 16): the step it is at, its
    replacement, when it stopped getting requests, and what happened in words."""

    __tablename__ = "drain_moves"

    deployment_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    node_id: Mapped[str] = mapped_column(
        String(16), ForeignKey("nodes.id", ondelete="CASCADE"), index=True
    )
    step: Mapped[str] = mapped_column(String(16))
    replacement_id: Mapped[str | None] = mapped_column(String(16))
    retired_at: Mapped[float | None] = mapped_column(Float)
    note: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[float] = mapped_column(Float)
