"""Registering a model's weights: what ``POST /admin/models`` and a finished pull job do.

A path on the leader's host is checked (it exists; a file is GGUF) and its size recorded; a
path on another node's host is taken as given and recorded as that node's copy.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from berth.api import LocatedModel, ModelIn, RegisteredModel
from berth.cluster.link import LOCAL_NODE_ID
from berth.deployments.lifecycle import LifecycleManager
from berth.errors import ConfigError, NotFoundError
from berth.store import ModelRecord, Store


def model_view(record: ModelRecord) -> RegisteredModel:
    """A model for the admin API."""
    return RegisteredModel(
        name=record.name,
        path=str(record.path),
        source=record.source,
        repo_id=record.repo_id,
        revision=record.revision,
        size_bytes=record.size_bytes,
        created_at=record.created_at,
    )


def located_model_view(record: ModelRecord, locations: dict[str, str]) -> LocatedModel:
    """A model with where it is on other nodes' hosts (node id → path)."""
    return model_view(record).extended(LocatedModel, locations=locations)


def _is_gguf(path: Path) -> bool:
    """Whether ``path`` starts with the GGUF magic ``b"GGUF"`` (the GGUF spec's header)."""
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF"


def _path_size_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


async def register_model(
    store: Store, lifecycle: LifecycleManager, body: ModelIn
) -> LocatedModel | RegisteredModel:
    """Register ``body``'s weights and tell the lifecycle manager.

    Raises ``ConfigError`` for a relative path, or a local path that is missing or not GGUF,
    ``NotFoundError`` for an unknown node, ``ConflictError`` for a name already taken.
    """
    path = Path(body.path)
    if not path.is_absolute():
        raise ConfigError(f"model path must be absolute, not {body.path!r}")
    if body.node is not None:
        node = await asyncio.to_thread(store.lookup_node, body.node)
        if node.id != LOCAL_NODE_ID:
            return await _add_remote_location(store, lifecycle, body.name, node.id, str(path))
    if not path.exists():
        raise ConfigError(f"model path does not exist: {path}")
    path = path.resolve()
    if path.is_file() and not _is_gguf(path):
        raise ConfigError(f"{path} is not a GGUF file; register a .gguf file or a model folder")
    record = await asyncio.to_thread(
        store.add_model,
        body.name,
        str(path),
        source=body.source,
        repo_id=body.repo_id,
        revision=body.revision,
        size_bytes=_path_size_bytes(path),
    )
    await lifecycle.refresh_known_models()
    return model_view(record)


async def _add_remote_location(
    store: Store, lifecycle: LifecycleManager, name: str, node_id: str, path: str
) -> LocatedModel:
    # The path lives on the agent's host: the leader cannot check it.
    try:
        record = await asyncio.to_thread(store.get_model, name)
    except NotFoundError:
        # The leader has no copy: "remote" keeps it from being run on node local.
        record = await asyncio.to_thread(store.add_model, name, path, source="remote")
    await asyncio.to_thread(store.set_model_location, name, node_id, path)
    await lifecycle.refresh_known_models()
    return located_model_view(record, {node_id: path})
