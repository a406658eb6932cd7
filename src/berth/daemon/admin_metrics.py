"""The admin API's metrics route: every node's load over the last minute, for dashboards.

``GET /admin/metrics/snapshot`` answers::

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

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from berth.daemon.services import LeaderServices
from berth.observability.cluster import ClusterSnapshot, NodeSeries

#: The per-deployment figures kept as series (one value per sample).
_COLUMNS = ("in_flight", "requests_total", "errors_total", "latency_p95_ms")


def _node_series_json(series: NodeSeries) -> dict[str, Any]:
    samples = series.samples
    count = len(samples)
    gpus: dict[str, dict[str, list[float | None]]] = {}
    deployments: dict[str, dict[str, Any]] = {}
    for i, sample in enumerate(samples):
        for gpu in sample.gpus:
            columns = gpus.setdefault(
                str(gpu.index), {"util_pct": [None] * count, "mem_used_bytes": [None] * count}
            )
            columns["util_pct"][i] = gpu.util_pct
            columns["mem_used_bytes"][i] = gpu.mem_used_bytes
        for d in sample.deployments:
            entry = deployments.setdefault(
                d.deployment, {"model": d.model, **{name: [None] * count for name in _COLUMNS}}
            )
            entry["in_flight"][i] = d.in_flight
            entry["requests_total"][i] = d.requests_total
            entry["errors_total"][i] = d.errors_total
            entry["latency_p95_ms"][i] = d.latency_p95_ms
    return {
        "node": series.node,
        "latest": asdict(series.latest),
        "series": {"at": [s.at for s in samples], "gpus": gpus, "deployments": deployments},
    }


def snapshot_json(snapshot: ClusterSnapshot) -> dict[str, Any]:
    """The JSON shape of ``GET /admin/metrics/snapshot`` (see the module docstring)."""
    return {
        "at": snapshot.at,
        "window_s": snapshot.window_s,
        "nodes": [_node_series_json(node) for node in snapshot.nodes],
    }


def build_metrics_router(services: LeaderServices) -> APIRouter:
    """The metrics routes, bound to ``services``."""
    router = APIRouter()

    @router.get("/admin/metrics/snapshot")
    async def metrics_snapshot() -> dict[str, Any]:
        return snapshot_json(services.cluster_metrics.snapshot())

    return router
