"""Prometheus series of usage per key, read from admission's counters at scrape time.

The request path adds nothing to a Prometheus metric: :class:`UsageCollector` builds the
series when ``/metrics`` is scraped, from the usage ledger's totals since the leader started
and the refusal counts. Keys are named by their ``name`` (never by secret, prefix or hash);
keys sharing a name share their series, and requests over the Unix socket are
``key="socket:cli"`` or ``key="socket:desk"`` (:class:`~berth.admission.socket.SocketCaller`).

=========================================  ===========================================
``berth_key_requests_total{key,model}``    requests answered by an engine
``berth_key_errors_total{key,model}``      of those, answered with an error or broken off
``berth_key_tokens_total{key,model,kind}`` tokens, ``kind`` ``prompt`` or ``completion``
``berth_key_refusals_total{key,reason}``   requests refused by a limit (``reason`` is the
                                           error ``code``, e.g. ``rpm_exceeded``)
=========================================  ===========================================

:class:`QueueCollector` does the same for the fair admission queue
(:class:`~berth.admission.gate.SlotGate`):

================================================  ====================================
``berth_admission_queue_depth{model}``            requests waiting for a slot now
``berth_admission_queue_wait_seconds{model}``     histogram: how long the requests
                                                  that waited waited for their slot
``berth_admission_queue_dropped_total{model,      requests that left the queue without
reason}``                                         a slot: ``queue_full``,
                                                  ``queue_timeout``, ``client_left``
================================================  ====================================
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from berth.admission.gate import WAIT_BUCKETS_S, SlotGate
from berth.admission.quotas import Admission


class UsageCollector(Collector):
    """Yields the per-key series of ``admission`` (see the module doc); register it on the
    leader's registry."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        admission = self._admission
        name_of = admission.name_of
        counts: dict[tuple[str, str], list[int]] = {}
        for key_id, model, (requests, errors, prompt, completion) in admission.ledger.totals():
            into = counts.setdefault((name_of(key_id), model), [0, 0, 0, 0])
            into[0] += requests
            into[1] += errors
            into[2] += prompt
            into[3] += completion
        requests_total = CounterMetricFamily(
            "berth_key_requests",
            "Requests an engine answered, per key and model",
            labels=["key", "model"],
        )
        errors_total = CounterMetricFamily(
            "berth_key_errors",
            "Requests answered with an error or broken off, per key and model",
            labels=["key", "model"],
        )
        tokens_total = CounterMetricFamily(
            "berth_key_tokens",
            "Tokens per key and model (kind: prompt or completion)",
            labels=["key", "model", "kind"],
        )
        for (key, model), (requests, errors, prompt, completion) in sorted(counts.items()):
            requests_total.add_metric([key, model], requests)
            errors_total.add_metric([key, model], errors)
            tokens_total.add_metric([key, model, "prompt"], prompt)
            tokens_total.add_metric([key, model, "completion"], completion)
        refusals: dict[tuple[str, str], int] = {}
        for (key_id, code), count in admission.refusals.items():
            pair = (name_of(key_id), code)
            refusals[pair] = refusals.get(pair, 0) + count
        refusals_total = CounterMetricFamily(
            "berth_key_refusals",
            "Requests refused by a key's limits (reason: the error code)",
            labels=["key", "reason"],
        )
        for (key, reason), count in sorted(refusals.items()):
            refusals_total.add_metric([key, reason], count)
        yield requests_total
        yield errors_total
        yield tokens_total
        yield refusals_total


class QueueCollector(Collector):
    """Yields the fair admission queue's series of ``gate`` (see the module doc)."""

    def __init__(self, gate: SlotGate) -> None:
        self._gate = gate

    def collect(self) -> Iterator[Metric]:
        gate = self._gate
        depth = GaugeMetricFamily(
            "berth_admission_queue_depth",
            "Requests waiting at the leader for a slot of one of the model's deployments",
            labels=["model"],
        )
        for model, count in sorted(gate.scheduler.waiting_by_model()):
            depth.add_metric([model], count)
        waits = HistogramMetricFamily(
            "berth_admission_queue_wait_seconds",
            "Seconds the requests that waited for a slot waited",
            labels=["model"],
        )
        stats = gate.stats
        bounds = [f"{bound:g}" for bound in WAIT_BUCKETS_S] + ["+Inf"]
        for model, counts in sorted(stats.waits.items()):
            cumulative = list(accumulate(counts))
            waits.add_metric(
                [model],
                list(zip(bounds, cumulative, strict=True)),
                sum_value=stats.wait_sum_s.get(model, 0.0),
            )
        dropped = CounterMetricFamily(
            "berth_admission_queue_dropped",
            "Requests that left the admission queue without a slot (reason: queue_full, "
            "queue_timeout, client_left)",
            labels=["model", "reason"],
        )
        for (model, reason), count in sorted(stats.dropped.items()):
            dropped.add_metric([model, reason], count)
        yield depth
        yield waits
        yield dropped
