"""The admin API's routes behind the console's Overview page.

- ``GET /admin/metrics/history`` → :class:`~berth.api.MetricsHistory`: the last hour at
  10 s steps, kept in this leader's memory (:mod:`berth.observability.history`);
- ``GET /admin/leaders`` → ``list[`` :class:`~berth.api.LeaderMember` ``]``: every leader
  sharing the store, its role, the lease's epoch, and this leader's load.

The routes take what they use: the history, and a function that lists the leaders
(:func:`leader_members`, bound by the daemon to its store and leadership).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter

from berth.admin.roles import needs
from berth.api import GpuHistory, LeaderMember, MetricsHistory, SeriesSet
from berth.observability.history import COUNTERS, LATENCIES, HistoryView
from berth.observability.history import MetricsHistory as History
from berth.observability.metrics import ProxyMetrics
from berth.store import Store
from berth.store.leadership import Leadership
from berth.vocab.roles import Role

_NAMES = (*COUNTERS, *LATENCIES)


def _series_set(series: dict[str, tuple[float | None, ...]], steps: int) -> SeriesSet:
    empty: tuple[float | None, ...] = (None,) * steps
    values = {name: list(series.get(name, empty)) for name in _NAMES}
    return SeriesSet.model_validate(values)


def history_view(view: HistoryView) -> MetricsHistory:
    """The answer of ``GET /admin/metrics/history``."""
    steps = len(view.at)
    models: dict[str, SeriesSet] = {}
    nodes: dict[str, SeriesSet] = {}
    gpus: list[GpuHistory] = []
    for scope, series in sorted(view.series.items()):
        kind, _, name = scope.partition(":")
        if kind == "model":
            models[name] = _series_set(series, steps)
        elif kind == "node":
            nodes[name] = _series_set(series, steps)
        elif kind == "gpu":
            node, _, index = name.rpartition("/")
            empty: tuple[float | None, ...] = (None,) * steps
            gpus.append(
                GpuHistory(
                    node=node,
                    index=int(index),
                    name=view.gpu_names.get(scope, ""),
                    util_pct=list(series.get("util_pct", empty)),
                    mem_used_bytes=list(series.get("mem_used_bytes", empty)),
                    mem_total_bytes=list(series.get("mem_total_bytes", empty)),
                )
            )
    return MetricsHistory(
        step_s=view.step_s,
        kept_s=view.kept_s,
        started_at=view.started_at,
        at=list(view.at),
        cluster=_series_set(view.series.get("cluster", {}), steps),
        models=models,
        nodes=nodes,
        gpus=gpus,
    )


async def leader_members(
    store: Store,
    leadership: Leadership | None,
    *,
    me: str,
    cluster_url: str,
    metrics: ProxyMetrics,
    history: History,
    clock: Callable[[], float] = time.time,
) -> list[LeaderMember]:
    """Every leader on ``store`` (with ``leader_ha``; else this one alone, active at epoch
    0), the one holding the lease first; this one's load from ``metrics`` and
    ``history``.  ``me`` is this leader's id when leadership is not shared."""
    now = clock()
    in_flight, rate = metrics.in_flight(), history.recent_rate()
    if leadership is None:
        return [
            LeaderMember(
                id=me, cluster_url=cluster_url, role="active", epoch=0, this=True, seen_at=now,
                in_flight=in_flight, requests_per_s=rate,
            )
        ]  # fmt: skip
    members = await asyncio.to_thread(store.leader_members)
    lease = await asyncio.to_thread(store.read_lease)
    holder = lease.holder if lease is not None and lease.live(now) else None
    out = []
    for member in members:
        this = member.holder == leadership.me
        active = holder is not None and member.holder == holder
        out.append(
            LeaderMember(
                id=member.holder,
                cluster_url=member.cluster_url,
                role="active" if active else "standby",
                epoch=lease.epoch if active and lease is not None else None,
                this=this,
                seen_at=member.seen_at,
                in_flight=in_flight if this else None,
                requests_per_s=rate if this else None,
            )
        )
    return sorted(out, key=lambda m: (m.role != "active", m.id))


def build_overview_router(
    history: History, leaders: Callable[[], Awaitable[list[LeaderMember]]]
) -> APIRouter:
    """The history and leaders routes."""
    router = APIRouter()

    @router.get("/admin/metrics/history", dependencies=[needs(Role.VIEWER)])
    async def metrics_history() -> MetricsHistory:
        return history_view(history.view())

    @router.get("/admin/leaders", dependencies=[needs(Role.VIEWER)])
    async def list_leaders() -> list[LeaderMember]:
        return await leaders()

    return router
