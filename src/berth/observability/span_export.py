"""Span export that never waits: a bound on the spans held for export, counted drops, and the
counts in ``/metrics``.

The SDK's :class:`~opentelemetry.sdk.trace.export.BatchSpanProcessor` already exports from
a thread of its own, in batches, over a bounded queue; but when that queue is full it drops
a span with only a log line (one per span, at warning), so nobody can count what was lost.
:class:`BoundedSpanProcessor` sits in front of it: it lets at most ``max_spans`` ended
spans be held (handed on, not yet taken by the exporter) and drops the rest itself,
counting them. The batch processor behind it is given a queue of the same size, so it never
drops one of its own. :class:`CountingExporter` sits behind it and counts the spans each
export takes (freeing room) and those an export failed to deliver.

Threads: ``on_end`` runs on the thread that ends a span (the event loop's), ``export`` on
the batch processor's worker (or a thread that flushes it, serialised with the worker by the
SDK's export lock). Each counter has one writer at a time, so none needs a lock of ours; a
reader (the scrape) sees each as it was at some instant.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["BoundedSpanProcessor", "CountingExporter", "SpanExportCollector"]


class CountingExporter(SpanExporter):
    """``exporter``, counting the spans handed to it (:attr:`taken`) and those whose export
    failed (:attr:`failed`)."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter
        self.taken = 0
        self.failed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.taken += len(spans)  # they left the queue: room for as many
        result = self._exporter.export(spans)
        if result is not SpanExportResult.SUCCESS:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class BoundedSpanProcessor(SpanProcessor):
    """Hands each sampled ended span on to ``inner`` (a batch processor exporting through
    ``counting``) while fewer than ``max_spans`` are held, else drops it and counts it in
    :attr:`dropped`. ``on_end`` does a subtraction and a comparison before handing on: it
    never blocks."""

    def __init__(self, inner: SpanProcessor, counting: CountingExporter, max_spans: int) -> None:
        if max_spans < 1:
            raise ValueError(f"max_spans must be at least 1, got {max_spans}")
        self._inner = inner
        self._counting = counting
        self._max_spans = max_spans
        self.accepted = 0
        self.dropped = 0

    @property
    def held(self) -> int:
        """Spans handed on and not yet taken by an export."""
        return self.accepted - self._counting.taken

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass  # the batch processor does nothing at a span's start either

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is None or not context.trace_flags.sampled:
            return
        if self.accepted - self._counting.taken >= self._max_spans:
            self.dropped += 1
            return
        self.accepted += 1
        self._inner.on_end(span)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class SpanExportCollector(Collector):
    """The tracing series of ``/metrics`` (docs/metrics.md), read from ``processor`` and
    ``exporter`` when scraped: ``berth_tracing_spans_dropped_total`` (the queue was full),
    ``berth_tracing_spans_exported_total`` (handed to the exporter),
    ``berth_tracing_spans_export_failed_total`` (an export that did not reach the
    collector) and ``berth_tracing_spans_queued`` (held for export now)."""

    def __init__(self, processor: BoundedSpanProcessor, exporter: CountingExporter) -> None:
        self._processor = processor
        self._exporter = exporter

    def describe(self) -> Iterable[Metric]:
        return list(self._families(0, 0, 0, 0))

    def collect(self) -> Iterable[Metric]:
        processor, exporter = self._processor, self._exporter
        return list(
            self._families(processor.dropped, exporter.taken, exporter.failed, processor.held)
        )

    @staticmethod
    def _families(dropped: int, taken: int, failed: int, held: int) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "berth_tracing_spans_dropped",
            "Ended spans dropped because the export queue was full",
            value=dropped,
        )
        yield CounterMetricFamily(
            "berth_tracing_spans_exported",
            "Spans handed to the OTLP exporter",
            value=taken,
        )
        yield CounterMetricFamily(
            "berth_tracing_spans_export_failed",
            "Spans whose export did not reach the collector",
            value=failed,
        )
        yield GaugeMetricFamily(
            "berth_tracing_spans_queued",
            "Ended spans held for export",
            value=max(0, held),
        )
