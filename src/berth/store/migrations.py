"""Versioned schema migrations.

The ``schema_version`` table holds one row per applied migration; the schema's version is the
highest.  :data:`MIGRATIONS` is the ordered list of numbered steps.  Each step is applied in
its own transaction together with its ``schema_version`` row, so a failed step leaves the
database as it was before it.  A database whose version is higher than the last step known
here was written by a newer berth and is refused.

Numbers increase but may skip: features built at the same time reserve their numbers, and
whichever lands first leaves a gap for the others.  So a step is applied when its own row is
missing, not when the version is below it: a database that already has step 7 still gets a
step 5 that arrives later (each step touches its own tables, so their order between
themselves does not matter).

A migration's table definitions are frozen copies written with SQLAlchemy Core, not the ORM
classes of :mod:`berth.store.tables`: those follow the latest schema, while migration 1 must
build the version-1 schema forever.  Everything is portable SQL (no SQLite-only statements).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Connection,
    Date,
    DateTime,
    Engine,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
    insert,
    inspect,
    select,
    text,
)

from berth.errors import StoreError
from berth.store.db import WRITE_OPTIONS
from berth.store.tables import UTCDateTime


@dataclass(frozen=True)
class Migration:
    """One schema step: ``apply`` runs inside the transaction that records ``version``."""

    version: int
    description: str
    apply: Callable[[Connection], None]


def _v1_initial(conn: Connection) -> None:
    metadata = MetaData()
    Table(
        "models",
        metadata,
        Column("name", String(255), primary_key=True),
        Column("path", Text, nullable=False),
        Column("source", String(16), nullable=False),
        Column("repo_id", String(255), nullable=True),
        Column("revision", String(255), nullable=True),
        Column("size_bytes", BigInteger, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    Table(
        "deployments",
        metadata,
        Column("id", String(16), primary_key=True),
        Column("model_name", String(255), nullable=False),
        Column("engine", String(32), nullable=False),
        Column("runtime", String(32), nullable=False),
        Column("node_id", String(255), nullable=False),
        Column("state", String(16), nullable=False),
        Column("port", Integer, nullable=True),
        Column("pid", Integer, nullable=True),
        Column("gpus", JSON, nullable=False),
        Column("ctx", Integer, nullable=True),
        Column("extra_args", JSON, nullable=False),
        Column("served_model_name", String(255), nullable=False),
        Column("failure_reason", Text, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("updated_at", DateTime(timezone=True), nullable=False),
        Index("ix_deployments_model_name", "model_name"),
        Index("ix_deployments_node_id", "node_id"),
        Index("ix_deployments_state", "state"),
        Index("ix_deployments_created_at", "created_at"),
    )
    Table(
        "api_keys",
        metadata,
        Column("id", String(16), primary_key=True),
        Column("name", String(255), nullable=False),
        Column("tier", String(16), nullable=False),
        Column("key_hash", String(128), nullable=False),
        Column("prefix", String(32), nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("revoked_at", DateTime(timezone=True), nullable=True),
        UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    metadata.create_all(conn)


def _v2_nodes(conn: Connection) -> None:
    metadata = MetaData()
    Table("models", metadata, Column("name", String(255), primary_key=True))
    Table(
        "nodes",
        metadata,
        Column("id", String(16), primary_key=True),
        Column("label", String(63), nullable=False),
        Column("status", String(16), nullable=False),
        Column("cert_fingerprint", String(80), nullable=True),
        Column("agent_version", String(64), nullable=True),
        Column("protocol_version", Integer, nullable=True),
        Column("capabilities", JSON, nullable=False),
        Column("inventory", JSON, nullable=True),
        Column("last_heartbeat_at", Float, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        UniqueConstraint("label", name="uq_nodes_label"),
        Index("ix_nodes_cert_fingerprint", "cert_fingerprint"),
    )
    Table(
        "enrollment_tokens",
        metadata,
        Column("token_hash", String(128), primary_key=True),
        Column("label", String(63), nullable=False),
        Column("expires_at", Float, nullable=False),
        Column("used_at", Float, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    Table(
        "model_locations",
        metadata,
        Column(
            "model_name",
            String(255),
            ForeignKey("models.name", ondelete="CASCADE"),
            primary_key=True,
        ),
        Column("node_id", String(16), ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True),
        Column("path", Text, nullable=False),
    )
    for name in ("nodes", "enrollment_tokens", "model_locations"):
        metadata.tables[name].create(conn)


def _v3_deployment_image(conn: Connection) -> None:
    # ADD COLUMN with a NULL default: the same statement on SQLite and PostgreSQL.
    conn.execute(text("ALTER TABLE deployments ADD COLUMN image VARCHAR(512)"))


def _v4_services_and_routes(conn: Connection) -> None:
    metadata = MetaData()
    Table("models", metadata, Column("name", String(255), primary_key=True))
    Table(
        "service_profiles",
        metadata,
        Column("name", String(255), primary_key=True),
        Column("model_name", String(255), ForeignKey("models.name"), nullable=False),
        Column("engine", String(32), nullable=False),
        Column("runtime", String(32), nullable=False),
        Column("gpus", JSON, nullable=False),
        Column("ctx", Integer, nullable=True),
        Column("extra_args", JSON, nullable=False),
        Column("image", String(512), nullable=True),
        Column("node_label", String(63), nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Index("ix_service_profiles_model_name", "model_name"),
    )
    Table(
        "routes",
        metadata,
        Column("public_name", String(255), primary_key=True),
        Column("fallback", String(255), ForeignKey("routes.public_name"), nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    Table(
        "route_targets",
        metadata,
        Column(
            "public_name",
            String(255),
            ForeignKey("routes.public_name", ondelete="CASCADE"),
            primary_key=True,
        ),
        Column("profile_name", String(255), ForeignKey("service_profiles.name"), primary_key=True),
        Column("priority", Integer, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Index("ix_route_targets_profile_name", "profile_name"),
    )
    for name in ("service_profiles", "routes", "route_targets"):
        metadata.tables[name].create(conn)


def _v5_service_scaling(conn: Connection) -> None:
    # ADD COLUMN with a constant default fills existing rows: the same statements on SQLite
    # and PostgreSQL.  Existing services become on demand with one replica at most, never
    # unloaded for idleness (idle_timeout_s NULL), which is how they behaved before.
    for column in (
        "min_replicas INTEGER NOT NULL DEFAULT 0",
        "max_replicas INTEGER NOT NULL DEFAULT 1",
        "idle_timeout_s FLOAT",
        "pinned BOOLEAN NOT NULL DEFAULT FALSE",
        "priority INTEGER NOT NULL DEFAULT 0",
        "capacity INTEGER",
    ):
        conn.execute(text(f"ALTER TABLE service_profiles ADD COLUMN {column}"))


def _add_column(conn: Connection, table: str, column: Column[Any]) -> None:
    # ADD COLUMN of a nullable column without a default: the same on SQLite and PostgreSQL;
    # the type is spelled by the connection's dialect (JSON, TIMESTAMP WITH TIME ZONE, …).
    spelled = column.type.compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column.name} {spelled}"))


def _v6_key_limits_and_usage(conn: Connection) -> None:
    _add_column(conn, "api_keys", Column("limits", JSON, nullable=True))
    _add_column(conn, "api_keys", Column("expires_at", DateTime(timezone=True), nullable=True))
    metadata = MetaData()
    Table(
        "usage_ledger",
        metadata,
        Column("day", Date, primary_key=True),
        Column("key_id", String(16), primary_key=True),
        Column("model", String(255), primary_key=True),
        Column("node_id", String(16), primary_key=True),
        Column("requests", BigInteger, nullable=False),
        Column("errors", BigInteger, nullable=False),
        Column("prompt_tokens", BigInteger, nullable=False),
        Column("completion_tokens", BigInteger, nullable=False),
        Column("estimated_requests", BigInteger, nullable=False),
        Column("estimated_tokens", BigInteger, nullable=False),
        Index("ix_usage_ledger_key_id", "key_id"),
    )
    metadata.create_all(conn)


def _v7_adapters(conn: Connection) -> None:
    # ADD COLUMN with a NULL default: the same statements on SQLite and PostgreSQL.
    conn.execute(text("ALTER TABLE deployments ADD COLUMN adapter_slots INTEGER"))
    spelled = JSON().compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE deployments ADD COLUMN lora_adapters {spelled}"))
    conn.execute(text("ALTER TABLE service_profiles ADD COLUMN max_adapters INTEGER"))
    metadata = MetaData()
    Table("models", metadata, Column("name", String(255), primary_key=True))
    Table("nodes", metadata, Column("id", String(16), primary_key=True))
    Table(
        "adapters",
        metadata,
        Column("name", String(255), primary_key=True),
        Column("base_model", String(255), ForeignKey("models.name"), nullable=False),
        Column("format", String(16), nullable=False),
        Column("rank", Integer, nullable=True),
        Column("target_modules", JSON, nullable=False),
        Column("source", String(16), nullable=False),
        Column("repo_id", String(255), nullable=True),
        Column("revision", String(255), nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Index("ix_adapters_base_model", "base_model"),
    )
    Table(
        "adapter_locations",
        metadata,
        Column(
            "adapter_name",
            String(255),
            ForeignKey("adapters.name", ondelete="CASCADE"),
            primary_key=True,
        ),
        Column("node_id", String(16), ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True),
        Column("path", Text, nullable=False),
    )
    for name in ("adapters", "adapter_locations"):
        metadata.tables[name].create(conn)


def _v8_restart_policy(conn: Connection) -> None:
    # ADD COLUMN with a constant default fills existing rows: the same statements on SQLite
    # and PostgreSQL.  Existing deployments and services get the default policy.
    for table in ("deployments", "service_profiles"):
        conn.execute(
            text(
                f"ALTER TABLE {table} ADD COLUMN restart_policy VARCHAR(16) NOT NULL "
                "DEFAULT 'on-failure'"
            )
        )
    conn.execute(
        text("ALTER TABLE deployments ADD COLUMN restart_count INTEGER NOT NULL DEFAULT 0")
    )
    conn.execute(text("ALTER TABLE deployments ADD COLUMN last_exit TEXT"))
    conn.execute(text("ALTER TABLE deployments ADD COLUMN last_exit_log TEXT"))


def _v9_service_timeouts(conn: Connection) -> None:
    # Nullable, no default: existing services take the leader's settings, as before.
    for name in ("first_byte_timeout_s", "stream_idle_timeout_s"):
        _add_column(conn, "service_profiles", Column(name, Float, nullable=True))


def _v10_leader_lease(conn: Connection) -> None:
    metadata = MetaData()
    Table(
        "leader_lease",
        metadata,
        Column("name", String(32), primary_key=True),
        Column("holder", String(255), nullable=False),
        Column("address", String(512), nullable=False),
        Column("epoch", BigInteger, nullable=False),
        Column("acquired_at", Float, nullable=False),
        Column("renewed_at", Float, nullable=False),
        Column("expires_at", Float, nullable=False),
    )
    Table(
        "change_counters",
        metadata,
        Column("topic", String(32), primary_key=True),
        Column("counter", BigInteger, nullable=False),
    )
    metadata.create_all(conn)


def _v11_usage_cached_tokens(conn: Connection) -> None:
    # ADD COLUMN with a constant default fills existing rows (no cache reads counted then):
    # the same statement on SQLite and PostgreSQL.
    conn.execute(
        text("ALTER TABLE usage_ledger ADD COLUMN cached_tokens BIGINT NOT NULL DEFAULT 0")
    )


def _v14_leader_members(conn: Connection) -> None:
    metadata = MetaData()
    Table(
        "leader_members",
        metadata,
        Column("cluster_url", String(512), primary_key=True),
        Column("holder", String(255), nullable=False),
        Column("seen_at", Float, nullable=False),
    )
    metadata.create_all(conn)


def _v15_cluster_bootstrap(conn: Connection) -> None:
    metadata = MetaData()
    Table(
        "cluster_bootstrap",
        metadata,
        Column("name", String(32), primary_key=True),
        Column("salt", LargeBinary, nullable=False),
        Column("nonce", LargeBinary, nullable=False),
        Column("ciphertext", LargeBinary, nullable=False),
        Column("created_at", Float, nullable=False),
    )
    metadata.create_all(conn)


def _v12_node_certificates(conn: Connection) -> None:
    metadata = MetaData()
    Table("nodes", metadata, Column("id", String(16), primary_key=True))
    table = Table(
        "node_certificates",
        metadata,
        Column("fingerprint", String(80), primary_key=True),
        Column("node_id", String(16), ForeignKey("nodes.id", ondelete="CASCADE"), nullable=False),
        Column("serial", String(48), nullable=False),
        Column("not_after", Float, nullable=False),
        Column("issuer_fingerprint", String(80), nullable=False),
        Column("issued_at", Float, nullable=False),
        Index("ix_node_certificates_node_id", "node_id"),
    )
    table.create(conn)


def _v13_service_routing_policy(conn: Connection) -> None:
    # Nullable, no default: existing services follow the leader's routing_policy, as before.
    _add_column(conn, "service_profiles", Column("routing_policy", String(16), nullable=True))


def _v16_node_drains(conn: Connection) -> None:
    # Two new tables and nothing else: the step stands alone, so it keeps its meaning under
    # any number (cordon and drain, berth.store.drains).
    metadata = MetaData()
    Table("nodes", metadata, Column("id", String(16), primary_key=True))
    Table(
        "node_drains",
        metadata,
        Column("node_id", String(16), ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True),
        Column("cordoned_at", Float, nullable=False),
        Column("drain_started_at", Float, nullable=True),
        Column("grace_s", Float, nullable=True),
        Column("force", Boolean, nullable=False),
        Column("finished_at", Float, nullable=True),
    )
    Table(
        "drain_moves",
        metadata,
        Column("deployment_id", String(16), primary_key=True),
        Column("node_id", String(16), ForeignKey("nodes.id", ondelete="CASCADE"), nullable=False),
        Column("step", String(16), nullable=False),
        Column("replacement_id", String(16), nullable=True),
        Column("retired_at", Float, nullable=True),
        Column("note", Text, nullable=True),
        Column("updated_at", Float, nullable=False),
        Index("ix_drain_moves_node_id", "node_id"),
    )
    for name in ("node_drains", "drain_moves"):
        metadata.tables[name].create(conn)


def _v17_key_roles(conn: Connection) -> None:
    # Nullable, no default: keys outside the admin tier have no role; every admin key made
    # before roles existed keeps what it could do (admin). The same statements on SQLite and
    # PostgreSQL.
    _add_column(conn, "api_keys", Column("role", String(16), nullable=True))
    conn.execute(text("UPDATE api_keys SET role = 'admin' WHERE tier = 'admin'"))


def _v18_signed_specs(conn: Connection) -> None:
    # Nullable, no default: a deployment made before signed specs has no signature, and the
    # leader refuses to start it until it is deployed again (docs/security.md). The same
    # statements on SQLite and PostgreSQL.
    _add_column(conn, "deployments", Column("signed_spec", Text, nullable=True))
    _add_column(conn, "deployments", Column("spec_signature", String(128), nullable=True))
    _add_column(conn, "deployments", Column("spec_key_id", String(64), nullable=True))


#: Every migration, in increasing order (numbers may skip: see the module docstring).
MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "models, deployments and api_keys", _v1_initial),
    Migration(2, "nodes, enrollment_tokens and model_locations", _v2_nodes),
    Migration(3, "deployments.image (the docker runtime's container image)", _v3_deployment_image),
    Migration(4, "service_profiles, routes and route_targets", _v4_services_and_routes),
    Migration(5, "service_profiles scaling settings", _v5_service_scaling),
    Migration(6, "api_keys.limits and expires_at, usage_ledger", _v6_key_limits_and_usage),
    Migration(
        7, "adapters, adapter_locations, deployments' and services' adapter slots", _v7_adapters
    ),
    Migration(
        8, "deployments' and services' restart policy, restart count, last exit", _v8_restart_policy
    ),
    Migration(9, "service_profiles stream timeouts (first byte, idle)", _v9_service_timeouts),
    Migration(10, "leader_lease (active leader and epoch), change_counters", _v10_leader_lease),
    Migration(
        11, "usage_ledger.cached_tokens (prompt tokens read from a cache)", _v11_usage_cached_tokens
    ),
    Migration(12, "node_certificates (issued client certificates)", _v12_node_certificates),
    Migration(13, "service_profiles routing policy", _v13_service_routing_policy),
    Migration(14, "leader_members (every shared leader's cluster URL)", _v14_leader_members),
    Migration(15, "cluster_bootstrap (the sealed CA and key pepper)", _v15_cluster_bootstrap),
    Migration(16, "node_drains and drain_moves (cordon and drain)", _v16_node_drains),
    Migration(17, "api_keys.role (viewer, operator or admin for admin keys)", _v17_key_roles),
    Migration(18, "deployments' signed spec, signature and signing key id", _v18_signed_specs),
)

LATEST_VERSION = MIGRATIONS[-1].version

#: The bootstrap table, created before migration 1; the ORM's ``SchemaVersionRow`` maps it.
_schema_version = Table(
    "schema_version",
    MetaData(),
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("description", String(255), nullable=False),
    Column("applied_at", UTCDateTime, nullable=False),
)


def applied_versions(conn: Connection) -> set[int]:
    """The migrations recorded in the database behind ``conn`` (empty if never migrated)."""
    if not inspect(conn).has_table(_schema_version.name):
        return set()
    return {int(v) for v in conn.execute(select(_schema_version.c.version)).scalars()}


def current_version(conn: Connection) -> int:
    """The schema version of the database behind ``conn``; 0 when it has never been migrated."""
    if not inspect(conn).has_table(_schema_version.name):
        return 0
    highest = conn.execute(select(func.max(_schema_version.c.version))).scalar_one()
    return int(highest) if highest is not None else 0


def _refuse_newer(version: int, latest: int) -> None:
    if version > latest:
        raise StoreError(
            f"the database is at schema version {version}, newer than this berth knows "
            f"({latest}); upgrade berth or point database_url at another database"
        )


def _lift_server_limits(conn: Connection) -> None:
    """On PostgreSQL, no statement limit for this transaction (``SET LOCAL``): a migration
    may take long on a big database (the store's limits: :mod:`berth.store.deadlines`)."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
        conn.exec_driver_sql("SET LOCAL idle_in_transaction_session_timeout = 0")


def migrate(
    engine: Engine,
    *,
    migrations: tuple[Migration, ...] = MIGRATIONS,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> int:
    """Apply every migration the database lacks and return the resulting version.

    Idempotent: an up-to-date database is left alone.  Safe against a concurrent migrator:
    each step re-reads what is applied inside its own write transaction.  Raises
    :class:`StoreError` when the database is newer than ``migrations`` (nothing is changed),
    or when ``migrations`` is not numbered upwards from 1.
    """
    versions = [m.version for m in migrations]
    if versions and (versions[0] != 1 or versions != sorted(set(versions))):
        raise StoreError("migrations must be numbered upwards from 1")
    latest = migrations[-1].version if migrations else 0

    with engine.connect() as conn:
        conn.execution_options(**WRITE_OPTIONS)
        with conn.begin():
            _schema_version.create(conn, checkfirst=True)

        for migration in migrations:
            with conn.begin():
                _lift_server_limits(conn)
                _refuse_newer(current_version(conn), latest)
                if migration.version in applied_versions(conn):
                    continue
                migration.apply(conn)
                conn.execute(
                    insert(_schema_version).values(
                        version=migration.version,
                        description=migration.description,
                        applied_at=now(),
                    )
                )
        return current_version(conn)
