"""The admin API's pull routes: ``/admin/pulls`` (start, list, show, cancel), and the pull
jobs wired to the leader's registries.

A finished download is registered as ``berth pull`` registers it
(:func:`berth.api.pulls.pulled_registration`), through the same code as ``POST
/admin/models`` and ``POST /admin/adapters``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

from fastapi import APIRouter

from berth.admin.adapters import register_adapter
from berth.admin.roles import needs
from berth.api import AdapterIn
from berth.api.pulls import Pull, PullIn, pulled_registration
from berth.deployments.adapters import AdapterManager
from berth.deployments.lifecycle import LifecycleManager
from berth.deployments.model_registration import model_view, register_model
from berth.deployments.pulls import PullJobs
from berth.store import Store
from berth.vocab.roles import Role


def leader_pull_jobs(
    store: Store, lifecycle: LifecycleManager, adapters: AdapterManager, models_dir: Path
) -> PullJobs:
    """Pull jobs into ``models_dir`` (``$BERTH_HOME/models``) that register what they pulled
    in ``store``: a model (``lifecycle`` learns its name) or an adapter (``adapters``
    reloads its registry)."""

    async def taken() -> set[str]:
        models = await asyncio.to_thread(store.list_models)
        adapters = await asyncio.to_thread(store.list_adapters)
        return {m.name for m in models} | {a.name for a in adapters}

    async def register(body: PullIn, folder: Path) -> Literal["model", "adapter"]:
        models = [model_view(r) for r in await asyncio.to_thread(store.list_models)]
        registration = await asyncio.to_thread(pulled_registration, body, folder, models)
        if isinstance(registration, AdapterIn):
            await register_adapter(store, adapters, registration)
            return "adapter"
        await register_model(store, lifecycle, registration)
        return "model"

    return PullJobs(models_dir=models_dir, register=register, taken=taken)


def build_pull_router(jobs: PullJobs) -> APIRouter:
    """The pull routes over ``jobs``."""
    router = APIRouter()

    @router.post("/admin/pulls", status_code=202, dependencies=[needs(Role.OPERATOR)])
    async def start_pull(body: PullIn) -> Pull:
        return await jobs.start(body)

    @router.get("/admin/pulls", dependencies=[needs(Role.VIEWER)])
    async def list_pulls() -> list[Pull]:
        return jobs.list()

    @router.get("/admin/pulls/{pull_id}", dependencies=[needs(Role.VIEWER)])
    async def show_pull(pull_id: str) -> Pull:
        return jobs.get(pull_id)

    @router.delete("/admin/pulls/{pull_id}", dependencies=[needs(Role.OPERATOR)])
    async def cancel_pull(pull_id: str) -> Pull:
        return await jobs.cancel(pull_id)

    return router
