"""The ``Store`` facade: the only door to the state database.

Every method opens a short session of its own and returns frozen records, never ORM objects,
so one ``Store`` can be shared by threads (the daemon calls it through ``asyncio.to_thread``).
Writes run in a write transaction (``BEGIN IMMEDIATE`` on SQLite, the write lock on
PostgreSQL: :mod:`berth.store.db`) so a read-check-write sequence cannot interleave with
another writer, in this process or another leader's.  Database failures surface as
:class:`StoreError`; domain refusals as :class:`NotFoundError`, :class:`ConflictError` and
:class:`InvalidTransitionError`; a fenced write of a leader that lost the lease as
:class:`~berth.store.errors.FencedError`.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session, sessionmaker

from berth.errors import (
    ConfigError,
    ConflictError,
    InvalidTransitionError,
    NotFoundError,
    StoreError,
)
from berth.store import migrations
from berth.store.adapters import AdapterMethods, adapter_named, adapters_of
from berth.store.api_keys import ApiKeyMethods
from berth.store.bootstrap import BootstrapMethods
from berth.store.certificates import CertificateMethods
from berth.store.changes import ChangeMethods
from berth.store.db import WRITE_OPTIONS, create_store_engine
from berth.store.deadlines import CallWatchdog, StoreDeadlines
from berth.store.drains import DrainMethods
from berth.store.lease import LeaseMethods
from berth.store.members import MemberMethods
from berth.store.nodes import NodeMethods, delete_model_locations
from berth.store.routes import RouteMethods
from berth.store.services import ServiceMethods, models_used_by_services
from berth.store.tables import DeploymentRow, ModelRow
from berth.store.usage import UsageMethods
from berth.store.values import UNCHANGED, Unchanged, aware, fresh_id
from berth.vocab.policies import DEFAULT_RESTART_POLICY, RestartPolicy, check_restart_policy
from berth.vocab.records import MODEL_SOURCES, DeploymentRecord, ModelRecord, ModelSource
from berth.vocab.signed_spec import SignedSpec
from berth.vocab.states import TERMINAL_STATES, DeploymentState, can_transition

_ACTIVE_STATES = tuple(s.value for s in DeploymentState if s not in TERMINAL_STATES)


def _utc_now() -> datetime:
    return datetime.now(UTC)


class Store(
    LeaseMethods,
    MemberMethods,
    ChangeMethods,
    NodeMethods,
    ServiceMethods,
    RouteMethods,
    AdapterMethods,
    ApiKeyMethods,
    UsageMethods,
    CertificateMethods,
    BootstrapMethods,
    DrainMethods,
):
    """The state database at ``url`` (the ``database_url`` setting).

    Nothing is touched until the first call; call :meth:`migrate` once at start-up before
    anything else.  The node registry, enrollment tokens and model locations are documented
    in :mod:`berth.store.nodes`; service profiles in :mod:`berth.store.services`;
    routes in :mod:`berth.store.routes`;
    LoRA adapters in :mod:`berth.store.adapters`; the usage ledger in :mod:`berth.store.usage`;
    the leadership lease and the fence on cluster-state writes (deployments here, services
    and routes) in :mod:`berth.store.lease`; change counters and feeds other leaders follow
    in :mod:`berth.store.changes`; cordoned and drained nodes in :mod:`berth.store.drains`.
    ``clock`` returns aware datetimes; tests may pass a fake one.  ``deadlines`` bound every
    call on PostgreSQL (:mod:`berth.store.deadlines`; a leader in shared leadership passes
    :meth:`StoreDeadlines.within_lease`); a call past them raises
    :class:`~berth.store.errors.StoreDeadlineError`.
    """

    def __init__(
        self,
        url: str,
        *,
        clock: Callable[[], datetime] = _utc_now,
        deadlines: StoreDeadlines | None = None,
    ) -> None:
        self.deadlines = deadlines or StoreDeadlines()
        #: keeps every PostgreSQL call's deadline (its ``cuts`` say how many were cut)
        self.watchdog = CallWatchdog()
        self._engine: Engine = create_store_engine(url, self.deadlines, self.watchdog)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._clock = clock
        self._fence_epoch: int | None = None

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for diagnostics and tests; do not write through it)."""
        return self._engine

    def close(self) -> None:
        """Close every pooled connection.  The store may not be used afterwards."""
        self._engine.dispose()
        self.watchdog.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- schema ------------------------------------------------------------------------

    def migrate(self) -> int:
        """Apply the missing schema migrations; return the schema version now in force.

        Raises :class:`StoreError` when the database was written by a newer berth, or cannot
        be opened or changed.  A migration has no call deadline (on a big database one may
        take minutes); opening the connection still has.
        """
        with _translated(), self.watchdog.unbounded():
            return migrations.migrate(self._engine, now=self._clock)

    def schema_version(self) -> int:
        """The database's schema version (0 for a database never migrated)."""
        with _translated(), self._engine.connect() as conn:
            return migrations.current_version(conn)

    # --- models ------------------------------------------------------------------------

    def add_model(
        self,
        name: str,
        path: str | Path,
        *,
        source: ModelSource = "local",
        repo_id: str | None = None,
        revision: str | None = None,
        size_bytes: int = 0,
    ) -> ModelRecord:
        """Register a model.  Raises :class:`ConflictError` when ``name`` is taken (by a
        model or an adapter) and :class:`ConfigError` for an unknown ``source`` or a negative
        ``size_bytes``."""
        if source not in MODEL_SOURCES:
            raise ConfigError(f"unknown model source {source!r}; valid: {', '.join(MODEL_SOURCES)}")
        if size_bytes < 0:
            raise ConfigError(f"size_bytes must not be negative, got {size_bytes}")
        row = ModelRow(
            name=name,
            path=str(path),
            source=source,
            repo_id=repo_id,
            revision=revision,
            size_bytes=size_bytes,
            created_at=self._clock(),
        )
        with self._write() as session:
            if session.get(ModelRow, name) is not None:
                raise ConflictError(f"model {name!r} already exists")
            base = adapter_named(session, name)
            if base is not None:
                raise ConflictError(f"{name!r} is already the name of an adapter of {base!r}")
            session.add(row)
        return _model_record(row)

    def get_model(self, name: str) -> ModelRecord:
        """The model called ``name``; :class:`NotFoundError` if there is none."""
        with self._read() as session:
            row = session.get(ModelRow, name)
            if row is None:
                raise NotFoundError("model", name)
            return _model_record(row)

    def list_models(self) -> list[ModelRecord]:
        """Every model, by name."""
        with self._read() as session:
            rows = session.scalars(select(ModelRow).order_by(ModelRow.name))
            return [_model_record(row) for row in rows]

    def remove_model(self, name: str) -> ModelRecord:
        """Unregister ``name`` and return what it was (files on disk are left alone).

        Raises :class:`NotFoundError` if unknown, and :class:`ConflictError` while a
        deployment that is not stopped or failed, or a service profile, uses it.
        """
        with self._write() as session:
            row = session.get(ModelRow, name)
            if row is None:
                raise NotFoundError("model", name)
            active = session.scalars(
                select(DeploymentRow.id)
                .where(DeploymentRow.model_name == name)
                .where(DeploymentRow.state.in_(_ACTIVE_STATES))
                .order_by(DeploymentRow.id)
            ).all()
            if active:
                raise ConflictError(
                    f"model {name!r} is used by active deployment(s) {', '.join(active)}; "
                    "stop them first"
                )
            services = models_used_by_services(session, name)
            if services:
                raise ConflictError(
                    f"model {name!r} is used by service(s) {', '.join(services)}; remove them "
                    "first (berth service rm NAME)"
                )
            adapters = adapters_of(session, name)
            if adapters:
                raise ConflictError(
                    f"model {name!r} is the base of adapter(s) {', '.join(adapters)}; remove "
                    "them first (berth adapters rm NAME)"
                )
            record = _model_record(row)
            delete_model_locations(session, name)
            session.delete(row)
        return record

    # --- deployments -------------------------------------------------------------------

    def create_deployment(
        self,
        model_name: str,
        engine: str,
        runtime: str,
        node_id: str,
        *,
        gpus: tuple[int, ...] = (),
        ctx: int | None = None,
        extra_args: tuple[str, ...] = (),
        served_model_name: str | None = None,
        image: str | None = None,
        adapter_slots: int | None = None,
        lora_adapters: tuple[str, ...] = (),
        restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY,
    ) -> DeploymentRecord:
        """Record a new deployment in state ``pending`` with a fresh id ``d-`` + 8 hex.

        ``served_model_name`` defaults to ``model_name``.  ``adapter_slots`` is the LoRA slot
        count of a vLLM/SGLang engine started with adapters enabled; ``lora_adapters`` the
        adapters a llama.cpp engine is started with, in ``--lora`` order.  Raises
        :class:`NotFoundError` when the model is not registered and :class:`ConfigError` for
        a negative GPU index or a non-positive ``ctx``.
        """
        if any(gpu < 0 for gpu in gpus):
            raise ConfigError(f"GPU indexes must not be negative, got {list(gpus)}")
        if ctx is not None and ctx <= 0:
            raise ConfigError(f"ctx must be a positive number of tokens, got {ctx}")
        now = self._clock()
        with self._fenced_write() as session:
            if session.get(ModelRow, model_name) is None:
                raise NotFoundError("model", model_name)
            row = DeploymentRow(
                id=fresh_id(session, DeploymentRow, "d-"),
                model_name=model_name,
                engine=engine,
                runtime=runtime,
                image=image,
                node_id=node_id,
                state=DeploymentState.PENDING.value,
                port=None,
                pid=None,
                gpus=list(gpus),
                ctx=ctx,
                extra_args=list(extra_args),
                served_model_name=served_model_name or model_name,
                failure_reason=None,
                created_at=now,
                updated_at=now,
                adapter_slots=adapter_slots,
                lora_adapters=list(lora_adapters) or None,
                restart_policy=check_restart_policy(restart_policy),
                restart_count=0,
            )
            session.add(row)
        return _deployment_record(row)

    def get_deployment(self, deployment_id: str) -> DeploymentRecord:
        """The deployment ``deployment_id``; :class:`NotFoundError` if there is none."""
        with self._read() as session:
            return _deployment_record(_get_deployment_row(session, deployment_id))

    def list_deployments(
        self, active_only: bool = False, *, ended_since: datetime | None = None
    ) -> list[DeploymentRecord]:
        """Deployments, newest first; only those not stopped or failed when ``active_only``,
        and with it those that stopped or failed at ``ended_since`` or later (their last
        write) when that is given."""
        query = select(DeploymentRow).order_by(
            DeploymentRow.created_at.desc(), DeploymentRow.id.desc()
        )
        if active_only and ended_since is not None:
            query = query.where(
                DeploymentRow.state.in_(_ACTIVE_STATES) | (DeploymentRow.updated_at >= ended_since)
            )
        elif active_only:
            query = query.where(DeploymentRow.state.in_(_ACTIVE_STATES))
        with self._read() as session:
            return [_deployment_record(row) for row in session.scalars(query)]

    def transition_deployment(
        self,
        deployment_id: str,
        target: DeploymentState,
        *,
        port: int | Unchanged | None = UNCHANGED,
        pid: int | Unchanged | None = UNCHANGED,
        failure_reason: str | Unchanged | None = UNCHANGED,
        restart_count: int | Unchanged = UNCHANGED,
        last_exit: str | Unchanged | None = UNCHANGED,
        last_exit_log: str | Unchanged | None = UNCHANGED,
    ) -> DeploymentRecord:
        """Move a deployment to ``target``, optionally setting ``port``, ``pid``,
        ``failure_reason``, ``restart_count``, ``last_exit`` and ``last_exit_log`` in the
        same write; return the updated record.

        The move is checked with :func:`berth.vocab.states.can_transition` and applied with
        an UPDATE conditioned on the state just read, so two racing callers cannot both move
        the same deployment out of one state.  Raises :class:`NotFoundError` for an unknown
        id and :class:`InvalidTransitionError` when the state machine forbids the move (or
        another writer moved the deployment first).
        """
        target = DeploymentState(target)
        with self._fenced_write() as session:
            row = _get_deployment_row(session, deployment_id)
            current = DeploymentState(row.state)
            if not can_transition(current, target):
                raise InvalidTransitionError(deployment_id, current.value, target.value)
            values: dict[str, Any] = {"state": target.value, "updated_at": self._clock()}
            for column, value in (
                ("port", port),
                ("pid", pid),
                ("failure_reason", failure_reason),
                ("restart_count", restart_count),
                ("last_exit", last_exit),
                ("last_exit_log", last_exit_log),
            ):
                if value is not UNCHANGED:
                    values[column] = value
            result = cast(
                CursorResult[Any],
                session.execute(
                    update(DeploymentRow)
                    .where(DeploymentRow.id == deployment_id)
                    .where(DeploymentRow.state == current.value)
                    .values(**values)
                    .execution_options(synchronize_session=False)
                ),
            )
            session.refresh(row)
            if result.rowcount != 1:
                raise InvalidTransitionError(deployment_id, row.state, target.value)
            return _deployment_record(row)

    def update_deployment_runtime(
        self, deployment_id: str, *, port: int | None, pid: int | None
    ) -> DeploymentRecord:
        """Record the engine's ``port`` and ``pid`` without changing the state.

        Raises :class:`NotFoundError` for an unknown id.
        """
        with self._fenced_write() as session:
            row = _get_deployment_row(session, deployment_id)
            row.port = port
            row.pid = pid
            row.updated_at = self._clock()
        return _deployment_record(row)

    def set_deployment_signature(self, deployment_id: str, signed: SignedSpec) -> DeploymentRecord:
        """Store the spec the cluster signed for the deployment (see
        :class:`~berth.vocab.signed_spec.SignedSpec`); :class:`NotFoundError` for an unknown
        id.  Only the deploy path of the admin API and CLI, and a key rotation carrying
        signatures over, call it."""
        with self._fenced_write() as session:
            row = _get_deployment_row(session, deployment_id)
            row.signed_spec = signed.spec.decode("ascii")
            row.spec_signature = base64.b64encode(signed.signature).decode("ascii")
            row.spec_key_id = signed.key_id
            row.updated_at = self._clock()
        return _deployment_record(row)

    # --- sessions ----------------------------------------------------------------------

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with _translated(), self._sessions() as session:
            yield session

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with _translated(), self._sessions() as session, session.begin():
            session.connection(execution_options=WRITE_OPTIONS)
            yield session


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except IntegrityError as exc:
        raise ConflictError(f"conflicting write: {exc.orig}") from exc
    except DBAPIError as exc:
        raise StoreError(f"database error: {_one_line(exc.orig)}") from exc
    except PoolTimeoutError as exc:  # every pooled connection busy past the checkout limit
        raise StoreError(f"database error: no free connection: {_one_line(exc)}") from exc


