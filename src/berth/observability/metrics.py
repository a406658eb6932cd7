"""Prometheus series of the OpenAI proxy and of deployment states.

:class:`ProxyMetrics` owns a private :class:`prometheus_client.CollectorRegistry` (never the
global one, so several apps and tests can live in one process). Every series is named
``berth_*``; ``docs/metrics.md`` lists them with their labels and meaning.

Label values are bounded on purpose: ``model`` is a public model name berth serves (or ``""``
when a request named no known model, so clients cannot create series at will), ``deployment``
and ``node`` are ids, ``status_class`` is ``1xx`` .. ``5xx`` and ``reason`` comes from the
closed set the proxy uses (see ``docs/metrics.md``).

Series of a deployment that stopped or failed stay :data:`LINGER_S` seconds after it ended (so
that a scrape reads their final values), then go; a leader that restarts restores the state
series of the deployments still active from the store (:meth:`ProxyMetrics.restore`), with
the same labels as before.

Hot path: the proxy calls :meth:`ProxyMetrics.request_started` and
:meth:`ProxyMetrics.request_finished` once per request. The request series are plain counters
in per-label-set slot objects, turned into Prometheus families only when scraped (a custom
collector), so a request costs a few dictionary look-ups and integer additions: no locks and
no per-sample objects. They are written from the event loop's thread only; a scrape from
another thread copies the tables first (one C-level copy, atomic under the GIL) and may see a
request half counted, never a torn value.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from berth.humanize import printable
from berth.observability.cluster import LINGER_S
from berth.observability.window import RequestMeter, is_error
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import TERMINAL_STATES, DeploymentState

#: Request latency buckets (seconds): from a cached short answer to a long generation.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: Time-to-first-byte buckets (seconds): proxy overhead at the low end, prefill at the top.
TTFB_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Target(NamedTuple):
    """Who served a request: the public model name, the deployment id and its node id."""

    model: str
    deployment: str
    node: str


def status_class(status: int) -> str:
    """``"2xx"`` for 200..299 and so on; the label value of an HTTP status."""
    return f"{status // 100}xx"


_STATUS_CLASSES = {status: status_class(status) for status in range(100, 600)}


#: Reasons that mean the exchange with the engine broke (errors for the serving node's meter).
_BROKEN_EXCHANGE = frozenset({"engine_unreachable", "engine_unavailable", "engine_timeout",
                              "engine_aborted", "stream_aborted", "first_byte_timeout",
                              "stream_idle_timeout"})  # fmt: skip

_TARGET_LABELS = ("model", "deployment", "node")
_STATUS_LABELS = (*_TARGET_LABELS, "status_class")


class _Histogram:
    """Per-bucket counts (not cumulative; the last slot is +Inf) and the sum, in seconds."""

    __slots__ = ("counts", "sum_s")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        self.sum_s = 0.0

    def family_buckets(self, bounds: tuple[float, ...]) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs as the text format writes them."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


class _RequestSeries:
    """One (model, deployment, node, status class): requests and their timings."""

    __slots__ = ("duration", "requests", "ttfb")

    def __init__(self) -> None:
        self.requests = 0
        self.duration = _Histogram(len(LATENCY_BUCKETS_S))
        self.ttfb = _Histogram(len(TTFB_BUCKETS_S))


class _TargetSeries:
    """One (model, deployment, node): requests in flight and tokens."""

    __slots__ = ("completion_tokens", "in_flight", "prompt_tokens")

    def __init__(self) -> None:
        self.in_flight = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0


class TargetTotals(NamedTuple):
    """A target's running totals since the leader started, as ``/metrics`` counts them:
    requests (every status class), those that failed (``berth_proxy_errors_total``), the
    tokens engines reported, and the time-to-first-byte histogram's per-bucket counts (not
    cumulative; the last is +Inf) over :data:`TTFB_BUCKETS_S`."""

    target: Target
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    ttfb_counts: tuple[int, ...]


class _RequestCollector(Collector):
    """Turns the request tables into Prometheus families at scrape time."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return list(self._families([], [], [], []))

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        m.expire()
        return self._families(
            list(m._requests.items()),
            list(m._targets.items()),
            list(m._errors.items()),
            list(m._retries.items()),
        )

    def _families(
        self,
        requests: list[tuple[tuple[Target, str], _RequestSeries]],
        targets: list[tuple[Target, _TargetSeries]],
        errors: list[tuple[tuple[Target, str, str], int]],
        retries: list[tuple[tuple[Target, str], int]],
    ) -> Iterator[Metric]:
        total = CounterMetricFamily(
            "berth_proxy_requests", "Requests answered by the OpenAI proxy.", labels=_STATUS_LABELS
        )
        duration = HistogramMetricFamily(
            "berth_proxy_request_duration_seconds",
            "Time from the request's arrival to the last byte of the answer.",
            labels=_STATUS_LABELS,
        )
        ttfb = HistogramMetricFamily(
            "berth_proxy_time_to_first_byte_seconds",
            "Time from the request's arrival to the first byte of the answer's body.",
            labels=_STATUS_LABELS,
        )
        for (target, klass), series in requests:
            labels = [*target, klass]
            total.add_metric(labels, series.requests)
            duration.add_metric(
                labels, series.duration.family_buckets(LATENCY_BUCKETS_S), series.duration.sum_s
            )
            if any(series.ttfb.counts):  # rejected requests never send a body first
                ttfb.add_metric(
                    labels, series.ttfb.family_buckets(TTFB_BUCKETS_S), series.ttfb.sum_s
                )
        failed = CounterMetricFamily(
            "berth_proxy_errors",
            "Requests that failed, by reason (also counted in berth_proxy_requests_total).",
            labels=(*_STATUS_LABELS, "reason"),
        )
        for (target, klass, reason), count in errors:
            failed.add_metric([*target, klass, reason], count)
        retried = CounterMetricFamily(
            "berth_proxy_retries",
            "Attempts that did not serve their request, which went on to another deployment, "
            "by the deployment left and why.",
            labels=(*_TARGET_LABELS, "reason"),
        )
        for (target, reason), count in retries:
            retried.add_metric([*target, reason], count)
        in_flight = GaugeMetricFamily(
            "berth_proxy_in_flight_requests",
            "Requests the proxy is relaying right now.",
            labels=_TARGET_LABELS,
        )
        prompt = CounterMetricFamily(
            "berth_proxy_prompt_tokens",
            "Prompt (input) tokens the engines reported in usage.",
            labels=_TARGET_LABELS,
        )
        completion = CounterMetricFamily(
            "berth_proxy_completion_tokens",
            "Completion (output) tokens the engines reported in usage.",
            labels=_TARGET_LABELS,
        )
        for target, counts in targets:
            in_flight.add_metric(list(target), counts.in_flight)
            prompt.add_metric(list(target), counts.prompt_tokens)
            completion.add_metric(list(target), counts.completion_tokens)
        yield from (total, failed, retried, in_flight, duration, ttfb, prompt, completion)


