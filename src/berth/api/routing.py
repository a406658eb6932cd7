"""``GET /admin/routing/{model}``: where a request would go now, and why."""

from __future__ import annotations

from berth.api.base import ApiModel


class RankedCandidate(ApiModel):
    """A deployment in the order the router would try it (``rank`` 1 first), with the
    reason in words; ``affinity_hit``: the request's session last went to its node.

    ``slots``: the requests the leader's fair admission queue lets through to it at once
    (``None``: not held); ``slots_from``: where that number came from, in words (``the
    service's capacity setting``, ``--parallel 2``, ``default_slots: ...``);
    ``slots_assumed``: whether it is assumed (an engine's default, the ``default_slots``
    setting) rather than known (the service's capacity, the engine's flag)."""

    rank: int
    deployment_id: str
    node_id: str
    affinity_hit: bool
    reason: str
    slots: int | None = None
    slots_from: str = ""
    slots_assumed: bool = False


class DroppedCandidate(ApiModel):
    """A deployment the router's hard filter left out, and why."""

    deployment_id: str
    node_id: str
    reason: str


class RoutingExplanation(ApiModel):
    """The ranking for ``model``; ``affinity_node`` is where the request's session (if any)
    last went."""

    model: str
    affinity_node: str | None
    candidates: list[RankedCandidate]
    dropped: list[DroppedCandidate]
