"""Whether berth traces, and where to: the ``[tracing]`` settings and the standard
``OTEL_*`` environment variables resolved into one :class:`TracingConfig` (pure: no
OpenTelemetry import, no I/O; :mod:`berth.observability.tracing` builds the exporter from it).

Each value comes from berth's own setting when it is set (flag, ``BERTH_TRACING_*``,
``config.toml``), else from the variable the OpenTelemetry specification names for it
(*OpenTelemetry Environment Variable Specification* and *OTLP Exporter Configuration*):

================  ===========================  ==================================================
what              berth setting                else
================  ===========================  ==================================================
collector         ``tracing_endpoint`` (base)  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (as is),
                                               ``OTEL_EXPORTER_OTLP_ENDPOINT`` (base)
export headers    ``tracing_headers``          ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``,
                                               ``OTEL_EXPORTER_OTLP_HEADERS``
sampler           ``tracing_sample_ratio``     ``OTEL_TRACES_SAMPLER`` and
                  (parent-based ratio)         ``OTEL_TRACES_SAMPLER_ARG``; default
                                               ``parentbased_always_on``
service name      (none)                       ``OTEL_SERVICE_NAME``, else ``berth-leader`` or
                                               ``berth-agent``
================  ===========================  ==================================================

Tracing is off (:func:`tracing_config` returns ``None``) when no collector is named, when
``OTEL_SDK_DISABLED`` is true, or when ``OTEL_TRACES_EXPORTER`` is ``none``. The SDK itself
reads what berth does not pass (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_SCHEDULE_DELAY``,
``OTEL_EXPORTER_OTLP_TIMEOUT``, ``OTEL_EXPORTER_OTLP_COMPRESSION``, the span limits).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import unquote

from berth.config import Settings
from berth.errors import ConfigError

__all__ = ["SamplerName", "TracingConfig", "parse_headers", "tracing_config"]

#: The samplers ``OTEL_TRACES_SAMPLER`` may name (the specification's built-in ones).
SamplerName = Literal[
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
]
_SAMPLERS: frozenset[str] = frozenset(SamplerName.__args__)  # type: ignore[attr-defined]
#: The OTLP/HTTP path of traces under a collector's base URL (OTLP specification).
TRACES_PATH = "/v1/traces"
_TRUE = frozenset({"true", "1", "yes", "on"})


@dataclass(frozen=True)
class TracingConfig:
    """How to trace: export to ``endpoint`` (the full ``.../v1/traces`` URL) with
    ``headers``; sample new traces with ``sampler`` at ``ratio`` (0..1; the ratio samplers
    only); hold at most ``queue_spans`` ended spans for export; name the process
    ``service_name`` unless ``OTEL_SERVICE_NAME`` is given (``None`` then: the SDK reads it)."""

    endpoint: str
    headers: Mapping[str, str] = field(default_factory=dict)
    sampler: SamplerName = "parentbased_traceidratio"
    ratio: float = 1.0
    queue_spans: int = 2048
    service_name: str | None = "berth-leader"


def parse_headers(text: str, where: str) -> dict[str, str]:
    """``key=value,key2=value2`` (values percent-decoded, as the OTLP exporter
    specification says) to a mapping with lower-case keys; :class:`ConfigError` naming
    ``where`` for a pair without ``=`` or a key."""
    headers: dict[str, str] = {}
    for pair in text.split(","):
        if not pair.strip():
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{where}: expected key=value pairs separated by commas")
        headers[key.strip().lower()] = unquote(value.strip())
    return headers


def _endpoint(settings: Settings, env: Mapping[str, str]) -> str | None:
    base = settings.tracing_endpoint
    if base is None:
        exact = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        if exact:
            return exact
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or None
    if base is None:
        return None
    base = base.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def _sampler(settings: Settings, env: Mapping[str, str]) -> tuple[SamplerName, float]:
    if settings.tracing_sample_ratio is not None:
        return "parentbased_traceidratio", settings.tracing_sample_ratio
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if name not in _SAMPLERS:
        shown = ", ".join(sorted(_SAMPLERS))
        raise ConfigError(f"OTEL_TRACES_SAMPLER={name!r} is not one of {shown}")
    sampler: SamplerName = name  # type: ignore[assignment]
    arg = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    ratio = 1.0
    if arg and sampler.endswith("traceidratio"):
        try:
            ratio = float(arg)
        except ValueError:
            raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a number") from None
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} must be from 0 to 1")
    return sampler, ratio


def tracing_config(
    settings: Settings, env: Mapping[str, str], *, service_name: str
) -> TracingConfig | None:
    """The tracing of a process named ``service_name`` (``berth-leader``, ``berth-agent``)
    from ``settings`` and the environment ``env``, or ``None`` when tracing is off.

    Raises :class:`ConfigError` for a malformed ``OTEL_EXPORTER_OTLP_*HEADERS``, an
    unknown ``OTEL_TRACES_SAMPLER`` or an ``OTEL_TRACES_SAMPLER_ARG`` that is no ratio
    (berth's own settings are checked when they are read).
    """
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return None
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    endpoint = _endpoint(settings, env)
    if endpoint is None:
        return None
    if settings.tracing_headers is not None:
        headers = parse_headers(settings.tracing_headers, "tracing_headers")
    else:
        name = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
        if name not in env:
            name = "OTEL_EXPORTER_OTLP_HEADERS"
        headers = parse_headers(env.get(name, ""), name)
    sampler, ratio = _sampler(settings, env)
    return TracingConfig(
        endpoint=endpoint,
        headers=headers,
        sampler=sampler,
        ratio=ratio,
        queue_spans=settings.tracing_queue_spans,
        service_name=None if env.get("OTEL_SERVICE_NAME", "").strip() else service_name,
    )
