"""The leader's long-lived objects, built once by the daemon and handed to the apps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from berth.admission import Admission
from berth.agent.core import AgentCore
from berth.agent.host import RuntimeStatus
from berth.cluster.ca import CertificateAuthority
from berth.cluster.direct_path import DataPaths
from berth.cluster.enrollment import EnrollmentService
from berth.cluster.hub import NodeHub
from berth.cluster.link_registry import LinkRegistry
from berth.config import Settings
from berth.deployments.adapters import AdapterManager
from berth.deployments.drain import DrainRunner
from berth.deployments.lifecycle import LifecycleManager
from berth.gateway.auth import Authenticator
from berth.gateway.proxy import OpenAIProxy
from berth.http_server.tls_reload import ReloadingTLS
from berth.observability.cluster import ClusterMetrics
from berth.observability.history import MetricsHistory
from berth.observability.metrics import ProxyMetrics
from berth.paths import BerthHome
from berth.routing.routes import RouteResolver
from berth.scaling import ScalingController
from berth.store import Store
from berth.store.leadership import Leadership


@dataclass
class Listener:
    """One address the daemon serves on, for banners and ``berth status``; ``tls``: the
    certificate pair a TLS listener serves (reloadable)."""

    name: str
    url: str
    tls: ReloadingTLS | None = None


@dataclass
class LeaderGraph:
    """Everything the HTTP apps need; no module-level globals anywhere."""

    home: BerthHome
    settings: Settings
    store: Store
    ca: CertificateAuthority
    pepper: bytes
    metrics: ProxyMetrics
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
    listeners: list[Listener] = field(default_factory=list)
    ready: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    #: The local node's runtimes as found at start-up (``/admin/info``, the start banner).
    runtimes: list[RuntimeStatus] = field(default_factory=list)
    #: Every node's load over the last minute (``/metrics``, ``/admin/metrics/snapshot``).
    cluster_metrics: ClusterMetrics = field(default_factory=ClusterMetrics)
    #: Starts and stops replicas of services (on demand, idle, scale out and in).
    scaling: ScalingController | None = None
    #: The last hour of requests, tokens, TTFT, errors and GPUs (the console's Overview).
    history: MetricsHistory | None = None
    #: Carries the store's drains out (the active leader's loop).
    drains: DrainRunner | None = None
    #: Shared leadership (``leader_ha``): the lease loop; ``None`` for a lone leader.
    leadership: Leadership | None = None
    #: Set by ``berth leader step-down`` before it stops the leader: the process then exits
    #: with ``STANDBY_RESTART_EXIT`` (:mod:`berth.errors`), so its service starts it again,
    #: as a standby.
    handed_over: bool = False

    @property
    def leader_only(self) -> bool:
        """Whether this leader is a control plane only: no engines on its own host."""
        return self.local_core is None
