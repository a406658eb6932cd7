"""Which deployments of a base model can serve one of its LoRA adapters, in tiers (pure).

A request for an adapter goes to a ready deployment of its base, ranked by tier first:

0. ``loaded``: the engine has the adapter now (or is loading it for another request);
   a llama.cpp engine started with the adapter (``--lora``) always has it;
1. ``free_slot``: the engine has room for one more adapter and the adapter's files are on
   its node;
2. ``evict``: every slot is taken, but one holds an adapter no request is using: the least
   recently used such adapter is unloaded first (:func:`eviction_choice`).

A deployment whose slots all hold adapters in use, whose node lacks the adapter's files, or
whose engine cannot take adapters at all (a llama.cpp engine started without this one, an
engine started without LoRA) is in no tier: it never gets the request, nor its retries. Only
the best non-empty tier is scored for the first choice (:mod:`berth.routing.scorer`); the
lower tiers follow it, so a failed attempt is retried only where the adapter is loaded or can
be loaded.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


class AdapterTier(enum.IntEnum):
    """How ready a deployment is for an adapter (lower is better)."""

    LOADED = 0
    FREE_SLOT = 1
    EVICT = 2


@dataclass(frozen=True)
class AdapterSlots:
    """A deployment's adapters as the leader knows them.

    ``slots`` is how many adapters its engine holds at once (``None``: the adapters were
    given at start, llama.cpp's way, and ``loaded`` is all it will ever have); ``loaded``
    the adapters it has or is loading; ``busy`` those with requests in flight; ``has_files``
    whether the adapter asked for is on the deployment's node.
    """

    deployment_id: str
    slots: int | None
    loaded: frozenset[str] = frozenset()
    busy: frozenset[str] = frozenset()
    has_files: bool = True


@dataclass(frozen=True)
class Tiered:
    """Each deployment that can serve the adapter, with its tier; and why the others cannot
    (deployment id -> reason, for ``/admin/routing`` and the 503 a request gets)."""

    tiers: Mapping[str, AdapterTier]
    refused: Mapping[str, str] = field(default_factory=dict)


def tier_of(adapter: str, deployment: AdapterSlots) -> AdapterTier | str:
    """``deployment``'s tier for ``adapter``, or the reason it has none."""
    if adapter in deployment.loaded:
        return AdapterTier.LOADED
    if deployment.slots is None:
        return "its engine was started without this adapter (restart it to add one)"
    if not deployment.has_files:
        return "the adapter's files are not on its node"
    if len(deployment.loaded) < deployment.slots:
        return AdapterTier.FREE_SLOT
    if deployment.loaded - deployment.busy:
        return AdapterTier.EVICT
    return f"all {deployment.slots} adapter slots are in use"


def rank_tiers(adapter: str, deployments: Iterable[AdapterSlots]) -> Tiered:
    """The tier of each deployment for ``adapter`` (see the module docstring)."""
    tiers: dict[str, AdapterTier] = {}
    refused: dict[str, str] = {}
    for deployment in deployments:
        found = tier_of(adapter, deployment)
        if isinstance(found, AdapterTier):
            tiers[deployment.deployment_id] = found
        else:
            refused[deployment.deployment_id] = found
    return Tiered(tiers, refused)


def eviction_choice(deployment: AdapterSlots, last_used: Mapping[str, float]) -> str | None:
    """The adapter to unload to make room: the least recently used of those no request is
    using (``last_used`` maps adapters to when they last served, in any clock; one never
    used counts as oldest); ``None`` when every loaded adapter is in use. Ties go to the
    first name in order, so the choice is the same every time."""
    idle = sorted(deployment.loaded - deployment.busy)
    if not idle:
        return None
    return min(idle, key=lambda name: (last_used.get(name, float("-inf")), name))
