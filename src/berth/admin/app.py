"""The admin API (``/admin/*``) and the plain endpoints (``/healthz``, ``/readyz``, ``/metrics``).

Keys and usage are in :mod:`berth.admin.keys`, nodes in :mod:`.nodes`, pulls from
the hub in :mod:`.pulls`; the schema and the ``Allow`` of a 405 in :mod:`.openapi`.

Served by FastAPI; authentication happens before a request reaches these routes (see
``daemon/app.py``).  Every error is answered in the OpenAI error shape, like ``/v1/*``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from berth import __version__
from berth.admin.adapters import build_adapter_router
from berth.admin.ca import build_ca_router
from berth.admin.deployments import build_deployment_router
from berth.admin.drains import build_drain_router
from berth.admin.keys import build_key_router
from berth.admin.metrics import build_metrics_router
from berth.admin.models import build_model_router
from berth.admin.nodes import build_node_router
from berth.admin.openapi import allowed_methods, install_schema
from berth.admin.overview import build_overview_router, leader_members
from berth.admin.plans import build_plan_router
from berth.admin.pulls import build_pull_router, leader_pull_jobs
from berth.admin.roles import OPEN, needs
from berth.admin.routing import build_routing_router
from berth.api import (
    DaemonInfo,
    ErrorBody,
    Health,
    LeaderStatus,
    ListenerInfo,
    Readiness,
    RuntimeInfo,
    SettingsReport,
    SettingValue,
    ShutdownAccepted,
    StepDownAccepted,
    StepDownIn,
    describe_invalid,
)
from berth.daemon.graph import LeaderGraph, Listener
from berth.errors import BerthError, ConflictError
from berth.keys import Role
from berth.openai_errors import error_body, error_from_exception
from berth.redact import mask_url_password
from berth.store.leadership import single_leader_view, standbys_seen, step_down_refusal
from berth.vocab.engines import parse_runtime_name
from berth.vocab.gpu import parse_simulated_gpus

log = logging.getLogger(__name__)

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


def _listener_info(listener: Listener) -> ListenerInfo:
    served = listener.tls.served if listener.tls is not None else None
    return ListenerInfo(
        name=listener.name,
        url=listener.url,
        certificate_serial=served.serial_hex if served is not None else None,
        certificate_not_after=served.not_after if served is not None else None,
    )


def _answer_errors_in_openai_shape(app: FastAPI) -> None:
    """Every error ``app`` answers, in the OpenAI shape: berth's own errors by their status,
    FastAPI's 404/405 as such, and a body that fails validation as a 400 (never a 422)."""

    @app.exception_handler(BerthError)
    async def _berth_error(_request: Request, exc: BerthError) -> Response:
        status, body, headers = error_from_exception(exc)
        return Response(body, status_code=status, headers=headers, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), type=kind)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(app, request.url.path))
        return Response(
            body, status_code=exc.status_code, headers=headers, media_type="application/json"
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            body = error_body("request body is not valid JSON", type="invalid_request_error")
            return Response(body, status_code=400, media_type="application/json")
        message, param = describe_invalid(first)
        body = error_body(message, type="invalid_request_error", param=param)
        return Response(body, status_code=400, media_type="application/json")


def daemon_info(services: LeaderGraph) -> DaemonInfo:
    """``GET /admin/info``: this leader's version, process, listeners, CA and runtimes."""
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


def build_status_router(services: LeaderGraph) -> APIRouter:
    """The plain endpoints (``/healthz``, ``/readyz``, ``/metrics``) and the leader's own
    state (``/admin/info``, ``/admin/config``)."""
    router = APIRouter()

    @router.get("/healthz", dependencies=[OPEN])
    async def healthz() -> Health:
        return Health()

    @router.get(
        "/readyz",
        responses={503: {"model": Readiness, "description": "still starting, or a standby"}},
        dependencies=[OPEN],
    )
    async def readyz(response: Response) -> Readiness:
        leadership = services.leadership
        if leadership is not None and not leadership.is_active:
            response.status_code = 503
            return Readiness(status="standby")
        if services.ready:
            return Readiness(status="ready")
        response.status_code = 503
        return Readiness(status="starting")

    @router.get("/admin/leader", dependencies=[needs(Role.VIEWER)])
    async def leader() -> LeaderStatus:
        leadership = services.leadership
        public = next((x.url for x in services.listeners if x.name == "public"), "")
        view = (
            single_leader_view(f"pid:{services.pid}", public)
            if leadership is None
            else leadership.view()
        )
        return LeaderStatus(
            role=view.role,
            id=view.id,
            epoch=view.epoch,
            active_address=view.active_address,
            ha=view.ha,
        )

    @router.get("/metrics", response_class=PlainTextResponse, dependencies=[OPEN])
    async def metrics() -> Response:
        payload, content_type = services.metrics.render()
        return Response(payload, media_type=content_type)

    @router.get("/admin/info", dependencies=[needs(Role.VIEWER)])
    async def info() -> DaemonInfo:
        return daemon_info(services)

    @router.get("/admin/config", dependencies=[needs(Role.VIEWER)])
    async def config() -> SettingsReport:
        return {
            name: SettingValue(value=shown["value"], source=services.settings.source(name))
            for name, shown in services.settings.as_json().items()
        }

    return router


def build_admin_app(services: LeaderGraph) -> FastAPI:
    """The FastAPI app for everything that is not ``/v1/*``: the status routes, then one
    router per area (models, deployments, keys, nodes, metrics, routing, adapters, plans,
    pulls), then ``/admin/shutdown``.

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
    _answer_errors_in_openai_shape(app)
    install_schema(app, tiers=list(services.settings.tiers))
    app.include_router(build_status_router(services))
    app.include_router(build_model_router(services))
    app.include_router(build_deployment_router(services))
    app.include_router(build_key_router(services))
    app.include_router(build_node_router(services))
    app.include_router(build_drain_router(services.store, services.drains))
    app.include_router(build_ca_router(services))
    app.include_router(build_metrics_router(services))
    history = services.history
    if history is not None:
        app.include_router(
            build_overview_router(
                history,
                lambda: leader_members(
                    services.store, services.leadership, me=f"pid:{services.pid}",
                    cluster_url=services.cluster_url, metrics=services.metrics, history=history,
                ),
            )
        )  # fmt: skip
    app.include_router(build_routing_router(services))
    app.include_router(build_adapter_router(services))
    app.include_router(build_plan_router(services))
    app.include_router(build_pull_router(leader_pull_jobs(services)))

    @app.post("/admin/leader/step-down", status_code=202, dependencies=[needs(Role.ADMIN)])
    async def step_down(body: StepDownIn | None = None) -> StepDownAccepted:
        leadership = services.leadership
        if leadership is None:
            raise ConflictError(
                "leadership is not shared here (leader_ha is off): no one to hand over to"
            )
        if not leadership.is_active:
            raise ConflictError("this leader is a standby: step down on the active one")
        # Read now, not the roster's copy: a standby that stopped a moment ago must not count.
        members = await asyncio.to_thread(services.store.leader_members)
        now_s, lease_s = time.time(), services.settings.leader_lease_s
        force = body is not None and body.force
        if not force:
            database = mask_url_password(services.settings.database_url)
            refusal = step_down_refusal(members, leadership.me, now_s, lease_s, database)
            if refusal is not None:
                raise ConflictError(refusal)
        standbys = standbys_seen(members, leadership.me, now_s, lease_s)
        log.warning(
            "leadership: stepping down on request%s; standbys seen: %s",
            " (forced)" if force else "",
            ", ".join(m.cluster_url for m in standbys) or "none",
        )
        services.handed_over = True  # it exits to be started again, as a standby
        os.kill(services.pid, signal.SIGTERM)  # the Leader's stop hands the lease over first
        return StepDownAccepted(standbys=[m.cluster_url for m in standbys])

    @app.post("/admin/shutdown", status_code=202, dependencies=[needs(Role.ADMIN)])
    async def shutdown() -> ShutdownAccepted:
        os.kill(services.pid, signal.SIGTERM)
        return ShutdownAccepted()

    return app
