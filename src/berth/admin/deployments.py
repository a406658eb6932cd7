"""``/admin/deployments``: list, create, show and stop deployments, and their engines' logs
(followed until the deployment ends, like ``docker logs -f``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from berth.admin.roles import needs
from berth.api import Deployment, DeploymentIn, ListedDeployment
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.cluster.leader.hub import NodeHub
from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.errors import ConfigError, ConflictError
from berth.store import Store
from berth.vocab.engines import parse_engine_name, parse_runtime_name
from berth.vocab.records import DeploymentRecord
from berth.vocab.roles import Role
from berth.vocab.states import TERMINAL_STATES


def deployment_view(
    record: DeploymentRecord, lifecycle: LifecycleManager | None = None
) -> Deployment:
    """A deployment for the admin API; ``progress`` says what a loading one is busy with
    (an image pull), ``None`` otherwise."""
    return Deployment(
        id=record.id,
        model_name=record.model_name,
        engine=parse_engine_name(record.engine),
        runtime=parse_runtime_name(record.runtime),
        node_id=record.node_id,
        state=record.state,
        port=record.port,
        pid=record.pid,
        gpus=list(record.gpus),
        ctx=record.ctx,
        extra_args=list(record.extra_args),
        served_model_name=record.served_model_name,
        failure_reason=record.failure_reason,
        created_at=record.created_at,
        updated_at=record.updated_at,
        image=record.image,
        progress=lifecycle.progress(record.id) if lifecycle is not None else None,
        restart_policy=record.restart_policy,
        restart_count=record.restart_count,
        last_exit=record.last_exit,
        last_exit_log=record.last_exit_log,
    )


#: The longest look back ``ended_within_s`` may ask for: ten years, in seconds (a window the
#: clock and the store's timestamps can hold; ``inf`` and ``1e20`` overflowed them).
MAX_ENDED_WITHIN_S = 10 * 366 * 86_400
#: The most log lines ``tail`` may ask for (the agent's engine logs keep fewer).
MAX_LOG_TAIL_LINES = 1_000_000

#: Seconds between checks whether a followed deployment has stopped.
FOLLOW_CHECK_INTERVAL_S = 1.0


async def _follow_until_settled(
    store: Store, deployment_id: str, first: bytes, chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """Relay a followed log until the client leaves or the deployment is stopped or failed
    (then the rest of the log is flushed and the stream ends, like ``docker logs -f``)."""
    queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=64)

    async def pump() -> None:
        async for chunk in chunks:
            await queue.put(chunk)

    pumping = asyncio.create_task(pump())
    try:
        yield first
        while True:
            try:
                yield await asyncio.wait_for(queue.get(), FOLLOW_CHECK_INTERVAL_S)
                continue
            except TimeoutError:
                pass
            if pumping.done() and queue.empty():
                # The log source ended early: its node's link was lost, or the log went away.
                error = None if pumping.cancelled() else pumping.exception()
                if error is not None:
                    yield f"\nberth: the log stream ended: {error}\n".encode()
                return
            record = await asyncio.to_thread(store.get_deployment, deployment_id)
            if record.state in TERMINAL_STATES:
                await asyncio.sleep(FOLLOW_CHECK_INTERVAL_S)  # the engine's last lines
                while not queue.empty():
                    yield queue.get_nowait()
                return
    finally:
        pumping.cancel()


def build_deployment_router(
    store: Store,
    lifecycle: LifecycleManager,
    hub: NodeHub,
    links: LinkRegistry,
    *,
    default_runtime: str,
    leader_only: bool,
) -> APIRouter:
    """The deployment routes (``/admin/deployments[/{id}[/stop|/logs]]``) over the store and
    the deployment manager; ``hub`` says which agents are connected, ``links`` reach a
    node's engine logs. A deployment without a runtime gets ``default_runtime``; with
    ``leader_only`` none may go to node ``local``."""
    router = APIRouter()

    @router.get("/admin/deployments", dependencies=[needs(Role.VIEWER)])
    async def list_deployments(
        active: bool = False,
        ended_within_s: float | None = Query(
            None, ge=0, le=MAX_ENDED_WITHIN_S, allow_inf_nan=False, examples=[3600]
        ),
    ) -> list[ListedDeployment]:
        # ``active`` with ``ended_within_s``: also those that ended that many seconds ago or
        # less (``berth ps``: a deployment never disappears silently).
        since = None
        if active and ended_within_s is not None and ended_within_s > 0:
            since = datetime.now(UTC) - timedelta(seconds=ended_within_s)
        records = await asyncio.to_thread(
            store.list_deployments, active_only=active, ended_since=since
        )
        nodes = {n.id: n for n in await asyncio.to_thread(store.list_nodes, True)}
        # A deployment serving a service's name is a replica of it.
        named = {s.name for s in await asyncio.to_thread(store.list_service_profiles)}
        listed = []
        for record in records:
            node = nodes.get(record.node_id)
            connected = record.node_id == LOCAL_NODE_ID or hub.is_connected(record.node_id)
            service = record.served_model_name if record.served_model_name in named else None
            listed.append(
                deployment_view(record, lifecycle).extended(
                    ListedDeployment,
                    node_label=node.label if node is not None else record.node_id,
                    node_connected=connected,
                    service=service,
                )
            )
        return listed

    @router.post("/admin/deployments", status_code=201, dependencies=[needs(Role.OPERATOR)])
    async def create_deployment(body: DeploymentIn) -> Deployment:
        if leader_only and body.node == LOCAL_NODE_ID:
            raise ConflictError(
                "this leader runs no engines (leader_only is set): run the deployment on an "
                "agent with --node LABEL (`berth nodes ls` lists them)"
            )
        record = await lifecycle.deploy(
            DeployOptions(
                model_name=body.model,
                engine=body.engine,
                node_id=body.node,
                runtime=default_runtime if body.runtime is None else body.runtime,
                gpus=tuple(body.gpus),
                ctx=body.ctx,
                extra_args=tuple(body.extra_args),
                served_model_name=body.served_model_name,
                image=body.image,
                max_adapters=body.max_adapters,
                force=body.force,
                restart_policy=body.restart,
            )
        )
        return deployment_view(record, lifecycle)

    @router.get("/admin/deployments/{deployment_id}", dependencies=[needs(Role.VIEWER)])
    async def get_deployment(deployment_id: str) -> Deployment:
        record = await asyncio.to_thread(store.get_deployment, deployment_id)
        return deployment_view(record, lifecycle)

    @router.post("/admin/deployments/{deployment_id}/stop", dependencies=[needs(Role.OPERATOR)])
    async def stop_deployment(deployment_id: str) -> Deployment:
        return deployment_view(await lifecycle.stop(deployment_id), lifecycle)

    @router.get(
        "/admin/deployments/{deployment_id}/logs",
        response_class=PlainTextResponse,
        dependencies=[needs(Role.VIEWER)],
    )
    async def deployment_logs(
        deployment_id: str,
        tail: int = Query(100, ge=0, le=MAX_LOG_TAIL_LINES),
        follow: bool = False,
    ) -> Response:
        record = await asyncio.to_thread(store.get_deployment, deployment_id)
        link = links.get(record.node_id)
        if link is None:
            raise ConfigError(f"node {record.node_id} is not connected")
        chunks = link.logs(deployment_id, tail_lines=tail, follow=follow)
        # Pull the first chunk now so a missing log is a clean 404, not a broken stream.
        first = await anext(chunks, b"")
        body = _follow_until_settled(store, deployment_id, first, chunks) if follow else None

        async def whole() -> AsyncIterator[bytes]:
            yield first
            async for chunk in chunks:
                yield chunk

        return StreamingResponse(body or whole(), media_type="text/plain; charset=utf-8")

    return router
