"""The leader's last hour for the console (``berth.observability.history``): what a step
counts agrees with ``/metrics``, percentiles from the TTFB histogram, GPUs, the bound, and
"no data" kept apart from zero."""

from __future__ import annotations

import re

import pytest

from berth.admin.overview import history_view, leader_members
from berth.cluster.protocol.frames import Heartbeat
from berth.cluster.protocol.payloads import GpuState
from berth.observability.cluster import ClusterMetrics
from berth.observability.history import MetricsHistory, histogram_quantile
from berth.observability.metrics import TTFB_BUCKETS_S, ProxyMetrics, Target
from berth.store import Store
from berth.store.leadership import Leadership

A = Target("tiny", "d-aaaa0001", "n-a")
B = Target("small", "d-bbbb0002", "local")


def served(metrics: ProxyMetrics, target: Target, *, ttfb_s: float = 0.02, tokens: int = 3,
           status: int = 200, error: str | None = None) -> None:  # fmt: skip
    metrics.request_started(target)
    metrics.request_finished(target, status=status, duration_s=0.5, ttfb_s=ttfb_s,
                             prompt_tokens=tokens, completion_tokens=2 * tokens,
                             error_reason=error)  # fmt: skip


def scraped(metrics: ProxyMetrics, family: str) -> float:
    text = metrics.render()[0].decode()
    return sum(float(v) for v in re.findall(rf"^{family}\{{[^}}]*\}} (\S+)$", text, re.M))


@pytest.mark.parametrize(
    ("q", "counts", "expected"),
    [
        (0.5, [0, 0, 0, 0, 0], None),  # nothing observed
        (0.5, [4, 0, 0, 0, 0], 0.5),  # all in the first bucket: half of its bound
        (0.5, [0, 2, 2, 0, 0], 2.0),  # the rank ends the second bucket
        (0.95, [0, 0, 0, 0, 10], 4.0),  # +Inf: the highest finite bound
    ],
)
def test_a_quantile_is_interpolated_within_its_bucket(
    q: float, counts: list[int], expected: float | None
) -> None:
    assert histogram_quantile(q, (1.0, 2.0, 3.0, 4.0), counts) == expected


def test_each_step_counts_what_metrics_grew_by_per_cluster_model_and_node() -> None:
    metrics = ProxyMetrics()
    history = MetricsHistory(metrics, ClusterMetrics(), clock=lambda: 0.0)
    history.sample(10.0)  # a quiet step: the cluster counted zero, nothing else is known
    for _ in range(3):
        served(metrics, A, tokens=4)
    served(metrics, B, ttfb_s=0.3, status=502, error="engine_unreachable")
    history.sample(20.0)
    served(metrics, A)
    history.sample(30.0)

    view = history_view(history.view())
    assert view.at == [10.0, 20.0, 30.0]
    assert view.cluster.requests == [0, 4, 1]
    assert view.cluster.errors == [0, 1, 0]
    # the sums agree with the counters /metrics shows
    assert sum(view.cluster.requests) == scraped(metrics, "berth_proxy_requests_total") == 5
    prompt = scraped(metrics, "berth_proxy_prompt_tokens_total")
    completion = scraped(metrics, "berth_proxy_completion_tokens_total")
    assert sum(view.cluster.prompt_tokens) == prompt == 3 * 4 + 3 + 3
    assert sum(view.cluster.completion_tokens) == completion == 2 * prompt
    assert view.models["tiny"].requests == [0, 3, 1]  # before its first request: zero
    assert view.nodes["local"].errors == [0, 1, 0]
    # TTFT: none in a step without requests, interpolated in the TTFB buckets otherwise
    assert view.cluster.ttft_p50_ms == [None, pytest.approx(20.0), 17.5]
    assert view.models["small"].ttft_p95_ms[1] == pytest.approx(
        1000 * histogram_quantile(0.95, TTFB_BUCKETS_S, [0] * 8 + [1] + [0] * 7)  # 0.25-0.5 s
    )
    assert view.models["small"].ttft_p50_ms == [None, pytest.approx(375.0), None]


def test_gpus_are_sampled_from_reports_and_missing_reports_are_no_data() -> None:
    metrics, cluster = ProxyMetrics(), ClusterMetrics(window_s=600)
    history = MetricsHistory(metrics, cluster, clock=lambda: 0.0)
    gpus = [GpuState(index=0, name="L4", memory_total_mb=100, memory_used_mb=25,
                     utilization_pct=None)]  # fmt: skip
    cluster.record_heartbeat("n-a", Heartbeat(sent_at=0.0, gpus=gpus), now=5.0)
    history.sample(10.0)
    history.sample(20.0)  # no report in this step
    (gpu,) = history_view(history.view()).gpus
    assert (gpu.node, gpu.index, gpu.name) == ("n-a", 0, "L4")
    assert gpu.mem_used_bytes == [25 * 1024 * 1024, None]
    assert gpu.util_pct == [None, None]  # the driver did not say: no data, never zero


def test_the_rings_keep_the_last_hour_and_drop_what_has_no_data_left() -> None:
    metrics = ProxyMetrics()
    history = MetricsHistory(metrics, ClusterMetrics(), step_s=10.0, kept_s=60.0)
    served(metrics, A)
    history.sample(10.0)
    for step in range(2, 12):
        history.sample(10.0 * step)
    view = history_view(history.view())
    assert len(view.at) == 6 and view.at[0] == 60.0  # six steps of ten seconds
    assert view.cluster.requests == [0] * 6
    assert "tiny" not in view.models  # a model with no request in the window goes
    assert history.recent_rate() == 0.0
    with pytest.raises(ValueError, match="step_s must be positive"):
        MetricsHistory(metrics, ClusterMetrics(), step_s=10.0, kept_s=5.0)


async def test_the_leaders_are_listed_with_role_epoch_and_this_ones_load(store: Store) -> None:
    """With shared leadership, every leader of the store: the lease's holder active with its
    epoch, the others standing by; only this leader's load is known here."""
    metrics = ProxyMetrics()
    history = MetricsHistory(metrics, ClusterMetrics())
    store.note_leader_member("https://a:11501", "host-a:1:aa", 100.0)
    store.note_leader_member("https://b:11501", "host-b:2:bb", 100.0)
    state = store.acquire_lease("host-b:2:bb", "https://b:11500", 60.0)
    metrics.request_started(A)  # one in flight on this leader
    me = Leadership(store, me="host-a:1:aa", address="https://a:11500", lease_s=60.0)
    lease = store.read_lease()
    assert lease is not None
    listed = await leader_members(
        store, me, me="unused", cluster_url="https://a:11501", metrics=metrics, history=history,
        clock=lambda: lease.acquired_at + 1,  # the store's clock (a test's may be fixed)
    )  # fmt: skip
    assert [(m.id, m.role, m.epoch, m.this, m.in_flight) for m in listed] == [
        ("host-b:2:bb", "active", state.epoch, False, None),
        ("host-a:1:aa", "standby", None, True, 1),
    ]
    alone = await leader_members(
        store, None, me="pid:7", cluster_url="https://a:11501", metrics=metrics, history=history
    )
    assert [(m.id, m.role, m.epoch, m.this, m.in_flight) for m in alone] == [
        ("pid:7", "active", 0, True, 1)
    ]
