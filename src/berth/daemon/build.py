"""Builds the leader's object graph from its settings: :func:`build_leader`.

It takes the home, the settings, the bound sockets (:func:`berth.daemon.sockets.bind_sockets`)
and the opened store (:func:`berth.daemon.pieces.open_store`) and returns :class:`LeaderParts`,
everything :class:`berth.daemon.server.Leader` starts and stops; each piece is built by a
function of :mod:`berth.daemon.pieces`, in the order the pieces depend on each other. Nothing
is started here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from berth.admin.services import load_routes
from berth.admin.status import Listener, RunState
from berth.admission import Admission, UsageLedger
from berth.agent.in_process_link import InProcessLink
from berth.agent.node_sampler import LocalNodeSampler
from berth.auth.authenticator import Authenticator
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.cluster.leader.direct_path import DataPaths
from berth.cluster.leader.hub import NodeHub
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.listener import (
    ClusterListener,
    build_cluster_app,
)
from berth.cluster.pki.enrollment import AuditLog, EnrollmentService
from berth.cluster.pki.peer_identity import ForwardedFingerprintTrust
from berth.config import Settings
from berth.daemon.app import build_apps
from berth.daemon.graph import LeaderGraph
from berth.daemon.ha import SharedLeadership, build_shared_leadership
from berth.daemon.pieces import (
    DeploymentEvents,
    LeaderMetrics,
    LeaderTls,
    build_adapters,
    build_admission,
    build_authenticator,
    build_hub,
    build_lifecycle,
    build_local_core,
    build_local_sampler,
    build_metrics,
    build_proxy,
    build_scaling,
    load_tls,
)
from berth.daemon.sockets import LeaderSockets, raise_open_files_limit
from berth.deployments.drain import DrainRunner
from berth.gateway.adapter_resolver import AdapterResolver
from berth.http_server.server import HttpServer
from berth.observability.loop_lag import LoopLagMonitor
from berth.observability.tracing_setup import open_tracing
from berth.paths import BerthHome
from berth.routing.cache_probe import CacheProbe
from berth.routing.prefix_index import PrefixIndex
from berth.routing.router import Router
from berth.routing.routes import RouteResolver
from berth.routing.signals import SignalBoard
from berth.routing.waiting import WaitingAttempts
from berth.store import Store

if TYPE_CHECKING:  # imported only where tracing is on
    from berth.observability.tracing import Tracing

log = logging.getLogger(__name__)


# -- the whole graph ------------------------------------------------------------------------


@dataclass
class LeaderParts:
    """Everything a built leader holds: the graph the apps see (``graph``), and what only
    the :class:`~berth.daemon.server.Leader` starts and stops."""

    graph: LeaderGraph
    sockets: LeaderSockets
    tls: LeaderTls
    ledger: UsageLedger
    loop_lag: LoopLagMonitor
    local_sampler: LocalNodeSampler | None
    public_server: HttpServer
    socket_server: HttpServer
    cluster_listener: ClusterListener
    #: OpenTelemetry's export, when tracing is on (shut down after the proxy)
    tracing: Tracing | None = None


def build_listeners(
    graph: LeaderGraph, sockets: LeaderSockets, tls: LeaderTls
) -> tuple[HttpServer, HttpServer, ClusterListener]:
    """The public and socket HTTP servers and the cluster listener, with the settings'
    listener bounds; raises the open files limit to cover their connection caps."""
    public_app, socket_app = build_apps(graph)
    limits = graph.settings.listener_limits()
    # Three listeners, each its cap, plus engines, the store and the pool to engines.
    raise_open_files_limit(3 * limits.max_connections + 2048)
    public_server = HttpServer("public", public_app, limits, ssl_context=tls.public.context)
    socket_server = HttpServer("socket", socket_app, limits)
    cluster_listener = ClusterListener(
        build_cluster_app(
            enrollment=graph.enrollment,
            ca_pem=lambda: tls.ca.server_root_pem,  # a CA rotation changes it
            agent_handler=graph.hub.handle_agent,
            on_registered=graph.hub.certificate_replaced,
            body_timeout_s=limits.body_timeout_s,
        ),
        sockets.cluster,
        tls.cluster.context,
        limits,
    )
    return public_server, socket_server, cluster_listener


def _build_data_paths(
    hub: NodeHub, links: LinkRegistry, tls: LeaderTls, home: BerthHome, settings: Settings
) -> DataPaths:
    """Requests to agents' engines: direct to an agent's ingress when it answers, else the hub."""
    return DataPaths(
        hub,
        links,
        tls.ca,
        home.ca_dir,
        probe_interval_s=settings.direct_probe_interval_s,
        probe_timeout_s=settings.direct_probe_timeout_s,
    )


def _build_router(
    resolver: AdapterResolver,
    signals: SignalBoard,
    hub: NodeHub,
    links: LinkRegistry,
    waiting: WaitingAttempts,
    settings: Settings,
    metrics: LeaderMetrics,
) -> Router:
    """The router over ``resolver``'s names, fed by the hub's reports and ``signals``."""
    return Router(
        resolver,
        signals=signals,
        node_reported=hub.has_reported,
        free_vram_mb=hub.free_vram_mb,
        links=links,  # a node whose link goes loses its affinity and its waiting requests
        waiting=waiting,
        policy=settings.routing_policy,
        prefixes=PrefixIndex(settings.prefix_cache_entries, settings.prefix_cache_mb),
        load_factor=settings.prefix_load_factor,
        on_decision=metrics.proxy.routing_decided,
    )


def _listeners(
    home: BerthHome, settings: Settings, sockets: LeaderSockets, tls: LeaderTls, cluster_url: str
) -> tuple[Listener, ...]:
    """The three listeners the leader reports: public HTTPS, the cluster link, the unix socket."""
    return (
        Listener("public", f"https://{settings.public_host}:{sockets.public_port}", tls.public),
        Listener("cluster", cluster_url, tls.cluster),
        Listener("socket", f"unix://{home.socket_file}"),
    )


def _shared_leadership(
    settings: Settings,
    store: Store,
    sockets: LeaderSockets,
    cluster_url: str,
    *,
    authenticator: Authenticator,
    admission: Admission,
    hub: NodeHub,
    enrollment: EnrollmentService,
) -> SharedLeadership | None:
    """With ``leader_ha``: this leader's lease loop, roster and key sync, the roster
    answering for the hub (a standby sends agents to the active) and enrollment (every
    leader's URL in a new URI). ``None`` without it."""
    if not settings.leader_ha:
        return None
    return build_shared_leadership(
        store, authenticator, admission, hub, enrollment,
        address=f"https://{settings.public_host}:{sockets.public_port}",
        cluster_url=cluster_url, lease_s=settings.leader_lease_s,
    )  # fmt: skip


#: Set to ``1`` in a leader's environment, its placement does not leave out nodes whose
#: agent policy would refuse: a test seam, so tests show the agent refusing by itself.  The
#: agents check their policy either way.
SKIP_POLICY_CHECK_ENV = "BERTH_TESTING_SKIP_LEADER_POLICY_CHECK"


async def build_leader(
    home: BerthHome,
    settings: Settings,
    sockets: LeaderSockets,
    store: Store,
    *,
    environ: Mapping[str, str],
    pid: int,
    started_at: float,
) -> LeaderParts:
    """Build every piece of the leader on ``store`` (opened by :func:`open_store`) and the
    bound ``sockets``; ``environ`` is read once, for the reverse proxy fingerprint mode
    (:mod:`berth.cluster.pki.peer_identity`) and the ``OTEL_*`` variables of tracing
    (:mod:`berth.observability.tracing_config`), and for :data:`SKIP_POLICY_CHECK_ENV`.
    Starts nothing."""
    forwarded = ForwardedFingerprintTrust.from_env(environ)
    tls = await load_tls(home, settings, store)
    metrics = await build_metrics(store)
    # OpenTelemetry traces of /v1 requests, when [tracing] or OTEL_* name a collector.
    tracing = open_tracing(
        settings, environ, service_name="berth-leader", registry=metrics.proxy.registry
    )
    admission, ledger, slots = await build_admission(store, settings, metrics.proxy)
    core = None if settings.leader_only else build_local_core(home, settings, environ)
    links = LinkRegistry([] if core is None else [InProcessLink(core)])
    audit = AuditLog(home.audit_log)
    signals = SignalBoard()
    adapters = await build_adapters(store, links, metrics.proxy)
    events = DeploymentEvents(adapters, metrics, signals)
    waiting = WaitingAttempts()  # requests before their first byte, woken on a give-up
    lifecycle = build_lifecycle(
        store, links, settings, events=events, waiting=waiting, slots=slots,
        metrics=metrics.proxy, audit=audit,
        check_agent_policies=environ.get(SKIP_POLICY_CHECK_ENV) != "1",
        signer=tls.signer,
    )  # fmt: skip
    if core is not None:  # this host's engines: an end is heard by the lifecycle at once
        core.on_engine_end(functools.partial(lifecycle.engine_ended, LOCAL_NODE_ID))
    hub = build_hub(
        store, links, lifecycle, settings, cluster_metrics=metrics.cluster, audit=audit,
        forwarded=forwarded, ca=tls.ca,
    )  # fmt: skip
    # Requests to agents' engines: direct to an agent's ingress when it answers, else the hub.
    data_paths = _build_data_paths(hub, links, tls, home, settings)
    routes = RouteResolver(lifecycle)  # route names first, then the lifecycle's own names
    scaling = build_scaling(
        lifecycle, signals, routes, settings, metrics=metrics.proxy, audit=audit
    )
    events.attach_scaling(scaling)
    drains = DrainRunner(
        store, lifecycle, in_flight=signals.in_flight, on_draining=scaling.set_draining_nodes,
        audit=audit.append, min_residency_s=settings.min_residency_s,
    )  # fmt: skip
    await load_routes(store, routes, lifecycle=lifecycle)
    resolver = AdapterResolver(routes, lifecycle, adapters)  # adapters' names, then routes'
    router = _build_router(resolver, signals, hub, links, waiting, settings, metrics)
    events.attach_router(router)
    proxy = build_proxy(
        resolver, router, settings, metrics=metrics.proxy, data_paths=data_paths, core=core,
        scaling=scaling, admission=admission, slots=slots, adapters=adapters,
        tracer=tracing.requests() if tracing is not None else None,
    )  # fmt: skip
    # On the health watch's cycle, the engines' own cache signals correct the prefix record.
    cache_probe = CacheProbe(router, proxy.engines, timeout_s=settings.probe_timeout_s)
    lifecycle.after_probes(cache_probe.read_round)
    cluster_url = settings.cluster_url(sockets.cluster_port)
    enrollment = EnrollmentService(
        store=store, ca=tls.ca, pepper=tls.pepper, cluster_url=cluster_url, audit=audit,
        cert_lifetime_s=settings.agent_cert_lifetime_s,
    )  # fmt: skip
    authenticator = await build_authenticator(
        store, tls.pepper, settings, metrics=metrics.proxy, audit=audit
    )
    shared = _shared_leadership(
        settings, store, sockets, cluster_url,
        authenticator=authenticator, admission=admission, hub=hub, enrollment=enrollment,
    )  # fmt: skip
    graph = LeaderGraph(
        home=home,
        settings=settings,
        store=store,
        ca=tls.ca,
        pepper=tls.pepper,
        metrics=metrics.proxy,
        cluster_metrics=metrics.cluster,
        history=metrics.history,
        proxy=proxy,
        lifecycle=lifecycle,
        authenticator=authenticator,
        local_core=core,
        links=links,
        hub=hub,
        data_paths=data_paths,
        enrollment=enrollment,
        cluster_url=cluster_url,
        pid=pid,
        started_at=started_at,
        routes=routes,
        scaling=scaling,
        drains=drains,
        admission=admission,
        adapters=adapters,
        listeners=_listeners(home, settings, sockets, tls, cluster_url),
        shared=shared,
        run=RunState(),
    )
    public_server, socket_server, cluster_listener = build_listeners(graph, sockets, tls)
    return LeaderParts(
        graph=graph,
        sockets=sockets,
        tls=tls,
        ledger=ledger,
        loop_lag=metrics.loop_lag,
        local_sampler=build_local_sampler(core, metrics, settings),
        public_server=public_server,
        socket_server=socket_server,
        cluster_listener=cluster_listener,
        tracing=tracing,
    )
