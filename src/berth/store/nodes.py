"""The node registry, enrollment tokens and model locations: the :class:`Store`'s cluster half.

:class:`NodeMethods` is mixed into :class:`berth.store.Store`; it only uses the store's
session helpers and clock, so these methods behave like every other store method (short
sessions, write transactions, frozen records).

Times passed in as ``now`` are epoch seconds (``time.time()``), so callers decide the clock
(tests pass a fixed one).  Enrollment tokens are stored only as their peppered hash, so a
leader restart neither loses nor resurrects them.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any, Final, cast

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from berth.errors import ConfigError, ConflictError, EnrollmentTokenError, NotFoundError
from berth.store.tables import (
    EnrollmentTokenRow,
    ModelLocationRow,
    ModelRow,
    NodeCertificateRow,
    NodeRow,
)
from berth.vocab.gpu import GpuInfo
from berth.vocab.records import NODE_STATUSES, ModelLocation, NodeHardware, NodeRecord, NodeStatus

#: The leader's own host: always present, always this id and label, never removable.
LOCAL_NODE_ID: Final = "local"

_ID_ATTEMPTS = 8


class NodeMethods:
    """Store methods for nodes, enrollment tokens and model locations (see the module doc)."""

    _clock: Callable[[], datetime]

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    # --- nodes -------------------------------------------------------------------------

    def ensure_local_node(self) -> NodeRecord:
        """Create node ``local`` (status ``ready``) if missing; return it."""
        with self._write() as session:
            row = session.get(NodeRow, LOCAL_NODE_ID)
            if row is None:
                row = _new_node(LOCAL_NODE_ID, LOCAL_NODE_ID, "ready", None, self._clock())
                session.add(row)
        return _node_record(row)

    def propose_node_id(self, label: str) -> str:
        """The id a registration for ``label`` will get: the existing node's, else a fresh
        unused ``n-`` + 8 hex (not reserved; :meth:`enroll_node` checks it)."""
        with self._read() as session:
            existing = _node_by_label(session, label)
            if existing is not None:
                return existing.id
            for _ in range(_ID_ATTEMPTS):
                candidate = "n-" + secrets.token_hex(4)
                if session.get(NodeRow, candidate) is None:
                    return candidate
        raise ConflictError("could not find a free node id")  # pragma: no cover

    def enroll_node(
        self, label: str, cert_fingerprint: str, *, node_id: str | None = None
    ) -> NodeRecord:
        """Record that ``label`` holds the client certificate ``cert_fingerprint``.

        A new label gets ``node_id`` (default: a fresh one) and status ``unreachable`` until
        its agent says Hello.  Re-enrolling a label keeps its id, replaces the fingerprint
        and sets the status back to ``unreachable`` (also for a removed node).  Raises
        :class:`ConflictError` for ``local``, or when ``node_id`` differs from the id the
        label already has (a concurrent registration of the same label won).
        """
        if label == LOCAL_NODE_ID:
            raise ConflictError("the label 'local' is the leader's own node")
        with self._write() as session:
            row = _node_by_label(session, label)
            if row is not None:
                if node_id is not None and node_id != row.id:
                    raise ConflictError(f"node {label!r} was enrolled concurrently as {row.id}")
                row.cert_fingerprint = cert_fingerprint
                row.status = "unreachable"
                return _node_record(row)
            node_id = node_id or "n-" + secrets.token_hex(4)
            row = _new_node(node_id, label, "unreachable", cert_fingerprint, self._clock())
            session.add(row)
            session.flush()
            return _node_record(row)

    def get_node(self, node_id: str) -> NodeRecord:
        """The node ``node_id`` (removed ones too); :class:`NotFoundError` if there is none."""
        with self._read() as session:
            return _node_record(_node_row(session, node_id))

    def get_node_by_label(self, label: str) -> NodeRecord:
        """The node labelled ``label`` (removed ones too); :class:`NotFoundError` if none."""
        with self._read() as session:
            row = _node_by_label(session, label)
            if row is None:
                raise NotFoundError("node", label)
            return _node_record(row)

    def lookup_node(self, id_or_label: str) -> NodeRecord:
        """The node whose id, else whose label, is ``id_or_label``; :class:`NotFoundError`."""
        with self._read() as session:
            row = session.get(NodeRow, id_or_label) or _node_by_label(session, id_or_label)
            if row is None:
                raise NotFoundError("node", id_or_label)
            return _node_record(row)

    def find_node_by_fingerprint(self, cert_fingerprint: str) -> NodeRecord | None:
        """The node enrolled with this client certificate, or renewed from it (removed ones
        too), or ``None``."""
        with self._read() as session:
            row = session.scalars(
                select(NodeRow).where(NodeRow.cert_fingerprint == cert_fingerprint)
            ).first()
            if row is None:
                issued = session.get(NodeCertificateRow, cert_fingerprint)
                row = None if issued is None else session.get(NodeRow, issued.node_id)
            return None if row is None else _node_record(row)

    def list_nodes(self, include_removed: bool = False) -> list[NodeRecord]:
        """Nodes, ``local`` first, then by label; removed ones only when asked."""
        query = select(NodeRow).order_by(NodeRow.id != LOCAL_NODE_ID, NodeRow.label)
        if not include_removed:
            query = query.where(NodeRow.status != "removed")
        with self._read() as session:
            return [_node_record(row) for row in session.scalars(query)]

    def record_node_hello(
        self,
        node_id: str,
        *,
        agent_version: str,
        protocol_version: int,
        capabilities: Sequence[str],
        inventory: NodeHardware,
        now: float,
    ) -> NodeRecord:
        """Record an agent's Hello: its versions, capabilities and hardware; status ``ready``.

        Raises :class:`NotFoundError` for an unknown node and :class:`ConflictError` for a
        removed one (its link must be refused).
        """
        with self._write() as session:
            row = _node_row(session, node_id)
            _refuse_removed(row)
            row.agent_version = agent_version
            row.protocol_version = protocol_version
            row.capabilities = list(capabilities)
            row.inventory = _inventory_json(inventory)
            row.last_heartbeat_at = now
            row.status = "ready"
            return _node_record(row)

    def record_node_heartbeat(
        self, node_id: str, now: float, inventory: NodeHardware | None = None
    ) -> NodeRecord:
        """Record a heartbeat at ``now`` (epoch s), and new hardware figures when given.

        Raises :class:`NotFoundError` for an unknown node.
        """
        with self._write() as session:
            row = _node_row(session, node_id)
            row.last_heartbeat_at = now
            if inventory is not None:
                row.inventory = _inventory_json(inventory)
            return _node_record(row)

    def set_node_status(self, node_id: str, status: NodeStatus) -> NodeRecord:
        """Set the status (``ready`` when a link comes up, ``unreachable`` when it drops).

        A removed node stays removed unless re-enrolled: raises :class:`ConflictError`.
        Raises :class:`ConfigError` for an unknown status, :class:`NotFoundError` for an
        unknown node.
        """
        if status not in NODE_STATUSES:
            raise ConfigError(f"unknown node status {status!r}; valid: {', '.join(NODE_STATUSES)}")
        with self._write() as session:
            row = _node_row(session, node_id)
            if status != "removed":
                _refuse_removed(row)
            row.status = status
            return _node_record(row)

    def remove_node(self, node_id: str) -> NodeRecord:
        """Mark ``node_id`` removed; its fingerprint is kept so its agent is told "removed".

        Removing twice is harmless.  Raises :class:`ConflictError` for ``local`` and
        :class:`NotFoundError` for an unknown node.
        """
        if node_id == LOCAL_NODE_ID:
            raise ConflictError("node 'local' is the leader's own host and cannot be removed")
        with self._write() as session:
            row = _node_row(session, node_id)
            row.status = "removed"
            return _node_record(row)

    # --- enrollment tokens -------------------------------------------------------------

    def create_enrollment_token(self, label: str, token_hash: str, expires_at: float) -> None:
        """Store a single-use token for ``label`` by its hash, valid until ``expires_at``.

        Raises :class:`ConflictError` for ``local`` or a hash already stored.
        """
        if label == LOCAL_NODE_ID:
            raise ConflictError("the label 'local' is the leader's own node")
        with self._write() as session:
            if session.get(EnrollmentTokenRow, token_hash) is not None:
                raise ConflictError("an enrollment token with this hash already exists")
            session.add(
                EnrollmentTokenRow(
                    token_hash=token_hash,
                    label=label,
                    expires_at=expires_at,
                    used_at=None,
                    created_at=self._clock(),
                )
            )

    def consume_enrollment_token(self, token_hash: str, now: float) -> str:
        """Spend the token with this hash at ``now`` (epoch s) and return its label.

        Raises :class:`EnrollmentTokenError` with reason ``unknown``, ``used`` (single use:
        the second call for one token always fails) or ``expired``.
        """
        with self._write() as session:
            row = session.get(EnrollmentTokenRow, token_hash)
            if row is None:
                raise EnrollmentTokenError("unknown", "unknown enrollment token")
            if row.used_at is not None:
                raise EnrollmentTokenError("used", "enrollment token already used")
            if now >= row.expires_at:
                raise EnrollmentTokenError(
                    "expired", "enrollment token expired; create a new one with berth nodes enroll"
                )
            row.used_at = now
            return row.label

    # --- model locations ---------------------------------------------------------------

    def set_model_location(self, model_name: str, node_id: str, path: str) -> ModelLocation:
        """Record (or replace) where ``model_name``'s weights are on ``node_id``'s host.

        Raises :class:`NotFoundError` for an unknown model or node.
        """
        with self._write() as session:
            if session.get(ModelRow, model_name) is None:
                raise NotFoundError("model", model_name)
            _node_row(session, node_id)
            row = session.get(ModelLocationRow, (model_name, node_id))
            if row is None:
                row = ModelLocationRow(model_name=model_name, node_id=node_id, path=path)
                session.add(row)
            else:
                row.path = path
            return ModelLocation(model_name, node_id, path)

    def model_path_on_node(self, model_name: str, node_id: str) -> str | None:
        """The recorded path of ``model_name`` on ``node_id``, or ``None`` if none."""
        with self._read() as session:
            row = session.get(ModelLocationRow, (model_name, node_id))
            return None if row is None else row.path

    def list_model_locations(self, model_name: str | None = None) -> list[ModelLocation]:
        """Every recorded location (of one model when ``model_name`` is given)."""
        query = select(ModelLocationRow).order_by(
            ModelLocationRow.model_name, ModelLocationRow.node_id
        )
        if model_name is not None:
            query = query.where(ModelLocationRow.model_name == model_name)
        with self._read() as session:
            return [
                ModelLocation(row.model_name, row.node_id, row.path)
                for row in session.scalars(query)
            ]


def delete_model_locations(session: Session, model_name: str) -> None:
    """Drop every location of ``model_name`` (the model is being removed)."""
    session.execute(delete(ModelLocationRow).where(ModelLocationRow.model_name == model_name))


def _node_row(session: Session, node_id: str) -> NodeRow:
    row = session.get(NodeRow, node_id)
    if row is None:
        raise NotFoundError("node", node_id)
    return row


def _node_by_label(session: Session, label: str) -> NodeRow | None:
    return session.scalars(select(NodeRow).where(NodeRow.label == label)).first()


def _refuse_removed(row: NodeRow) -> None:
    if row.status == "removed":
        raise ConflictError(f"node {row.label} ({row.id}) was removed; enroll it again")


def _inventory_json(inventory: NodeHardware) -> dict[str, Any]:
    data = asdict(inventory)
    data["gpus"] = [asdict(gpu) for gpu in inventory.gpus]
    return data


def _inventory(data: dict[str, Any] | None) -> NodeHardware | None:
    if data is None:
        return None
    return NodeHardware(
        hostname=str(data["hostname"]),
        cpu_count=int(data["cpu_count"]),
        memory_total_mb=int(data["memory_total_mb"]),
        gpus=tuple(
            GpuInfo(
                index=int(gpu["index"]),
                name=str(gpu["name"]),
                uuid=str(gpu["uuid"]),
                memory_total_mb=int(gpu["memory_total_mb"]),
                memory_used_mb=int(gpu["memory_used_mb"]),
                utilization_pct=gpu.get("utilization_pct"),
            )
            for gpu in data.get("gpus", ())
        ),
    )


def _node_record(row: NodeRow) -> NodeRecord:
    created = row.created_at
    created = created.replace(tzinfo=UTC) if created.tzinfo is None else created.astimezone(UTC)
    return NodeRecord(
        id=row.id,
        label=row.label,
        status=cast(NodeStatus, row.status),
        cert_fingerprint=row.cert_fingerprint,
        agent_version=row.agent_version,
        protocol_version=row.protocol_version,
        capabilities=tuple(row.capabilities),
        inventory=_inventory(cast("dict[str, Any] | None", row.inventory)),
        last_heartbeat_at=row.last_heartbeat_at,
        created_at=created,
    )


def _new_node(
    node_id: str, label: str, status: NodeStatus, fingerprint: str | None, now: datetime
) -> NodeRow:
    """A node's row before its agent's first Hello: no version, capabilities, inventory or
    heartbeat yet."""
    return NodeRow(
        id=node_id,
        label=label,
        status=status,
        cert_fingerprint=fingerprint,
        agent_version=None,
        protocol_version=None,
        capabilities=[],
        inventory=None,
        last_heartbeat_at=None,
        created_at=now,
    )
