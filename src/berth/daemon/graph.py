"""The leader's long-lived objects: :class:`LeaderGraph`, built once by
:func:`berth.daemon.build.build_leader` and never assigned to after.

Nothing outside :mod:`berth.daemon` takes the graph. The daemon hands each subsystem and
each admin router the few objects it uses (:mod:`berth.daemon.admin_routes`,
:mod:`berth.daemon.app`), so a signature says what a route touches. What changes while the
leader runs is not a field of the graph but one object in it, :class:`RunState`.
"""

from __future__ import annotations

from dataclasses import dataclass

from berth.admin.status import LeaderFacts, Listener, RunState
from berth.admission import Admission
from berth.agent.core import AgentCore
from berth.auth.authenticator import Authenticator
from berth.cluster.leader.direct_path import DataPaths
from berth.cluster.leader.hub import NodeHub
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.enrollment import EnrollmentService
from berth.config import Settings
from berth.daemon.ha import SharedLeadership
from berth.deployments.adapters import AdapterManager
from berth.deployments.drain import DrainRunner
from berth.deployments.lifecycle import LifecycleManager
from berth.gateway.proxy import OpenAIProxy
from berth.observability.cluster import ClusterMetrics
from berth.observability.history import MetricsHistory
from berth.observability.metrics import ProxyMetrics
from berth.paths import BerthHome
from berth.routing.routes import RouteResolver
from berth.scaling import ScalingController
from berth.store import Store
from berth.store.leadership import Leadership


@dataclass(frozen=True)
class LeaderGraph:
    """Everything the leader's apps and loops share; no module-level globals anywhere."""

    home: BerthHome
    settings: Settings
    store: Store
    ca: CertificateAuthority
    #: The secret API keys are hashed with.
    pepper: bytes
    metrics: ProxyMetrics
    #: Every node's load over the last minute (``/metrics``, ``/admin/metrics/snapshot``).
    cluster_metrics: ClusterMetrics
    proxy: OpenAIProxy
    lifecycle: LifecycleManager
    authenticator: Authenticator
    #: The agent core running node ``local``'s engines; ``None`` on a leader-only daemon
    #: (``leader_only``), which runs no engines and has no ``local`` link.
    local_core: AgentCore | None
    #: the leader's live links by node id (the hub attaches and detaches remote ones)
    links: LinkRegistry
    hub: NodeHub
    #: each agent's data path (direct to its ingress, or the tunnel), for the proxy and
    #: ``/admin/nodes``
    data_paths: DataPaths
    enrollment: EnrollmentService
    #: The URL agents dial (``leader=`` in enrollment URIs).
    cluster_url: str
    pid: int
    started_at: float
    #: The proxy's resolver: routes, then the lifecycle's names (reloaded on route changes).
    routes: RouteResolver
    #: LoRA adapters: the registry the router serves them from, and where each is loaded.
    adapters: AdapterManager
    #: Per-key limits and the usage ledger (updated by the admin API's key routes).
    admission: Admission
    #: Starts and stops replicas of services (on demand, idle, scale out and in).
    scaling: ScalingController
    #: The last hour of requests, tokens, TTFT, errors and GPUs (the console's Overview).
    history: MetricsHistory
    #: Carries the store's drains out (the active leader's loop).
    drains: DrainRunner
    #: The public listener, the cluster listener, the Unix socket.
    listeners: tuple[Listener, ...]
    #: Shared leadership (``leader_ha``): the lease loop, the roster and key sync; ``None``
    #: for a lone leader.
    shared: SharedLeadership | None
    #: What changes while it runs: ready, the runtimes found at start, handed over.
    run: RunState

    @property
    def leader_only(self) -> bool:
        """Whether this leader is a control plane only: no engines on its own host."""
        return self.local_core is None

    @property
    def leadership(self) -> Leadership | None:
        """The lease loop (``leader_ha``), which a standby's listeners read; ``None`` for a
        lone leader."""
        return self.shared.leadership if self.shared is not None else None

    @property
    def facts(self) -> LeaderFacts:
        """What ``/admin/info`` says of this leader that does not change while it runs."""
        return LeaderFacts(
            pid=self.pid,
            started_at=self.started_at,
            home=self.home,
            cluster_url=self.cluster_url,
            listeners=self.listeners,
            leader_only=self.leader_only,
        )
