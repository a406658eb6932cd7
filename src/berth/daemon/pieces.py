"""The leader's pieces, each built by a small function from the settings and the pieces it
needs (:func:`berth.daemon.build.build_leader` calls them in dependency order). Nothing here
starts a task, a listener or an engine. Blocking steps (the store, the CA, reading
certificates) run off the event loop.

The one cycle (the lifecycle manager tells the scaling controller of state changes, and the
scaling controller is built on the lifecycle manager) goes through :class:`DeploymentEvents`,
to which the controller is attached once built.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from berth.admin.adapters import reload_adapters
from berth.admission import Admission, QueueCollector, SlotGate, UsageCollector, UsageLedger
from berth.agent.adopted import AdoptedWatcher
from berth.agent.core import AgentCore
from berth.agent.node_sampler import LocalNodeSampler
from berth.auth.authenticator import Authenticator
from berth.auth.limiter import FailedAuthLimiter
from berth.auth.metrics import AuthCollector
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.cluster.leader.direct_path import DataPaths
from berth.cluster.leader.hub import NodeHub
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.listener import (
    cluster_ssl_context,
    cluster_tls_files,
)
from berth.cluster.pki import signing_key
from berth.cluster.pki.bootstrap import share_through_store
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.enrollment import AuditLog
from berth.cluster.pki.peer_identity import ForwardedFingerprintTrust
from berth.cluster.pki.renewal import LinkCertificates
from berth.cluster.pki.signing_key import SpecSigner, trusted_in
from berth.config import Settings
from berth.daemon.public_tls import public_ssl_context, public_tls_files
from berth.deployments.adapters import AdapterManager
from berth.deployments.fleet import LeaderFleet
from berth.deployments.lifecycle import LifecycleManager
from berth.deployments.placement_facts import ResidentUsage
from berth.deployments.restarts import Backoff
from berth.deployments.supervisor import restart_reporter
from berth.errors import DaemonError
from berth.gateway.adapter_resolver import AdapterResolver
from berth.gateway.body_limits import BodyLimits
from berth.gateway.proxy import OpenAIProxy
from berth.http_server.tls_reload import CertificateReloads, ReloadingTLS
from berth.keys import load_or_create_pepper
from berth.observability.adapters import AdapterMetrics
from berth.observability.cluster import ClusterMetrics
from berth.observability.history import MetricsHistory
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
from berth.store import Store
from berth.store.deadlines import StoreDeadlines
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import TERMINAL_STATES, DeploymentState

if TYPE_CHECKING:  # imported only where tracing is on (build.py opens it)
    from berth.observability.tracing import RequestTracer

log = logging.getLogger(__name__)


# -- the store and the certificates ---------------------------------------------------------


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


async def open_store(settings: Settings) -> Store:
    """The store at ``database_url``, migrated, with node ``local``; for ``leader_only`` it
    raises ``DaemonError`` (and closes the store) while deployments on this host are active
    (:func:`refuse_local_leftovers`).  With ``leader_ha`` every call on it is bounded
    within the lease (:meth:`StoreDeadlines.within_lease`), else by the store's defaults."""
    deadlines = StoreDeadlines.within_lease(settings.leader_lease_s) if settings.leader_ha else None
    store = Store(settings.database_url, deadlines=deadlines)
    try:
        await asyncio.to_thread(store.migrate)
        await asyncio.to_thread(store.ensure_local_node)
        if settings.leader_only:
            await asyncio.to_thread(refuse_local_leftovers, store)
    except BaseException:
        store.close()
        raise
    return store


@dataclass
class LeaderTls:
    """The CA, the pepper API keys are hashed with, and both TLS listeners' reloadable
    certificate pairs with their reloader (SIGHUP and file changes)."""

    ca: CertificateAuthority
    pepper: bytes
    public: ReloadingTLS
    cluster: ReloadingTLS
    reloads: CertificateReloads
    #: the cluster's spec signing key, beside the CA (berth.cluster.pki.signing_key)
    signer: SpecSigner


