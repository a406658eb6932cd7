"""The LoRA adapters' series: which adapter is loaded where, and the loads and unloads.

Requests for an adapter are counted by the proxy's own series with the adapter as the
``model`` label (the name the client asked for); these series carry the base model as
``base``, so a query can group an adapter's traffic by its base (``docs/metrics.md``)::

    berth_adapter_requests_total{adapter, base, node}           attempts sent with the adapter
    berth_adapter_loaded{adapter, base, deployment, node}        1 while loaded (series gone after)
    berth_adapter_loads_total{adapter, base, node, outcome}      outcome: loaded | failed
    berth_adapter_unloads_total{adapter, base, node}             unloaded to free a slot
"""

from __future__ import annotations

import contextlib
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge

LoadOutcome = Literal["loaded", "failed"]


class AdapterMetrics:
    """The adapter series, registered in ``registry`` (the proxy's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "berth_adapter_requests",
            "Attempts sent to an engine with the LoRA adapter (a retry elsewhere counts again).",
            ("adapter", "base", "node"),
            registry=registry,
        )
        self.loaded = Gauge(
            "berth_adapter_loaded",
            "1 while the LoRA adapter is loaded in the deployment's engine.",
            ("adapter", "base", "deployment", "node"),
            registry=registry,
        )
        self.loads = Counter(
            "berth_adapter_loads",
            "LoRA adapter loads asked of engines, by outcome.",
            ("adapter", "base", "node", "outcome"),
            registry=registry,
        )
        self.unloads = Counter(
            "berth_adapter_unloads",
            "LoRA adapters unloaded from an engine to free a slot for another.",
            ("adapter", "base", "node"),
            registry=registry,
        )

    def request_sent(self, adapter: str, base: str, node: str) -> None:
        self.requests.labels(adapter, base, node).inc()

    def load_finished(
        self, adapter: str, base: str, deployment: str, node: str, outcome: LoadOutcome
    ) -> None:
        self.loads.labels(adapter, base, node, outcome).inc()
        if outcome == "loaded":
            self.loaded.labels(adapter, base, deployment, node).set(1)

    def unloaded(self, adapter: str, base: str, deployment: str, node: str) -> None:
        self.unloads.labels(adapter, base, node).inc()
        self.forget(adapter, base, deployment, node)

    def forget(self, adapter: str, base: str, deployment: str, node: str) -> None:
        """The adapter is no longer in that engine (unloaded, or the deployment ended)."""
        with contextlib.suppress(KeyError):  # never loaded, or already gone
            self.loaded.remove(adapter, base, deployment, node)
