"""Per-deployment request accounting over a rolling time window (pure: no I/O, clock injected).

Where a request is served (an agent relaying to its engine, or the leader's proxy for node
``local``), :class:`RequestMeter` hears each request start and finish and answers, per
deployment: requests in flight, requests and errors since the meter was made (cumulative, for
counters), and latency percentiles over the last ``window_s`` seconds.

An error is an engine status of 500 or more, or an exchange that failed before or while the
engine answered (:func:`is_error`); an engine's 4xx and a client leaving are not errors.

Memory is bounded: each deployment keeps at most ``max_samples`` latencies (the newest), so a
burst above that rate within the window reports percentiles over its latest part.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Length of the rolling window, in seconds (the heartbeat's percentiles cover this span).
WINDOW_S = 60.0
#: Most latency samples kept per deployment within the window.
MAX_SAMPLES = 10_000


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0 < q <= 100) of ascending ``sorted_values`` by nearest rank.

    Nearest rank (the smallest value with at least ``q`` % of the values at or below it) is
    always one of the observed values; ``None`` for an empty sequence. Raises ``ValueError``
    for ``q`` outside (0, 100].
    """
    if not 0 < q <= 100:
        raise ValueError(f"percentile {q} is outside (0, 100]")
    if not sorted_values:
        return None
    rank = math.ceil(q / 100 * len(sorted_values))
    return sorted_values[max(rank, 1) - 1]


def is_error(status: int | None, *, failed: bool = False) -> bool:
    """Whether a served request counts as an error.

    ``status`` is the engine's HTTP status (``None`` when it never answered); ``failed`` says
    the exchange broke off before or while the answer was relayed.
    """
    return failed or status is None or status >= 500


@dataclass(frozen=True)
class WindowStats:
    """One deployment's figures at one instant.

    ``requests_total``/``errors_total`` count finished requests since the meter was made;
    ``requests_in_window``/``errors_in_window`` those that finished in the last ``window_s``;
    the latencies (milliseconds) are over the window, ``None`` when it holds no request.
    """

    in_flight: int = 0
    requests_total: int = 0
    errors_total: int = 0
    requests_in_window: int = 0
    errors_in_window: int = 0
    latency_p50_ms: float | None = None
    latency_p95_ms: float | None = None


class _Deployment:
    __slots__ = ("errors_total", "in_flight", "requests_total", "samples")

    def __init__(self, max_samples: int) -> None:
        self.in_flight = 0
        self.requests_total = 0
        self.errors_total = 0
        # (finished at, latency in ms, was an error), oldest first.
        self.samples: deque[tuple[float, float, bool]] = deque(maxlen=max_samples)


class RequestMeter:
    """Requests per deployment: in flight, cumulative totals, and a rolling latency window.

    ``clock`` returns seconds on a monotonic scale (``time.monotonic`` by default). Every
    method is synchronous and cheap; callers on an event loop need no lock.
    """

    def __init__(
        self,
        *,
        window_s: float = WINDOW_S,
        max_samples: int = MAX_SAMPLES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or max_samples <= 0:
            raise ValueError("window_s and max_samples must be positive")
        self.window_s = window_s
        self._max_samples = max_samples
        self._clock = clock
        self._deployments: dict[str, _Deployment] = {}

    def _entry(self, deployment_id: str) -> _Deployment:
        entry = self._deployments.get(deployment_id)
        if entry is None:
            entry = self._deployments[deployment_id] = _Deployment(self._max_samples)
        return entry

    def started(self, deployment_id: str) -> None:
        """A request to ``deployment_id`` is now being served."""
        self._entry(deployment_id).in_flight += 1

    def finished(self, deployment_id: str, *, latency_ms: float, error: bool) -> None:
        """A request begun with :meth:`started` ended after ``latency_ms`` milliseconds."""
        entry = self._entry(deployment_id)
        entry.in_flight = max(0, entry.in_flight - 1)
        entry.requests_total += 1
        if error:
            entry.errors_total += 1
        entry.samples.append((self._clock(), latency_ms, error))

    def withdrawn(self, deployment_id: str) -> None:
        """A request begun with :meth:`started` went elsewhere (a retry): not counted."""
        entry = self._deployments.get(deployment_id)
        if entry is not None and entry.in_flight > 0:
            entry.in_flight -= 1

    def forget(self, deployment_id: str) -> None:
        """The deployment is gone: drop its figures and samples."""
        self._deployments.pop(deployment_id, None)

    def deployments(self) -> list[str]:
        """Every deployment the meter has heard of."""
        return list(self._deployments)

    def stats(self, deployment_id: str) -> WindowStats:
        """The deployment's figures now (all zero for one never seen)."""
        entry = self._deployments.get(deployment_id)
        if entry is None:
            return WindowStats()
        horizon = self._clock() - self.window_s
        samples = entry.samples
        while samples and samples[0][0] < horizon:
            samples.popleft()
        latencies = sorted(latency for _at, latency, _error in samples)
        return WindowStats(
            in_flight=entry.in_flight,
            requests_total=entry.requests_total,
            errors_total=entry.errors_total,
            requests_in_window=len(samples),
            errors_in_window=sum(1 for _at, _latency, error in samples if error),
            latency_p50_ms=percentile(latencies, 50),
            latency_p95_ms=percentile(latencies, 95),
        )


__all__ = ["MAX_SAMPLES", "WINDOW_S", "RequestMeter", "WindowStats", "is_error", "percentile"]