async def share_bootstrap(home: BerthHome, settings: Settings, store: Store) -> None:
    """With ``leader_ha`` and a ``cluster_secret``: make the home hold the cluster's CA and
    pepper sealed in ``store``, or publish its own (:mod:`berth.cluster.pki.bootstrap`;
    ``ConfigError`` for a wrong secret or a home with another CA).  With ``leader_ha``
    alone: a log line saying the homes must be prepared by hand.  A ``cluster_secret``
    without ``leader_ha``: a warning that it is not used (nothing is shared).  Else
    nothing."""
    if not settings.leader_ha:
        if settings.cluster_secret is not None:
            log.warning(
                "cluster_secret is set but leader_ha is off: the secret is not used and "
                "nothing is shared through the store; set leader_ha = true to share the CA "
                "and key pepper (docs/ha.md)"
            )
        return
    if settings.cluster_secret is None:
        log.info(
            "leader_ha without cluster_secret: the CA and key pepper are not shared through "
            "the store; every leader's home must hold the same ones (docs/ha.md)"
        )
        return
    await asyncio.to_thread(share_through_store, home, store, settings.cluster_secret)
    await asyncio.to_thread(signing_key.share_through_store, home, store, settings.cluster_secret)


async def load_tls(home: BerthHome, settings: Settings, store: Store) -> LeaderTls:
    """Load or create the CA and the pepper (shared through ``store`` first where
    :func:`share_bootstrap` says so), issue the listeners' certificates where the operator
    gave none, and load both pairs (``berth.http_server.tls_reload``: validated first, new
    connections only). ``ConfigError`` for an operator's pair OpenSSL refuses."""
    await share_bootstrap(home, settings, store)
    ca = await asyncio.to_thread(CertificateAuthority.load_or_create, home.ca_dir)
    signer = await asyncio.to_thread(SpecSigner.load_or_create, home.ca_dir)  # made with the CA
    public_files = await asyncio.to_thread(public_tls_files, settings, home, ca)
    pepper = await asyncio.to_thread(load_or_create_pepper, home.pepper_file)
    cluster_files = await asyncio.to_thread(
        cluster_tls_files, ca, settings.cluster_hosts(), home.ca_dir
    )
    public = await asyncio.to_thread(ReloadingTLS.load, "public", *public_files, public_ssl_context)
    cluster = await asyncio.to_thread(
        ReloadingTLS.load, "cluster", *cluster_files, lambda c, k: cluster_ssl_context(ca, c, k)
    )
    reloads = CertificateReloads([public, cluster], interval_s=settings.tls_reload_interval_s)
    return LeaderTls(ca, pepper, public, cluster, reloads, signer)


# -- metrics, admission, the local node -------------------------------------------------------


@dataclass
class LeaderMetrics:
    """The leader's metrics: the proxy's registry, the cluster series, the loop lag monitor
    of the leader's own loop, the meter of requests to node ``local``'s engines, and the
    last hour's history for the console."""

    proxy: ProxyMetrics
    cluster: ClusterMetrics
    loop_lag: LoopLagMonitor
    local_meter: RequestMeter
    history: MetricsHistory


async def build_metrics(store: Store) -> LeaderMetrics:
    """The metrics, with the labels of deployments still active carried over a restart."""
    local_meter = RequestMeter()  # requests to node local's engines, served by the proxy
    metrics = ProxyMetrics(local_meter=local_meter, local_node=LOCAL_NODE_ID)
    metrics.restore(await asyncio.to_thread(store.list_deployments, active_only=True))
    loop_lag = LoopLagMonitor()  # the leader's own loop: berth_event_loop_lag_seconds{node=local}
    cluster_metrics = ClusterMetrics(
        model_of=metrics.deployment_model,
        local_loop_lag=loop_lag.histogram,
        local_node=LOCAL_NODE_ID,
    )
    cluster_metrics.register(metrics.registry)
    history = MetricsHistory(metrics, cluster_metrics)  # the console's last hour
    return LeaderMetrics(metrics, cluster_metrics, loop_lag, local_meter, history)


