"""What :class:`~berth.observability.cluster.ClusterMetrics` reads of one node's report, as
read-only protocols.

A node reports its load in the agent link's ``HEARTBEAT`` frame
(:class:`berth.cluster.protocol.frames.Heartbeat`), which the leader's hub receives from
each agent and the node sampler builds for node ``local``. The series only read a few of its
fields, named here, so observability needs nothing of the cluster package (which sits above
it and feeds it) and the frame is handed over as it is, with no copy per heartbeat: the
frame's structs match these protocols field for field, and mypy checks that at each caller.
Units are the wire's: megabytes (2**20 bytes) for memory, percent for utilisation,
milliseconds for latencies, seconds for the lag histogram.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class GpuReport(Protocol):
    """One GPU of the node: its index and model name, memory in MB, utilisation in percent
    (``None``: not measured)."""

    @property
    def index(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def memory_total_mb(self) -> int: ...
    @property
    def memory_used_mb(self) -> int: ...
    @property
    def utilization_pct(self) -> int | None: ...


class DeploymentLoadReport(Protocol):
    """One deployment's load on the node: requests in flight, totals since the reporter
    started, latency percentiles in ms over its last 60 s (``None``: none served)."""

    @property
    def deployment_id(self) -> str: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def alive(self) -> bool: ...
    @property
    def requests_total(self) -> int: ...
    @property
    def errors_total(self) -> int: ...
    @property
    def latency_p50_ms(self) -> float | None: ...
    @property
    def latency_p95_ms(self) -> float | None: ...


class LagReport(Protocol):
    """The reporter's event-loop lag histogram, cumulative since it started: bucket upper
    bounds in seconds, one count per bucket plus the overflow, and the sum in seconds."""

    @property
    def bounds_s(self) -> Sequence[float]: ...
    @property
    def counts(self) -> Sequence[int]: ...
    @property
    def sum_s(self) -> float: ...


class NodeReport(Protocol):
    """One report of a node: its GPUs, its deployments' load, and its loop lag (``None``:
    the reporter sends none)."""

    @property
    def gpus(self) -> Sequence[GpuReport]: ...
    @property
    def deployments(self) -> Sequence[DeploymentLoadReport]: ...
    @property
    def loop_lag(self) -> LagReport | None: ...
