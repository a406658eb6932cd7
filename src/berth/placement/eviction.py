"""Which idle deployments to stop to make room on chosen GPUs: a pure choice.

:func:`choose_eviction` is handed the GPUs a deployment should go to (their
:class:`~berth.placement.fit.GpuFacts`, with berth's residents and their use), the memory
the deployment needs free on each, the current time and the minimum residency, and returns
either an :class:`Eviction` (the deployments to stop, least recently used first, with a
reason each) or an :class:`EvictionRefusal` saying why no choice makes room.  It stops
nothing: the scaling controller carries the choice out.

The rules (issue 14):

* a deployment may be stopped only when it is **idle**: not pinned, no request in flight
  and none queued, not still starting, and resident at least ``min_residency_s`` (so two
  models asked for in turn cannot evict each other back and forth);
* among those, the **least recently used** go first: by the time of their last request,
  or, for one that has had none, the time it started; ties by start time, then id;
* only as many as needed: once enough is free on every GPU, any chosen deployment the
  room does not depend on is kept (the most recently used are looked at first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from berth.humanize import age
from berth.placement.estimate import mib
from berth.placement.fit import GpuFacts, Resident


@dataclass(frozen=True)
class Eviction:
    """Stop ``deployment_ids`` (in this order) to make room; ``frees_mb`` by GPU index, and
    one reason line per deployment."""

    deployment_ids: tuple[str, ...]
    frees_mb: tuple[tuple[int, int], ...]
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class EvictionRefusal:
    """No eviction makes room: ``message`` says why; ``kept`` names each deployment that may
    not be stopped, with the rule that keeps it."""

    message: str
    kept: tuple[tuple[str, str], ...] = ()


def why_kept(resident: Resident, *, now: float, min_residency_s: float) -> str | None:
    """Why ``resident`` may not be evicted now, or ``None`` when it may."""
    if resident.pinned:
        return "pinned"
    if resident.in_flight:
        return f"{resident.in_flight} request(s) in flight"
    if resident.queued:
        return f"{resident.queued} request(s) queued"
    if resident.starting:
        return "still starting"
    resident_s = now - resident.started_at
    if resident_s < min_residency_s:
        return (
            f"resident {age(max(resident_s, 0.0))}, under the minimum residency of "
            f"{age(min_residency_s)}"
        )
    return None


def last_used_at(resident: Resident) -> float:
    """When ``resident`` was last used: its last request, else its start."""
    if resident.last_request_at is not None:
        return resident.last_request_at
    return resident.started_at


def choose_eviction(
    gpus: Sequence[GpuFacts],
    need_mb: Mapping[int, int],
    *,
    now: float,
    min_residency_s: float,
) -> Eviction | EvictionRefusal:
    """The idle deployments to stop so that each GPU ``i`` of ``gpus`` has ``need_mb[i]`` MiB
    free (see the module docstring for the rules).

    ``now`` and the residents' times are epoch seconds.  A GPU of ``gpus`` missing from
    ``need_mb`` needs nothing.  When the GPUs already have room, the eviction is empty.
    """
    free = {gpu.index: gpu.unfloored_free_mb for gpu in gpus}
    short = {i: need - free.get(i, 0) for i, need in need_mb.items() if need > free.get(i, 0)}
    if not short:
        return Eviction((), (), ())
    # Every deployment on the GPUs, with what stopping it frees on each.
    frees: dict[str, dict[int, int]] = {}
    residents: dict[str, Resident] = {}
    for gpu in gpus:
        for r in gpu.residents:
            frees.setdefault(r.deployment_id, {})[gpu.index] = r.vram_mb
            residents[r.deployment_id] = r
    kept: list[tuple[str, str]] = []
    idle: list[Resident] = []
    for deployment_id, resident in sorted(residents.items()):
        why = why_kept(resident, now=now, min_residency_s=min_residency_s)
        if why is None:
            idle.append(resident)
        else:
            kept.append((deployment_id, why))
    idle.sort(key=lambda r: (last_used_at(r), r.started_at, r.deployment_id))

    def covered(chosen: Sequence[Resident]) -> bool:
        return all(
            sum(frees[r.deployment_id].get(i, 0) for r in chosen) >= missing
            for i, missing in short.items()
        )

    chosen: list[Resident] = []
    for resident in idle:
        if covered(chosen):
            break
        if any(frees[resident.deployment_id].get(i, 0) for i in short):
            chosen.append(resident)
    if not covered(chosen):
        shortfall = ", ".join(f"GPU {i} is short of {mib(m)}" for i, m in sorted(short.items()))
        detail = "; ".join(f"{d}: {why}" for d, why in kept)
        message = f"stopping every idle deployment would not make room ({shortfall})"
        if detail:
            message += f"; kept: {detail}"
        return EvictionRefusal(message, tuple(kept))
    for resident in sorted(chosen, key=last_used_at, reverse=True):
        rest = [r for r in chosen if r is not resident]
        if covered(rest):
            chosen = rest
    freed: dict[int, int] = {}
    for resident in chosen:
        for i, mb in frees[resident.deployment_id].items():
            freed[i] = freed.get(i, 0) + mb
    reasons = tuple(
        f"stop {r.deployment_id} ({r.served_model_name}): {_idle_line(r, now)}, frees "
        f"{mib(sum(frees[r.deployment_id].values()))}"
        for r in chosen
    )
    return Eviction(tuple(r.deployment_id for r in chosen), tuple(sorted(freed.items())), reasons)


def _idle_line(resident: Resident, now: float) -> str:
    if resident.last_request_at is None:
        return f"no request since it started {age(max(now - resident.started_at, 0.0))} ago"
    return f"last request {age(max(now - resident.last_request_at, 0.0))} ago"
