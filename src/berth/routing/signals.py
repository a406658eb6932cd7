"""Live per-deployment load as the leader sees it: requests in flight and recent latency.

The proxy calls :meth:`SignalBoard.started` when it sends a request to a deployment,
:meth:`SignalBoard.observe` when the answer's head arrives (counted: :meth:`SignalBoard.answers`),
and :meth:`SignalBoard.finished` when the exchange is over (or the attempt failed). In-flight
counts are exact and immediate (every request goes through the leader); the p95 is over the
samples of the last ``window_s`` seconds (at most ``max_samples`` per deployment). When a
request last started or finished on a deployment (:meth:`SignalBoard.last_active_at`) is
what the scaling controller's idle timeout counts from.

Requests in flight are this process's, or, given the host's shared table (``in_flight``,
:class:`~berth.host.deployments.SharedDeployments`), the host's: every serving process
counts in its own column and reads the sum, so the router ranks on the host's load.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from berth.host.deployments import SharedDeployments
from berth.observability.window import percentile

#: Seconds a deployment is ranked after healthy ones per failed attempt in a row, and at most.
DEMOTION_STEP_S = 5.0
MAX_DEMOTION_S = 60.0
#: Seconds of latency samples the p95 is computed over.
WINDOW_S = 60.0
MAX_SAMPLES = 256


class SignalBoard:
    """In-flight counts and recent time-to-first-byte samples per deployment (``in_flight``:
    the host's shared counts; ``None``: this process's)."""

    def __init__(
        self,
        *,
        window_s: float = WINDOW_S,
        max_samples: int = MAX_SAMPLES,
        clock: Callable[[], float] = time.monotonic,
        in_flight: SharedDeployments | None = None,
    ) -> None:
        self._shared = in_flight
        self._window_s = window_s
        self._max_samples = max_samples
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._node_in_flight: dict[str, int] = {}
        self._samples: dict[str, deque[tuple[float, float]]] = {}
        self._failures: dict[str, tuple[int, float]] = {}  # consecutive count, demoted until
        self._last_active: dict[str, float] = {}
        self._answers: dict[str, int] = {}

    def started(self, deployment_id: str, node_id: str) -> None:
        if self._shared is not None:
            self._shared.started(deployment_id, node_id)
            self._last_active[deployment_id] = self._clock()
            return
        self._in_flight[deployment_id] = self._in_flight.get(deployment_id, 0) + 1
        self._node_in_flight[node_id] = self._node_in_flight.get(node_id, 0) + 1
        self._last_active[deployment_id] = self._clock()

    def finished(self, deployment_id: str, node_id: str) -> None:
        """The request left the deployment (answered in full, failed or abandoned)."""
        self._last_active[deployment_id] = self._clock()
        if self._shared is not None:
            self._shared.finished(deployment_id, node_id)
            return
        left = self._in_flight.get(deployment_id, 0) - 1
        if left > 0:
            self._in_flight[deployment_id] = left
        else:
            self._in_flight.pop(deployment_id, None)
        node_left = self._node_in_flight.get(node_id, 0) - 1
        if node_left > 0:
            self._node_in_flight[node_id] = node_left
        else:
            self._node_in_flight.pop(node_id, None)

    def observe(self, deployment_id: str, latency_s: float) -> None:
        """A sample of the deployment's time to the answer's head, in seconds: it began an
        answer (:meth:`answers`)."""
        self._answers[deployment_id] = self._answers.get(deployment_id, 0) + 1
        samples = self._samples.get(deployment_id)
        if samples is None:  # not setdefault: that would make a deque per sample
            samples = self._samples[deployment_id] = deque(maxlen=self._max_samples)
        samples.append((self._clock(), latency_s * 1000.0))

    def failed(self, deployment_id: str) -> None:
        """An attempt on the deployment failed (unreachable, timed out, 5xx): it is ranked
        after healthy ones for a while, longer after each failure in a row (5 s steps,
        at most :data:`MAX_DEMOTION_S`)."""
        count = self._failures.get(deployment_id, (0, 0.0))[0] + 1
        until = self._clock() + min(MAX_DEMOTION_S, DEMOTION_STEP_S * count)
        self._failures[deployment_id] = (count, until)

    def succeeded(self, deployment_id: str) -> None:
        """An attempt on the deployment was answered: no longer demoted."""
        self._failures.pop(deployment_id, None)

    def recently_failed(self, deployment_id: str) -> bool:
        failure = self._failures.get(deployment_id)
        return failure is not None and self._clock() < failure[1]

    def node_in_flight(self, node_id: str) -> int:
        if self._shared is not None:
            return self._shared.node_in_flight(node_id)
        return self._node_in_flight.get(node_id, 0)

    def in_flight(self, deployment_id: str) -> int:
        if self._shared is not None:
            return self._shared.in_flight(deployment_id)
        return self._in_flight.get(deployment_id, 0)

    def last_active_at(self, deployment_id: str) -> float | None:
        """When a request last started or finished on the deployment, on this board's clock
        (``None``: never, or it was forgotten)."""
        return self._last_active.get(deployment_id)

    def answers(self, deployment_id: str) -> int:
        """How many answers the deployment has begun (heads observed) since it was first
        seen or last forgotten: a count that only grows, which a request waiting for its
        first byte reads to tell a busy engine (the count moves) from a hung one."""
        return self._answers.get(deployment_id, 0)

    def p95_ms(self, deployment_id: str) -> float | None:
        """The 95th percentile (nearest rank) of the window's samples; ``None`` if none."""
        samples = self._samples.get(deployment_id)
        if not samples:
            return None
        horizon = self._clock() - self._window_s
        while samples and samples[0][0] < horizon:
            samples.popleft()
        if not samples:
            return None
        return percentile(sorted(value for _at, value in samples), 95)

    def forget(self, deployment_id: str) -> None:
        """The deployment is gone: drop its samples, failures and last activity."""
        self._samples.pop(deployment_id, None)
        self._failures.pop(deployment_id, None)
        self._last_active.pop(deployment_id, None)
        self._answers.pop(deployment_id, None)
        if self._shared is not None:  # its row goes once nothing counts in it
            self._shared.forget(deployment_id)
