"""The admin API's metrics route: every node's load over the last minute, for dashboards.

``GET /admin/metrics/snapshot`` answers a :class:`berth.api.MetricsSnapshot`::

    {"at": 1718000000.0, "window_s": 60.0,
     "nodes": [{"node": "local",
                "latest": {"at": ..., "gpus": [{"index", "name", "util_pct",
                                                "mem_used_bytes", "mem_total_bytes"}],
                           "deployments": [{"deployment", "model", "in_flight",
                                            "requests_total", "errors_total",
                                            "latency_p50_ms", "latency_p95_ms", "alive"}]},
                "series": {"at": [...],
                           "gpus": {"0": {"util_pct": [...], "mem_used_bytes": [...]}},
                           "deployments": {"d-3f2a91c4": {"model", "in_flight": [...],
                                                          "requests_total": [...],
                                                          "errors_total": [...],
                                                          "latency_p95_ms": [...]}}}}]}

Series are one value per sample (the heartbeat's resolution), aligned with ``series.at``
(seconds since the epoch), ``null`` where a sample did not carry that GPU or deployment.
"""

from __future__ import annotations

from fastapi import APIRouter

from berth.admin.roles import needs
from berth.api import (
    DeploymentColumns,
    DeploymentSampleOut,
    GpuColumns,
    GpuSampleOut,
    MetricsSnapshot,
    NodeMetrics,
    NodeSampleOut,
    NodeSeriesColumns,
)
from berth.observability.cluster import ClusterMetrics, ClusterSnapshot, NodeSample, NodeSeries
from berth.vocab.roles import Role


def _sample_view(sample: NodeSample) -> NodeSampleOut:
    return NodeSampleOut(
        at=sample.at,
        gpus=[
            GpuSampleOut(
                index=g.index,
                name=g.name,
                util_pct=g.util_pct,
                mem_used_bytes=g.mem_used_bytes,
                mem_total_bytes=g.mem_total_bytes,
            )
            for g in sample.gpus
        ],
        deployments=[
            DeploymentSampleOut(
                deployment=d.deployment,
                model=d.model,
                in_flight=d.in_flight,
                requests_total=d.requests_total,
                errors_total=d.errors_total,
                latency_p50_ms=d.latency_p50_ms,
                latency_p95_ms=d.latency_p95_ms,
                alive=d.alive,
            )
            for d in sample.deployments
        ],
    )


def _node_view(series: NodeSeries) -> NodeMetrics:
    samples = series.samples
    count = len(samples)
    util: dict[str, list[float | None]] = {}
    mem: dict[str, list[int | None]] = {}
    models: dict[str, str] = {}
    in_flight: dict[str, list[int | None]] = {}
    requests: dict[str, list[int | None]] = {}
    errors: dict[str, list[int | None]] = {}
    p95: dict[str, list[float | None]] = {}
    for i, sample in enumerate(samples):
        for gpu in sample.gpus:
            key = str(gpu.index)
            util.setdefault(key, [None] * count)[i] = gpu.util_pct
            mem.setdefault(key, [None] * count)[i] = gpu.mem_used_bytes
        for d in sample.deployments:
            models.setdefault(d.deployment, d.model)
            in_flight.setdefault(d.deployment, [None] * count)[i] = d.in_flight
            requests.setdefault(d.deployment, [None] * count)[i] = d.requests_total
            errors.setdefault(d.deployment, [None] * count)[i] = d.errors_total
            p95.setdefault(d.deployment, [None] * count)[i] = d.latency_p95_ms
    return NodeMetrics(
        node=series.node,
        latest=_sample_view(series.latest),
        series=NodeSeriesColumns(
            at=[s.at for s in samples],
            gpus={key: GpuColumns(util_pct=util[key], mem_used_bytes=mem[key]) for key in util},
            deployments={
                key: DeploymentColumns(
                    model=model,
                    in_flight=in_flight[key],
                    requests_total=requests[key],
                    errors_total=errors[key],
                    latency_p95_ms=p95[key],
                )
                for key, model in models.items()
            },
        ),
    )


def snapshot_view(snapshot: ClusterSnapshot) -> MetricsSnapshot:
    """The answer of ``GET /admin/metrics/snapshot`` (see the module docstring)."""
    return MetricsSnapshot(
        at=snapshot.at,
        window_s=snapshot.window_s,
        nodes=[_node_view(node) for node in snapshot.nodes],
    )


def build_metrics_router(cluster_metrics: ClusterMetrics) -> APIRouter:
    """``GET /admin/metrics/snapshot``: every node's load over the last minute, from
    ``cluster_metrics``."""
    router = APIRouter()

    @router.get("/admin/metrics/snapshot", dependencies=[needs(Role.VIEWER)])
    async def metrics_snapshot() -> MetricsSnapshot:
        return snapshot_view(cluster_metrics.snapshot())

    return router
