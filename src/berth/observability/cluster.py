"""The leader's view of every node's load: heartbeats in, Prometheus series and snapshots out.

Each node (an agent's heartbeat, or the leader's own sample of node ``local``) reports GPU
utilisation and memory, and per deployment the requests in flight, cumulative requests and
errors, and latency percentiles over the reporter's last 60 s. :class:`ClusterMetrics` keeps
the samples of the last ``window_s`` seconds per node and exposes them:

- as Prometheus families (a custom collector registered on the leader's registry):
  ``berth_node_gpu_util_pct`` and ``berth_node_gpu_mem_used_bytes`` {node, gpu};
  ``berth_deployment_in_flight``, ``berth_deployment_latency_p50_seconds``,
  ``berth_deployment_latency_p95_seconds`` (gauges; seconds, Prometheus' base unit, which
  ``promtool check metrics`` requires: ``_ms`` names are refused as abbreviated units) and
  ``berth_deployment_requests_total``, ``berth_deployment_errors_total`` (counters)
  {node, deployment, model};
- as a JSON-ready :class:`ClusterSnapshot` for ``GET /admin/metrics/snapshot``;
- ``berth_event_loop_lag_seconds`` {node}: each agent's event-loop lag histogram from its
  heartbeats, and the leader's own (node ``local``) read live from its monitor.

Counters are the leader's own: they start at zero when the leader starts and never jump or go
down. The leader adds up the growth between a node's reports; a report lower than the previous
one (the agent restarted) counts in full, the rule Prometheus itself applies to counter resets.
An agent's totals count since the agent started, so they may hold requests an earlier leader
already counted: a deployment first reported in the first heartbeat of a link
(:meth:`ClusterMetrics.node_connected`) takes that report as its baseline and counts only what
follows; an agent's loop-lag histogram likewise takes the first report this leader gets from
the node as its baseline. Gauges come from the node's latest sample and disappear once it is
older than the window (a silent node reports nothing current). A stopped deployment's and a
removed node's counters (and its lag histogram) stay ``linger_s`` longer (so that a scrape
reads their last values), then go.

Written from the event loop only; a scrape from another thread copies the tables first.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from berth.observability.loop_lag import LagHistogram
from berth.observability.node_report import LagReport, NodeReport

#: Seconds of samples kept per node.
WINDOW_S = 60.0
#: Seconds the series of a stopped deployment or a removed node stay before they go: a
#: scrape in that time reads their final values. Prometheus looks back 5 minutes for a
#: series' latest sample and advises scrape intervals well under that, so every scraper
#: configured as advised reads them at least once.
LINGER_S = 300.0
_MIB = 1024 * 1024
_NODE_GPU = ("node", "gpu")
_NODE_DEPLOYMENT = ("node", "deployment", "model")

ModelLookup = Callable[[str], "str | None"]
LagSource = Callable[[], LagHistogram]


@dataclass(frozen=True)
class GpuSample:
    """One GPU in one sample; ``util_pct`` is ``None`` when the driver does not say."""

    index: int
    name: str
    util_pct: float | None
    mem_used_bytes: int
    mem_total_bytes: int


@dataclass(frozen=True)
class DeploymentSample:
    """One deployment in one sample; the totals are the leader's (monotonic) counters."""

    deployment: str
    model: str
    in_flight: int
    requests_total: int
    errors_total: int
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    alive: bool


@dataclass(frozen=True)
class NodeSample:
    """What one node reported at ``at`` (seconds since the epoch, leader's clock)."""

    at: float
    gpus: tuple[GpuSample, ...]
    deployments: tuple[DeploymentSample, ...]


@dataclass(frozen=True)
class NodeSeries:
    """A node's latest sample and every sample of the window, oldest first."""

    node: str
    latest: NodeSample
    samples: tuple[NodeSample, ...]


@dataclass(frozen=True)
class ClusterSnapshot:
    """Every node with a sample in the window, by node id."""

    at: float
    window_s: float
    nodes: tuple[NodeSeries, ...] = field(default_factory=tuple)


class _Counter:
    """The leader's running totals for one (node, deployment), and the last reported ones."""

    __slots__ = ("errors_total", "model", "reported_errors", "reported_requests", "requests_total")

    def __init__(self, model: str) -> None:
        self.model = model
        self.requests_total = 0
        self.errors_total = 0
        self.reported_requests = 0
        self.reported_errors = 0


