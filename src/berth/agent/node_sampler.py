"""A node's load report: built from its request meter and agent core, sent or sampled.

An agent puts :func:`deployment_loads` in each heartbeat; the leader measures node ``local``
the same way and feeds it to its :class:`~berth.observability.cluster.ClusterMetrics` through
:class:`LocalNodeSampler`, at the heartbeat interval, as if ``local`` were an agent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from berth.agent.core import AgentCore
from berth.cluster.protocol.frames import Heartbeat
from berth.cluster.protocol.payloads import DeploymentLoad, LoopLag
from berth.cluster.wire_forms import gpu_states
from berth.observability.cluster import ClusterMetrics
from berth.observability.loop_lag import LagHistogram
from berth.observability.window import RequestMeter
from berth.vocab.gpu import GpuInfo

log = logging.getLogger(__name__)


def deployment_loads(meter: RequestMeter, engines: list[tuple[str, bool]]) -> list[DeploymentLoad]:
    """One :class:`DeploymentLoad` per ``(deployment id, alive)`` engine, from ``meter``."""
    loads = []
    for deployment_id, alive in engines:
        stats = meter.stats(deployment_id)
        loads.append(
            DeploymentLoad(
                deployment_id=deployment_id,
                in_flight=stats.in_flight,
                alive=alive,
                requests_total=stats.requests_total,
                errors_total=stats.errors_total,
                latency_p50_ms=stats.latency_p50_ms,
                latency_p95_ms=stats.latency_p95_ms,
            )
        )
    return loads


def loop_lag_report(histogram: LagHistogram) -> LoopLag:
    """``histogram`` as a heartbeat carries it."""
    return LoopLag(
        bounds_s=list(histogram.bounds_s), counts=list(histogram.counts), sum_s=histogram.sum_s
    )


def core_heartbeat(
    core: AgentCore,
    meter: RequestMeter,
    now: float,
    gpus: list[GpuInfo],
    *,
    loop_lag: LagHistogram | None = None,
) -> Heartbeat:
    """What a node running ``core`` reports at ``now``: ``gpus`` (a reading of
    ``core.gpus()`` taken off the loop), its engines' load and, when given, its loop lag."""
    engines = [(e.deployment_id, e.alive) for e in core.engines()]
    return Heartbeat(
        sent_at=now,
        gpus=gpu_states(gpus),
        deployments=deployment_loads(meter, engines),
        adopted=core.adopted.states() if core.adopted is not None else [],
        loop_lag=loop_lag_report(loop_lag) if loop_lag is not None else None,
    )


class LocalNodeSampler:
    """Samples node ``local`` (the leader's own engines) into ``sink`` every ``interval_s``.

    Requests to local engines are counted in ``meter`` by the leader's proxy
    (:class:`~berth.observability.metrics.ProxyMetrics` ``local_meter``).
    """

    def __init__(
        self,
        core: AgentCore,
        meter: RequestMeter,
        sink: ClusterMetrics,
        *,
        node_id: str = "local",
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._core = core
        self._meter = meter
        self._sink = sink
        self._node_id = node_id
        self._interval_s = interval_s
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    async def sample_once(self) -> None:
        # NVML calls block for a moment; keep them off the event loop.
        gpus = await asyncio.to_thread(self._core.gpus)
        engines = [(e.deployment_id, e.alive) for e in self._core.engines()]
        now = self._clock()
        heartbeat = Heartbeat(
            sent_at=now, gpus=gpu_states(gpus), deployments=deployment_loads(self._meter, engines)
        )
        self._sink.record_heartbeat(self._node_id, heartbeat, now)

    async def _run(self) -> None:
        while True:
            try:
                await self.sample_once()
            except Exception:  # the loop must survive a failing GPU query; the log keeps why
                log.exception("sampling node %s failed", self._node_id)
            await asyncio.sleep(self._interval_s)

    def start(self) -> None:
        """Start sampling in the background (on the running loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="local-node-sampler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
