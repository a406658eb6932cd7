"""Cordoned and drained nodes: the :class:`Store`'s maintenance half (migration 16).

A node is *cordoned* while it has a ``node_drains`` row: no new deployment is placed on it
(``berth nodes cordon``).  A *drain* (``berth nodes drain``) is a cordon with a start time,
a grace for requests in flight and whether ``--force`` was given; each deployment the drain
moves has a ``drain_moves`` row saying which step it is at::

    replacing ──▶ retired ──▶ stopped
        │
        └──▶ left ──▶ replacing (tried again later)

- ``replacing``: its replacement (``replacement_id``; ``None`` until placed) is starting
  elsewhere; the deployment still serves.
- ``retired``: the replacement is ready; the deployment gets no new request since
  ``retired_at`` (epoch s) and is stopped once its requests in flight finish, at the latest
  ``grace_s`` later.
- ``stopped``: done.
- ``left``: it stays where it is, and ``note`` says why (pinned to the node, or it fits
  nowhere else); ``--force`` stops it instead.

The drain is state here, not a loop in memory: whichever leader is active carries it on
from these rows (:mod:`berth.deployments.drain`), so a leader restart or a failover resumes
it.  Every write is fenced like the rest of the cluster state; ``now`` values are epoch
seconds from the caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import cast

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.store.tables import DrainMoveRow, NodeDrainRow, NodeRow
from berth.vocab.drains import MOVE_STEPS, DrainMove, MoveStep, NodeDrain


class DrainMethods:
    """Store methods for cordons and drains (see the module doc)."""

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _fenced_write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def cordon_node(self, node_id: str, now: float) -> NodeDrain:
        """Cordon ``node_id`` at ``now`` (a node already cordoned stays as it is).  Raises
        :class:`NotFoundError` for an unknown node, :class:`ConflictError` for a removed one."""
        with self._fenced_write() as session:
            _live_node(session, node_id)
            row = session.get(NodeDrainRow, node_id)
            if row is None:
                row = NodeDrainRow(
                    node_id=node_id,
                    cordoned_at=now,
                    drain_started_at=None,
                    grace_s=None,
                    force=False,
                    finished_at=None,
                )
                session.add(row)
                session.flush()
            return _drain(session, row)

    def uncordon_node(self, node_id: str) -> NodeDrain | None:
        """Take ``node_id`` out of maintenance: placement may use it again, a drain under way
        stops where it is (replacements started stay).  What it was, or ``None`` when it was
        not cordoned.  Raises :class:`NotFoundError` for an unknown node."""
        with self._fenced_write() as session:
            if session.get(NodeRow, node_id) is None:
                raise NotFoundError("node", node_id)
            row = session.get(NodeDrainRow, node_id)
            if row is None:
                return None
            was = _drain(session, row)
            session.execute(delete(DrainMoveRow).where(DrainMoveRow.node_id == node_id))
            session.delete(row)
            return was

    def start_drain(self, node_id: str, now: float, *, grace_s: float, force: bool) -> NodeDrain:
        """Cordon ``node_id`` and drain it from ``now``: each deployment on it is moved
        elsewhere (:mod:`berth.deployments.drain`), its requests in flight given ``grace_s``
        seconds.  Asked again while it drains, the grace and ``force`` are updated; asked
        after it finished, it drains again (what was left is tried again).  Raises
        :class:`ConfigError` for a negative grace, :class:`NotFoundError` for an unknown
        node and :class:`ConflictError` for a removed one."""
        if grace_s < 0:
            raise ConfigError(f"the grace must not be negative, got {grace_s} s")
        with self._fenced_write() as session:
            _live_node(session, node_id)
            row = session.get(NodeDrainRow, node_id)
            if row is None:
                row = NodeDrainRow(node_id=node_id, cordoned_at=now, force=force)
                session.add(row)
            if row.drain_started_at is None or row.finished_at is not None:
                row.drain_started_at = now
            row.finished_at = None
            row.grace_s = grace_s
            row.force = force
            session.flush()
            return _drain(session, row)

    def finish_drain(self, node_id: str, now: float) -> None:
        """Record that ``node_id``'s drain has nothing left to move (at ``now``); a node no
        longer cordoned is left alone."""
        with self._fenced_write() as session:
            row = session.get(NodeDrainRow, node_id)
            if row is not None and row.drain_started_at is not None and row.finished_at is None:
                row.finished_at = now

    def node_drain(self, node_id: str) -> NodeDrain | None:
        """``node_id``'s cordon and drain, or ``None`` when it is not cordoned."""
        with self._read() as session:
            row = session.get(NodeDrainRow, node_id)
            return None if row is None else _drain(session, row)

    def node_drains(self) -> list[NodeDrain]:
        """Every cordoned node with its drain, by node id."""
        with self._read() as session:
            rows = session.scalars(select(NodeDrainRow).order_by(NodeDrainRow.node_id))
            return [_drain(session, row) for row in rows]

    def record_drain_move(
        self,
        node_id: str,
        deployment_id: str,
        step: MoveStep,
        now: float,
        *,
        replacement_id: str | None = None,
        retired_at: float | None = None,
        note: str | None = None,
    ) -> DrainMove:
        """Write the move of ``deployment_id`` off ``node_id`` as at ``step`` (``now``: epoch
        s).  Raises :class:`ConfigError` for an unknown step and :class:`ConflictError` when
        the node is no longer draining (it was uncordoned meanwhile: nothing is written)."""
        if step not in MOVE_STEPS:
            raise ConfigError(f"unknown drain step {step!r}; valid: {', '.join(MOVE_STEPS)}")
        with self._fenced_write() as session:
            drain = session.get(NodeDrainRow, node_id)
            if drain is None or drain.drain_started_at is None:
                raise ConflictError(f"node {node_id} is not being drained")
            row = session.get(DrainMoveRow, deployment_id)
            if row is None:
                row = DrainMoveRow(deployment_id=deployment_id, node_id=node_id)
                session.add(row)
            row.step = step
            row.replacement_id = replacement_id
            row.retired_at = retired_at
            row.note = note
            row.updated_at = now
            session.flush()
            return _move(row)


def _live_node(session: Session, node_id: str) -> NodeRow:
    row = session.get(NodeRow, node_id)
    if row is None:
        raise NotFoundError("node", node_id)
    if row.status == "removed":
        raise ConflictError(f"node {row.label} ({row.id}) was removed")
    return row


def _moves(session: Session, node_id: str) -> Iterator[DrainMove]:
    query = (
        select(DrainMoveRow)
        .where(DrainMoveRow.node_id == node_id)
        .order_by(DrainMoveRow.deployment_id)
    )
    for row in session.scalars(query):
        yield _move(row)


def _move(row: DrainMoveRow) -> DrainMove:
    return DrainMove(
        deployment_id=row.deployment_id,
        node_id=row.node_id,
        step=cast(MoveStep, row.step),
        replacement_id=row.replacement_id,
        retired_at=row.retired_at,
        note=row.note,
        updated_at=row.updated_at,
    )


def _drain(session: Session, row: NodeDrainRow) -> NodeDrain:
    return NodeDrain(
        node_id=row.node_id,
        cordoned_at=row.cordoned_at,
        drain_started_at=row.drain_started_at,
        grace_s=row.grace_s,
        force=bool(row.force),
        finished_at=row.finished_at,
        moves=tuple(_moves(session, row.node_id)),
    )
