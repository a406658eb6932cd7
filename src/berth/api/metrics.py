"""``GET /admin/metrics/snapshot``: every node's load over the last minute, for dashboards.

Times are seconds since the epoch (the leader's clock); series hold one value per sample
(the heartbeat's resolution), aligned with :attr:`NodeSeriesColumns.at`, ``None`` where a
sample did not carry that GPU or deployment.
"""

from __future__ import annotations

from berth.api.base import ApiModel


class GpuSampleOut(ApiModel):
    """One GPU in one sample; ``util_pct`` is ``None`` when the driver does not say."""

    index: int
    name: str
    util_pct: float | None
    mem_used_bytes: int
    mem_total_bytes: int


class DeploymentSampleOut(ApiModel):
    """One deployment in one sample; the totals are the leader's (monotonic) counters."""

    deployment: str
    model: str
    in_flight: int
    requests_total: int
    errors_total: int
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    alive: bool


class NodeSampleOut(ApiModel):
    """What one node reported at ``at``."""

    at: float
    gpus: list[GpuSampleOut]
    deployments: list[DeploymentSampleOut]


class GpuColumns(ApiModel):
    """One GPU's series."""

    util_pct: list[float | None]
    mem_used_bytes: list[int | None]


class DeploymentColumns(ApiModel):
    """One deployment's series."""

    model: str
    in_flight: list[int | None]
    requests_total: list[int | None]
    errors_total: list[int | None]
    latency_p95_ms: list[float | None]


class NodeSeriesColumns(ApiModel):
    """A node's samples of the window as columns: GPUs by index (as a string, a JSON key),
    deployments by id."""

    at: list[float]
    gpus: dict[str, GpuColumns]
    deployments: dict[str, DeploymentColumns]


class NodeMetrics(ApiModel):
    """A node's latest sample and its window."""

    node: str
    latest: NodeSampleOut
    series: NodeSeriesColumns


class MetricsSnapshot(ApiModel):
    """Every node with a sample in the last ``window_s`` seconds, at ``at``."""

    at: float
    window_s: float
    nodes: list[NodeMetrics]