async def build_admission(
    store: Store, settings: Settings, metrics: ProxyMetrics
) -> tuple[Admission, UsageLedger, SlotGate]:
    """Per-key limits and usage (in memory, the budgets starting from the ledger's totals),
    the usage ledger, and the fair queue of requests beyond their deployments' slots."""
    ledger = UsageLedger(store)
    admission = Admission(
        settings.tiers,
        ledger,
        desk_tier=settings.desk_tier,
        max_body_bytes_per_key=settings.max_body_bytes_per_key,
    )
    today, month_start = admission.budget_days()
    admission.load(
        await asyncio.to_thread(store.list_api_keys),
        await asyncio.to_thread(store.token_totals, day=today, month_start=month_start),
    )
    metrics.registry.register(UsageCollector(admission))
    slots = SlotGate(max_waiting=settings.queue_max_requests, timeout_s=settings.queue_timeout_s)
    metrics.registry.register(QueueCollector(slots))
    return admission, ledger, slots


def build_local_core(home: BerthHome, settings: Settings, environ: Mapping[str, str]) -> AgentCore:
    """The agent core for node ``local``: this host's engines, as processes or containers,
    started only as the ``[agent_policy]`` settings allow (the Hugging Face cache of the
    default model roots read from ``environ``)."""
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
        policy=settings.agent_policy(environ),
        spec_keys=functools.partial(trusted_in, home.ca_dir),  # a start runs only what was signed
    )


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)


def build_local_sampler(
    core: AgentCore | None, metrics: LeaderMetrics, settings: Settings
) -> LocalNodeSampler | None:
    """The sampler of node ``local``'s load (``None`` on a leader-only daemon)."""
    if core is None:
        return None
    return LocalNodeSampler(
        core,
        metrics.local_meter,
        metrics.cluster,
        node_id=LOCAL_NODE_ID,
        interval_s=settings.heartbeat_interval_s,
    )


# -- deployments ----------------------------------------------------------------------------


class DeploymentEvents:
    """What a deployment's state change touches beyond the store (the lifecycle manager's
    ``on_state``), and what placement's eviction choice knows of a deployment's use
    (its ``usage``).

    The scaling controller is built after the lifecycle manager (it is built on it), so it is
    attached here with :meth:`attach_scaling` once it exists; until then neither method
    consults it.
    """

    def __init__(
        self, adapters: AdapterManager, metrics: LeaderMetrics, signals: SignalBoard
    ) -> None:
        self._adapters = adapters
        self._metrics = metrics
        self._signals = signals
        self._scaling: ScalingController | None = None
        self._router: Router | None = None

    def attach_scaling(self, scaling: ScalingController) -> None:
        """From now on, state changes reach ``scaling`` and usage is its view."""
        self._scaling = scaling

    def attach_router(self, router: Router) -> None:
        """From now on, a deployment that leaves ready takes its prefix record with it."""
        self._router = router

    def on_state(self, record: DeploymentRecord) -> None:
        """A deployment changed state: its adapters, its metric labels, the scaling
        controller; a deployment that ended takes its routing samples and window with it."""
        self._adapters.deployment_changed(record)
        self._metrics.proxy.set_deployment_state(
            record.id, model=record.served_model_name, node=record.node_id, state=record.state
        )
        if self._scaling is not None:
            self._scaling.deployment_changed(record)
        if record.state is not DeploymentState.READY and self._router is not None:
            # Stopping, stopped, failed or restarting: its engine's prefix cache is gone (or
            # going), so the prefix policy's record of it goes at once.
            self._router.deployment_gone(record.id)
        if record.state in TERMINAL_STATES:
            self._signals.forget(record.id)
            self._metrics.local_meter.forget(record.id)
            self._metrics.cluster.deployment_ended(record.id)  # its series go after a linger

    def resident_usage(self, deployment_id: str) -> ResidentUsage:
        """The scaling controller's view of a deployment's use (a protected replica counts
        as pinned); before it is attached, only the requests in flight."""
        if self._scaling is None:
            return ResidentUsage(in_flight=self._signals.in_flight(deployment_id))
        use = self._scaling.usage(deployment_id)
        return ResidentUsage(use.last_request_at, use.in_flight, use.queued, use.protected)


async def build_adapters(
    store: Store, links: LinkRegistry, metrics: ProxyMetrics
) -> AdapterManager:
    """The LoRA adapter manager, told of the active deployments and the stored adapters."""
    adapters = AdapterManager(links, metrics=AdapterMetrics(metrics.registry))
    for active in await asyncio.to_thread(store.list_deployments, active_only=True):
        adapters.deployment_changed(active)
    await reload_adapters(store, adapters)
    return adapters


