"""The last hour of what the cluster did, kept in the leader's memory for the console.

:class:`MetricsHistory` samples, every ``step_s`` seconds (10 s), the same counters
``/metrics`` exposes (:meth:`berth.observability.metrics.ProxyMetrics.request_totals`) and
each node's latest GPU report (:class:`berth.observability.cluster.ClusterMetrics`), and
keeps per *series* one value per step in a ring of ``kept_s / step_s`` slots (360: the
last hour).  The series, for the whole cluster, per model (the public name) and per node
(where the request was served):

- ``requests``, ``errors``, ``prompt_tokens``, ``completion_tokens``: how many in the step
  (the growth of the counters over it, so the sum over any steps is what ``/metrics``
  grew by);
- ``ttft_p50_ms``, ``ttft_p95_ms``: time to first token (the proxy's time to the first byte
  of the answer, the first token of a stream) over the step's requests, interpolated within
  the histogram's buckets as Prometheus' ``histogram_quantile`` does; ``None`` for a step
  without requests;

and per GPU (``node/index``) ``util_pct`` and ``mem_used_bytes`` (``None`` when its node
sent no report in the step, or the driver does not say).

Bounded: a fixed number of steps per series, and series are only kept for the labels the
proxy's counters have (bounded there); a series with nothing but ``None`` in its ring goes.
The history lives in this leader's memory: a console reload reads it again, a leader
restart starts it anew.  Written from the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from berth.observability.cluster import ClusterMetrics
from berth.observability.metrics import TTFB_BUCKETS_S, ProxyMetrics, TargetTotals

log = logging.getLogger(__name__)

#: Seconds per step (the charts' resolution).
STEP_S = 10.0
#: Seconds of steps kept (the charts' window).
KEPT_S = 3600.0

COUNTERS = ("requests", "errors", "prompt_tokens", "completion_tokens")
LATENCIES = ("ttft_p50_ms", "ttft_p95_ms")

Value = float | None


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """The ``q`` quantile (0..1) of observations counted per bucket (``counts``: not
    cumulative, one more than ``bounds``, the last +Inf), linearly interpolated within its
    bucket as Prometheus' ``histogram_quantile`` does; ``None`` with no observation.  One
    that falls in the +Inf bucket is the highest finite bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    running = 0
    lower = 0.0
    for index, count in enumerate(counts):
        if index >= len(bounds):
            return bounds[-1]
        upper = bounds[index]
        if count > 0 and running + count >= rank:
            return lower + (upper - lower) * (rank - running) / count
        running += count
        lower = upper
    return bounds[-1]


@dataclass(frozen=True)
class HistoryView:
    """The kept steps: ``at`` their end times (epoch s, oldest first); ``series`` by scope
    (``cluster``, ``model:NAME``, ``node:ID``, ``gpu:NODE/INDEX``) and name, each aligned
    with ``at``; ``gpu_names`` a GPU scope's model name."""

    step_s: float
    kept_s: float
    started_at: float
    at: tuple[float, ...]
    series: dict[str, dict[str, tuple[Value, ...]]]
    gpu_names: dict[str, str]


