"""``GET /admin/routing/{model}``: where a request for ``model`` would go, and why.

The ranking the proxy would use right now, from the same router: each candidate with its
place, the reason (affinity, in flight, p95, free GPU memory) and its slots at the fair
admission queue with where they came from (known or assumed), and the ones the hard filter
dropped; the routing policy its requests follow and how the last one went (under
``prefix``: the matched prefix, and why a load bound overrode it). ``?session=ID`` (or
``?conversation=ID``) explains a request that carries that ``X-Session-Id``
(``X-Conversation-Id``). A model that nothing serves now is answered 409 with the reason
(the proxy's 503 is for a request that cannot be served; this one asks about the router).
"""

from __future__ import annotations

from fastapi import APIRouter

from berth.admin.roles import needs
from berth.api import DroppedCandidate, LastDecision, RankedCandidate, RoutingExplanation
from berth.errors import ConflictError
from berth.routing.affinity import affinity_key
from berth.routing.errors import NoReadyDeploymentError
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from berth.vocab.roles import Role


def build_routing_router(routing: Router) -> APIRouter:
    """``GET /admin/routing/{model}``: how ``routing`` (the proxy's router) ranks a
    model's deployments now, and why."""
    router = APIRouter()

    @router.get("/admin/routing/{model:path}", dependencies=[needs(Role.VIEWER)])
    async def explain_route(
        model: str, session: str | None = None, conversation: str | None = None
    ) -> RoutingExplanation:
        headers: list[tuple[bytes, bytes]] = []
        if session:
            headers.append((b"x-session-id", session.encode("latin-1", "replace")))
        if conversation:
            headers.append((b"x-conversation-id", conversation.encode("latin-1", "replace")))
        key = affinity_key(headers)
        try:
            ranking = routing.explain(model, key)
            # The same table the ranking just read (no await between): each one's slots.
            listed = routing.resolver.candidates(model)
        except NoReadyDeploymentError as exc:
            raise ConflictError(str(exc)) from None
        upstreams = {u.deployment_id: u for u in listed}
        none = Upstream("", "", "", model)
        last = routing.last_decisions.get(model)
        return RoutingExplanation(
            model=model,
            policy=routing.policy_of(listed),
            last_decision=None
            if last is None
            else LastDecision(
                policy=last.policy,
                outcome=last.outcome,
                deployment_id=last.deployment_id,
                matched_blocks=last.matched_blocks,
                matched_tokens=last.matched_tokens,
                longest_blocks=last.longest_blocks,
                reason=last.reason,
            ),
            affinity_node=routing.affinity.get(key),
            candidates=[
                RankedCandidate(
                    rank=place,
                    deployment_id=r.candidate.deployment_id,
                    node_id=r.candidate.node_id,
                    affinity_hit=r.affinity_hit,
                    reason=r.reason,
                    slots=u.slots,
                    slots_from=u.slots_from,
                    slots_assumed=u.slots_assumed,
                    cache_signal=cache_signal_text(routing, r.candidate.deployment_id),
                )
                for place, r in enumerate(ranking.ranked, start=1)
                for u in (upstreams.get(r.candidate.deployment_id, none),)
            ],
            dropped=[
                DroppedCandidate(
                    deployment_id=d.candidate.deployment_id,
                    node_id=d.candidate.node_id,
                    reason=d.reason,
                )
                for d in ranking.dropped
            ],
        )

    return router


def cache_signal_text(router: Router, deployment_id: str) -> str:
    """The deployment's last cache signal and its correction, in words (``""``: none read)."""
    last = router.cache_signals.get(deployment_id)
    if last is None:
        return ""
    signal, correction = last
    return signal.describe() + (f"; {correction.reason}" if correction.reason else "")
