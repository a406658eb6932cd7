"""The scorer: ranks the deployments that can serve a request, and says why (pure).

Rules, in order:

1. a hard filter drops a candidate whose node is known to lack the free GPU memory the
   request needs (``required_vram_mb``; skipped when either number is unknown);
2. a lexicographic rank: a node that has reported signals before one that has not; a
   deployment without a recent failed attempt before one with (``SignalBoard.failed``); an
   affinity hit (the node that served this session before: its KV cache holds the prompt),
   unless that node has more than :data:`AFFINITY_MAX_EXTRA_IN_FLIGHT` requests in flight
   beyond the least busy candidate;
   fewer requests in flight on the node; a lower recent p95 latency (:func:`p95_bucket`:
   near-equal latencies tie, an unknown one is tried first); then a rotating tie-break so
   that equal nodes share the load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: p95 latencies within this factor of each other count as equal (log-scale buckets).
P95_BUCKET_RATIO = 1.5
#: p95 latencies under this many ms count as equal.
P95_FLOOR_MS = 50.0
#: An affinity hit is set aside when its node has more than this many requests in flight
#: beyond the least busy candidate: a cache hit is not worth a queue (and a key shared by
#: many clients, such as one API key, must not pin them all to one node).
AFFINITY_MAX_EXTRA_IN_FLIGHT = 4


@dataclass(frozen=True)
class NodeSignals:
    """What is known of a node's load: requests in flight (all its deployments), the
    deployment's recent p95 latency in ms (``None``: no samples yet), free GPU memory in MiB
    (``None``: unknown, e.g. no GPU inventory)."""

    in_flight: int
    p95_ms: float | None = None
    free_vram_mb: int | None = None
    recently_failed: bool = False


@dataclass(frozen=True)
class Candidate:
    """A ready deployment of the requested model; ``signals`` is ``None`` for a node that
    has reported nothing yet."""

    deployment_id: str
    node_id: str
    signals: NodeSignals | None
    required_vram_mb: int | None = None


@dataclass(frozen=True)
class Ranked:
    """A candidate in its place, with the reason in words (for ``/admin/routing``)."""

    candidate: Candidate
    affinity_hit: bool
    reason: str


@dataclass(frozen=True)
class Dropped:
    candidate: Candidate
    reason: str


@dataclass(frozen=True)
class Ranking:
    ranked: tuple[Ranked, ...]
    dropped: tuple[Dropped, ...]


def p95_bucket(p95_ms: float | None) -> float:
    """The latency bucket used for ranking (lower is better).

    Below :data:`P95_FLOOR_MS` every latency is bucket 0: differences there are noise, not
    signal. Above it, buckets grow by a factor :data:`P95_BUCKET_RATIO`. An unknown p95 is
    ``-inf``: a deployment without samples yet is tried, or it would never get any.
    """
    if p95_ms is None:
        return -math.inf
    if p95_ms < P95_FLOOR_MS:
        return 0
    return 1 + math.floor(math.log(p95_ms / P95_FLOOR_MS) / math.log(P95_BUCKET_RATIO))


def rank(
    candidates: Sequence[Candidate],
    affinity_node: str | None = None,
    rotation: int = 0,
    affinity_slack: int = AFFINITY_MAX_EXTRA_IN_FLIGHT,
) -> Ranking:
    """Order ``candidates`` best first (see the module docstring for the rules).

    ``affinity_node`` is the node the affinity map points at (``None``: no entry);
    ``rotation`` shifts the final tie-break (pass a counter so that ties alternate);
    ``affinity_slack`` is how many more requests in flight than the least busy candidate the
    affinity node may have and still be preferred (0: only when it is among the least busy).
    """
    kept: list[Candidate] = []
    dropped: list[Dropped] = []
    for candidate in candidates:
        signals = candidate.signals
        need = candidate.required_vram_mb
        free = signals.free_vram_mb if signals is not None else None
        if free is not None and need is not None and free < need:
            why = f"needs {need} MiB of GPU memory, node has {free} MiB free"
            dropped.append(Dropped(candidate, why))
            continue
        kept.append(candidate)
    count = len(kept)
    loads = [c.signals.in_flight for c in kept if c.signals is not None]
    least = min(loads, default=0)
    set_aside = any(
        c.node_id == affinity_node
        and c.signals is not None
        and c.signals.in_flight > least + affinity_slack
        for c in kept
    )
    if set_aside:
        affinity_node = None

    def key(item: tuple[int, Candidate]) -> tuple[bool, bool, bool, int, float, int]:
        index, candidate = item
        signals = candidate.signals
        hit = candidate.node_id == affinity_node
        turn = (index - rotation) % max(count, 1)
        if signals is None:
            return (True, False, not hit, 0, 0.0, turn)
        p95 = p95_bucket(signals.p95_ms)
        return (False, signals.recently_failed, not hit, signals.in_flight, p95, turn)

    ordered = sorted(enumerate(kept), key=key)
    ranked = tuple(
        Ranked(c, c.node_id == affinity_node, _reason(c, c.node_id == affinity_node, set_aside))
        for _i, c in ordered
    )
    return Ranking(ranked, tuple(dropped))


def _reason(candidate: Candidate, hit: bool, set_aside: bool = False) -> str:
    signals = candidate.signals
    if signals is None:
        return "no signals from its node yet (ranked last)"
    affinity = "affinity hit" if hit else "no affinity"
    if set_aside and not hit:
        affinity += " (the affinity node is too busy)"
    parts = [affinity, f"{signals.in_flight} in flight"]
    if signals.recently_failed:
        parts.insert(0, "failed recently (ranked after healthy ones)")
    parts.append("p95 unknown" if signals.p95_ms is None else f"p95 {signals.p95_ms:.1f} ms")
    if signals.free_vram_mb is not None:
        parts.append(f"{signals.free_vram_mb} MiB GPU memory free")
    return ", ".join(parts)
