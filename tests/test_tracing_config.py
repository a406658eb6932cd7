"""Whether and where berth traces (the ``[tracing]`` settings over the ``OTEL_*`` variables),
the span export's bound with its counted drops in ``/metrics``, and that a process that does
not trace never loads the OpenTelemetry SDK."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, generate_latest

from berth.config import Settings
from berth.errors import ConfigError
from berth.observability.span_export import (
    BoundedSpanProcessor,
    CountingExporter,
    SpanExportCollector,
)
from berth.observability.tracing_config import TracingConfig, tracing_config
from berth.observability.tracing_setup import open_tracing
from berth.paths import BerthHome

ROOT = Path(__file__).resolve().parents[1]


def _settings(tmp_path: Path, **env: str) -> Settings:
    return Settings.load(BerthHome(tmp_path), env=env)


def _config(tmp_path: Path, **env: str) -> TracingConfig | None:
    return tracing_config(_settings(tmp_path, **env), env, service_name="berth-leader")


def test_tracing_is_off_by_default(tmp_path: Path) -> None:
    assert _config(tmp_path) is None
    assert open_tracing(_settings(tmp_path), {}, service_name="berth-leader") is None


@pytest.mark.parametrize(
    ("env", "endpoint"),
    [
        ({"BERTH_TRACING_ENDPOINT": "http://collector:4318"}, "http://collector:4318/v1/traces"),
        ({"BERTH_TRACING_ENDPOINT": "http://c:4318/v1/traces/"}, "http://c:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://otel.example.com"},
         "https://otel.example.com/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom",
          "OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4318"}, "http://c:4318/custom"),
        ({"BERTH_TRACING_ENDPOINT": "http://mine:4318",
          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://theirs:4318/v1/traces"},
         "http://mine:4318/v1/traces"),
    ],
    ids=["setting", "setting-with-path", "otel-base", "otel-traces-first", "setting-wins"],
)  # fmt: skip
def test_the_collector_comes_from_the_setting_else_the_otel_variables(
    tmp_path: Path, env: dict[str, str], endpoint: str
) -> None:
    config = _config(tmp_path, **env)
    assert config is not None and config.endpoint == endpoint


@pytest.mark.parametrize(
    "off", [{"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}], ids=str
)
def test_the_sdk_s_own_off_switches_turn_it_off(tmp_path: Path, off: dict[str, str]) -> None:
    assert _config(tmp_path, BERTH_TRACING_ENDPOINT="http://c:4318", **off) is None


@pytest.mark.parametrize(
    ("env", "sampler", "ratio"),
    [
        ({}, "parentbased_always_on", 1.0),
        ({"BERTH_TRACING_SAMPLE_RATIO": "0.25"}, "parentbased_traceidratio", 0.25),
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
         "parentbased_traceidratio", 0.1),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, "always_off", 1.0),
        ({"BERTH_TRACING_SAMPLE_RATIO": "0.5", "OTEL_TRACES_SAMPLER": "always_off"},
         "parentbased_traceidratio", 0.5),
    ],
    ids=["default", "setting", "otel", "otel-off", "setting-wins"],
)  # fmt: skip
def test_the_sampler_comes_from_the_ratio_setting_else_the_otel_variables(
    tmp_path: Path, env: dict[str, str], sampler: str, ratio: float
) -> None:
    config = _config(tmp_path, BERTH_TRACING_ENDPOINT="http://c:4318", **env)
    assert config is not None and (config.sampler, config.ratio) == (sampler, ratio)


def test_export_headers_come_from_the_setting_else_the_otel_variable(tmp_path: Path) -> None:
    on = {"BERTH_TRACING_ENDPOINT": "http://c:4318"}
    config = _config(tmp_path, **on, OTEL_EXPORTER_OTLP_HEADERS="Authorization=Bearer%20t,x-a=1")
    assert config is not None and config.headers == {"authorization": "Bearer t", "x-a": "1"}
    config = _config(
        tmp_path, **on, BERTH_TRACING_HEADERS="x-b=2", OTEL_EXPORTER_OTLP_HEADERS="a=1"
    )
    assert config is not None and config.headers == {"x-b": "2"}
    # berth config show names the headers, never their values
    (row,) = [r for r in _settings(tmp_path, BERTH_TRACING_HEADERS="x-b=2").rows()
              if r.name == "tracing_headers"]  # fmt: skip
    assert row.value == "x-b=***"


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER='sometimes' is not one of"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
         "must be from 0 to 1"),
        ({"OTEL_EXPORTER_OTLP_HEADERS": "no-equals-sign"}, "OTEL_EXPORTER_OTLP_HEADERS: expected"),
    ],
    ids=["sampler", "ratio", "headers"],
)  # fmt: skip
def test_a_malformed_otel_variable_is_refused_naming_it(
    tmp_path: Path, env: dict[str, str], said: str
) -> None:
    with pytest.raises(ConfigError, match=said):
        _config(tmp_path, BERTH_TRACING_ENDPOINT="http://c:4318", **env)


def test_a_malformed_tracing_setting_is_refused_when_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="BERTH_TRACING_ENDPOINT"):
        _settings(tmp_path, BERTH_TRACING_ENDPOINT="collector:4318")
    with pytest.raises(ConfigError, match="BERTH_TRACING_SAMPLE_RATIO"):
        _settings(tmp_path, BERTH_TRACING_SAMPLE_RATIO="1.5")


# -- the export's bound ---------------------------------------------------------------------


class HeldProcessor(SpanProcessor):
    """A batch processor whose exporter has taken nothing yet: every span stays held."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


class NoExporter(SpanExporter):
    def export(self, spans: object) -> SpanExportResult:
        return SpanExportResult.FAILURE


def test_spans_past_the_bound_are_dropped_at_once_and_counted_in_metrics() -> None:
    held = HeldProcessor()
    counting = CountingExporter(NoExporter())
    bounded = BoundedSpanProcessor(held, counting, max_spans=3)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(bounded)
    tracer = provider.get_tracer("test")
    for index in range(5):
        tracer.start_span(f"s{index}").end()
    assert [span.name for span in held.spans] == ["s0", "s1", "s2"]
    # The exporter takes (and fails to send) the three: room for more.
    counting.export(held.spans)
    tracer.start_span("s5").end()
    registry = CollectorRegistry()
    registry.register(SpanExportCollector(bounded, counting))
    text = generate_latest(registry).decode()
    assert "berth_tracing_spans_dropped_total 2.0" in text
    assert "berth_tracing_spans_exported_total 3.0" in text
    assert "berth_tracing_spans_export_failed_total 3.0" in text
    assert "berth_tracing_spans_queued 1.0" in text
    assert [span.name for span in held.spans][-1] == "s5"


def test_a_process_that_does_not_trace_never_loads_the_sdk() -> None:
    code = (
        "import sys, berth.gateway.proxy, berth.agent.service, berth.agent.runner, "
        "berth.daemon.server\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk') "
        "or m == 'berth.observability.tracing')\n"
        "print(loaded)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "src")},
    )
    assert done.stdout.strip() == "[]"
