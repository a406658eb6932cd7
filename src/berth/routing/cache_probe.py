"""Reading the engines' own cache signals on the probe cycle (the I/O half of
:mod:`berth.routing.cache_signals`).

After each round of health probes (:meth:`berth.deployments.reconcile.Reconciler.watch`),
:meth:`CacheProbe.read_round` reads, for every ready deployment that the ``prefix`` policy
routes to and whose engine berth knows, llama.cpp's ``/slots`` or vLLM's or SGLang's
``/metrics`` through :class:`EngineGetter` (the proxy's engine client: directly for node
``local``, through the agent for the others, with the engine's key), all at once, each
bounded by ``timeout_s`` and :data:`MAX_SIGNAL_BYTES`, and hands each reading to
:meth:`berth.routing.router.Router.cache_reported`. A deployment under ``least-load``, or an
adopted endpoint, costs nothing. A reading that fails leaves the estimate as it was; it is
logged once per deployment until one succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from berth.routing.cache_signals import SIGNAL_PATHS, CacheSignal, parse_metrics, parse_slots
from berth.routing.errors import EngineSignalError
from berth.routing.resolver import Upstream
from berth.routing.router import Router

log = logging.getLogger(__name__)

#: The most bytes of one answer read: ``/slots`` is a few hundred bytes a slot, an engine's
#: ``/metrics`` tens of KiB (histograms per served model).
MAX_SIGNAL_BYTES = 1024 * 1024


class EngineGetter(Protocol):
    """``GET`` one path of a deployment's engine."""

    async def get(
        self, upstream: Upstream, path: str, *, limit_bytes: int, timeout_s: float
    ) -> bytes:
        """The body of ``GET path`` (at most ``limit_bytes``) when it answers 200 within
        ``timeout_s`` seconds. Raises :class:`EngineSignalError` otherwise (unreachable,
        slow, another status, a body over the limit)."""
        ...


class CacheProbe:
    """Reads the engines' cache signals into ``router`` through ``getter``."""

    def __init__(self, router: Router, getter: EngineGetter, *, timeout_s: float) -> None:
        self._router = router
        self._getter = getter
        self._timeout_s = timeout_s
        self._failing: set[str] = set()

    async def read_round(self, upstreams: Sequence[Upstream]) -> None:
        """Read every one of ``upstreams`` that has a signal worth reading (see the module
        docstring), at once; never raises for one engine's failure."""
        wanted = [u for u in upstreams if self._wanted(u)]
        self._failing &= {u.deployment_id for u in wanted}  # gone ones are forgotten
        if wanted:
            await asyncio.gather(*(self._read_one(u) for u in wanted))

    def _wanted(self, upstream: Upstream) -> bool:
        policy = upstream.routing_policy or self._router.policy
        return policy == "prefix" and upstream.engine in SIGNAL_PATHS

    async def _read_one(self, upstream: Upstream) -> None:
        deployment_id = upstream.deployment_id
        try:
            signal = await self.read(upstream)
        except EngineSignalError as exc:
            if deployment_id not in self._failing:
                self._failing.add(deployment_id)
                log.warning("deployment %s: no cache signal (%s)", deployment_id, exc.reason)
            return
        self._failing.discard(deployment_id)
        correction = self._router.cache_reported(deployment_id, signal)
        if correction.drop:
            log.info("deployment %s: prefix entries dropped: %s", deployment_id, correction.reason)

    async def read(self, upstream: Upstream) -> CacheSignal:
        """One reading of ``upstream``'s engine. Raises :class:`EngineSignalError` when it
        cannot be read or parsed, or berth does not know the engine."""
        engine = upstream.engine
        if engine not in SIGNAL_PATHS:
            raise EngineSignalError(
                "no cache signal for this engine", deployment_id=upstream.deployment_id
            )
        path, _source = SIGNAL_PATHS[engine]
        body = await self._getter.get(
            upstream, path, limit_bytes=MAX_SIGNAL_BYTES, timeout_s=self._timeout_s
        )
        try:
            if engine == "llamacpp":
                return parse_slots(body)
            return parse_metrics(
                "vllm" if engine == "vllm" else "sglang", body.decode("utf-8", "replace")
            )
        except EngineSignalError as exc:
            raise EngineSignalError(exc.reason, deployment_id=upstream.deployment_id) from exc
