"""Prometheus series of usage per key, read from admission's counters at scrape time.

The request path adds nothing to a Prometheus metric: :class:`UsageCollector` builds the
series when ``/metrics`` is scraped, from the usage ledger's totals since the leader started
and the refusal counts. Keys are named by their ``name`` (never by secret, prefix or hash);
keys sharing a name share their series, and requests over the Unix socket are
``key="(socket)"``.

=========================================  ===========================================
``berth_key_requests_total{key,model}``    requests answered by an engine
``berth_key_errors_total{key,model}``      of those, answered with an error or broken off
``berth_key_tokens_total{key,model,kind}`` tokens, ``kind`` ``prompt`` or ``completion``
``berth_key_refusals_total{key,reason}``   requests refused by a limit (``reason`` is the
                                           error ``code``, e.g. ``rpm_exceeded``)
=========================================  ===========================================
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

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
