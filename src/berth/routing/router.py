"""The router: candidates from the table of ready deployments, ranked with live signals and
the affinity map; the proxy walks the result (``gateway/dispatch.py``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from berth.routing.affinity import API_KEY_PREFIX, AffinityMap
from berth.routing.affinity import affinity_key as request_affinity_key
from berth.routing.scorer import (
    AFFINITY_MAX_EXTRA_IN_FLIGHT,
    Candidate,
    Dropped,
    NodeSignals,
    Ranked,
    Ranking,
    rank,
)
from berth.routing.signals import SignalBoard
from berth.routing.waiting import WaitingAttempts

if TYPE_CHECKING:
    from berth.cluster.link import AgentLink
    from berth.cluster.link_registry import LinkRegistry
    from berth.routing.resolver import Upstream, UpstreamResolver


class Router:
    """Plans where a request goes: every ready deployment of the model on a reachable node,
    best first.

    ``node_reported(node_id)`` says whether a node has sent signals (a remote node before its
    first heartbeat has not); ``free_vram_mb(node_id)`` its free GPU memory when known.
    ``links``, when given, is watched: a node whose link goes loses its affinity entries
    and the requests waiting on it for a first byte are sent elsewhere (:meth:`node_lost`).
    ``waiting`` holds those requests (shared with whoever gives up deployments: the
    health watcher).
    """

    def __init__(
        self,
        resolver: UpstreamResolver,
        *,
        signals: SignalBoard | None = None,
        affinity: AffinityMap | None = None,
        node_reported: Callable[[str], bool] = lambda _node: True,
        free_vram_mb: Callable[[str], int | None] = lambda _node: None,
        links: LinkRegistry | None = None,
        waiting: WaitingAttempts | None = None,
    ) -> None:
        self.resolver = resolver
        self.signals = signals or SignalBoard()
        self.waiting = waiting if waiting is not None else WaitingAttempts()
        self.affinity = affinity or AffinityMap()
        self._node_reported = node_reported
        self._free_vram_mb = free_vram_mb
        self._turn = itertools.count()
        if links is not None:
            links.watch(self._link_changed)

    def plan(self, model: str, affinity_key: str | None) -> list[Upstream]:
        """The ready deployments of ``model``, best first.

        Raises ``NotFoundError`` (unknown model) and ``NoReadyDeploymentError`` (none ready)
        from the resolver.
        """
        upstreams = self.resolver.candidates(model)
        return upstreams if len(upstreams) == 1 else self._ordered(upstreams, affinity_key)

    def plan_request(
        self, model: str, headers: Sequence[tuple[bytes, bytes]]
    ) -> tuple[list[Upstream], str | None]:
        """:meth:`plan` for a request with these ASGI ``headers``, and its affinity key.

        The key is only worked out when there is a choice to make: a model served by one
        deployment costs no header scan, no hashing and no affinity entry (key ``None``).
        """
        upstreams = self.resolver.candidates(model)
        if len(upstreams) == 1:
            return upstreams, None
        key = request_affinity_key(headers)
        return self._ordered(upstreams, key), key

    def why_first(self, plan: Sequence[Upstream], affinity_key: str | None) -> str:
        """Why ``plan[0]`` leads a plan made for ``affinity_key``: the scorer's reason in
        words (for the request's trace). Changes neither the affinity map's order nor the
        tie-break rotation; a reason does not depend on the rotation."""
        if len(plan) == 1:
            return "the only ready deployment"
        ranking = self._rank(list(plan), affinity_key, self.affinity.peek(affinity_key), 0)
        first = plan[0].deployment_id
        for ranked in ranking.ranked:
            if ranked.candidate.deployment_id == first:
                return ranked.reason
        return "ranked first"

    def _ordered(self, upstreams: list[Upstream], affinity_key: str | None) -> list[Upstream]:
        ranking = self.explain_upstreams(upstreams, affinity_key)
        by_id = {u.deployment_id: u for u in upstreams}
        return [by_id[r.candidate.deployment_id] for r in ranking.ranked]

    def explain(self, model: str, affinity_key: str | None = None) -> Ranking:
        """The ranking :meth:`plan` would use, with reasons (for the admin API); it changes
        neither the affinity map's order nor the tie-break rotation."""
        upstreams = self.resolver.candidates(model)
        return self._rank(upstreams, affinity_key, self.affinity.peek(affinity_key), 0)

    def explain_upstreams(self, upstreams: list[Upstream], affinity_key: str | None) -> Ranking:
        """Rank ``upstreams`` for a request with ``affinity_key`` (advances the rotation)."""
        node = self.affinity.get(affinity_key)
        return self._rank(upstreams, affinity_key, node, next(self._turn))

    def _rank(
        self,
        upstreams: list[Upstream],
        affinity_key: str | None,
        affinity_node: str | None,
        rotation: int,
    ) -> Ranking:
        # A key that is only the API key (no session header) may be shared by many
        # clients: it breaks ties between equally busy nodes but never outweighs load.
        weak = affinity_key is not None and affinity_key.startswith(API_KEY_PREFIX)
        slack = 0 if weak else AFFINITY_MAX_EXTRA_IN_FLIGHT
        # An adapter's candidates come in tiers (routing/adapters.py): each tier is scored on
        # its own, the best first, so a lower tier is only reached by a retry.
        ranked: list[Ranked] = []
        dropped: list[Dropped] = []
        for tier in sorted({u.tier for u in upstreams}):
            candidates = [
                Candidate(u.deployment_id, u.node_id, self._signals_of(u))
                for u in upstreams
                if u.tier == tier
            ]
            ranking = rank(candidates, affinity_node, rotation, slack)
            ranked.extend(ranking.ranked)
            dropped.extend(ranking.dropped)
        return Ranking(tuple(ranked), tuple(dropped))

    def succeeded(self, affinity_key: str | None, upstream: Upstream) -> None:
        """A dispatch to ``upstream`` answered: remember the node for this key."""
        self.affinity.record(affinity_key, upstream.node_id)

    def node_lost(self, node_id: str) -> int:
        """A node became unreachable: forget its affinity entries (how many there were are
        returned), and send the requests waiting on it for a first byte elsewhere."""
        self.waiting.give_up_node(node_id, f"is on node {node_id}, whose link was lost")
        return self.affinity.forget_node(node_id)

    def _link_changed(self, node_id: str, link: AgentLink | None) -> None:
        if link is None:
            self.node_lost(node_id)

    def _signals_of(self, upstream: Upstream) -> NodeSignals | None:
        node = upstream.node_id
        if not self._node_reported(node):
            return None
        return NodeSignals(
            in_flight=self.signals.node_in_flight(node),
            p95_ms=self.signals.p95_ms(upstream.deployment_id),
            free_vram_mb=self._free_vram_mb(node),
            recently_failed=self.signals.recently_failed(upstream.deployment_id),
        )
