"""The leader's own state on the admin listener: the plain endpoints (``/healthz``,
``/readyz``, ``/metrics``), ``/admin/info``, ``/admin/config`` and ``/admin/leader``, and the
two routes that end this leader's run (``POST /admin/leader/step-down``, ``POST
/admin/shutdown``).

What these routes read is given to them: the facts fixed when the leader was built
(:class:`LeaderFacts`), what changes while it runs (:class:`RunState`, which the daemon's
``Leader`` writes and these routes read, the step-down route excepted), the settings, the CA,
the metrics registry and the lease loop (``None`` for a lone leader).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Protocol

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from berth import __version__
from berth.admin.roles import OPEN, needs
from berth.agent.host import RuntimeStatus
from berth.api import (
    DaemonInfo,
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
)
from berth.cluster.pki.ca import CertificateAuthority
from berth.config import Settings
from berth.errors import ConflictError
from berth.http_server.tls_reload import ReloadingTLS
from berth.observability.metrics import ProxyMetrics
from berth.paths import BerthHome
from berth.redact import mask_url_password
from berth.store import Store
from berth.store.leadership import (
    Leadership,
    single_leader_view,
    standbys_seen,
    step_down_refusal,
)
from berth.vocab.engines import parse_runtime_name
from berth.vocab.gpu import parse_simulated_gpus
from berth.vocab.roles import Role

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listener:
    """One address the daemon serves on, for banners and ``berth status``; ``tls``: the
    certificate pair a TLS listener serves (reloadable)."""

    name: str
    url: str
    tls: ReloadingTLS | None = None


@dataclass(frozen=True)
class LeaderFacts:
    """What ``/admin/info`` says of a leader that does not change while it runs: its
    process (``pid``, ``started_at`` in Unix seconds), its home, the URL agents dial
    (``cluster_url``), its listeners, and whether it runs no engines (``leader_only``)."""

    pid: int
    started_at: float
    home: BerthHome
    cluster_url: str
    listeners: tuple[Listener, ...]
    leader_only: bool


@dataclass
class RunState:
    """What changes while a leader runs, as its status routes show it.

    ``ready``: started (every piece), set by the ``Leader`` once every piece started and
    cleared when it stops; ``serving``: set while it leads, saying what it still waits for
    before it can serve what it routes (:class:`berth.daemon.link_wait.LinkWait`; ``None``
    while it does not lead); ``draining``: stopping or stepping down, still serving while
    ``/readyz`` sends the balancer elsewhere (the ``drain_s`` setting); ``runtimes``: node
    ``local``'s runtimes as found at start-up (empty on a leader-only daemon);
    ``handed_over``: ``berth leader step-down`` asked this leader to stop and come back as a
    standby, read by the ``Leader`` when it stops.
    """

    ready: bool = False
    serving: ServingCheck | None = None
    draining: bool = False
    runtimes: tuple[RuntimeStatus, ...] = ()
    handed_over: bool = False


class ServingCheck(Protocol):
    """What a leading leader still waits for before it serves: ``None`` when nothing."""

    def pending(self) -> str | None: ...


def readiness(run: RunState, leadership: Leadership | None) -> tuple[int, Readiness]:
    """``GET /readyz``'s status and body: 200 ``ready`` only on a leader that serves what it
    routes; else 503 ``draining`` (stopping: still serving, about to close), ``standby`` (it
    does not hold the lease), ``starting`` (its pieces, or its leader-only loops, are
    starting, or it waits for its agents' links: ``detail`` says which)."""
    if run.draining:
        detail = "this leader is stopping; it closes its listeners once the drain is over"
        return 503, Readiness(status="draining", detail=detail)
    if leadership is not None and not leadership.is_active:
        return 503, Readiness(status="standby")
    if not run.ready or run.serving is None:
        return 503, Readiness(status="starting")
    pending = run.serving.pending()
    if pending is not None:
        return 503, Readiness(status="starting", detail=pending)
    return 200, Readiness(status="ready")


def _listener_info(listener: Listener) -> ListenerInfo:
    served = listener.tls.served if listener.tls is not None else None
    return ListenerInfo(
        name=listener.name,
        url=listener.url,
        certificate_serial=served.serial_hex if served is not None else None,
        certificate_not_after=served.not_after if served is not None else None,
    )


def daemon_info(
    facts: LeaderFacts, run: RunState, settings: Settings, ca: CertificateAuthority
) -> DaemonInfo:
    """``GET /admin/info``: this leader's version, process, listeners, CA and runtimes."""
    return DaemonInfo(
        version=__version__,
        pid=facts.pid,
        home=str(facts.home.root),
        started_at=facts.started_at,
        uptime_s=round(time.time() - facts.started_at, 1),
        ca_fingerprint=ca.fingerprint_sha256,
        ca_file=str(facts.home.ca_dir / "ca.pem"),
        listeners=[_listener_info(x) for x in facts.listeners],
        cluster_url=facts.cluster_url,
        # No --public-cert: clients must trust the berth CA (ca_file) to reach /v1.
        public_cert_from_ca=settings.public_cert is None,
        ready=run.ready,
        # A control plane only: no engines on the leader's host (the leader_only setting).
        leader_only=facts.leader_only,
        runtimes=[
            RuntimeInfo(
                name=parse_runtime_name(runtime.name),
                available=runtime.available,
                detail=runtime.detail,
            )
            for runtime in run.runtimes
        ],
        simulated_gpus_mb=[]
        if facts.leader_only
        else list(parse_simulated_gpus(settings.simulated_gpus or "")),
    )


def build_status_router(
    facts: LeaderFacts,
    run: RunState,
    settings: Settings,
    ca: CertificateAuthority,
    proxy_metrics: ProxyMetrics,
    leadership: Leadership | None,
) -> APIRouter:
    """The plain endpoints (``/healthz``, ``/readyz``, ``/metrics``) and the leader's own
    state (``/admin/info``, ``/admin/config``, ``/admin/leader``)."""
    router = APIRouter()

    @router.get("/healthz", dependencies=[OPEN])
    async def healthz() -> Health:
        return Health()

    @router.get(
        "/readyz",
        responses={
            503: {
                "model": Readiness,
                "description": "starting, waiting for agents' links, a standby, or draining",
            }
        },
        dependencies=[OPEN],
        response_model_exclude_none=True,  # a detail only where there is one
    )
    async def readyz(response: Response) -> Readiness:
        response.status_code, body = readiness(run, leadership)
        return body

    @router.get("/admin/leader", dependencies=[needs(Role.VIEWER)])
    async def leader() -> LeaderStatus:
        public = next((x.url for x in facts.listeners if x.name == "public"), "")
        view = (
            single_leader_view(f"pid:{facts.pid}", public)
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
        payload, content_type = proxy_metrics.render()
        return Response(payload, media_type=content_type)

    @router.get("/admin/info", dependencies=[needs(Role.VIEWER)])
    async def info() -> DaemonInfo:
        return daemon_info(facts, run, settings, ca)

    @router.get("/admin/config", dependencies=[needs(Role.VIEWER)])
    async def config() -> SettingsReport:
        return {
            name: SettingValue(value=shown["value"], source=settings.source(name))
            for name, shown in settings.as_json().items()
        }

    return router


def build_stop_router(
    leadership: Leadership | None, store: Store, settings: Settings, run: RunState, *, pid: int
) -> APIRouter:
    """``POST /admin/leader/step-down`` (hand the lease to a standby, then stop and come
    back as one: ``run.handed_over``) and ``POST /admin/shutdown``; both end the run with a
    SIGTERM to the leader's process ``pid``, whose ``Leader`` stops in order."""
    router = APIRouter()

    @router.post("/admin/leader/step-down", status_code=202, dependencies=[needs(Role.ADMIN)])
    async def step_down(body: StepDownIn | None = None) -> StepDownAccepted:
        if leadership is None:
            raise ConflictError(
                "leadership is not shared here (leader_ha is off): no one to hand over to"
            )
        if not leadership.is_active:
            raise ConflictError("this leader is a standby: step down on the active one")
        # Read now, not the roster's copy: a standby that stopped a moment ago must not count.
        members = await asyncio.to_thread(store.leader_members)
        now_s, lease_s = time.time(), settings.leader_lease_s
        force = body is not None and body.force
        if not force:
            database = mask_url_password(settings.database_url)
            refusal = step_down_refusal(members, leadership.me, now_s, lease_s, database)
            if refusal is not None:
                raise ConflictError(refusal)
        standbys = standbys_seen(members, leadership.me, now_s, lease_s)
        log.warning(
            "leadership: stepping down on request%s; standbys seen: %s",
            " (forced)" if force else "",
            ", ".join(m.cluster_url for m in standbys) or "none",
        )
        run.handed_over = True  # it exits to be started again, as a standby
        os.kill(pid, signal.SIGTERM)  # the Leader drains, then hands the lease over
        return StepDownAccepted(standbys=[m.cluster_url for m in standbys])

    @router.post("/admin/shutdown", status_code=202, dependencies=[needs(Role.ADMIN)])
    async def shutdown() -> ShutdownAccepted:
        os.kill(pid, signal.SIGTERM)
        return ShutdownAccepted()

    return router
