"""Runs the leader: builds its services, binds its listeners, serves until told to stop.

Two listeners of berth's own HTTP server (:mod:`berth.http_server`) share one event loop: the
public HTTPS listener and the Unix socket for the local CLI; the cluster listener for agents
(aiohttp, see ``cluster/listener.py``) runs on the same loop. All three apply the listener
bounds of the settings (``max_head_bytes`` ...). Sockets are bound here, before anything else
starts, so a port in use fails the start with the listener's name, and the socket file is
created with mode 0600 from the first instant.

With ``leader_only`` the leader is a control plane only: no agent core, no ``local`` link, no
local node sampler; every deployment runs on an agent.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import signal
import socket
import time
from pathlib import Path

from berth.admin.adapters import reload_adapters
from berth.admin.services import load_routes
from berth.admission import Admission, QueueCollector, SlotGate, UsageCollector, UsageLedger
from berth.agent.adopted import AdoptedWatcher
from berth.agent.core import AgentCore
from berth.agent.in_process_link import InProcessLink
from berth.agent.node_sampler import LocalNodeSampler
from berth.agent.owner import own_engines
from berth.cluster.ca import CertificateAuthority
from berth.cluster.direct_path import DataPaths
from berth.cluster.enrollment import AuditLog, EnrollmentService
from berth.cluster.hub import NodeHub
from berth.cluster.link import LOCAL_NODE_ID
from berth.cluster.link_registry import LinkRegistry
from berth.cluster.listener import (
    ClusterListener,
    build_cluster_app,
    cluster_ssl_context,
    cluster_tls_files,
)
from berth.cluster.peer_identity import ForwardedFingerprintTrust
from berth.cluster.renewal import LinkCertificates
from berth.config import Settings
from berth.daemon.app import build_apps
from berth.daemon.graph import LeaderGraph, Listener
from berth.daemon.public_tls import public_ssl_context
from berth.deployments.adapters import AdapterManager
from berth.deployments.fleet import LeaderFleet
from berth.deployments.lifecycle import LifecycleManager
from berth.deployments.placement_facts import ResidentUsage
from berth.deployments.restarts import Backoff
from berth.deployments.supervisor import restart_reporter
from berth.errors import DaemonError
from berth.eventloop import freeze_startup_objects
from berth.gateway.adapter_resolver import AdapterResolver
from berth.gateway.auth import Authenticator
from berth.gateway.auth_limiter import FailedAuthLimiter
from berth.gateway.auth_metrics import AuthCollector
from berth.gateway.proxy import OpenAIProxy
from berth.http_server.server import HttpServer
from berth.http_server.tls_reload import CertificateReloads, ReloadingTLS
from berth.keys import load_or_create_pepper
from berth.observability.adapters import AdapterMetrics
from berth.observability.cluster import ClusterMetrics
from berth.observability.loop_lag import LoopLagMonitor
from berth.observability.metrics import ProxyMetrics
from berth.observability.window import RequestMeter
from berth.paths import BerthHome
from berth.routing.router import Router
from berth.routing.routes import RouteResolver
from berth.routing.signals import SignalBoard
from berth.routing.waiting import WaitingAttempts
from berth.runtime.docker import DockerRuntime, resolve_docker_host
from berth.runtime.engines import EngineBinaries
from berth.runtime.gpu import inventory_for
from berth.runtime.process import ProcessRuntime
from berth.scaling import ScalingController, ScalingMetrics, ScalingPolicy, route_services
from berth.store import DeploymentRecord, Store
from berth.store.states import TERMINAL_STATES

log = logging.getLogger(__name__)


#: Seconds requests in flight get to finish when the leader stops (as uvicorn gave them).
SHUTDOWN_GRACE_S = 5.0


def bind_tcp(name: str, host: str, port: int) -> socket.socket:
    """Bind a listening TCP socket on ``host`` (an address or name; an IPv6 address may be in
    brackets) and ``port`` (0: any free one).

    Raises ``DaemonError`` naming the listener, address and port when binding fails (a port
    in use: ``public listener 127.0.0.1:11500: address already in use``).
    """
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says TCP, and without it a head and body written as two TLS records
    # wait ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise DaemonError(f"{name} listener {host}:{port}: {reason}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def bind_unix(path: Path) -> socket.socket:
    """Bind the local CLI socket with mode 0600 (the umask covers the moment of creation)."""
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a stale socket from a daemon that died
        else:
            raise DaemonError(f"a berth daemon already listens on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(512)
    sock.setblocking(False)
    return sock


def public_tls_files(
    settings: Settings, home: BerthHome, ca: CertificateAuthority
) -> tuple[Path, Path]:
    """The public listener's certificate and key: the operator's, or one issued by the CA.

    The issued certificate covers ``public_host``, ``localhost``, 127.0.0.1 and ::1, and is
    re-issued when the configured host is not among its SANs.
    """
    if settings.public_cert and settings.public_key:
        return Path(settings.public_cert), Path(settings.public_key)
    cert, key = home.ca_dir / "public.pem", home.ca_dir / "public.key"
    hosts = sorted({settings.public_host, "localhost", "127.0.0.1", "::1"})
    ca.ensure_server_certificate(hosts, cert, key)
    return cert, key


def refuse_local_leftovers(store: Store) -> None:
    """For a leader-only start: ``DaemonError`` if deployments on node ``local`` are still
    active.  Their engines may still run, and a leader without a local agent core could
    neither take them back nor stop them."""
    left = [r.id for r in store.list_deployments(active_only=True) if r.node_id == LOCAL_NODE_ID]
    if left:
        raise DaemonError(
            f"leader_only is set, but deployments on this host are still active: "
            f"{', '.join(left)}; start once without --leader-only, stop them (berth stop ID), "
            "then start with --leader-only"
        )


def build_local_core(home: BerthHome, settings: Settings) -> AgentCore:
    """The agent core for node ``local``: this host's engines, as processes or containers."""
    return AgentCore(
        ProcessRuntime(process_tree=settings.process_tree),
        EngineBinaries(
            llama_server=_optional_str(settings.llama_server_bin),
            vllm=_optional_str(settings.vllm_bin),
            sglang_python=str(settings.sglang_python),
        ),
        inventory_for(settings.simulated_gpus),
        logs_dir=home.logs_dir,
        journal_path=home.local_engines_file,  # the engines' keys, for a restarted leader
        keys_dir=home.engine_keys_dir,
        docker=DockerRuntime(
            host=resolve_docker_host(settings.docker_host), home=home.root, node_id=LOCAL_NODE_ID
        ),
        docker_shm_size=settings.docker_shm_size,
        adopted=AdoptedWatcher(home.adopted_file),
    )


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)


