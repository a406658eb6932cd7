"""LoRA adapters: the :class:`Store`'s half for the adapter registry.

An **adapter** belongs to one base model and is served under a name of its own, so that name
must not already be a model's, a service's, a route's or a running deployment's served name
(and those refuse an adapter's name in turn: :func:`adapter_named`). Its files may be on
several nodes (``adapter_locations``, a path per node, like a model's); the router only sends
an adapter's requests to deployments of its base on nodes that have it.

:class:`AdapterMethods` is mixed into :class:`berth.store.Store`. Refusals are
:class:`NotFoundError` (an unknown base model, node or adapter) and :class:`ConflictError`
(a taken name; the adapter registered for another base, or at another path on that node).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import cast

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.store.tables import (
    AdapterLocationRow,
    AdapterRow,
    DeploymentRow,
    ModelRow,
    NodeRow,
    RouteRow,
    ServiceProfileRow,
)
from berth.store.values import aware
from berth.vocab.records import MODEL_SOURCES, AdapterFormatName, AdapterRecord, ModelSource
from berth.vocab.states import TERMINAL_STATES, DeploymentState

_ACTIVE_STATES = tuple(s.value for s in DeploymentState if s not in TERMINAL_STATES)
_FORMATS: tuple[AdapterFormatName, ...] = ("peft", "gguf")


class AdapterMethods:
    """Store methods for LoRA adapters (see the module doc)."""

    _clock: Callable[[], datetime]

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def add_adapter(
        self,
        name: str,
        base_model: str,
        node_id: str,
        path: str,
        *,
        format: AdapterFormatName,
        rank: int | None = None,
        target_modules: Sequence[str] = (),
        source: ModelSource = "local",
        repo_id: str | None = None,
        revision: str | None = None,
    ) -> AdapterRecord:
        """Register the adapter ``name`` of ``base_model`` at ``path`` on ``node_id``'s host,
        or add that node's location to an adapter of that name and base.

        Raises :class:`NotFoundError` for an unknown base model or node;
        :class:`ConflictError` when ``name`` is a model, service, route or running
        deployment's served name, names an adapter of another base, or is already
        registered on that node at another path; :class:`ConfigError` for an unknown format
        or source, or a rank that is not positive.
        """
        if format not in _FORMATS:
            raise ConfigError(f"unknown adapter format {format!r}; valid: {', '.join(_FORMATS)}")
        if source not in MODEL_SOURCES:
            raise ConfigError(f"unknown adapter source {source!r}")
        if rank is not None and rank <= 0:
            raise ConfigError(f"an adapter's rank must be positive, not {rank}")
        with self._write() as session:
            if session.get(ModelRow, base_model) is None:
                raise NotFoundError("model", base_model)
            if session.get(NodeRow, node_id) is None:
                raise NotFoundError("node", node_id)
            row = session.get(AdapterRow, name)
            if row is None:
                taken = _name_used_by(session, name)
                if taken is not None:
                    raise ConflictError(
                        f"{name!r} is already {taken}: an adapter needs a name of its own, "
                        "since clients ask for it as the model"
                    )
                row = AdapterRow(
                    name=name,
                    base_model=base_model,
                    format=format,
                    rank=rank,
                    target_modules=list(target_modules),
                    source=source,
                    repo_id=repo_id,
                    revision=revision,
                    created_at=self._clock(),
                )
                session.add(row)
            else:
                if row.base_model != base_model:
                    raise ConflictError(
                        f"adapter {name!r} is registered for model {row.base_model!r}, not "
                        f"{base_model!r}"
                    )
                if row.format != format:
                    raise ConflictError(
                        f"adapter {name!r} is a {row.format} adapter; this path is {format}"
                    )
                if rank is not None and row.rank is None:
                    row.rank = rank
                    row.target_modules = list(target_modules)
            located = session.get(AdapterLocationRow, (name, node_id))
            if located is not None and located.path != path:
                raise ConflictError(
                    f"adapter {name!r} is already at {located.path} on node {node_id}; "
                    f"remove it there first (berth adapters rm {name} --node {node_id})"
                )
            if located is None:
                session.add(AdapterLocationRow(adapter_name=name, node_id=node_id, path=path))
            session.flush()
            return _adapter_record(session, row)

    def get_adapter(self, name: str) -> AdapterRecord:
        """The adapter ``name``; :class:`NotFoundError` if there is none."""
        with self._read() as session:
            row = session.get(AdapterRow, name)
            if row is None:
                raise NotFoundError("adapter", name)
            return _adapter_record(session, row)

    def list_adapters(self, base_model: str | None = None) -> list[AdapterRecord]:
        """Every adapter by name (of one base model when ``base_model`` is given)."""
        query = select(AdapterRow).order_by(AdapterRow.name)
        if base_model is not None:
            query = query.where(AdapterRow.base_model == base_model)
        with self._read() as session:
            rows = list(session.scalars(query))
            locations = _locations(session, [row.name for row in rows])
            return [_record(row, locations.get(row.name, {})) for row in rows]

    def remove_adapter(self, name: str, node_id: str | None = None) -> AdapterRecord:
        """Unregister ``name`` (its files stay), or only its location on ``node_id``; the
        adapter goes with its last location. Returns what it was.

        Raises :class:`NotFoundError` for an unknown adapter, or one not on ``node_id``.
        """
        with self._write() as session:
            row = session.get(AdapterRow, name)
            if row is None:
                raise NotFoundError("adapter", name)
            record = _adapter_record(session, row)
            if node_id is not None:
                if node_id not in record.locations:
                    raise NotFoundError(
                        "adapter", name, message=f"adapter {name!r} is not on node {node_id}"
                    )
                session.execute(
                    delete(AdapterLocationRow).where(
                        AdapterLocationRow.adapter_name == name,
                        AdapterLocationRow.node_id == node_id,
                    )
                )
                if len(record.locations) > 1:
                    return record
            session.execute(
                delete(AdapterLocationRow).where(AdapterLocationRow.adapter_name == name)
            )
            session.delete(row)
            return record


def adapter_named(session: Session, name: str) -> str | None:
    """The base model of the adapter called ``name``, or ``None`` when there is none (a
    model, service or route of that name would hide it)."""
    row = session.get(AdapterRow, name)
    return None if row is None else row.base_model


def refuse_adapter_name(session: Session, name: str, what: str) -> None:
    """Raise :class:`ConflictError` when ``name``, the name of a new ``what`` (``"service"``,
    ``"route"``), is already an adapter's (the adapter would be hidden behind it)."""
    base = adapter_named(session, name)
    if base is not None:
        raise ConflictError(
            f"{name!r} is already the name of an adapter of {base!r}: name the {what} differently"
        )


