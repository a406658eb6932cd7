"""Placement: pure decisions on where a deployment goes, over plain values.

- :mod:`.estimate`: the VRAM a deployment needs, from its model's shape (:mod:`.shape`,
  read by :mod:`.model_files` from a GGUF header, :mod:`.gguf`, or an HF ``config.json``,
  :mod:`.hf_config`: the only modules here that read files);
- :mod:`.fit`: the free VRAM of a GPU for placement, and the choice of GPUs by fit and
  replica spread;
- :mod:`.eviction`: which idle deployments to stop to make room;
- :mod:`.plan`: :func:`plan_placement`, the whole decision, from what :mod:`.request`
  holds (the request, each node's facts, the image settings) to what :mod:`.result` holds
  (a placement or a typed refusal).

The lifecycle manager gathers the facts (:class:`NodeFacts`), asks :func:`plan_placement`
and carries the answer out; nothing here but the file readers does I/O.
"""

from berth.placement.estimate import EstimateRequest, VramEstimate, estimate_vram, mib
from berth.placement.eviction import Eviction, EvictionRefusal, choose_eviction
from berth.placement.fit import GpuFacts, GpuOption, ReplicaAt, Resident
from berth.placement.plan import plan_placement
from berth.placement.request import (
    EvictionPolicy,
    GpuReservation,
    NodeFacts,
    PlacementPolicy,
    PlacementRequest,
)
from berth.placement.result import (
    CONFLICT_REASONS,
    ModelAt,
    ModelPull,
    Placement,
    Refusal,
    RefusalReason,
)
from berth.placement.shape import ModelShape

__all__ = [
    "CONFLICT_REASONS",
    "EstimateRequest",
    "Eviction",
    "EvictionPolicy",
    "EvictionRefusal",
    "GpuFacts",
    "GpuOption",
    "GpuReservation",
    "ModelAt",
    "ModelPull",
    "ModelShape",
    "NodeFacts",
    "Placement",
    "PlacementPolicy",
    "PlacementRequest",
    "Refusal",
    "RefusalReason",
    "ReplicaAt",
    "Resident",
    "VramEstimate",
    "choose_eviction",
    "estimate_vram",
    "mib",
    "plan_placement",
]