class ProxyMetrics:
    """The proxy's request series and the deployment-state gauge, in their own registry.

    ``local_meter``, when given, also hears every request routed to a deployment on
    ``local_node``: for those the leader's proxy is where the request is served, so it is
    measured here the way an agent measures the requests it relays (``docs/metrics.md``).
    Every series of a deployment that stopped or failed goes ``linger_s`` seconds after it
    ended (on ``clock``, monotonic seconds), once no request is in flight on it.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        local_meter: RequestMeter | None = None,
        local_node: str = "local",
        linger_s: float = LINGER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if linger_s < 0:
            raise ValueError("linger_s must not be negative")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._local_meter = local_meter
        self._local_node = local_node
        self._linger_s = linger_s
        self._clock = clock
        self._requests: dict[tuple[Target, str], _RequestSeries] = {}
        self._targets: dict[Target, _TargetSeries] = {}
        self._errors: dict[tuple[Target, str, str], int] = {}
        self._retries: dict[tuple[Target, str], int] = {}
        self._deployments: dict[str, tuple[str, str]] = {}
        #: when each stopped or failed deployment ended, on ``clock``
        self._ended: dict[str, float] = {}
        self.registry.register(_RequestCollector(self))
        self.deployment_state = Gauge(
            "berth_deployment_state",
            "1 for the deployment's current state, 0 for the others.",
            ("deployment", "model", "node", "state"),
            registry=self.registry,
        )
        self.deployment_restarts = Counter(
            "berth_deployment_restarts_total",
            "Engines the restart policy started again, by how the engine had ended.",
            ("deployment", "model", "node", "reason"),
            registry=self.registry,
        )
        #: the reason labels each deployment's restart series has
        self._restart_reasons: dict[str, set[str]] = {}
        self.routing_decisions = Counter(
            "berth_routing_decisions_total",
            "Requests routed among two or more deployments, by the routing policy and its "
            "outcome (matched, overridden_by_load, no_match, affinity, least_loaded).",
            ("policy", "outcome"),
            registry=self.registry,
        )

    def routing_decided(self, policy: str, outcome: str) -> None:
        """The router chose among two or more deployments (``berth.routing.router``)."""
        self.routing_decisions.labels(policy, outcome).inc()

    # -- requests ---------------------------------------------------------------------------

    def request_started(self, target: Target) -> None:
        """A request was routed to ``target`` and is now in flight."""
        series = self._targets.get(target)
        if series is None:
            series = self._targets[target] = _TargetSeries()
        series.in_flight += 1
        if self._local_meter is not None and target.node == self._local_node:
            self._local_meter.started(target.deployment)

    def request_moved(self, old: Target, new: Target) -> None:
        """A request started on ``old`` is being served by ``new`` after a retry."""
        if old == new:
            return
        series = self._targets.get(old)
        if series is not None and series.in_flight > 0:
            series.in_flight -= 1
        if self._local_meter is not None and old.node == self._local_node:
            self._local_meter.withdrawn(old.deployment)
        self.request_started(new)

    def request_retried(self, target: Target, reason: str) -> None:
        """An attempt at ``target`` did not serve its request, which went on to another
        deployment; ``reason`` is why (an error code such as ``first_byte_timeout``, or
        ``status 503``: from the proxy's closed set, never the client's text)."""
        key = (target, reason)
        self._retries[key] = self._retries.get(key, 0) + 1

    def request_finished(
        self,
        target: Target,
        *,
        status: int,
        duration_s: float,
        ttfb_s: float | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        error_reason: str | None = None,
    ) -> None:
        """A request started with :meth:`request_started` ended.

        ``status`` is the HTTP status sent to the client (499 when it left before one was
        sent), ``duration_s`` and ``ttfb_s`` are seconds (``ttfb_s`` is ``None`` when no body
        byte was sent), the token counts come from the engine's usage report, and
        ``error_reason`` names what went wrong, if anything.
        """
        series = self._targets[target]
        series.in_flight -= 1
        series.prompt_tokens += prompt_tokens
        series.completion_tokens += completion_tokens
        self._observe(target, status, duration_s, ttfb_s, error_reason)
        if self._ended and target.deployment in self._ended:
            # The last request of a stopped deployment: its count, too, must be scraped.
            self._ended[target.deployment] = self._clock()
        if self._local_meter is not None and target.node == self._local_node:
            failed = error_reason in _BROKEN_EXCHANGE
            self._local_meter.finished(
                target.deployment,
                latency_ms=duration_s * 1000.0,
                error=is_error(status, failed=failed),
            )

    def request_rejected(
        self, *, model: str, status: int, duration_s: float, error_reason: str
    ) -> None:
        """A request was answered before any deployment was chosen (bad input, no model).

        ``model`` must be a name berth serves, or ``""``: never a name taken from the request
        unchecked.
        """
        self._observe(Target(model, "", ""), status, duration_s, None, error_reason)

    def _observe(
        self,
        target: Target,
        status: int,
        duration_s: float,
        ttfb_s: float | None,
        error_reason: str | None,
    ) -> None:
        klass = _STATUS_CLASSES.get(status) or status_class(status)
        key = (target, klass)
        series = self._requests.get(key)
        if series is None:
            series = self._requests[key] = _RequestSeries()
        series.requests += 1
        histogram = series.duration
        histogram.counts[bisect_left(LATENCY_BUCKETS_S, duration_s)] += 1
        histogram.sum_s += duration_s
        if ttfb_s is not None:
            histogram = series.ttfb
            histogram.counts[bisect_left(TTFB_BUCKETS_S, ttfb_s)] += 1
            histogram.sum_s += ttfb_s
        if error_reason is not None:
            error_key = (target, klass, error_reason)
            self._errors[error_key] = self._errors.get(error_key, 0) + 1

    def request_totals(self) -> list[TargetTotals]:
        """Every target's running totals now (the request history samples them; see
        :class:`TargetTotals`).  Series dropped after their linger are not listed."""
        totals: dict[Target, list[int]] = {}
        ttfb: dict[Target, list[int]] = {}
        width = len(TTFB_BUCKETS_S) + 1
        for (target, _klass), series in list(self._requests.items()):
            row = totals.setdefault(target, [0, 0, 0, 0])
            row[0] += series.requests
            counts = ttfb.setdefault(target, [0] * width)
            for index, count in enumerate(series.ttfb.counts):
                counts[index] += count
        for (target, _klass, _reason), count in list(self._errors.items()):
            totals.setdefault(target, [0, 0, 0, 0])[1] += count
        for target, series_ in list(self._targets.items()):
            row = totals.setdefault(target, [0, 0, 0, 0])
            row[2] += series_.prompt_tokens
            row[3] += series_.completion_tokens
        return [
            TargetTotals(
                target, row[0], row[1], row[2], row[3], tuple(ttfb.get(target, [0] * width))
            )
            for target, row in totals.items()
        ]

    def in_flight(self) -> int:
        """Requests the proxy is relaying right now, over every target."""
        return sum(series.in_flight for series in list(self._targets.values()))

    # -- deployments ------------------------------------------------------------------------

    def set_deployment_state(
        self, deployment: str, *, model: str, node: str, state: DeploymentState
    ) -> None:
        """Record ``state`` as the deployment's current one (1) and every other state as 0.

        A terminal state (``stopped``, ``failed``) starts the deployment's linger: all its
        series go ``linger_s`` later. ``model`` is written with its unprintable characters
        escaped (:func:`berth.humanize.printable`): the text format escapes only ``\\``,
        ``"`` and newline in a label, and a name stored before the admin API checked names
        may hold a CR.
        """
        model = printable(model)
        self.expire()
        previous = self._deployments.get(deployment)
        if previous is not None and previous != (model, node):
            self._remove_state_series(deployment)
        self._deployments[deployment] = (model, node)
        for candidate in DeploymentState:
            value = 1.0 if candidate is state else 0.0
            self.deployment_state.labels(deployment, model, node, candidate.value).set(value)
        if state in TERMINAL_STATES:
            self._ended.setdefault(deployment, self._clock())

    def deployment_restarted(self, deployment: str, *, model: str, node: str, reason: str) -> None:
        """The restart policy started the deployment's engine again; ``reason`` is how it
        had ended (:data:`berth.deployments.restarts.EndCause`).  The series go with the
        deployment's state series."""
        self.deployment_restarts.labels(deployment, printable(model), node, reason).inc()
        self._restart_reasons.setdefault(deployment, set()).add(reason)

    def restore(self, records: Iterable[DeploymentRecord]) -> None:
        """Record the state of each deployment in ``records`` (the store's, read when the
        leader starts) that is not stopped or failed, with the labels it had before: its
        series, and the model label of the cluster series, continue across a restart."""
        for record in records:
            if record.state not in TERMINAL_STATES:
                self.set_deployment_state(
                    record.id,
                    model=record.served_model_name,
                    node=record.node_id,
                    state=record.state,
                )

    def expire(self) -> None:
        """Drop every series of the deployments that ended, and finished their last request,
        at least ``linger_s`` ago (called before each scrape and state change)."""
        if not self._ended:
            return
        horizon = self._clock() - self._linger_s
        due = {d for d, at in list(self._ended.items()) if at <= horizon}
        if not due:
            return
        busy = {t.deployment for t, s in list(self._targets.items()) if s.in_flight > 0}
        for deployment in due - busy:
            self._ended.pop(deployment, None)
            self._remove_state_series(deployment)
            for target in [t for t in list(self._targets) if t.deployment == deployment]:
                self._targets.pop(target, None)
            for key in [k for k in list(self._requests) if k[0].deployment == deployment]:
                self._requests.pop(key, None)
            for error in [k for k in list(self._errors) if k[0].deployment == deployment]:
                self._errors.pop(error, None)
            for retry in [k for k in list(self._retries) if k[0].deployment == deployment]:
                self._retries.pop(retry, None)

    def _remove_state_series(self, deployment: str) -> None:
        labels = self._deployments.pop(deployment, None)
        if labels is None:
            return
        model, node = labels
        for candidate in DeploymentState:
            self.deployment_state.remove(deployment, model, node, candidate.value)
        for reason in self._restart_reasons.pop(deployment, ()):
            self.deployment_restarts.remove(deployment, model, node, reason)

    def deployment_model(self, deployment: str) -> str | None:
        """The model label of a deployment whose state was recorded, else ``None``."""
        labels = self._deployments.get(deployment)
        return labels[0] if labels is not None else None

    # -- exposition -------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The registry in the Prometheus text format: ``(body, content type)`` for /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = [
    "LATENCY_BUCKETS_S",
    "TTFB_BUCKETS_S",
    "ProxyMetrics",
    "Target",
    "TargetTotals",
    "status_class",
]
