"""``GET /admin/routing/{model}``: where a request for ``model`` would go, and why.

The ranking the proxy would use right now, from the same router: each candidate with its
place and the reason (affinity, in flight, p95, free GPU memory), and the ones the hard
filter dropped. ``?session=ID`` (or ``?conversation=ID``) explains a request that carries
that ``X-Session-Id`` (``X-Conversation-Id``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter

from berth.api import DroppedCandidate, RankedCandidate, RoutingExplanation
from berth.routing.affinity import affinity_key

if TYPE_CHECKING:
    from berth.daemon.services import LeaderServices


def build_routing_router(services: LeaderServices) -> APIRouter:
    router = APIRouter()

    @router.get("/admin/routing/{model:path}")
    async def explain_route(
        model: str, session: str | None = None, conversation: str | None = None
    ) -> RoutingExplanation:
        headers: list[tuple[bytes, bytes]] = []
        if session:
            headers.append((b"x-session-id", session.encode("latin-1", "replace")))
        if conversation:
            headers.append((b"x-conversation-id", conversation.encode("latin-1", "replace")))
        key = affinity_key(headers)
        routing = services.proxy.router
        ranking = routing.explain(model, key)
        return RoutingExplanation(
            model=model,
            affinity_node=routing.affinity.get(key),
            candidates=[
                RankedCandidate(
                    rank=place,
                    deployment_id=r.candidate.deployment_id,
                    node_id=r.candidate.node_id,
                    affinity_hit=r.affinity_hit,
                    reason=r.reason,
                )
                for place, r in enumerate(ranking.ranked, start=1)
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
