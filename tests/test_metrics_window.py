"""The rolling request window: percentiles, error classification, totals and expiry."""

from __future__ import annotations

import pytest

from berth.observability.window import RequestMeter, WindowStats, is_error, percentile


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([7.0], 50, 7.0),
        ([7.0], 95, 7.0),
        ([1.0, 2.0], 50, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.0),
        ([float(v) for v in range(1, 101)], 95, 95.0),
        ([float(v) for v in range(1, 101)], 50, 50.0),
        ([float(v) for v in range(1, 21)], 95, 19.0),
        ([1.0, 2.0, 3.0], 100, 3.0),
    ],
)
def test_percentile_is_nearest_rank(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


@pytest.mark.parametrize("q", [0, -1, 100.5])
def test_percentile_refuses_out_of_range(q: float) -> None:
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], q)


@pytest.mark.parametrize(
    ("status", "failed", "expected"),
    [
        (200, False, False),
        (404, False, False),
        (499, False, False),
        (500, False, True),
        (503, False, True),
        (200, True, True),
        (None, False, True),
    ],
)
def test_is_error(status: int | None, failed: bool, expected: bool) -> None:
    assert is_error(status, failed=failed) is expected


def test_unknown_deployment_reports_zeros() -> None:
    assert RequestMeter().stats("d-00000000") == WindowStats()


def test_in_flight_totals_and_percentiles() -> None:
    clock = Clock()
    meter = RequestMeter(clock=clock)
    for _ in range(3):
        meter.started("d-1")
    meter.finished("d-1", latency_ms=10.0, error=False)
    meter.finished("d-1", latency_ms=30.0, error=True)
    stats = meter.stats("d-1")
    assert stats.in_flight == 1
    assert (stats.requests_total, stats.errors_total) == (2, 1)
    assert (stats.requests_in_window, stats.errors_in_window) == (2, 1)
    assert (stats.latency_p50_ms, stats.latency_p95_ms) == (10.0, 30.0)
    assert meter.deployments() == ["d-1"]


@pytest.mark.parametrize(
    ("age_s", "kept"),
    [(0.0, True), (59.9, True), (60.0, True), (60.1, False), (300.0, False)],
)
def test_latencies_leave_the_window_totals_stay(age_s: float, kept: bool) -> None:
    clock = Clock()
    meter = RequestMeter(window_s=60.0, clock=clock)
    meter.started("d-1")
    meter.finished("d-1", latency_ms=42.0, error=True)
    clock.now += age_s
    stats = meter.stats("d-1")
    assert stats.requests_total == 1 and stats.errors_total == 1
    assert stats.requests_in_window == (1 if kept else 0)
    assert stats.latency_p95_ms == (42.0 if kept else None)


def test_samples_are_bounded_newest_kept() -> None:
    meter = RequestMeter(max_samples=3, clock=Clock())
    for latency in (1.0, 2.0, 3.0, 4.0, 5.0):
        meter.started("d-1")
        meter.finished("d-1", latency_ms=latency, error=False)
    stats = meter.stats("d-1")
    assert stats.requests_total == 5
    assert stats.requests_in_window == 3
    assert stats.latency_p50_ms == 4.0


@pytest.mark.parametrize(("window_s", "max_samples"), [(0, 10), (-1, 10), (60, 0)])
def test_meter_refuses_bad_bounds(window_s: float, max_samples: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        RequestMeter(window_s=window_s, max_samples=max_samples)