def raise_open_files_limit(wanted: int) -> None:
    """Raise this process's soft limit of open files towards ``wanted`` (never past the hard
    limit), so that the listeners' connection caps, not ``EMFILE``, are what refuses."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit to %d: %s", target, exc)


async def serve(home: BerthHome, settings: Settings) -> None:
    """Run the leader until SIGTERM or SIGINT, then stop every engine it started; SIGHUP
    reloads the public and cluster listeners' certificates.

    Raises ``DaemonError`` when a listener cannot bind (naming it, its address and port), or
    when ``leader_only`` is set while deployments on this host are still active.
    """
    home.ensure()
    # Read once, here: the reverse-proxy fingerprint mode (berth.cluster.peer_identity).
    forwarded = ForwardedFingerprintTrust.from_env(os.environ)
    public_sock = bind_tcp("public", settings.public_bind, settings.public_port)
    try:
        cluster_sock = bind_tcp("cluster", settings.cluster_bind, settings.cluster_port)
    except DaemonError:
        public_sock.close()
        raise
    unix_sock = bind_unix(home.socket_file)
    public_port: int = public_sock.getsockname()[1]  # the real one, also for --public-port 0
    cluster_url = settings.cluster_url(cluster_sock.getsockname()[1])

    store = Store(settings.database_url)
    await asyncio.to_thread(store.migrate)
    await asyncio.to_thread(store.ensure_local_node)
    if settings.leader_only:
        try:
            await asyncio.to_thread(refuse_local_leftovers, store)
        except DaemonError:
            for sock in (public_sock, cluster_sock, unix_sock):
                sock.close()
            home.socket_file.unlink(missing_ok=True)
            store.close()
            raise
    ca = await asyncio.to_thread(CertificateAuthority.load_or_create, home.ca_dir)
    tls = await asyncio.to_thread(public_tls_files, settings, home, ca)
    pepper = await asyncio.to_thread(load_or_create_pepper, home.pepper_file)
    cluster_tls = await asyncio.to_thread(
        cluster_tls_files, ca, settings.cluster_hosts(), home.ca_dir
    )
    # Both listeners' certificates are reloaded on SIGHUP and when their files change
    # (berth.http_server.tls_reload: validated first, new connections only).
    public_pair = await asyncio.to_thread(ReloadingTLS.load, "public", *tls, public_ssl_context)
    cluster_pair = await asyncio.to_thread(
        ReloadingTLS.load, "cluster", *cluster_tls, lambda c, k: cluster_ssl_context(ca, c, k)
    )
    reloads = CertificateReloads(
        [public_pair, cluster_pair], interval_s=settings.tls_reload_interval_s
    )

    # Per-key limits and usage: in memory, the budgets starting from the ledger's totals.
    ledger = UsageLedger(store)
    admission = Admission(settings.tiers, ledger, desk_tier=settings.desk_tier)
    today, month_start = admission.budget_days()
    admission.load(
        await asyncio.to_thread(store.list_api_keys),
        await asyncio.to_thread(store.token_totals, day=today, month_start=month_start),
    )

    local_meter = RequestMeter()  # requests to node local's engines, served by the proxy
    metrics = ProxyMetrics(local_meter=local_meter, local_node=LOCAL_NODE_ID)
    # The labels of deployments still active carry over a restart (the cluster series' too).
    metrics.restore(await asyncio.to_thread(store.list_deployments, active_only=True))
    loop_lag = LoopLagMonitor()  # the leader's own loop: berth_event_loop_lag_seconds{node=local}
    cluster_metrics = ClusterMetrics(
        model_of=metrics.deployment_model,
        local_loop_lag=loop_lag.histogram,
        local_node=LOCAL_NODE_ID,
    )
    cluster_metrics.register(metrics.registry)
    metrics.registry.register(UsageCollector(admission))
    # Fair admission: requests beyond their deployments' slots wait here, fair across keys.
    slots = SlotGate(max_waiting=settings.queue_max_requests, timeout_s=settings.queue_timeout_s)
    metrics.registry.register(QueueCollector(slots))
    core = None if settings.leader_only else build_local_core(home, settings)
    links = LinkRegistry([] if core is None else [InProcessLink(core)])
    audit = AuditLog(home.audit_log)
    signals = SignalBoard()
    scaling: ScalingController | None = None  # built below, once the lifecycle manager is
    adapters = AdapterManager(links, metrics=AdapterMetrics(metrics.registry))
    for active in await asyncio.to_thread(store.list_deployments, active_only=True):
        adapters.deployment_changed(active)
    await reload_adapters(store, adapters)

    def on_state(record: DeploymentRecord) -> None:
        adapters.deployment_changed(record)
        metrics.set_deployment_state(
            record.id, model=record.served_model_name, node=record.node_id, state=record.state
        )
        if scaling is not None:
            scaling.deployment_changed(record)
        if record.state in TERMINAL_STATES:  # its routing samples and window go with it
            signals.forget(record.id)
            local_meter.forget(record.id)
            cluster_metrics.deployment_ended(record.id)  # its series go after a linger

    def resident_usage(deployment_id: str) -> ResidentUsage:
        """What placement's eviction choice knows of a deployment's use: the scaling
        controller's view (a protected replica counts as pinned)."""
        if scaling is None:
            return ResidentUsage(in_flight=signals.in_flight(deployment_id))
        use = scaling.usage(deployment_id)
        return ResidentUsage(use.last_request_at, use.in_flight, use.queued, use.protected)

    waiting = WaitingAttempts()  # requests before their first byte, woken on a give-up
    lifecycle = LifecycleManager(
        store,
        links,
        health_timeout_s=settings.health_timeout_s,
        stop_grace_s=settings.stop_grace_s,
        watch_interval_s=settings.probe_interval_s,
        probe_timeout_s=settings.probe_timeout_s,
        probes_to_fail=settings.probes_to_fail,
        waiting=waiting,
        on_state=on_state,
        images=settings.docker_images(),
        gpu_images=settings.docker_gpu_images(),
        usage=resident_usage,
        min_residency_s=settings.min_residency_s,
        slots_changed=slots.resize,  # a service's capacity changed: waiters may go now
        restart_backoff=Backoff(
            initial_s=settings.restart_backoff_s,
            max_s=settings.restart_backoff_max_s,
            reset_after_s=settings.restart_reset_after_s,
            crashloop_restarts=settings.crashloop_restarts,
        ),
        on_restart=restart_reporter(metrics, audit.append),
        default_slots=settings.default_slots,
    )
    hub = NodeHub(
        store,
        links,
        listener=lifecycle,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        node_timeout_s=settings.node_timeout_s,
        link_timeout_s=settings.link_timeout_s,
        cluster_metrics=cluster_metrics,
        audit=audit,
        forwarded=forwarded,
        certificates=LinkCertificates(
            store, ca, lifetime_s=settings.agent_cert_lifetime_s, audit=audit
        ),
    )
    if forwarded is not None:
        log.warning("cluster: trusting x-berth-client-fingerprint from %s", forwarded.describe())
    # Requests to agents' engines: direct to an agent's ingress when it answers, else the hub.
    data_paths = DataPaths(
        hub,
        links,
        ca,
        home.ca_dir,
        probe_interval_s=settings.direct_probe_interval_s,
        probe_timeout_s=settings.direct_probe_timeout_s,
    )
    routes = RouteResolver(lifecycle)  # route names first, then the lifecycle's own names
    scaling = ScalingController(
        LeaderFleet(lifecycle, min_residency_s=settings.min_residency_s),
        signals,
        route_services=lambda model: route_services(routes.table, model),
        policy=ScalingPolicy(
            load_wait_s=settings.load_wait_s,
            load_queue_max=settings.load_queue_max,
            scale_out_after_s=settings.scale_out_after_s,
            interval_s=settings.scaling_interval_s,
            default_slots=settings.default_slots,
        ),
        metrics=ScalingMetrics(metrics.registry),
        audit=audit.append,
    )
    await load_routes(store, routes, lifecycle=lifecycle)
    resolver = AdapterResolver(routes, lifecycle, adapters)  # adapters' names, then routes'
    router = Router(
        resolver,
        signals=signals,
        node_reported=hub.has_reported,
        free_vram_mb=hub.free_vram_mb,
        links=links,  # a node whose link goes loses its affinity and its waiting requests
        waiting=waiting,
    )
    local_sampler = None
    if core is not None:
        local_sampler = LocalNodeSampler(
            core,
            local_meter,
            cluster_metrics,
            node_id=LOCAL_NODE_ID,
            interval_s=settings.heartbeat_interval_s,
        )
    proxy = OpenAIProxy(
        resolver,
        metrics,
        max_body_bytes=settings.max_body_bytes,
        tunnels=data_paths,
        router=router,
        max_attempts=settings.max_attempts,
        read_timeout_s=settings.read_timeout_s,
        first_byte_timeout_s=settings.first_byte_timeout_s or None,  # 0: off
        stream_idle_timeout_s=settings.stream_idle_timeout_s or None,
        relay_buffer_chunks=settings.relay_buffer_chunks,
        engine_auth=core.engine_auth if core is not None else None,
        on_demand=scaling.stage,
        admission=admission,
        slots=slots,
        adapters=adapters,
    )
    enrollment = EnrollmentService(
        store=store,
        ca=ca,
        pepper=pepper,
        cluster_url=cluster_url,
        audit=audit,
        cert_lifetime_s=settings.agent_cert_lifetime_s,
    )
    # Keys checked with caches in front of the store, failures limited per client address.
    authenticator = Authenticator(
        store,
        pepper,
        limiter=FailedAuthLimiter(
            burst=settings.auth_failure_burst, rate_per_s=settings.auth_failure_rate_per_s
        ),
        refusal_delay_s=settings.auth_refusal_delay_s,
        audit=audit.append,
    )
    authenticator.know(await asyncio.to_thread(store.api_key_hashes))  # never rate limited
    metrics.registry.register(AuthCollector(authenticator.counts))
    services = LeaderGraph(
        home=home,
        settings=settings,
        store=store,
        ca=ca,
        pepper=pepper,
        metrics=metrics,
        cluster_metrics=cluster_metrics,
        proxy=proxy,
        lifecycle=lifecycle,
        authenticator=authenticator,
        local_core=core,
        links=links,
        hub=hub,
        data_paths=data_paths,
        enrollment=enrollment,
        cluster_url=cluster_url,
        pid=os.getpid(),
        started_at=time.time(),
        routes=routes,
        scaling=scaling,
        admission=admission,
        adapters=adapters,
        listeners=[
            Listener("public", f"https://{settings.public_host}:{public_port}", public_pair),
            Listener("cluster", cluster_url, cluster_pair),
            Listener("socket", f"unix://{home.socket_file}"),
        ],
    )
    public_app, socket_app = build_apps(services)
    limits = settings.listener_limits()
    # Three listeners, each its cap, plus engines, the store and the pool to engines.
    raise_open_files_limit(3 * limits.max_connections + 2048)
    public_server = HttpServer("public", public_app, limits, ssl_context=public_pair.context)
    socket_server = HttpServer("socket", socket_app, limits)
    cluster_listener = ClusterListener(
        build_cluster_app(
            enrollment=enrollment,
            ca_pem=lambda: ca.server_root_pem,  # a CA rotation changes it
            agent_handler=hub.handle_agent,
            on_registered=hub.certificate_replaced,
            body_timeout_s=limits.body_timeout_s,
        ),
        cluster_sock,
        cluster_pair.context,
        limits,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reloads.reload_all)  # never the default: death

    home.pid_file.write_text(f"{os.getpid()}\n")
    await proxy.startup()
    flusher = asyncio.create_task(ledger.run())  # the usage ledger, written every few seconds
    try:
        await data_paths.start()  # before the cluster listener: no agent links before it
        await public_server.start(public_sock)
        await socket_server.start(unix_sock)
        await cluster_listener.start()
        reloads.start()
        if core is not None:
            services.runtimes = await core.runtime_status()
            for runtime in services.runtimes:
                verdict = "available" if runtime.available else "unavailable"
                log.info("runtime %s: %s (%s)", runtime.name, verdict, runtime.detail)
            # Held until this process ends; its warden stops this host's engines if the
            # leader does not come back.
            await own_engines(home, "leader", settings, LOCAL_NODE_ID)
            # Engines (in the journal) and containers (by label) left running by the last
            # leader, with their keys, for reconcile.
            await core.restore()
        await lifecycle.start()
        scaling.start(
            await asyncio.to_thread(store.list_service_profiles),
            await asyncio.to_thread(store.list_deployments, active_only=True),
        )
        if core is not None and core.adopted is not None:
            watcher = core.adopted  # the servers this host adopted: node local reports them
            watcher.on_change = lambda: lifecycle.adopted_reported(LOCAL_NODE_ID, watcher.states())
            watcher.start()
        if local_sampler is not None:
            local_sampler.start()
        freeze_startup_objects()  # full collections then skip the start-up heap
        loop_lag.start()
        services.ready = True
        log.info(
            "berth leader ready%s: public https://%s:%d, cluster %s, socket %s, CA %s",
            " (leader-only: no engines on this host)" if core is None else "",
            settings.public_bind,
            public_port,
            cluster_url,
            home.socket_file,
            ca.fingerprint_sha256,
        )
        await stop.wait()
        log.info("berth leader stopping")
        services.ready = False
        await asyncio.gather(
            public_server.close(SHUTDOWN_GRACE_S), socket_server.close(SHUTDOWN_GRACE_S)
        )
    finally:
        await reloads.close()
        await asyncio.gather(public_server.close(0.0), socket_server.close(0.0))
        if local_sampler is not None:
            await local_sampler.stop()
        await scaling.close()
        await hub.shutdown()
        await data_paths.close()
        await cluster_listener.stop()
        await lifecycle.shutdown()
        await proxy.shutdown()
        ledger.stop()  # every answer has been settled: write the rest of the usage
        await flusher
        if core is not None:
            if core.adopted is not None:
                await core.adopted.stop()
            core.close()
        loop_lag.stop()
        home.pid_file.unlink(missing_ok=True)
        home.socket_file.unlink(missing_ok=True)
        log.info("berth leader stopped")
