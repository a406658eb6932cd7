"""The leader's per-node metrics: counters across leader and agent restarts, gauges, expiry,
stopped deployments and removed nodes, the local node's measurement in the proxy's metrics,
and the admin snapshot's shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from berth.admin.metrics import snapshot_view
from berth.cluster.protocol.frames import Heartbeat
from berth.cluster.protocol.payloads import DeploymentLoad, GpuState, LoopLag
from berth.observability.cluster import ClusterMetrics, counter_delta
from berth.observability.metrics import ProxyMetrics, Target
from berth.observability.window import RequestMeter

MiB = 1024 * 1024
DASHBOARD = Path(__file__).parents[1] / "docs" / "dashboards" / "berth.json"
MODELS = {"d-aaaa0001": "tiny", "d-bbbb0002": "small"}


def beat(*loads: DeploymentLoad, gpus: tuple[tuple[int, int | None, int], ...] = ()) -> Heartbeat:
    """A heartbeat with ``loads`` and GPUs given as (index, utilisation %, MiB used)."""
    states = [
        GpuState(index=i, name="GPU", memory_total_mb=80_000, memory_used_mb=used,
                 utilization_pct=util)
        for i, util, used in gpus
    ]  # fmt: skip
    return Heartbeat(sent_at=0.0, gpus=states, deployments=list(loads))


def load(
    deployment: str = "d-aaaa0001",
    requests: int = 0,
    errors: int = 0,
    *,
    in_flight: int = 0,
    latency_p50_ms: float | None = None,
    latency_p95_ms: float | None = None,
) -> DeploymentLoad:
    return DeploymentLoad(
        deployment_id=deployment,
        in_flight=in_flight,
        requests_total=requests,
        errors_total=errors,
        latency_p50_ms=latency_p50_ms,
        latency_p95_ms=latency_p95_ms,
    )


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@pytest.fixture
def cluster_metrics(registry: CollectorRegistry) -> ClusterMetrics:
    cluster = ClusterMetrics(model_of=MODELS.get, clock=lambda: 1000.0)
    cluster.register(registry)
    return cluster


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


@pytest.mark.parametrize(
    ("previous", "reported", "delta"),
    [(0, 0, 0), (0, 5, 5), (5, 9, 4), (9, 9, 0), (9, 2, 2), (9, 0, 0)],
)
def test_counter_delta(previous: int, reported: int, delta: int) -> None:
    assert counter_delta(previous, reported) == delta


def test_counters_never_decrease_across_an_agent_restart(
    cluster_metrics: ClusterMetrics, registry: CollectorRegistry
) -> None:
    labels = {"node": "n-1", "deployment": "d-aaaa0001", "model": "tiny"}
    seen = []
    # 10 then 15 requests; the agent restarts (counts from 0), then 3, then 7 more.
    for at, requests, errors in [(1.0, 10, 1), (2.0, 15, 2), (3.0, 3, 0), (4.0, 7, 1)]:
        cluster_metrics.record_heartbeat(
            "n-1", beat(load(requests=requests, errors=errors)), 1000 + at
        )
        seen.append(
            (
                value(registry, "berth_deployment_requests_total", **labels),
                value(registry, "berth_deployment_errors_total", **labels),
            )
        )
    assert seen == [(10, 1), (15, 2), (18, 2), (22, 3)]


def test_a_leader_restart_starts_the_counters_at_zero_from_the_agents_totals(
    cluster_metrics: ClusterMetrics, registry: CollectorRegistry
) -> None:
    labels = {"node": "n-1", "deployment": "d-aaaa0001", "model": "tiny"}
    # A fresh leader; the agent has served 1288 requests (12 failed) since it started.
    cluster_metrics.node_connected("n-1")
    cluster_metrics.record_heartbeat("n-1", beat(load(requests=1288, errors=12)), 1001.0)
    assert value(registry, "berth_deployment_requests_total", **labels) == 0
    assert value(registry, "berth_deployment_errors_total", **labels) == 0
    cluster_metrics.record_heartbeat("n-1", beat(load(requests=1293, errors=13)), 1002.0)  # 5 more
    assert value(registry, "berth_deployment_requests_total", **labels) == 5
    assert value(registry, "berth_deployment_errors_total", **labels) == 1


def test_an_agent_restart_after_a_leader_restart_never_lowers_a_counter(
    cluster_metrics: ClusterMetrics, registry: CollectorRegistry
) -> None:
    labels = {"node": "n-1", "deployment": "d-aaaa0001", "model": "tiny"}
    seen = []
    # (new link?, the agent's total): leader restart at 1288; 5 more; the agent restarts
    # and reconnects (its total is 0 again), then 3 more; its link drops and comes back
    # without a restart, then 2 more.
    steps = [(True, 1288), (False, 1293), (True, 0), (False, 3), (True, 3), (False, 5)]
    for at, (new_link, requests) in enumerate(steps):
        if new_link:
            cluster_metrics.node_connected("n-1")
        cluster_metrics.record_heartbeat("n-1", beat(load(requests=requests)), 1000.0 + at)
        seen.append(value(registry, "berth_deployment_requests_total", **labels))
    assert seen == [0, 5, 5, 8, 8, 10]


def test_a_deployment_started_while_linked_counts_from_zero(
    cluster_metrics: ClusterMetrics, registry: CollectorRegistry
) -> None:
    cluster_metrics.node_connected("n-1")
    cluster_metrics.record_heartbeat("n-1", beat(load(requests=40)), 1000.0)
    # d-bbbb0002 started after the link came up: everything it reports is this leader's.
    cluster_metrics.record_heartbeat(
        "n-1", beat(load(requests=40), load("d-bbbb0002", 3, 1)), 1001.0
    )
    new = {"node": "n-1", "deployment": "d-bbbb0002", "model": "small"}
    assert value(registry, "berth_deployment_requests_total", **new) == 3
    assert value(registry, "berth_deployment_errors_total", **new) == 1
    # Node local never links: its meter starts with the leader, so all of it counts.
    cluster_metrics.record_heartbeat("local", beat(load(requests=2)), 1001.0)
    local = {"node": "local", "deployment": "d-aaaa0001", "model": "tiny"}
    assert value(registry, "berth_deployment_requests_total", **local) == 2


def test_a_stopped_deployment_keeps_its_counters_for_the_linger(
    registry: CollectorRegistry,
) -> None:
    now = [1000.0]
    metrics = ClusterMetrics(linger_s=300.0, model_of=MODELS.get, clock=lambda: now[0])
    metrics.register(registry)
    metrics.record_heartbeat("n-1", beat(load(requests=7), load("d-bbbb0002", requests=2)))
    metrics.deployment_ended("d-aaaa0001")
    stopped = {"node": "n-1", "deployment": "d-aaaa0001", "model": "tiny"}
    now[0] += 299.0
    metrics.record_heartbeat("n-1", beat(load("d-bbbb0002", requests=4)))
    assert value(registry, "berth_deployment_requests_total", **stopped) == 7
    now[0] += 1.0
    assert value(registry, "berth_deployment_requests_total", **stopped) is None
    running = {"node": "n-1", "deployment": "d-bbbb0002", "model": "small"}
    assert value(registry, "berth_deployment_requests_total", **running) == 4


def test_gauges_per_node_and_gpu(
    cluster_metrics: ClusterMetrics, registry: CollectorRegistry
) -> None:
    cluster_metrics.record_heartbeat(
        "n-1",
        beat(
            load(in_flight=2, latency_p50_ms=120.0, latency_p95_ms=900.0),
            gpus=((0, 35, 1000), (1, None, 2000)),
        ),
        1000.0,
    )
    cluster_metrics.record_heartbeat("n-2", beat(load("d-bbbb0002"), gpus=((0, 80, 3000),)), 1000.0)
    assert value(registry, "berth_node_gpu_util_pct", node="n-1", gpu="0") == 35
    assert value(registry, "berth_node_gpu_util_pct", node="n-1", gpu="1") is None  # unknown
    assert value(registry, "berth_node_gpu_mem_used_bytes", node="n-1", gpu="1") == 2000 * MiB
    assert value(registry, "berth_node_gpu_util_pct", node="n-2", gpu="0") == 80
    labels = {"node": "n-1", "deployment": "d-aaaa0001", "model": "tiny"}
    assert value(registry, "berth_deployment_in_flight", **labels) == 2
    assert value(registry, "berth_deployment_latency_p50_seconds", **labels) == pytest.approx(0.12)
    assert value(registry, "berth_deployment_latency_p95_seconds", **labels) == pytest.approx(0.9)
    small = {"node": "n-2", "deployment": "d-bbbb0002", "model": "small"}
    assert value(registry, "berth_deployment_in_flight", **small) == 0
    assert value(registry, "berth_deployment_latency_p95_seconds", **small) is None  # no traffic


def test_gauges_follow_the_latest_heartbeat(
    cluster_metrics: ClusterMetrics, registry: CollectorRegistry
) -> None:
    cluster_metrics.record_heartbeat("n-1", beat(load(in_flight=4), gpus=((0, 90, 1),)), 1000.0)
    cluster_metrics.record_heartbeat("n-1", beat(load(in_flight=1), gpus=((0, 10, 1),)), 1000.0)
    assert value(registry, "berth_node_gpu_util_pct", node="n-1", gpu="0") == 10
    labels = {"node": "n-1", "deployment": "d-aaaa0001", "model": "tiny"}
    assert value(registry, "berth_deployment_in_flight", **labels) == 1


def test_a_silent_node_loses_its_gauges_keeps_its_counters(registry: CollectorRegistry) -> None:
    now = [1000.0]
    metrics = ClusterMetrics(window_s=60.0, model_of=MODELS.get, clock=lambda: now[0])
    metrics.register(registry)
    metrics.record_heartbeat("n-1", beat(load(requests=5, in_flight=1), gpus=((0, 50, 1),)))
    now[0] += 61.0
    labels = {"node": "n-1", "deployment": "d-aaaa0001", "model": "tiny"}
    assert value(registry, "berth_node_gpu_util_pct", node="n-1", gpu="0") is None
    assert value(registry, "berth_deployment_in_flight", **labels) is None
    assert value(registry, "berth_deployment_requests_total", **labels) == 5
    assert metrics.snapshot().nodes == ()


def test_removing_a_node_drops_its_gauges_now_and_its_counters_after_the_linger(
    registry: CollectorRegistry,
) -> None:
    now = [1000.0]
    metrics = ClusterMetrics(linger_s=300.0, model_of=MODELS.get, clock=lambda: now[0])
    metrics.register(registry)
    metrics.record_heartbeat("n-1", beat(load(requests=5), gpus=((0, 50, 1),)))
    metrics.record_heartbeat("n-2", beat(load("d-bbbb0002", requests=2)))
    metrics.remove_node("n-1")
    assert value(registry, "berth_node_gpu_util_pct", node="n-1", gpu="0") is None
    gone = {"node": "n-1", "deployment": "d-aaaa0001", "model": "tiny"}
    assert value(registry, "berth_deployment_requests_total", **gone) == 5  # the final value
    assert [n.node for n in metrics.snapshot().nodes] == ["n-2"]
    now[0] += 300.0
    assert value(registry, "berth_deployment_requests_total", **gone) is None
    kept = {"node": "n-2", "deployment": "d-bbbb0002", "model": "small"}
    assert value(registry, "berth_deployment_requests_total", **kept) == 2


def test_snapshot_keeps_the_window_as_series(registry: CollectorRegistry) -> None:
    now = [1000.0]
    metrics = ClusterMetrics(window_s=60.0, model_of=MODELS.get, clock=lambda: now[0])
    for step in range(20):  # a heartbeat every 5 s for 95 s: the last 60 s stay
        now[0] = 1000.0 + 5 * step
        metrics.record_heartbeat(
            "n-1", beat(load(requests=step, in_flight=step % 3), gpus=((0, step, 100),))
        )
    body = snapshot_view(metrics.snapshot()).model_dump(mode="json")
    assert body["window_s"] == 60.0
    (node,) = body["nodes"]
    assert node["node"] == "n-1"
    assert node["latest"]["at"] == 1095.0
    assert node["latest"]["gpus"][0]["util_pct"] == 19
    series = node["series"]
    assert series["at"] == [1000.0 + 5 * s for s in range(7, 20)]
    assert series["gpus"]["0"]["util_pct"] == [float(s) for s in range(7, 20)]
    deployment = series["deployments"]["d-aaaa0001"]
    assert deployment["model"] == "tiny"
    assert deployment["requests_total"] == list(range(7, 20))
    assert deployment["in_flight"] == [s % 3 for s in range(7, 20)]


def test_the_proxy_measures_local_requests_only() -> None:
    meter = RequestMeter(clock=lambda: 0.0)
    proxy = ProxyMetrics(local_meter=meter, local_node="local")
    local = Target("tiny", "d-aaaa0001", "local")
    remote = Target("tiny", "d-bbbb0002", "n-1")
    outcomes = [
        (200, None),
        (404, "engine_status"),  # the engine's 4xx: not the node's failure
        (499, "client_disconnected"),
        (502, "engine_unreachable"),
        (200, "stream_aborted"),
    ]
    for status, reason in outcomes:
        for target in (local, remote):
            proxy.request_started(target)
            proxy.request_finished(target, status=status, duration_s=0.25, error_reason=reason)
    proxy.request_started(local)
    stats = meter.stats("d-aaaa0001")
    assert (stats.in_flight, stats.requests_total, stats.errors_total) == (1, 5, 2)
    assert stats.latency_p95_ms == 250.0
    assert meter.deployments() == ["d-aaaa0001"]  # remote requests are counted on their agent


def test_the_grafana_dashboard_uses_only_series_that_exist(
    cluster_metrics: ClusterMetrics, registry: CollectorRegistry
) -> None:
    heartbeat = beat(load(requests=1, latency_p50_ms=1.0, latency_p95_ms=2.0), gpus=((0, 5, 1),))
    heartbeat.loop_lag = LoopLag(bounds_s=[0.01, 0.1], counts=[9, 1, 0], sum_s=0.1)
    cluster_metrics.record_heartbeat("n-1", heartbeat)
    exposed = {s.name for family in registry.collect() for s in family.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    variables = dashboard["templating"]["list"]
    assert variables[0]["type"] == "datasource" and variables[0]["query"] == "prometheus"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in variables if v["type"] == "query"]
    used = {name for expr in exprs for name in re.findall(r"\bberth_[a-z0-9_]+", expr)}
    assert used and used <= exposed, used - exposed
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("gpu utilisation", "gpu memory", "in flight", "p95", "request rate", "error",
                  "event loop lag"):  # fmt: skip
        assert topic in titles
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