class _Step:
    """What one step adds, by scope: counts summed, TTFB histograms summed."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.ttfb: dict[str, list[int]] = {}

    def add(self, scope: str, counts: Sequence[int], ttfb: Sequence[int]) -> None:
        if not any(counts):
            return  # nothing grew: the scope's counts are zero (filled in by the history)
        row = self.counts.setdefault(scope, [0] * len(COUNTERS))
        for index, value in enumerate(counts):
            row[index] += value
        hist = self.ttfb.setdefault(scope, [0] * len(ttfb))
        for index, value in enumerate(ttfb):
            hist[index] += value


class MetricsHistory:
    """The rings (see the module docstring).  ``clock`` gives epoch seconds."""

    def __init__(
        self,
        proxy: ProxyMetrics,
        cluster: ClusterMetrics,
        *,
        step_s: float = STEP_S,
        kept_s: float = KEPT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if step_s <= 0 or kept_s < step_s:
            raise ValueError("step_s must be positive and kept_s at least one step")
        self.step_s = step_s
        self.kept_s = kept_s
        self._proxy = proxy
        self._cluster = cluster
        self._clock = clock
        self._slots = int(kept_s // step_s)
        self.started_at = clock()
        self._at: deque[float] = deque(maxlen=self._slots)
        self._series: dict[tuple[str, str], deque[Value]] = {}
        self._gpu_names: dict[str, str] = {}
        self._last: dict[tuple[str, str, str], TargetTotals] = {}
        self._task: asyncio.Task[None] | None = None

    # -- sampling -------------------------------------------------------------------------

    def start(self) -> None:
        """Sample every ``step_s`` from now on."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="berth-metrics-history")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            try:
                self.sample()
            except Exception:  # the loop must outlive a bug in one sample
                log.exception("metrics history: a sample failed")

    def sample(self, now: float | None = None) -> None:
        """Close one step at ``now`` (default: the clock): what the counters grew by since
        the last step, and each GPU's latest report."""
        at = self._clock() if now is None else now
        step = _Step()
        for totals in self._proxy.request_totals():
            target = totals.target
            before = self._last.get(target)
            self._last[target] = totals
            counts = _growth(before, totals)
            ttfb = [
                max(0, n - (before.ttfb_counts[i] if before is not None else 0))
                for i, n in enumerate(totals.ttfb_counts)
            ]
            step.add("cluster", counts, ttfb)
            if target.model:
                step.add(f"model:{target.model}", counts, ttfb)
            if target.node:
                step.add(f"node:{target.node}", counts, ttfb)
        self._at.append(at)
        seen: set[tuple[str, str]] = set()
        for scope, grown in step.counts.items():
            for name, value in zip(COUNTERS, grown, strict=True):
                seen.add(self._put(scope, name, float(value)))
            hist = step.ttfb[scope]
            for name, q in zip(LATENCIES, (0.5, 0.95), strict=True):
                quantile = histogram_quantile(q, TTFB_BUCKETS_S, hist)
                seen.add(self._put(scope, name, None if quantile is None else quantile * 1000.0))
        if "cluster" not in step.counts:  # no request in the step: the cluster counted 0
            for name in COUNTERS:
                seen.add(self._put("cluster", name, 0.0))
        snapshot = self._cluster.snapshot(at)
        for node in snapshot.nodes:
            if node.latest.at < at - self.step_s:
                continue  # no report in this step
            for gpu in node.latest.gpus:
                scope = f"gpu:{node.node}/{gpu.index}"
                self._gpu_names[scope] = gpu.name
                seen.add(self._put(scope, "util_pct", gpu.util_pct))
                seen.add(self._put(scope, "mem_used_bytes", float(gpu.mem_used_bytes)))
                seen.add(self._put(scope, "mem_total_bytes", float(gpu.mem_total_bytes)))
        for key, ring in list(self._series.items()):
            if key in seen:
                continue
            # counters of a known scope grew by nothing; anything else was not reported
            ring.append(0.0 if key[1] in COUNTERS else None)
            if all(v is None for v in ring) or (
                key[1] in COUNTERS and all(not v for v in ring) and key[0] != "cluster"
            ):
                del self._series[key]
        for scope in set(self._gpu_names) - {scope for scope, _ in self._series}:
            del self._gpu_names[scope]

    def _put(self, scope: str, name: str, value: Value) -> tuple[str, str]:
        key = (scope, name)
        ring = self._series.get(key)
        if ring is None:
            # a new series: before it, counts were zero; anything else was not known
            pad: Value = 0.0 if name in COUNTERS else None
            ring = self._series[key] = deque([pad] * (len(self._at) - 1), maxlen=self._slots)
        ring.append(value)
        return key

    # -- reading --------------------------------------------------------------------------

    def view(self) -> HistoryView:
        """The kept steps, every series aligned with them."""
        series: dict[str, dict[str, tuple[Value, ...]]] = {}
        for (scope, name), ring in self._series.items():
            series.setdefault(scope, {})[name] = tuple(ring)
        return HistoryView(
            step_s=self.step_s,
            kept_s=self.kept_s,
            started_at=self.started_at,
            at=tuple(self._at),
            series=series,
            gpu_names=dict(self._gpu_names),
        )

    def recent_rate(self, steps: int = 6) -> float | None:
        """The cluster's requests a second over the last ``steps`` steps (``None``: none
        kept yet)."""
        ring = self._series.get(("cluster", "requests"))
        if not ring:
            return None
        last = [v for v in list(ring)[-steps:] if v is not None]
        return sum(last) / (len(last) * self.step_s) if last else None


def _growth(before: TargetTotals | None, now: TargetTotals) -> tuple[int, int, int, int]:
    """How much each counter grew since ``before`` (never negative)."""
    if before is None:
        return (now.requests, now.errors, now.prompt_tokens, now.completion_tokens)
    return (
        max(0, now.requests - before.requests),
        max(0, now.errors - before.errors),
        max(0, now.prompt_tokens - before.prompt_tokens),
        max(0, now.completion_tokens - before.completion_tokens),
    )


__all__ = [
    "KEPT_S",
    "STEP_S",
    "HistoryView",
    "MetricsHistory",
    "histogram_quantile",
]