def _one_line(error: BaseException | None) -> str:
    """The driver's message on one line: libpq's has a hint on a second (``Connection
    refused\n\tIs the server running ...``), and a CLI error or a log line is one line."""
    return " ".join(str(error).split())


def _get_deployment_row(session: Session, deployment_id: str) -> DeploymentRow:
    row = session.get(DeploymentRow, deployment_id)
    if row is None:
        raise NotFoundError("deployment", deployment_id)
    return row


def _model_record(row: ModelRow) -> ModelRecord:
    return ModelRecord(
        name=row.name,
        path=Path(row.path),
        source=cast(ModelSource, row.source),
        repo_id=row.repo_id,
        revision=row.revision,
        size_bytes=row.size_bytes,
        created_at=aware(row.created_at),
    )


def _deployment_record(row: DeploymentRow) -> DeploymentRecord:
    return DeploymentRecord(
        id=row.id,
        model_name=row.model_name,
        engine=row.engine,
        runtime=row.runtime,
        node_id=row.node_id,
        state=DeploymentState(row.state),
        port=row.port,
        pid=row.pid,
        gpus=tuple(row.gpus),
        ctx=row.ctx,
        extra_args=tuple(row.extra_args),
        served_model_name=row.served_model_name,
        failure_reason=row.failure_reason,
        created_at=aware(row.created_at),
        updated_at=aware(row.updated_at),
        image=row.image,
        adapter_slots=row.adapter_slots,
        lora_adapters=tuple(row.lora_adapters or ()),
        restart_policy=check_restart_policy(row.restart_policy),
        restart_count=row.restart_count,
        last_exit=row.last_exit,
        last_exit_log=row.last_exit_log,
        signed_spec=_signed_spec(row),
    )


def _signed_spec(row: DeploymentRow) -> SignedSpec | None:
    """The row's signed spec; ``None`` when it has none or a part does not decode (a
    damaged signature is no signature: the start is refused, naming why)."""
    if row.signed_spec is None or row.spec_signature is None or row.spec_key_id is None:
        return None
    try:
        signature = base64.b64decode(row.spec_signature, validate=True)
    except ValueError:
        return None
    return SignedSpec(row.signed_spec.encode(), signature, row.spec_key_id)