def build_lifecycle(
    store: Store,
    links: LinkRegistry,
    settings: Settings,
    *,
    events: DeploymentEvents,
    waiting: WaitingAttempts,
    slots: SlotGate,
    metrics: ProxyMetrics,
    audit: AuditLog,
    check_agent_policies: bool = True,
    signer: SpecSigner,
) -> LifecycleManager:
    """The deployment manager, with the settings' timeouts, probes, images and restart
    backoff; ``slots`` hears of capacity changes (waiters may go);
    ``check_agent_policies`` whether placement leaves out nodes whose policy refuses."""
    return LifecycleManager(
        store,
        links,
        check_agent_policies=check_agent_policies,
        health_timeout_s=settings.health_timeout_s,
        stop_grace_s=settings.stop_grace_s,
        watch_interval_s=settings.probe_interval_s,
        probe_timeout_s=settings.probe_timeout_s,
        probes_to_fail=settings.probes_to_fail,
        waiting=waiting,
        on_state=events.on_state,
        images=settings.docker_images(),
        gpu_images=settings.docker_gpu_images(),
        usage=events.resident_usage,
        min_residency_s=settings.min_residency_s,
        slots_changed=slots.resize,
        restart_backoff=Backoff(
            initial_s=settings.restart_backoff_s,
            max_s=settings.restart_backoff_max_s,
            reset_after_s=settings.restart_reset_after_s,
            crashloop_restarts=settings.crashloop_restarts,
        ),
        on_restart=restart_reporter(metrics, audit.append),
        default_slots=settings.default_slots,
        signer=signer,
        require_agent_spec_check=settings.require_agent_spec_check,
    )


def build_hub(
    store: Store,
    links: LinkRegistry,
    lifecycle: LifecycleManager,
    settings: Settings,
    *,
    cluster_metrics: ClusterMetrics,
    audit: AuditLog,
    forwarded: ForwardedFingerprintTrust | None,
    ca: CertificateAuthority,
) -> NodeHub:
    """The agents' hub: their links, heartbeats and timeouts, reported to ``lifecycle``;
    their certificates renewed over the links (``agent_cert_lifetime_s``)."""
    if forwarded is not None:
        log.warning("cluster: trusting x-berth-client-fingerprint from %s", forwarded.describe())
    return NodeHub(
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


def build_scaling(
    lifecycle: LifecycleManager,
    signals: SignalBoard,
    routes: RouteResolver,
    settings: Settings,
    *,
    metrics: ProxyMetrics,
    audit: AuditLog,
) -> ScalingController:
    """The controller that starts and stops services' replicas (on demand, idle, scale out
    and in), with the settings' policy."""
    return ScalingController(
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


# -- the request path -----------------------------------------------------------------------


def build_proxy(
    resolver: AdapterResolver,
    router: Router,
    settings: Settings,
    *,
    metrics: ProxyMetrics,
    data_paths: DataPaths,
    core: AgentCore | None,
    scaling: ScalingController,
    admission: Admission,
    slots: SlotGate,
    adapters: AdapterManager,
    tracer: RequestTracer | None = None,
) -> OpenAIProxy:
    """The ``/v1`` proxy with the settings' bounds and timeouts (0: off); ``tracer`` traces
    its requests when tracing is on."""
    return OpenAIProxy(
        resolver,
        metrics,
        max_body_bytes=settings.max_body_bytes,
        body_limits=BodyLimits(
            max_elements=settings.max_body_elements,
            max_messages=settings.max_messages,
            max_content_parts=settings.max_content_parts,
        ),
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
        tracer=tracer,
    )


async def build_authenticator(
    store: Store, pepper: bytes, settings: Settings, *, metrics: ProxyMetrics, audit: AuditLog
) -> Authenticator:
    """Keys checked with caches in front of the store, failures limited per client address;
    the known keys' hashes loaded (never rate limited)."""
    authenticator = Authenticator(
        store,
        pepper,
        limiter=FailedAuthLimiter(
            burst=settings.auth_failure_burst, rate_per_s=settings.auth_failure_rate_per_s
        ),
        refusal_delay_s=settings.auth_refusal_delay_s,
        audit=audit.append,
    )
    authenticator.know(await asyncio.to_thread(store.api_key_hashes))
    metrics.registry.register(AuthCollector(authenticator.counts))
    return authenticator
