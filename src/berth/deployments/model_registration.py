"""Registering a model's weights: what ``POST /admin/models`` and a finished pull job do.

A path on the leader's host is checked in a worker thread, with bounds on a folder's entries
and time (:func:`berth.weights.model_files.inspect_model_path`: only a regular GGUF file or a
folder is a model) and its size recorded; a path on another node's host is taken as given and
recorded as that node's copy.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from berth.api import LocatedModel, ModelIn, RegisteredModel
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.deployments.lifecycle import LifecycleManager
from berth.errors import ConfigError, NotFoundError
from berth.store import Store
from berth.vocab.records import ModelRecord
from berth.weights.model_files import inspect_model_path


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


async def register_model(
    store: Store, lifecycle: LifecycleManager, body: ModelIn
) -> LocatedModel | RegisteredModel:
    """Register ``body``'s weights and tell the lifecycle manager.

    Raises ``ConfigError`` for a relative path, or a local path that is missing, unreadable,
    neither a regular file nor a folder, a file that is not GGUF, or a folder past the bounds
    of :func:`~berth.weights.model_files.inspect_model_path`; ``NotFoundError`` for an
    unknown node, ``ConflictError`` for a name already taken.
    """
    path = Path(body.path)
    if not path.is_absolute():
        raise ConfigError(f"model path must be absolute, not {body.path!r}")
    if body.node is not None:
        node = await asyncio.to_thread(store.lookup_node, body.node)
        if node.id != LOCAL_NODE_ID:
            return await _add_remote_location(store, lifecycle, body.name, node.id, str(path))
    files = await asyncio.to_thread(inspect_model_path, path)
    record = await asyncio.to_thread(
        store.add_model,
        body.name,
        str(files.path),
        source=body.source,
        repo_id=body.repo_id,
        revision=body.revision,
        size_bytes=files.size_bytes,
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