class _LagTotals:
    """The leader's running lag histogram for one node, and the last reported one."""

    __slots__ = ("bounds_s", "counts", "reported", "reported_sum_s", "sum_s")

    def __init__(self, report: LagReport) -> None:
        self.bounds_s = tuple(report.bounds_s)
        self.counts = [0] * len(report.counts)
        self.sum_s = 0.0
        self.reported = list(report.counts)
        self.reported_sum_s = report.sum_s

    def add(self, report: LagReport) -> None:
        if sum(report.counts) < sum(self.reported):  # the agent restarted: all of it is new
            deltas, delta_sum_s = list(report.counts), report.sum_s
        else:
            deltas = [max(0, now - before) for now, before in zip(report.counts, self.reported,
                                                                  strict=True)]  # fmt: skip
            delta_sum_s = max(0.0, report.sum_s - self.reported_sum_s)
        for index, delta in enumerate(deltas):
            self.counts[index] += delta
        self.sum_s += delta_sum_s
        self.reported = list(report.counts)
        self.reported_sum_s = report.sum_s

    def histogram(self) -> LagHistogram:
        return LagHistogram(self.bounds_s, tuple(self.counts), self.sum_s)


def counter_delta(previous: int, reported: int) -> int:
    """How much a cumulative count grew from ``previous`` to ``reported``.

    A report below the previous one means the reporter restarted and counts from zero again,
    so all of it is new (Prometheus' own counter-reset rule).
    """
    return reported - previous if reported >= previous else reported


#: Heartbeat samples kept per node (the window at 0.05 s intervals, the fastest allowed).
MAX_SAMPLES_PER_NODE = 1200


