"""A cordoned node and its drain, as the store returns them (:class:`NodeDrain`, each
deployment it moves a :class:`DrainMove` at one :data:`MoveStep`): frozen values, read by
placement's drain plan, the drain runner and the admin API. The steps and what each means:
:mod:`berth.store.drains`, which keeps them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

MoveStep = Literal["replacing", "retired", "stopped", "left"]
MOVE_STEPS: tuple[MoveStep, ...] = get_args(MoveStep)


@dataclass(frozen=True)
class DrainMove:
    """One deployment a drain moves (see the module doc for the steps)."""

    deployment_id: str
    node_id: str
    step: MoveStep
    replacement_id: str | None
    retired_at: float | None
    note: str | None
    updated_at: float


@dataclass(frozen=True)
class NodeDrain:
    """A cordoned node and its drain, if one was asked (``drain_started_at`` set).

    ``finished_at``: when no deployment was left to move (``None``: still draining, or
    cordoned only).  ``moves``: the deployments the drain has looked at, by id.
    """

    node_id: str
    cordoned_at: float
    drain_started_at: float | None
    grace_s: float | None
    force: bool
    finished_at: float | None
    moves: tuple[DrainMove, ...] = ()

    @property
    def draining(self) -> bool:
        """A drain was asked and has not finished."""
        return self.drain_started_at is not None and self.finished_at is None

    def move(self, deployment_id: str) -> DrainMove | None:
        """The move of ``deployment_id``, if the drain has one."""
        return next((m for m in self.moves if m.deployment_id == deployment_id), None)