def adapters_of(session: Session, base_model: str) -> list[str]:
    """The adapters of ``base_model``, by name (the model must stay while they do)."""
    return list(
        session.scalars(
            select(AdapterRow.name)
            .where(AdapterRow.base_model == base_model)
            .order_by(AdapterRow.name)
        ).all()
    )


def _name_used_by(session: Session, name: str) -> str | None:
    """What already answers to ``name`` as a model name, in words; ``None`` if nothing."""
    if session.get(ModelRow, name) is not None:
        return "a model's name"
    if session.get(ServiceProfileRow, name) is not None:
        return "a service's name"
    if session.get(RouteRow, name) is not None:
        return "a route's name"
    served = session.scalar(
        select(DeploymentRow.id)
        .where(DeploymentRow.served_model_name == name, DeploymentRow.state.in_(_ACTIVE_STATES))
        .limit(1)
    )
    if served is not None:
        return f"the served name of deployment {served}"
    return None


def _locations(session: Session, names: Sequence[str]) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    if not names:
        return found
    query = (
        select(AdapterLocationRow)
        .where(AdapterLocationRow.adapter_name.in_(names))
        .order_by(AdapterLocationRow.node_id)
    )
    for row in session.scalars(query):
        found.setdefault(row.adapter_name, {})[row.node_id] = row.path
    return found


def _adapter_record(session: Session, row: AdapterRow) -> AdapterRecord:
    return _record(row, _locations(session, [row.name]).get(row.name, {}))


def _record(row: AdapterRow, locations: dict[str, str]) -> AdapterRecord:
    return AdapterRecord(
        name=row.name,
        base_model=row.base_model,
        format=cast(AdapterFormatName, row.format),
        rank=row.rank,
        target_modules=tuple(row.target_modules),
        source=cast(ModelSource, row.source),
        repo_id=row.repo_id,
        revision=row.revision,
        created_at=aware(row.created_at),
        locations=dict(locations),
    )