class ClusterMetrics:
    """Rolling per-node samples, monotonic per-deployment counters and loop-lag histograms.

    ``model_of`` maps a deployment id to its public model name (``None`` while unknown; the
    label is then ``""`` until it is known). ``clock`` gives seconds since the epoch.
    ``local_loop_lag``, when given, is read at every scrape for the leader's own loop lag,
    exposed with ``node=local_node``.
    """

    def __init__(
        self,
        *,
        window_s: float = WINDOW_S,
        linger_s: float = LINGER_S,
        model_of: ModelLookup | None = None,
        clock: Callable[[], float] = time.time,
        local_loop_lag: LagSource | None = None,
        local_node: str = "local",
    ) -> None:
        if window_s <= 0 or linger_s < 0:
            raise ValueError("window_s must be positive and linger_s not negative")
        self.window_s = window_s
        self.linger_s = linger_s
        self._model_of: ModelLookup = model_of or (lambda _deployment: None)
        self._clock = clock
        self._samples: dict[str, deque[NodeSample]] = {}
        self._counters: dict[tuple[str, str], _Counter] = {}
        #: nodes whose link came up and whose first report since has not arrived
        self._linked: set[str] = set()
        #: when each stopped deployment ended (its counters go ``linger_s`` later)
        self._ended_deployments: dict[str, float] = {}
        #: when each removed node was removed (likewise)
        self._removed_nodes: dict[str, float] = {}
        self._lag: dict[str, _LagTotals] = {}
        self._local_loop_lag = local_loop_lag
        self._local_node = local_node

    # -- input ------------------------------------------------------------------------------

    def record_heartbeat(
        self, node_id: str, heartbeat: NodeReport, now: float | None = None
    ) -> None:
        """Take one report of ``node_id``, received at ``now`` (default: the clock)."""
        at = self._clock() if now is None else now
        first_of_link = node_id in self._linked
        self._linked.discard(node_id)
        gpus = tuple(
            GpuSample(
                index=g.index,
                name=g.name,
                util_pct=None if g.utilization_pct is None else float(g.utilization_pct),
                mem_used_bytes=g.memory_used_mb * _MIB,
                mem_total_bytes=g.memory_total_mb * _MIB,
            )
            for g in heartbeat.gpus
        )
        deployments = []
        for load in heartbeat.deployments:
            counter = self._counters.get((node_id, load.deployment_id))
            if counter is None:
                counter = self._new_counter(node_id, load.deployment_id)
                if first_of_link:
                    # Running before this link came up: what it reports may predate this
                    # leader (or was counted by it before a restart). Baseline, not growth.
                    counter.reported_requests = load.requests_total
                    counter.reported_errors = load.errors_total
            elif not counter.model:
                counter.model = self._model_of(load.deployment_id) or ""
            counter.requests_total += counter_delta(counter.reported_requests, load.requests_total)
            counter.errors_total += counter_delta(counter.reported_errors, load.errors_total)
            counter.reported_requests = load.requests_total
            counter.reported_errors = load.errors_total
            deployments.append(
                DeploymentSample(
                    deployment=load.deployment_id,
                    model=counter.model,
                    in_flight=load.in_flight,
                    requests_total=counter.requests_total,
                    errors_total=counter.errors_total,
                    latency_p50_ms=load.latency_p50_ms,
                    latency_p95_ms=load.latency_p95_ms,
                    alive=load.alive,
                )
            )
        samples = self._samples.get(node_id)
        if samples is None:
            # Bounded whatever an agent sends: a heartbeat flood keeps only the newest.
            samples = self._samples[node_id] = deque(maxlen=MAX_SAMPLES_PER_NODE)
        samples.append(NodeSample(at, gpus, tuple(deployments)))
        self._prune(samples, at)
        if heartbeat.loop_lag is not None:
            self._record_loop_lag(node_id, heartbeat.loop_lag)
        self._expire(at)

    def _record_loop_lag(self, node_id: str, report: LagReport) -> None:
        totals = self._lag.get(node_id)
        if totals is None or totals.bounds_s != tuple(report.bounds_s):
            # The first report this leader has (or one with other buckets: a new agent
            # version) is the baseline; the lag measured before it is not this leader's.
            self._lag[node_id] = _LagTotals(report)
        else:
            totals.add(report)

    def node_connected(self, node_id: str) -> None:
        """The node's link came up (a new session): in its next report, a deployment this
        leader has no counter for takes the reported totals as its baseline.

        Call it before the session's first heartbeat is recorded (the hub does, when it
        admits the session). Without it (node ``local``, whose meter starts with the
        leader), new deployments count from zero.
        """
        self._linked.add(node_id)
        self._removed_nodes.pop(node_id, None)  # enrolled again, under the same id

    def deployment_ended(self, deployment_id: str, now: float | None = None) -> None:
        """The deployment stopped or failed at ``now`` (default: the clock): its counters,
        on every node, go :attr:`linger_s` later."""
        at = self._clock() if now is None else now
        self._ended_deployments.setdefault(deployment_id, at)

    def remove_node(self, node_id: str, now: float | None = None) -> None:
        """Forget ``node_id`` (removed from the cluster) at ``now`` (default: the clock): its
        gauges and snapshot go at once, its counters :attr:`linger_s` later."""
        at = self._clock() if now is None else now
        self._samples.pop(node_id, None)
        self._linked.discard(node_id)
        self._removed_nodes.setdefault(node_id, at)

    def _new_counter(self, node_id: str, deployment_id: str) -> _Counter:
        counter = self._counters[(node_id, deployment_id)] = _Counter(
            self._model_of(deployment_id) or ""
        )
        return counter

    def _expire(self, now: float) -> None:
        """Drop the counters whose deployment ended, or whose node was removed, at least
        :attr:`linger_s` before ``now``."""
        horizon = now - self.linger_s
        ended = {d for d, at in list(self._ended_deployments.items()) if at <= horizon}
        removed = {n for n, at in list(self._removed_nodes.items()) if at <= horizon}
        if not ended and not removed:
            return
        for key in list(self._counters):
            if key[0] in removed or key[1] in ended:
                self._counters.pop(key, None)
        for deployment_id in ended:
            self._ended_deployments.pop(deployment_id, None)
        for node_id in removed:
            self._removed_nodes.pop(node_id, None)
            self._lag.pop(node_id, None)

    def _prune(self, samples: deque[NodeSample], now: float) -> None:
        horizon = now - self.window_s
        while samples and samples[0].at < horizon:
            samples.popleft()

    # -- output -----------------------------------------------------------------------------

    def snapshot(self, now: float | None = None) -> ClusterSnapshot:
        """Every node with a sample in the last ``window_s`` seconds, sorted by node id."""
        at = self._clock() if now is None else now
        nodes = []
        for node_id, samples in sorted(self._samples.items()):
            self._prune(samples, at)
            if samples:
                nodes.append(NodeSeries(node_id, samples[-1], tuple(samples)))
        return ClusterSnapshot(at=at, window_s=self.window_s, nodes=tuple(nodes))

    def register(self, registry: CollectorRegistry) -> None:
        """Expose the series on ``registry`` (the leader's, beside the proxy's)."""
        registry.register(_ClusterCollector(self))

    def _latest(self, now: float) -> list[tuple[str, NodeSample]]:
        horizon = now - self.window_s
        out = []
        for node_id, samples in list(self._samples.items()):
            latest = samples[-1] if samples else None
            if latest is not None and latest.at >= horizon:
                out.append((node_id, latest))
        return out

    def _totals(self, now: float) -> list[tuple[tuple[str, str], str, int, int]]:
        self._expire(now)
        return [
            (key, c.model, c.requests_total, c.errors_total)
            for key, c in list(self._counters.items())
        ]

    def loop_lag(self, now: float | None = None) -> list[tuple[str, LagHistogram]]:
        """Each node's loop-lag histogram at ``now`` (default: the clock), the leader's own
        (``local_node``) first."""
        self._expire(self._clock() if now is None else now)
        out = [] if self._local_loop_lag is None else [(self._local_node, self._local_loop_lag())]
        out += [(node_id, totals.histogram()) for node_id, totals in list(self._lag.items())]
        return out


