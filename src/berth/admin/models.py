"""``/admin/models``: the models the leader knows (``berth models``), where each has files,
and one model's detail (:mod:`.model_detail`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from berth.admin.model_detail import model_detail
from berth.admin.roles import needs
from berth.api import LocatedModel, ModelDetail, ModelIn, ModelRemoved, RegisteredModel
from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.lifecycle import LifecycleManager
from berth.deployments.model_registration import located_model_view, register_model
from berth.store import Store
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
        return await register_model(store, lifecycle, body)

    @router.get("/admin/models/{name:path}", dependencies=[needs(Role.VIEWER)])
    async def show_model(name: str) -> ModelDetail:
        return await model_detail(store, lifecycle.estimator, links, name)

    @router.delete("/admin/models/{name:path}", dependencies=[needs(Role.OPERATOR)])
    async def remove_model(name: str) -> ModelRemoved:
        await asyncio.to_thread(store.remove_model, name)
        await lifecycle.refresh_known_models()
        return ModelRemoved(removed=name)

    return router
