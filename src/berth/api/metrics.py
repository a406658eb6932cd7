"""``GET /admin/metrics/snapshot``: every node's load over the last minute, for dashboards;
``GET /admin/metrics/history``: the last hour at 10 s steps; ``GET /admin/leaders``.

Times are seconds since the epoch (the leader's clock); series hold one value per sample
(the heartbeat's resolution), aligned with :attr:`NodeSeriesColumns.at`, ``None`` where a
sample did not carry that GPU or deployment.
"""

from __future__ import annotations

from typing import Literal

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


class SeriesSet(ApiModel):
    """One scope's series over the kept steps (aligned with :attr:`MetricsHistory.at`):
    requests, failed requests (``berth_proxy_errors_total``) and prompt and completion tokens
    counted in each step, and the time to first token's median and 95th percentile over
    the step's requests in milliseconds (``None``: no request in that step)."""

    requests: list[float | None]
    errors: list[float | None]
    prompt_tokens: list[float | None]
    completion_tokens: list[float | None]
    ttft_p50_ms: list[float | None]
    ttft_p95_ms: list[float | None]


class GpuHistory(ApiModel):
    """One GPU's utilisation (percent) and memory (bytes) over the kept steps; ``None``
    where its node sent no report, or the driver does not say."""

    node: str
    index: int
    name: str
    util_pct: list[float | None]
    mem_used_bytes: list[float | None]
    mem_total_bytes: list[float | None]


class MetricsHistory(ApiModel):
    """``GET /admin/metrics/history``: the last ``kept_s`` seconds at ``step_s`` resolution
    as this leader kept them since ``started_at`` (epoch seconds; a restart starts anew):
    ``at`` the end of each step, the cluster's series, each model's and each node's, and
    each GPU's."""

    step_s: float
    kept_s: float
    started_at: float
    at: list[float]
    cluster: SeriesSet
    models: dict[str, SeriesSet]
    nodes: dict[str, SeriesSet]
    gpus: list[GpuHistory]


class LeaderMember(ApiModel):
    """``GET /admin/leaders``: one leader sharing the store: its ``id`` (host:pid:random),
    the cluster URL agents dial it at (``None``: a lone leader), its ``role`` and the
    lease's ``epoch`` while it is the active one, ``this``: the leader that answered, when
    it was last seen (epoch s), and its load as this leader knows it: requests in flight
    and requests a second over the last minute (``None``: another leader's, not known here)."""

    id: str
    cluster_url: str | None
    role: Literal["active", "standby"]
    epoch: int | None
    this: bool
    seen_at: float | None
    in_flight: int | None
    requests_per_s: float | None
