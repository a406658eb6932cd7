"""Prometheus series of the OpenAI proxy and of deployment states.

:class:`ProxyMetrics` owns a private :class:`prometheus_client.CollectorRegistry` (never the
global one, so several apps and tests can live in one process). Every series is named
``berth_*``; ``docs/metrics.md`` lists them with their labels and meaning.

Label values are bounded on purpose: ``model`` is a public model name berth serves (or ``""``
when a request named no known model, so clients cannot create series at will), ``deployment``
and ``node`` are ids, ``status_class`` is ``1xx`` .. ``5xx`` and ``reason`` comes from the
closed set the proxy uses (see ``docs/metrics.md``).

The proxy calls :meth:`ProxyMetrics.request_started` and :meth:`ProxyMetrics.request_finished`
once per request; labelled children are cached, so those calls cost a few dictionary look-ups
and lock-protected increments.
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from berth.daemon.states import DeploymentState

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


class _RequestChildren:
    __slots__ = ("duration", "requests", "ttfb")

    def __init__(self, metrics: ProxyMetrics, target: Target, klass: str) -> None:
        labels = (*target, klass)
        self.requests = metrics.requests.labels(*labels)
        self.duration = metrics.duration.labels(*labels)
        self.ttfb = metrics.ttfb.labels(*labels)


class _TargetChildren:
    __slots__ = ("completion_tokens", "in_flight", "prompt_tokens")

    def __init__(self, metrics: ProxyMetrics, target: Target) -> None:
        self.in_flight = metrics.in_flight.labels(*target)
        self.prompt_tokens = metrics.prompt_tokens.labels(*target)
        self.completion_tokens = metrics.completion_tokens.labels(*target)


class ProxyMetrics:
    """The proxy's request series and the deployment-state gauge, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        target = ("model", "deployment", "node")
        by_status = (*target, "status_class")
        r = self.registry
        self.requests = Counter(
            "berth_proxy_requests", "Requests answered by the OpenAI proxy.", by_status, registry=r
        )
        self.errors = Counter(
            "berth_proxy_errors",
            "Proxied requests that failed, by reason (also counted in requests).",
            (*by_status, "reason"),
            registry=r,
        )
        self.in_flight = Gauge(
            "berth_proxy_in_flight_requests",
            "Requests the proxy is relaying right now.",
            target,
            registry=r,
        )
        self.duration = Histogram(
            "berth_proxy_request_duration_seconds",
            "Time from the request's arrival to the last byte of the answer.",
            by_status,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttfb = Histogram(
            "berth_proxy_time_to_first_byte_seconds",
            "Time from the request's arrival to the first byte of the answer's body.",
            by_status,
            buckets=TTFB_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "berth_proxy_prompt_tokens",
            "Prompt (input) tokens the engines reported in usage.",
            target,
            registry=r,
        )
        self.completion_tokens = Counter(
            "berth_proxy_completion_tokens",
            "Completion (output) tokens the engines reported in usage.",
            target,
            registry=r,
        )
        self.deployment_state = Gauge(
            "berth_deployment_state",
            "1 for the deployment's current state, 0 for the others.",
            ("deployment", "model", "node", "state"),
            registry=r,
        )
        self._request_children: dict[tuple[Target, str], _RequestChildren] = {}
        self._target_children: dict[Target, _TargetChildren] = {}
        self._deployments: dict[str, tuple[str, str]] = {}

    # -- requests ---------------------------------------------------------------------------

    def request_started(self, target: Target) -> None:
        """A request was routed to ``target`` and is now in flight."""
        self._for_target(target).in_flight.inc()

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
        per_target = self._for_target(target)
        per_target.in_flight.dec()
        if prompt_tokens:
            per_target.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            per_target.completion_tokens.inc(completion_tokens)
        self._observe(target, status, duration_s, ttfb_s, error_reason)

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
        klass = status_class(status)
        children = self._request_children.get((target, klass))
        if children is None:
            children = _RequestChildren(self, target, klass)
            self._request_children[(target, klass)] = children
        children.requests.inc()
        children.duration.observe(duration_s)
        if ttfb_s is not None:
            children.ttfb.observe(ttfb_s)
        if error_reason is not None:
            self.errors.labels(*target, klass, error_reason).inc()

    def _for_target(self, target: Target) -> _TargetChildren:
        children = self._target_children.get(target)
        if children is None:
            children = _TargetChildren(self, target)
            self._target_children[target] = children
        return children

    # -- deployments ------------------------------------------------------------------------

    def set_deployment_state(
        self, deployment: str, *, model: str, node: str, state: DeploymentState
    ) -> None:
        """Record ``state`` as the deployment's current one (1) and every other state as 0."""
        previous = self._deployments.get(deployment)
        if previous is not None and previous != (model, node):
            self.remove_deployment(deployment)
        self._deployments[deployment] = (model, node)
        for candidate in DeploymentState:
            value = 1.0 if candidate is state else 0.0
            self.deployment_state.labels(deployment, model, node, candidate.value).set(value)

    def remove_deployment(self, deployment: str) -> None:
        """Drop the deployment's state series (when it is deleted from the store).

        Its request counters stay: they are totals a scrape may not have read yet.
        """
        labels = self._deployments.pop(deployment, None)
        if labels is None:
            return
        model, node = labels
        for candidate in DeploymentState:
            self.deployment_state.remove(deployment, model, node, candidate.value)

    # -- exposition -------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The registry in the Prometheus text format: ``(body, content type)`` for /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = [
    "LATENCY_BUCKETS_S",
    "TTFB_BUCKETS_S",
    "ProxyMetrics",
    "Target",
    "status_class",
]