class _ClusterCollector(Collector):
    """Turns :class:`ClusterMetrics` into Prometheus families at scrape time."""

    def __init__(self, metrics: ClusterMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return list(self._families([], [], []))

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        now = m._clock()
        return self._families(m._latest(now), m._totals(now), m.loop_lag(now))

    def _families(
        self,
        latest: list[tuple[str, NodeSample]],
        totals: list[tuple[tuple[str, str], str, int, int]],
        lags: list[tuple[str, LagHistogram]],
    ) -> Iterator[Metric]:
        util = GaugeMetricFamily(
            "berth_node_gpu_util_pct",
            "GPU utilisation in percent, from the node's latest report.",
            labels=_NODE_GPU,
        )
        mem = GaugeMetricFamily(
            "berth_node_gpu_mem_used_bytes",
            "GPU memory in use, in bytes, from the node's latest report.",
            labels=_NODE_GPU,
        )
        in_flight = GaugeMetricFamily(
            "berth_deployment_in_flight",
            "Requests the serving node is relaying to the deployment's engine.",
            labels=_NODE_DEPLOYMENT,
        )
        p50 = GaugeMetricFamily(
            "berth_deployment_latency_p50_seconds",
            "Median request latency over the serving node's last 60 s.",
            labels=_NODE_DEPLOYMENT,
        )
        p95 = GaugeMetricFamily(
            "berth_deployment_latency_p95_seconds",
            "95th percentile request latency over the serving node's last 60 s.",
            labels=_NODE_DEPLOYMENT,
        )
        for node_id, sample in latest:
            for gpu in sample.gpus:
                labels = [node_id, str(gpu.index)]
                if gpu.util_pct is not None:
                    util.add_metric(labels, gpu.util_pct)
                mem.add_metric(labels, gpu.mem_used_bytes)
            for d in sample.deployments:
                labels = [node_id, d.deployment, d.model]
                in_flight.add_metric(labels, d.in_flight)
                if d.latency_p50_ms is not None:
                    p50.add_metric(labels, d.latency_p50_ms / 1000.0)
                if d.latency_p95_ms is not None:
                    p95.add_metric(labels, d.latency_p95_ms / 1000.0)
        requests = CounterMetricFamily(
            "berth_deployment_requests",
            "Requests served by the deployment's node, whatever the outcome.",
            labels=_NODE_DEPLOYMENT,
        )
        errors = CounterMetricFamily(
            "berth_deployment_errors",
            "Requests that failed on the serving node (engine status >= 500 or a broken exchange).",
            labels=_NODE_DEPLOYMENT,
        )
        for (node_id, deployment), model, requests_total, errors_total in totals:
            requests.add_metric([node_id, deployment, model], requests_total)
            errors.add_metric([node_id, deployment, model], errors_total)
        lag = HistogramMetricFamily(
            "berth_event_loop_lag_seconds",
            "How late a 20 ms timer ran on the event loop of berth's process on the node.",
            labels=("node",),
        )
        for node_id, histogram in lags:
            lag.add_metric([node_id], histogram.cumulative(), histogram.sum_s)
        yield from (util, mem, in_flight, requests, errors, p50, p95, lag)


__all__ = [
    "LINGER_S",
    "WINDOW_S",
    "ClusterMetrics",
    "ClusterSnapshot",
    "DeploymentSample",
    "GpuSample",
    "NodeSample",
    "NodeSeries",
    "counter_delta",
]
