"""The admin API's LoRA adapter routes: ``/admin/adapters`` (register, list, show, remove).

Registering an adapter on the leader's own host reads its files and the base model's
(:mod:`berth.weights.adapter_files`) and refuses, with every reason, one that is not an
adapter or does not fit its base; a path on another node's host is taken as given (the
engine checks it when it loads it). After each change the router's registry is reloaded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter

from berth.admin.roles import needs
from berth.api import Adapter, AdapterIn, AdapterLoaded, AdapterRemoved, AddedAdapter
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.deployments.adapters import AdapterManager
from berth.deployments.lora_plan import lora_notes, plan_lora
from berth.deployments.planner import DeployOptions, PlannedDeployment
from berth.errors import ConfigError
from berth.placement import Placement
from berth.store import Store
from berth.vocab.records import AdapterRecord, ModelRecord
from berth.vocab.roles import Role
from berth.weights.adapter_files import (
    AdapterFacts,
    adapter_format_of,
    check_fits,
    inspect_adapter,
    inspect_base,
)


def adapter_view(record: AdapterRecord, manager: AdapterManager) -> Adapter:
    """An adapter for the admin API, with where it is loaded now."""
    return Adapter(
        name=record.name,
        base=record.base_model,
        format=record.format,
        rank=record.rank,
        target_modules=list(record.target_modules),
        source=record.source,
        repo_id=record.repo_id,
        revision=record.revision,
        created_at=record.created_at,
        locations=dict(record.locations),
        loaded_on=[
            AdapterLoaded(deployment_id=d, node_id=n) for d, n in manager.loaded_on(record.name)
        ],
    )


async def reload_adapters(store: Store, manager: AdapterManager) -> None:
    """Give the router the store's adapters (at start and after every change)."""
    manager.load_registry(await asyncio.to_thread(store.list_adapters))


def check_local_adapter(path: Path, base: ModelRecord) -> AdapterFacts:
    """Read the adapter at ``path`` and check it against ``base``'s files (when they are on
    this host). Raises :class:`ConfigError` with every reason it is refused. Blocking."""
    facts = inspect_adapter(path)
    base_facts = None
    if base.source != "remote":
        base_facts = inspect_base(base.path, repo_id=base.repo_id)
    if base_facts is not None:
        reasons = check_fits(facts, base_facts, base_name=base.name)
        if reasons:
            raise ConfigError(
                f"adapter {path} does not fit model {base.name!r}: " + "; ".join(reasons)
            )
    return facts


async def plan_notes(
    store: Store, manager: AdapterManager, options: DeployOptions, planned: PlannedDeployment
) -> list[str]:
    """What ``berth plan`` says of the model's adapters: what the planned deployment would
    start with (when it is placed), and which running deployments of the model need a
    restart to serve adapters registered after they started. Raises ``ConfigError`` for a
    ``max_adapters`` the deployment could not take (:func:`plan_lora`)."""
    records = await asyncio.to_thread(store.list_adapters, planned.model.name)
    notes: list[str] = []
    result = planned.result
    if isinstance(result, Placement):
        lora = plan_lora(
            planned.engine,
            result.runtime,
            result.node_id,
            records,
            max_adapters=options.max_adapters,
            node_serves_adapters=manager.node_serves_adapters(result.node_id),
        )
        notes.extend(lora_notes(lora))
    for deployment_id, names in manager.restarts_for(planned.model.name).items():
        notes.append(
            f"running deployment {deployment_id} needs a restart to serve "
            f"{'adapter' if len(names) == 1 else 'adapters'} {', '.join(names)}"
        )
    return notes


async def register_adapter(store: Store, manager: AdapterManager, body: AdapterIn) -> AddedAdapter:
    """Register ``body``'s adapter in ``store`` (what ``POST /admin/adapters`` and a finished
    pull job do) and reload the router's registry, ``manager``'s.

    Raises ``ConfigError`` for a relative path or a local adapter refused
    (:func:`check_local_adapter`), ``NotFoundError`` for an unknown base model or node,
    ``ConflictError`` for a name already taken.
    """
    path = Path(body.path)
    if not path.is_absolute():
        raise ConfigError(f"adapter path must be absolute, not {body.path!r}")
    base = await asyncio.to_thread(store.get_model, body.base)
    node_id = LOCAL_NODE_ID
    if body.node is not None:
        node_id = (await asyncio.to_thread(store.lookup_node, body.node)).id
    checked = node_id == LOCAL_NODE_ID
    if checked:
        facts = await asyncio.to_thread(check_local_adapter, path, base)
        format_, rank, modules = facts.format, facts.rank, facts.target_modules
        shown = str(path.resolve())
    else:
        format_, rank, modules, shown = adapter_format_of(path), None, (), str(path)
    record = await asyncio.to_thread(
        store.add_adapter,
        body.name,
        base.name,
        node_id,
        shown,
        format=format_,
        rank=rank,
        target_modules=modules,
        source=body.source,
        repo_id=body.repo_id,
        revision=body.revision,
    )
    await reload_adapters(store, manager)
    return adapter_view(record, manager).extended(
        AddedAdapter, checked=checked, restart_needed=manager.restart_needed(record.name)
    )


def build_adapter_router(store: Store, manager: AdapterManager) -> APIRouter:
    """The adapter routes over the store's registry and ``manager`` (the router's registry
    and where each adapter is loaded)."""
    router = APIRouter()

    @router.get("/admin/adapters", dependencies=[needs(Role.VIEWER)])
    async def list_adapters() -> list[Adapter]:
        records = await asyncio.to_thread(store.list_adapters)
        return [adapter_view(r, manager) for r in records]

    @router.post("/admin/adapters", status_code=201, dependencies=[needs(Role.OPERATOR)])
    async def add_adapter(body: AdapterIn) -> AddedAdapter:
        return await register_adapter(store, manager, body)

    @router.get("/admin/adapters/{name:path}", dependencies=[needs(Role.VIEWER)])
    async def show_adapter(name: str) -> Adapter:
        return adapter_view(await asyncio.to_thread(store.get_adapter, name), manager)

    @router.delete("/admin/adapters/{name:path}", dependencies=[needs(Role.OPERATOR)])
    async def remove_adapter(name: str, node: str | None = None) -> AdapterRemoved:
        node_id = None
        if node is not None:
            node_id = (await asyncio.to_thread(store.lookup_node, node)).id
        await asyncio.to_thread(store.remove_adapter, name, node_id)
        await reload_adapters(store, manager)
        return AdapterRemoved(removed=name, node=node_id)

    return router
