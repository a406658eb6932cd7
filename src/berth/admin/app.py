"""The admin API (``/admin/*``) and the plain endpoints (``/healthz``, ``/readyz``, ``/metrics``).

Keys and usage are in :mod:`berth.admin.keys`, nodes in :mod:`.nodes`, pulls from
the hub in :mod:`.pulls`.

Served by FastAPI; authentication happens before a request reaches these routes (see
``daemon/app.py``).  Every error is answered in the OpenAI error shape, like ``/v1/*``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from berth import __version__
from berth.admin.adapters import build_adapter_router
from berth.admin.ca import build_ca_router
from berth.admin.keys import build_key_router
from berth.admin.metrics import build_metrics_router
from berth.admin.model_detail import model_detail
from berth.admin.nodes import build_node_router
from berth.admin.plans import build_plan_router
from berth.admin.pulls import build_pull_router, leader_pull_jobs
from berth.admin.routing import build_routing_router
from berth.api import (
    DaemonInfo,
    Deployment,
    DeploymentIn,
    ErrorBody,
    Health,
    ListedDeployment,
    ListenerInfo,
    LocatedModel,
    ModelDetail,
    ModelIn,
    ModelRemoved,
    Readiness,
    RegisteredModel,
    RuntimeInfo,
    SettingsReport,
    SettingValue,
    ShutdownAccepted,
    describe_invalid,
)
from berth.cluster.link import LOCAL_NODE_ID
from berth.daemon.graph import LeaderGraph, Listener
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.deployments.model_registration import located_model_view, register_model
from berth.errors import BerthError, ConfigError, ConflictError
from berth.openai_errors import error_body, error_from_exception
from berth.runtime.engines import parse_engine_name, parse_runtime_name
from berth.runtime.gpu import parse_simulated_gpus
from berth.store import DeploymentRecord, Store
from berth.store.states import TERMINAL_STATES

#: Every admin error is an OpenAI-shaped body (``ErrorBody``); FastAPI's own 422 answer is
#: never sent (a bad request body is a 400), so the schema lists the ranges instead.
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    "4XX": {
        "model": ErrorBody,
        "description": "refused: bad input (400), unknown name (404), "
        "conflict with current state (409)",
    },
    "5XX": {"model": ErrorBody, "description": "an engine or the leader failed"},
}


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


def _listener_info(listener: Listener) -> ListenerInfo:
    served = listener.tls.served if listener.tls is not None else None
    return ListenerInfo(
        name=listener.name,
        url=listener.url,
        certificate_serial=served.serial_hex if served is not None else None,
        certificate_not_after=served.not_after if served is not None else None,
    )


def build_admin_app(services: LeaderGraph) -> FastAPI:
    """The FastAPI app for everything that is not ``/v1/*``.

    Every JSON route declares its answer's model (:mod:`berth.api`), so the schema at
    ``/admin/openapi.json`` (admin key over TCP, like the rest of ``/admin``) describes it.
    """
    app = FastAPI(
        title="berth admin API",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url="/admin/openapi.json",
        responses=ERROR_RESPONSES,
    )
    store = services.store
    lifecycle = services.lifecycle

    @app.exception_handler(BerthError)
    async def _berth_error(_request: Request, exc: BerthError) -> Response:
        status, body, headers = error_from_exception(exc)
        return Response(body, status_code=status, headers=headers, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), type=kind)
        return Response(body, status_code=exc.status_code, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            body = error_body("request body is not valid JSON", type="invalid_request_error")
            return Response(body, status_code=400, media_type="application/json")
        message, param = describe_invalid(first)
        body = error_body(message, type="invalid_request_error", param=param)
        return Response(body, status_code=400, media_type="application/json")

    @app.get("/healthz")
    async def healthz() -> Health:
        return Health()

    @app.get("/readyz", responses={503: {"model": Readiness, "description": "still starting"}})
    async def readyz(response: Response) -> Readiness:
        if services.ready:
            return Readiness(status="ready")
        response.status_code = 503
        return Readiness(status="starting")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        payload, content_type = services.metrics.render()
        return Response(payload, media_type=content_type)

    @app.get("/admin/info")
    async def info() -> DaemonInfo:
        return DaemonInfo(
            version=__version__,
            pid=services.pid,
            home=str(services.home.root),
            started_at=services.started_at,
            uptime_s=round(time.time() - services.started_at, 1),
            ca_fingerprint=services.ca.fingerprint_sha256,
            ca_file=str(services.home.ca_dir / "ca.pem"),
            listeners=[_listener_info(x) for x in services.listeners],
            cluster_url=services.cluster_url,
            # No --public-cert: clients must trust the berth CA (ca_file) to reach /v1.
            public_cert_from_ca=services.settings.public_cert is None,
            ready=services.ready,
            # A control plane only: no engines on the leader's host (the leader_only setting).
            leader_only=services.leader_only,
            runtimes=[
                RuntimeInfo(
                    name=parse_runtime_name(runtime.name),
                    available=runtime.available,
                    detail=runtime.detail,
                )
                for runtime in services.runtimes
            ],
            simulated_gpus_mb=[]
            if services.leader_only
            else list(parse_simulated_gpus(services.settings.simulated_gpus or "")),
        )

    @app.get("/admin/config")
    async def config() -> SettingsReport:
        return {
            name: SettingValue(value=shown["value"], source=services.settings.source(name))
            for name, shown in services.settings.as_json().items()
        }

    # -- models ------------------------------------------------------------------------------
    @app.get("/admin/models")
    async def list_models() -> list[LocatedModel]:
        records = await asyncio.to_thread(store.list_models)
        locations = await asyncio.to_thread(store.list_model_locations)
        return [
            located_model_view(r, {x.node_id: x.path for x in locations if x.model_name == r.name})
            for r in records
        ]

    @app.post("/admin/models", status_code=201)
    async def add_model(body: ModelIn) -> LocatedModel | RegisteredModel:
        return await register_model(store, lifecycle, body)

    @app.get("/admin/models/{name:path}")
    async def show_model(name: str) -> ModelDetail:
        return await model_detail(store, lifecycle.estimator, services.links, name)

    @app.delete("/admin/models/{name:path}")
    async def remove_model(name: str) -> ModelRemoved:
        await asyncio.to_thread(store.remove_model, name)
        await lifecycle.refresh_known_models()
        return ModelRemoved(removed=name)

    # -- deployments -------------------------------------------------------------------------
    @app.get("/admin/deployments")
    async def list_deployments(
        active: bool = False, ended_within_s: float | None = None
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
            connected = record.node_id == LOCAL_NODE_ID or services.hub.is_connected(record.node_id)
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

    @app.post("/admin/deployments", status_code=201)
    async def create_deployment(body: DeploymentIn) -> Deployment:
        if services.leader_only and body.node == LOCAL_NODE_ID:
            raise ConflictError(
                "this leader runs no engines (leader_only is set): run the deployment on an "
                "agent with --node LABEL (`berth nodes ls` lists them)"
            )
        record = await lifecycle.deploy(
            DeployOptions(
                model_name=body.model,
                engine=body.engine,
                node_id=body.node,
                runtime=body.runtime or services.settings.default_runtime,
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

    @app.get("/admin/deployments/{deployment_id}")
    async def get_deployment(deployment_id: str) -> Deployment:
        record = await asyncio.to_thread(store.get_deployment, deployment_id)
        return deployment_view(record, lifecycle)

    @app.post("/admin/deployments/{deployment_id}/stop")
    async def stop_deployment(deployment_id: str) -> Deployment:
        return deployment_view(await lifecycle.stop(deployment_id), lifecycle)

    @app.get("/admin/deployments/{deployment_id}/logs", response_class=PlainTextResponse)
    async def deployment_logs(
        deployment_id: str, tail: int = 100, follow: bool = False
    ) -> Response:
        record = await asyncio.to_thread(store.get_deployment, deployment_id)
        link = services.links.get(record.node_id)
        if link is None:
            raise ConfigError(f"node {record.node_id} is not connected")
        chunks = link.logs(deployment_id, tail_lines=max(tail, 0), follow=follow)
        # Pull the first chunk now so a missing log is a clean 404, not a broken stream.
        first = await anext(chunks, b"")
        body = _follow_until_settled(store, deployment_id, first, chunks) if follow else None

        async def whole() -> AsyncIterator[bytes]:
            yield first
            async for chunk in chunks:
                yield chunk

        return StreamingResponse(body or whole(), media_type="text/plain; charset=utf-8")

    app.include_router(build_key_router(services))
    app.include_router(build_node_router(services))
    app.include_router(build_ca_router(services))
    app.include_router(build_metrics_router(services))
    app.include_router(build_routing_router(services))
    app.include_router(build_adapter_router(services))
    app.include_router(build_plan_router(services))
    app.include_router(build_pull_router(leader_pull_jobs(services)))

    @app.post("/admin/shutdown", status_code=202)
    async def shutdown() -> ShutdownAccepted:
        os.kill(services.pid, signal.SIGTERM)
        return ShutdownAccepted()

    return app
