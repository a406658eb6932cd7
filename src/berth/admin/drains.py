"""The admin API's maintenance routes: cordon, uncordon and drain a node.

- ``POST /admin/nodes/{id-or-label}/cordon`` → :class:`~berth.api.NodeMaintenance`: nothing
  new is placed on the node (placement, on-demand loads, scale-out); what runs there runs on;
- ``DELETE /admin/nodes/{id-or-label}/cordon`` → :class:`~berth.api.Uncordoned`: it takes
  placements again, and a drain under way stops where it is;
- ``POST /admin/nodes/{id-or-label}/drain`` ``{"grace_s", "force"}`` →
  :class:`~berth.api.NodeMaintenance`: cordon, then move every deployment off it
  (:mod:`berth.deployments.drain`).

The drain is written to the store and carried out by the active leader's
:class:`~berth.deployments.drain.DrainRunner`, told to look at once.  The routes take only
what they use: the store and the runner (``None`` on a leader that runs no drains).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import APIRouter

from berth.admin.roles import needs
from berth.api import (
    DrainActionOut,
    DrainIn,
    DrainMoveOut,
    MaintenanceState,
    NodeMaintenance,
    Uncordoned,
)
from berth.deployments.drain import DrainRunner
from berth.placement.drain import DrainPlan, drain_summary
from berth.store import Store
from berth.vocab.drains import NodeDrain
from berth.vocab.roles import Role


def maintenance_view(drain: NodeDrain, plan: DrainPlan | None = None) -> NodeMaintenance:
    """A cordoned node's maintenance as the API shows it; ``plan`` is the drain's last look
    on this leader, if any."""
    state: MaintenanceState
    if drain.drain_started_at is None:
        state = "cordoned"
    elif drain.finished_at is None:
        state = "draining"
    else:
        state = "drained"
    return NodeMaintenance(
        state=state,
        summary=drain_summary(drain, plan),
        cordoned_at=drain.cordoned_at,
        drain_started_at=drain.drain_started_at,
        grace_s=drain.grace_s,
        force=drain.force,
        finished_at=drain.finished_at,
        moves=[
            DrainMoveOut(
                deployment_id=m.deployment_id,
                step=m.step,
                replacement_id=m.replacement_id,
                retired_at=m.retired_at,
                note=m.note,
                updated_at=m.updated_at,
            )
            for m in drain.moves
        ],
        actions=[
            DrainActionOut(deployment_id=a.deployment_id, action=a.kind, reason=a.reason)
            for a in (plan.actions if plan is not None else ())
        ],
    )


def build_drain_router(
    store: Store, runner: DrainRunner | None, *, clock: Callable[[], float] = time.time
) -> APIRouter:
    """The cordon and drain routes over ``store``, waking ``runner`` on each change."""
    router = APIRouter()

    def view(drain: NodeDrain) -> NodeMaintenance:
        plan = runner.plans.get(drain.node_id) if runner is not None else None
        return maintenance_view(drain, plan)

    def wake() -> None:
        if runner is not None:
            runner.wake()

    @router.post("/admin/nodes/{ident}/cordon", dependencies=[needs(Role.OPERATOR)])
    async def cordon(ident: str) -> NodeMaintenance:
        record = await asyncio.to_thread(store.lookup_node, ident)
        drain = await asyncio.to_thread(store.cordon_node, record.id, clock())
        wake()
        return view(drain)

    @router.delete("/admin/nodes/{ident}/cordon", dependencies=[needs(Role.OPERATOR)])
    async def uncordon(ident: str) -> Uncordoned:
        record = await asyncio.to_thread(store.lookup_node, ident)
        was = await asyncio.to_thread(store.uncordon_node, record.id)
        wake()
        return Uncordoned(
            node_id=record.id, label=record.label, was=None if was is None else view(was)
        )

    @router.post("/admin/nodes/{ident}/drain", status_code=202, dependencies=[needs(Role.OPERATOR)])
    async def drain(ident: str, body: DrainIn) -> NodeMaintenance:
        record = await asyncio.to_thread(store.lookup_node, ident)
        started = await asyncio.to_thread(
            store.start_drain, record.id, clock(), grace_s=body.grace_s, force=body.force
        )
        wake()
        return view(started)

    return router
