"""``/admin/models``: the models the leader knows (``berth models``), where each has files,
and one model's detail (:mod:`.model_detail`)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from fastapi import APIRouter

from berth.admin.model_detail import model_detail
from berth.admin.roles import needs
from berth.api import LocatedModel, ModelDetail, ModelIn, ModelRemoved, RegisteredModel
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.lifecycle import LifecycleManager
from berth.deployments.model_registration import located_model_view, register_model
from berth.store import Store
from berth.vocab.agent_policy import AgentPolicy, check_path
from berth.vocab.roles import Role


def build_model_router(store: Store, lifecycle: LifecycleManager, links: LinkRegistry) -> APIRouter:
    """List, register, show and remove models (``/admin/models[/{name}]``); a model's detail
    asks each node's link where its files are (``links``)."""
    router = APIRouter()

    @router.get("/admin/models", dependencies=[needs(Role.VIEWER)])
    async def list_models() -> list[LocatedModel]:
        records = await asyncio.to_thread(store.list_models)
        locations = await asyncio.to_thread(store.list_model_locations)
        return [
            located_model_view(r, {x.node_id: x.path for x in locations if x.model_name == r.name})
            for r in records
        ]

    @router.post("/admin/models", status_code=201, dependencies=[needs(Role.OPERATOR)])
    async def add_model(body: ModelIn) -> LocatedModel | RegisteredModel:
        added = await register_model(store, lifecycle, body)
        local = links.get(LOCAL_NODE_ID)
        if isinstance(added, LocatedModel) or local is None or local.agent_policy is None:
            return added
        warning = await asyncio.to_thread(outside_roots_warning, added.path, local.agent_policy)
        return added if warning is None else added.model_copy(update={"warning": warning})

    @router.get("/admin/models/{name:path}", dependencies=[needs(Role.VIEWER)])
    async def show_model(name: str) -> ModelDetail:
        return await model_detail(store, lifecycle.estimator, links, name)

    @router.delete("/admin/models/{name:path}", dependencies=[needs(Role.OPERATOR)])
    async def remove_model(name: str) -> ModelRemoved:
        await asyncio.to_thread(store.remove_model, name)
        await lifecycle.refresh_known_models()
        return ModelRemoved(removed=name)

    return router


def outside_roots_warning(path: str, policy: AgentPolicy) -> str | None:
    """What to tell whoever registered weights at ``path`` (on the leader's host) that node
    local's ``policy`` keeps from engines, with the command that allows their folder (the
    roots it has, and the folder); ``None`` when ``path`` lies under a model root."""
    refusal = check_path("model path", path, policy, os.path.realpath)
    if refusal is None:
        return None
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    roots = ",".join(str(root) for root in (*policy.model_roots, folder))
    return (
        f"node local will refuse to run it: {refusal.message}; allow its folder with "
        f"`berth config set-policy model_roots={roots}`, then restart the daemon "
        "(`berth daemon stop`, `berth daemon start`)"
    )
