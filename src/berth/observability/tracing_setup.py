"""Opening a process's tracing from its settings: :func:`open_tracing`, the one call the
leader's and the agent's wiring make. With tracing off it returns ``None`` without loading the
OpenTelemetry SDK (:mod:`berth.observability.tracing` is imported only when tracing is on)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from berth.config import Settings
from berth.observability.tracing_config import tracing_config

if TYPE_CHECKING:
    from berth.observability.tracing import Tracing

__all__ = ["open_tracing"]

log = logging.getLogger(__name__)


def open_tracing(
    settings: Settings,
    env: Mapping[str, str],
    *,
    service_name: str,
    registry: CollectorRegistry | None = None,
    attributes: Mapping[str, str] | None = None,
) -> Tracing | None:
    """The process's tracing (:func:`berth.observability.tracing.build_tracing`), with its
    series in ``registry`` when given, or ``None`` when it is off: then the OpenTelemetry
    SDK is not even imported. Raises what :func:`tracing_config` raises."""
    config = tracing_config(settings, env, service_name=service_name)
    if config is None:
        return None
    # Imported here so that a process that does not trace never loads the SDK.
    from berth.observability.tracing import build_tracing

    tracing = build_tracing(config, attributes=attributes)
    if registry is not None:
        registry.register(tracing.collector())
    log.info("tracing: spans to %s (%s, ratio %g)", config.endpoint, config.sampler, config.ratio)
    return tracing
