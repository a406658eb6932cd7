"""The scaling series (``docs/metrics.md``), registered in the leader's registry.

- ``berth_service_replicas{service,state}``: active deployments of each service by state
  (pending, loading, ready, stopping);
- ``berth_on_demand_queue_depth{service}``: requests waiting at the leader for the service
  to load;
- ``berth_on_demand_wait_seconds{service,outcome}``: how long each of them waited, by how the
  wait ended (``ready``, ``timeout``, ``failed``, ``queue_full``, ``client_gone``);
- ``berth_service_loads_total{service,reason}``: replicas started by the controller
  (``on_demand``, ``min_replicas``, ``scale_out``) and loads refused (``refused``);
- ``berth_service_unloads_total{service,reason}``: replicas stopped by it (``idle``,
  ``above_max``) or evicted to make room for another service (``evicted``).

A removed service's series are removed with it (:meth:`ScalingMetrics.forget`).
"""

from __future__ import annotations

import contextlib
from typing import Final, Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from berth.vocab.states import DeploymentState

#: Wait-time buckets in seconds: a warm start is well under a second, a cold model load
#: takes seconds to minutes, and the wait gives up at ``load_wait_s`` (120 s by default).
WAIT_BUCKETS_S: Final = (0.05, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: The states a replica is counted in.
REPLICA_STATES: Final = (
    DeploymentState.PENDING,
    DeploymentState.LOADING,
    DeploymentState.READY,
    DeploymentState.STOPPING,
)

WaitOutcome = Literal["ready", "timeout", "failed", "queue_full", "client_gone"]
LoadReason = Literal["on_demand", "min_replicas", "scale_out", "refused"]
UnloadReason = Literal["idle", "above_max", "evicted"]


class ScalingMetrics:
    """The scaling controller's and the on-demand stage's series in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._replicas = Gauge(
            "berth_service_replicas",
            "Active deployments of each service, by state.",
            ("service", "state"),
            registry=self.registry,
        )
        self._queue = Gauge(
            "berth_on_demand_queue_depth",
            "Requests waiting at the leader for the service to load.",
            ("service",),
            registry=self.registry,
        )
        self._wait = Histogram(
            "berth_on_demand_wait_seconds",
            "Time requests waited at the leader for their service to load, by outcome.",
            ("service", "outcome"),
            buckets=WAIT_BUCKETS_S,
            registry=self.registry,
        )
        self._loads = Counter(
            "berth_service_loads",
            "Replicas the scaling controller started (or was refused), by reason.",
            ("service", "reason"),
            registry=self.registry,
        )
        self._unloads = Counter(
            "berth_service_unloads",
            "Replicas stopped by the scaling controller or evicted, by reason.",
            ("service", "reason"),
            registry=self.registry,
        )
        self._services: set[str] = set()

    def replicas(self, service: str, counts: dict[DeploymentState, int]) -> None:
        """Set the service's replica gauge from ``counts`` (a state left out counts 0)."""
        self._services.add(service)
        for state in REPLICA_STATES:
            self._replicas.labels(service, state.value).set(counts.get(state, 0))

    def queue_depth(self, service: str, depth: int) -> None:
        self._services.add(service)
        self._queue.labels(service).set(depth)

    def waited(self, service: str, outcome: WaitOutcome, seconds: float) -> None:
        self._services.add(service)
        self._wait.labels(service, outcome).observe(max(0.0, seconds))

    def loaded(self, service: str, reason: LoadReason) -> None:
        self._services.add(service)
        self._loads.labels(service, reason).inc()

    def unloaded(self, service: str, reason: UnloadReason) -> None:
        self._services.add(service)
        self._unloads.labels(service, reason).inc()

    def forget(self, service: str) -> None:
        """The service was removed: drop its series."""
        if service not in self._services:
            return
        self._services.discard(service)
        children: list[tuple[Gauge | Histogram | Counter, tuple[str, ...]]] = [
            (self._queue, (service,)),
            *((self._replicas, (service, s.value)) for s in REPLICA_STATES),
            *((self._wait, (service, o)) for o in get_args(WaitOutcome)),
            *((self._loads, (service, r)) for r in get_args(LoadReason)),
            *((self._unloads, (service, r)) for r in get_args(UnloadReason)),
        ]
        for metric, labels in children:
            with contextlib.suppress(KeyError):  # a child never created
                metric.remove(*labels)
