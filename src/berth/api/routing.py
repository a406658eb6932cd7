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
    setting) rather than known (the service's capacity, the engine's flag).

    ``cache_signal``: under the ``prefix`` policy, what its engine last said of its prefix
    cache on the probe cycle and what that corrected, in words (``llama.cpp /slots: 1,532
    tokens cached in 2 slots``; ``""``: not read)."""

    rank: int
    deployment_id: str
    node_id: str
    affinity_hit: bool
    reason: str
    slots: int | None = None
    slots_from: str = ""
    slots_assumed: bool = False
    cache_signal: str = ""


class DroppedCandidate(ApiModel):
    """A deployment the router's hard filter left out, and why."""

    deployment_id: str
    node_id: str
    reason: str


class LastDecision(ApiModel):
    """The model's last request that had a choice to make: its ``outcome`` (``matched``,
    ``overridden_by_load``, ``no_match``: the prefix policy's; ``affinity``: a session
    header's node took it; ``least_loaded``: the least-load policy's), the deployment first
    tried, its match (prompt blocks it held, about ``matched_tokens`` tokens), the longest
    match among the candidates (more than its own when the load bound overrode it), and
    the reason in words."""

    policy: str
    outcome: str
    deployment_id: str
    matched_blocks: int = 0
    matched_tokens: int = 0
    longest_blocks: int = 0
    reason: str = ""


class RoutingExplanation(ApiModel):
    """The ranking for ``model``; ``affinity_node`` is where the request's session (if any)
    last went; ``policy`` the routing policy its requests follow (``least-load``,
    ``prefix``) and ``last_decision`` how the last one went (``None``: none yet).

    Under ``prefix`` the ranking shown is the scorer's, before a prompt reorders it: what a
    request with no cached prefix anywhere would get."""

    model: str
    affinity_node: str | None
    candidates: list[RankedCandidate]
    dropped: list[DroppedCandidate]
    policy: str = "least-load"
    last_decision: LastDecision | None = None
