"""Placement: pure decisions on where a deployment goes, over plain values.

The lifecycle manager gathers the facts (:class:`NodeFacts`), asks :func:`plan_placement`
and carries the answer out; nothing here does I/O.
"""

from berth.placement.plan import (
    CONFLICT_REASONS,
    GpuReservation,
    ModelAt,
    ModelPull,
    NodeFacts,
    Placement,
    PlacementPolicy,
    PlacementRequest,
    Refusal,
    RefusalReason,
    plan_placement,
)

__all__ = [
    "CONFLICT_REASONS",
    "GpuReservation",
    "ModelAt",
    "ModelPull",
    "NodeFacts",
    "Placement",
    "PlacementPolicy",
    "PlacementRequest",
    "Refusal",
    "RefusalReason",
    "plan_placement",
]
