"""The router: candidates from the table of ready deployments, ranked with live signals and
the affinity map, then, under the ``prefix`` policy, reordered for the engines' prefix
caches (:mod:`berth.routing.prefix`); the proxy walks the result
(``gateway/dispatch.py``)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from berth.routing.affinity import API_KEY_PREFIX, AffinityMap, SessionRecord
from berth.routing.affinity import affinity_key as request_affinity_key
from berth.routing.cache_signals import CacheSignal, Correction, correct
from berth.routing.prefix import DEFAULT_LOAD_FACTOR, PrefixCandidate, PrefixOutcome, choose
from berth.routing.prefix_blocks import PromptBlocks, prompt_blocks
from berth.routing.prefix_index import PrefixIndex, PrefixRecord
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
from berth.vocab.policies import RoutingPolicy

if TYPE_CHECKING:
    from berth.cluster.leader.agent_link import AgentLink
    from berth.cluster.leader.link_registry import LinkRegistry
    from berth.routing.resolver import Upstream, UpstreamResolver


#: A routing decision's outcome, as counted in ``berth_routing_decisions_total``: the
#: prefix policy's (:data:`berth.routing.prefix.PrefixOutcome`), ``affinity`` (a session
#: header's node took it, under either policy) or ``least_loaded`` (the least-load policy).
DecisionOutcome = Literal["matched", "overridden_by_load", "no_match", "affinity", "least_loaded"]
DECISION_OUTCOMES: tuple[DecisionOutcome, ...] = (
    "matched",
    "overridden_by_load",
    "no_match",
    "affinity",
    "least_loaded",
)


@dataclass(frozen=True)
class RoutingDecision:
    """Where a request with a choice to make went, and why (``berth routing`` shows a
    model's last one): the policy, the outcome, the deployment first tried, its match
    (prompt blocks it holds, and their rough tokens), the longest match among the
    candidates, and the reason in words."""

    policy: RoutingPolicy
    outcome: DecisionOutcome
    deployment_id: str
    matched_blocks: int = 0
    matched_tokens: int = 0
    longest_blocks: int = 0
    reason: str = ""


class Router:
    """Plans where a request goes: every ready deployment of the model on a reachable node,
    best first.

    ``node_reported(node_id)`` says whether a node has sent signals (a remote node before its
    first heartbeat has not); ``free_vram_mb(node_id)`` its free GPU memory when known.
    ``links``, when given, is watched: a node whose link goes loses its affinity entries
    and the requests waiting on it for a first byte are sent elsewhere (:meth:`node_lost`).
    ``waiting`` holds those requests (shared with whoever gives up deployments: the
    health watcher).

    ``policy`` is the default routing policy (a service's own wins: ``Upstream.
    routing_policy``); ``prefixes`` the prefix policy's record, ``load_factor`` its bound
    (:mod:`berth.routing.prefix`); ``on_decision(policy, outcome)`` hears every decision
    among two or more candidates (the metrics' counter).
    """

    def __init__(
        self,
        resolver: UpstreamResolver,
        *,
        signals: SignalBoard | None = None,
        affinity: SessionRecord | None = None,
        node_reported: Callable[[str], bool] = lambda _node: True,
        free_vram_mb: Callable[[str], int | None] = lambda _node: None,
        links: LinkRegistry | None = None,
        waiting: WaitingAttempts | None = None,
        policy: RoutingPolicy = "least-load",
        prefixes: PrefixRecord | None = None,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        on_decision: Callable[[str, str], None] | None = None,
    ) -> None:
        self.resolver = resolver
        self.signals = signals or SignalBoard()
        self.waiting = waiting if waiting is not None else WaitingAttempts()
        self.affinity: SessionRecord = affinity if affinity is not None else AffinityMap()
        self._node_reported = node_reported
        self._free_vram_mb = free_vram_mb
        self._turn = itertools.count()
        self.policy: RoutingPolicy = policy
        self.prefixes: PrefixRecord = prefixes if prefixes is not None else PrefixIndex()
        self.load_factor = load_factor
        self._on_decision = on_decision
        #: model -> its last decision among two or more candidates (known models only)
        self.last_decisions: dict[str, RoutingDecision] = {}
        #: deployment id -> node id, of the deployments with prefix entries
        self._node_of: dict[str, str] = {}
        #: deployment id -> its engine's last cache signal and what it corrected (the
        #: probe cycle's readings, :meth:`cache_reported`; ``berth routing`` shows them)
        self.cache_signals: dict[str, tuple[CacheSignal, Correction]] = {}
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
        self,
        model: str,
        headers: Sequence[tuple[bytes, bytes]],
        payload: Mapping[str, object] | None = None,
    ) -> tuple[list[Upstream], str | None]:
        """:meth:`plan` for a request with these ASGI ``headers`` and parsed body
        ``payload`` (its messages or prompt: the prefix policy's input), and its affinity key.

        The key is only worked out when there is a choice to make: a model served by one
        deployment costs no header scan, no hashing and no affinity entry (key ``None``).
        """
        upstreams = self.resolver.candidates(model)
        if len(upstreams) == 1:
            return upstreams, None
        key = request_affinity_key(headers)
        ranking = self.explain_upstreams(upstreams, key)
        by_id = {u.deployment_id: u for u in upstreams}
        ordered = [by_id[r.candidate.deployment_id] for r in ranking.ranked]
        if not ordered:
            return ordered, key
        policy = self.policy_of(ordered)
        strong = key is not None and not key.startswith(API_KEY_PREFIX)
        hit = strong and bool(ranking.ranked) and ranking.ranked[0].affinity_hit
        if policy == "prefix" and payload is not None:
            ordered, decision = self._by_prefix(ranking, by_id, prompt_blocks(payload), hit)
        else:
            outcome: DecisionOutcome = "affinity" if hit else "least_loaded"
            decision = RoutingDecision(policy, outcome, ordered[0].deployment_id)
        self.last_decisions[model] = decision
        if self._on_decision is not None:
            self._on_decision(decision.policy, decision.outcome)
        return ordered, key

    def policy_of(self, upstreams: Sequence[Upstream]) -> RoutingPolicy:
        """The policy for a request with these candidates: the first one's service's, else
        the default (a route merging services of two policies follows its first)."""
        own = upstreams[0].routing_policy if upstreams else None
        return own or self.policy

    def _by_prefix(
        self,
        ranking: Ranking,
        by_id: Mapping[str, Upstream],
        blocks: PromptBlocks,
        affinity_hit: bool,
    ) -> tuple[list[Upstream], RoutingDecision]:
        """The prefix policy over the scorer's ``ranking`` (each adapter tier on its own);
        records the first choice as holding ``blocks``."""
        ranked = [by_id[r.candidate.deployment_id] for r in ranking.ranked]
        matches = self.prefixes.matches(blocks, by_id)
        first = ranked[0]
        decision: RoutingDecision | None
        if affinity_hit:  # a session header's node wins: it has the conversation
            matched = matches.get(first.deployment_id, 0)
            decision = RoutingDecision(
                "prefix",
                "affinity",
                first.deployment_id,
                matched,
                blocks.approx_tokens(matched),
                max(matches.values(), default=0),
                "the request's session last went to this deployment's node",
            )
            order = ranked
        else:
            order = []
            decision = None
            for tier in sorted({u.tier for u in ranked}):
                members = [
                    r for r in ranking.ranked if by_id[r.candidate.deployment_id].tier == tier
                ]
                choice = choose(
                    [
                        PrefixCandidate(
                            r.candidate.deployment_id,
                            self.signals.in_flight(r.candidate.deployment_id),
                            matches.get(r.candidate.deployment_id, 0),
                            demoted=r.candidate.signals is None
                            or r.candidate.signals.recently_failed,
                        )
                        for r in members
                    ],
                    self.load_factor,
                )
                order.extend(by_id[d] for d in choice.order)
                if decision is None:
                    outcome: PrefixOutcome = choice.outcome
                    decision = RoutingDecision(
                        "prefix",
                        outcome,
                        choice.chosen,
                        choice.matched_blocks,
                        blocks.approx_tokens(choice.matched_blocks),
                        choice.longest_blocks,
                        choice.reason,
                    )
        assert decision is not None  # ranked is never empty here
        if blocks.hashes:
            order = [dataclasses.replace(u, prompt_blocks=blocks) for u in order]
            self._record(order[0], blocks)
        return order, decision

    def _record(self, upstream: Upstream, blocks: PromptBlocks) -> None:
        self.prefixes.record(upstream.deployment_id, blocks)
        self._node_of[upstream.deployment_id] = upstream.node_id

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
        """A dispatch to ``upstream`` answered: remember the node for this key, and, under
        the prefix policy, that its deployment holds the request's prompt (a retry's
        deployment too: the first choice was recorded when it was chosen)."""
        self.affinity.record(affinity_key, upstream.node_id)
        if upstream.prompt_blocks is not None:
            self._record(upstream, upstream.prompt_blocks)

    def cache_reported(self, deployment_id: str, signal: CacheSignal) -> Correction:
        """The probe cycle read ``signal`` from the deployment's engine: correct its prefix
        entries by it (:func:`berth.routing.cache_signals.correct`: a restarted or empty
        engine's go, the rest are capped by its capacity) and keep it for ``berth routing``.
        Returns the correction applied."""
        last = self.cache_signals.get(deployment_id)
        previous = None if last is None else last[0]
        correction = correct(previous, signal, in_flight=self.signals.in_flight(deployment_id))
        if correction.drop:
            self.prefixes.drop(deployment_id)
        elif correction.cap_blocks is not None:
            self.prefixes.trim({deployment_id: correction.cap_blocks})
        self.cache_signals[deployment_id] = (signal, correction)
        return correction

    def deployment_gone(self, deployment_id: str) -> int:
        """The deployment stopped or was removed: forget its prefix entries at once (how
        many there were), its engine's cache signal and its last decisions."""
        self._node_of.pop(deployment_id, None)
        self.cache_signals.pop(deployment_id, None)
        for model in [
            m for m, d in self.last_decisions.items() if d.deployment_id == deployment_id
        ]:
            del self.last_decisions[model]
        return self.prefixes.drop(deployment_id)

    def node_lost(self, node_id: str) -> int:
        """A node became unreachable: forget its affinity entries (how many there were are
        returned), and send the requests waiting on it for a first byte elsewhere."""
        self.waiting.give_up_node(node_id, f"is on node {node_id}, whose link was lost")
        for deployment_id in [d for d, n in self._node_of.items() if n == node_id]:
            self.deployment_gone(deployment_id)
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
