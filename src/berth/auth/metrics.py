"""Prometheus series of API-key authentication, read from the authenticator's counts at
scrape time (:class:`~berth.auth.authenticator.AuthCounts`; the request path adds nothing to a
metric).

================================================  ==========================================
``berth_auth_key_reads_total``                    API-key reads from the store (background
                                                  reads ahead of a cache entry's end too)
``berth_auth_refusals_total{reason}``             requests refused: ``invalid`` (the store
                                                  did not know the secret),
                                                  ``cached_invalid`` (remembered invalid, no
                                                  read), ``rate_limited`` (429, no read)
``berth_auth_key_read_waits_total{why}``          requests that waited for a key read:
                                                  ``new`` (not cached here), ``changed``
                                                  (changed since it was), ``stale`` (unread
                                                  past ``MAX_STALE_S``)
================================================  ==========================================
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from berth.auth.authenticator import AuthCounts


class AuthCollector(Collector):
    """Yields the series of the module doc from ``counts``; register it on the leader's
    registry."""

    def __init__(self, counts: AuthCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts
        reads = CounterMetricFamily(
            "berth_auth_key_reads", "API-key reads from the store", value=counts.key_reads
        )
        refusals = CounterMetricFamily(
            "berth_auth_refusals",
            "Requests refused by API-key authentication, by reason",
            labels=["reason"],
        )
        refusals.add_metric(["invalid"], counts.invalid)
        refusals.add_metric(["cached_invalid"], counts.cached_invalid)
        refusals.add_metric(["rate_limited"], counts.rate_limited)
        waits = CounterMetricFamily(
            "berth_auth_key_read_waits",
            "Requests that waited for an API-key read from the store, by why",
            labels=["why"],
        )
        for why in ("new", "changed", "stale"):
            waits.add_metric([why], counts.waits.get(why, 0))
        yield reads
        yield refusals
        yield waits
