"""LoRA adapters on the leader: serving each under its own name, loading it where it is sent.

Three parts, one object (:class:`AdapterManager`) holding the state they share, all in
memory (the registry is re-read from the store when the admin API changes it, so a request
never touches the database):

- **the resolver** (:mod:`berth.gateway.adapter_resolver` wraps the proxy's resolver with
  :meth:`AdapterManager.upstreams`): a request for an adapter's name resolves to the ready
  deployments of its base, each tagged with the adapter and its tier (loaded, free slot,
  evict: :mod:`berth.routing.adapters`); a deployment that cannot take the adapter is left
  out, so neither the first attempt nor a retry goes there. ``/v1/models`` lists each
  adapter whose base is served, with the base as ``parent``.
- **the gate** (:meth:`AdapterManager.enter`): before an attempt, loads the adapter into the
  chosen engine when it lacks it, unloading the least recently used idle adapter first when
  the slots are full; the load is a link op (``load_adapter``), run on the deployment's
  node by its agent. Requests for one adapter on one engine share one load. The returned
  :class:`AdapterLease` counts the request as using the adapter until its answer is closed,
  so an adapter in use is never the one unloaded.
- **deployments**: fed every state change (:meth:`AdapterManager.deployment_changed`), it
  knows each active deployment's engine, slots and, for llama.cpp, its ``--lora`` order.

The engine is asked with the name it knows the adapter by: vLLM and SGLang load it under the
adapter's own name, so the request's ``model`` stays the adapter's; llama.cpp answers to any
``model`` and gets llama-server's per-request ``lora`` field (``[{"id": i, "scale": s}]``, ids
in ``--lora`` order) with the adapter at 1 and every other at 0, and a request for the
base model gets them all at 0: a request without the field gets the engine's global scales,
and ``--lora-init-without-apply`` leaves those at 1 in the llama-server berth ships.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.lora_plan import FORMAT_OF_ENGINE
from berth.engine_http.answer import EngineAnswer
from berth.errors import BerthError, NotFoundError
from berth.observability.adapters import AdapterMetrics
from berth.routing.adapters import AdapterSlots, AdapterTier, eviction_choice, rank_tiers
from berth.routing.errors import AdapterUnavailableError, NoReadyDeploymentError
from berth.routing.resolver import AdapterUse, Upstream
from berth.vocab.engines import EngineName, parse_engine_name
from berth.vocab.records import AdapterRecord, DeploymentRecord
from berth.vocab.states import RESTARTING_STATES

log = logging.getLogger(__name__)

#: What the proxy asks an engine (its engine request value), passed through the gate as is.
R = TypeVar("R")

#: The proxy's engine client's ``open``: (upstream, engine request) -> answer.
EngineOpener = Callable[[Upstream, R], Awaitable[EngineAnswer]]


@dataclass(frozen=True)
class AdapterEntry:
    """An adapter as the router needs it: its base, format and path per node id."""

    name: str
    base: str
    format: str
    locations: dict[str, str]


@dataclass
class _Engine:
    """What the leader knows of one active deployment's adapters."""

    deployment_id: str
    node_id: str
    engine: EngineName
    base: str
    #: the name its engine serves the base under (the ready table's key)
    served: str
    #: LoRA slots (vLLM, SGLang); ``None``: adapters given at start only (llama.cpp) or none
    slots: int | None
    #: llama.cpp: the adapters given with --lora, in order (their ids)
    lora_order: tuple[str, ...] = ()
    #: loaded adapters -> when each last served (monotonic seconds)
    loaded: dict[str, float] = field(default_factory=dict)
    #: loads in progress, shared by the requests that wait for them
    loading: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    in_flight: Counter[str] = field(default_factory=Counter)

    def view(self, adapter: AdapterEntry) -> AdapterSlots:
        if self.slots is None:
            return AdapterSlots(self.deployment_id, None, frozenset(self.lora_order))
        held = frozenset(self.loaded) | frozenset(self.loading)
        busy = frozenset(name for name, count in self.in_flight.items() if count > 0)
        return AdapterSlots(
            self.deployment_id,
            self.slots,
            held,
            busy | frozenset(self.loading),
            has_files=self.node_id in adapter.locations,
        )


class AdapterLease:
    """One request's use of an adapter on one engine; :meth:`release` once its answer is
    done (the gate's answer wrapper does it on close)."""

    def __init__(self, manager: AdapterManager, deployment_id: str, adapter: str) -> None:
        self._manager = manager
        self._deployment_id = deployment_id
        self._adapter = adapter
        self._released = False

    def release(self, status: int | None) -> None:
        """The request is over; ``status`` is the engine's answer (``None``: none came)."""
        if not self._released:
            self._released = True
            self._manager.released(self._deployment_id, self._adapter, status)


class LeasedAnswer:
    """An engine's answer that releases its adapter lease when closed (whoever closes it:
    the relay at the end, or the dispatcher when it retries elsewhere)."""

    def __init__(self, answer: EngineAnswer, lease: AdapterLease) -> None:
        self._answer = answer
        self._lease = lease
        self.status = answer.status
        self.headers = answer.headers
        self.content_length = answer.content_length

    def header(self, name: bytes) -> bytes | None:
        return self._answer.header(name)

    @property
    def at_eof(self) -> bool:
        return self._answer.at_eof

    async def read_chunk(self) -> bytes:
        return await self._answer.read_chunk()

    async def read(self, limit_bytes: int | None = None) -> bytes:
        return await self._answer.read(limit_bytes)

    def close(self) -> None:
        self._answer.close()
        self._lease.release(self.status)


class AdapterManager:
    """The adapter registry, each active deployment's adapters, and the loads (see the
    module docstring). ``links`` carries the load and unload ops; ``clock`` is monotonic
    seconds (for least-recently-used order)."""

    def __init__(
        self,
        links: LinkRegistry,
        *,
        metrics: AdapterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._links = links
        self._metrics = metrics
        self._clock = clock
        self._adapters: dict[str, AdapterEntry] = {}
        self._engines: dict[str, _Engine] = {}

    # -- the registry and the deployments --------------------------------------------------

    def load_registry(self, records: Iterable[AdapterRecord]) -> None:
        """Swap in the registry (the store's adapters), at start and after each change."""
        self._adapters = {
            r.name: AdapterEntry(r.name, r.base_model, r.format, dict(r.locations)) for r in records
        }

    def entry(self, name: str) -> AdapterEntry | None:
        """The registered adapter called ``name``, or ``None``."""
        return self._adapters.get(name)

    def adapters(self) -> list[AdapterEntry]:
        return list(self._adapters.values())

    def deployment_changed(self, record: DeploymentRecord) -> None:
        """A deployment's state changed (or it is known at start): keep or forget it."""
        known = self._engines.get(record.id)
        # An engine that ended (restarted later, or not) holds no adapter any more.
        if not record.is_active or record.state in RESTARTING_STATES:
            if known is not None:
                del self._engines[record.id]
                for name in list(known.loaded):
                    self._forget_metric(known, name)
            return
        if known is not None:
            return
        self._engines[record.id] = _Engine(
            deployment_id=record.id,
            node_id=record.node_id,
            engine=parse_engine_name(record.engine),
            base=record.model_name,
            served=record.served_model_name,
            slots=record.adapter_slots,
            lora_order=record.lora_adapters,
        )

    def loaded_on(self, name: str) -> list[tuple[str, str]]:
        """``(deployment id, node id)`` of every engine that has adapter ``name`` loaded (or
        was started with it)."""
        return sorted(
            (e.deployment_id, e.node_id)
            for e in self._engines.values()
            if name in e.loaded or name in e.lora_order
        )

    def restart_needed(self, name: str) -> list[str]:
        """Active deployments of the adapter's base that cannot take it until restarted: a
        llama.cpp engine on a node that has it, started without it; a vLLM or SGLang
        engine started without LoRA."""
        adapter = self._adapters.get(name)
        if adapter is None:
            return []
        found = []
        for e in self._engines.values():
            if e.base != adapter.base or FORMAT_OF_ENGINE[e.engine] != adapter.format:
                continue
            if e.engine == "llamacpp":
                if e.node_id in adapter.locations and name not in e.lora_order:
                    found.append(e.deployment_id)
            elif e.slots is None:
                found.append(e.deployment_id)
        return sorted(found)

    def restarts_for(self, base: str) -> dict[str, list[str]]:
        """The active deployments of ``base`` that need a restart to serve some of its
        adapters (:meth:`restart_needed`): deployment id -> those adapters, by name."""
        found: dict[str, list[str]] = {}
        for name in sorted(a.name for a in self._adapters.values() if a.base == base):
            for deployment_id in self.restart_needed(name):
                found.setdefault(deployment_id, []).append(name)
        return dict(sorted(found.items()))

    # -- resolving -------------------------------------------------------------------------

    def deployments_of(self, base: str) -> dict[str, str]:
        """The base's active deployments: deployment id -> the name it is served under."""
        return {e.deployment_id: e.served for e in self._engines.values() if e.base == base}

    def upstreams(self, adapter: AdapterEntry, found: list[Upstream]) -> list[Upstream]:
        """``found`` (ready deployments of the adapter's base) that can serve ``adapter``,
        each tagged with it and its tier. Raises :class:`NoReadyDeploymentError` naming why
        none can."""
        views: list[AdapterSlots] = []
        by_id: dict[str, Upstream] = {}
        refused: dict[str, str] = {}
        for upstream in found:
            engine = self._engines.get(upstream.deployment_id)
            if engine is None:
                continue
            if FORMAT_OF_ENGINE[engine.engine] != adapter.format:
                refused[upstream.deployment_id] = (
                    f"a {adapter.format} adapter does not run on {engine.engine}"
                )
                continue
            if engine.slots is not None and not self.node_serves_adapters(engine.node_id):
                refused[upstream.deployment_id] = "its node's agent cannot load adapters"
                continue
            views.append(engine.view(adapter))
            by_id[upstream.deployment_id] = upstream
        tiered = rank_tiers(adapter.name, views)
        refused.update(tiered.refused)
        if not tiered.tiers:
            why = "; ".join(f"{d}: {reason}" for d, reason in sorted(refused.items()))
            raise NoReadyDeploymentError(
                adapter.name,
                detail=why or f"no ready deployment of its base model {adapter.base!r}",
            )
        return [
            self._tagged(by_id[d], adapter, tier)
            for d, tier in sorted(tiered.tiers.items(), key=lambda item: item[1])
        ]

    def _tagged(self, upstream: Upstream, adapter: AdapterEntry, tier: AdapterTier) -> Upstream:
        engine = self._engines[upstream.deployment_id]
        use = AdapterUse(adapter.name, adapter.base)
        if engine.slots is None:  # llama.cpp: the adapter by its scale; any model name will do
            scales = tuple(1.0 if name == adapter.name else 0.0 for name in engine.lora_order)
            engine_model = upstream.engine_model
            return replace(
                upstream,
                model=adapter.name,
                engine_model=engine_model,
                adapter=use,
                tier=int(tier),
                lora_scales=scales,
            )
        # vLLM, SGLang: loaded under its own name, which the client asked for
        return replace(upstream, model=adapter.name, engine_model=None, adapter=use, tier=int(tier))

    def base_request(self, upstream: Upstream) -> Upstream:
        """``upstream`` for a request that names no adapter: on a llama.cpp engine started
        with adapters, every adapter's scale is set to 0 for it."""
        engine = self._engines.get(upstream.deployment_id)
        if engine is None or not engine.lora_order:
            return upstream
        return replace(upstream, lora_scales=(0.0,) * len(engine.lora_order))

    def node_serves_adapters(self, node_id: str) -> bool:
        """Whether ``node_id``'s link is up and its agent offers the ``load_adapter`` op."""
        link = self._links.get(node_id)
        return link is not None and "op.load_adapter" in link.capabilities

    # -- the gate --------------------------------------------------------------------------

    async def enter(self, upstream: Upstream) -> AdapterLease | None:
        """Make sure ``upstream``'s engine has its adapter, and count the request as using
        it; ``None`` for a request without an adapter.

        Raises :class:`AdapterUnavailableError` (retried on another candidate) when the
        engine cannot take it now: every slot holds an adapter in use, the node's link is
        gone, or the load failed.
        """
        use = upstream.adapter
        if use is None:
            return None
        engine = self._engines.get(upstream.deployment_id)
        adapter = self._adapters.get(use.name)
        if engine is None or adapter is None:
            raise AdapterUnavailableError(upstream, "is no longer known to serve the adapter")
        if engine.slots is None:  # given at start
            return self._lease(engine, use.name)
        while True:
            if use.name in engine.loaded:
                return self._lease(engine, use.name)
            pending = engine.loading.get(use.name)
            if pending is None:
                pending = self._start_load(upstream, engine, adapter)
            try:
                await asyncio.shield(pending)
            except BerthError as exc:
                raise AdapterUnavailableError(
                    upstream, f"could not load adapter {use.name!r} ({exc})"
                ) from exc

    def gated(self, open_engine: EngineOpener[R]) -> EngineOpener[R]:
        """``open_engine`` behind the gate: a request for an adapter has it loaded into the
        engine first (:meth:`enter`, which may raise :class:`AdapterUnavailableError`), and
        its answer holds the adapter in use until the answer is closed. The engine request
        goes through untouched."""

        async def gated_open(upstream: Upstream, request: R) -> EngineAnswer:
            lease = await self.enter(upstream)
            if lease is None:
                return await open_engine(upstream, request)
            try:
                answer = await open_engine(upstream, request)
            except BaseException:
                lease.release(None)
                raise
            return LeasedAnswer(answer, lease)

        return gated_open

    def _lease(self, engine: _Engine, name: str) -> AdapterLease:
        engine.in_flight[name] += 1
        if name in engine.loaded:
            engine.loaded[name] = self._clock()
        if self._metrics is not None:
            self._metrics.request_sent(name, engine.base, engine.node_id)
        return AdapterLease(self, engine.deployment_id, name)

    def released(self, deployment_id: str, name: str, status: int | None) -> None:
        engine = self._engines.get(deployment_id)
        if engine is None:
            return
        engine.in_flight[name] -= 1
        if engine.in_flight[name] <= 0:
            del engine.in_flight[name]
        if name in engine.loaded:
            engine.loaded[name] = self._clock()
            if status == 404 and engine.slots is not None:
                # The engine does not have it after all (restarted behind berth's back):
                # the next request loads it again.
                log.warning("deployment %s answered 404 for adapter %s: loading it again "
                            "next time", deployment_id, name)  # fmt: skip
                del engine.loaded[name]
                self._forget_metric(engine, name)

    def _start_load(
        self, upstream: Upstream, engine: _Engine, adapter: AdapterEntry
    ) -> asyncio.Task[None]:
        """Reserve a slot now (no await before the task exists, so two requests never take
        the same one) and load in a task of its own: a client that leaves does not cut a
        load short."""
        assert engine.slots is not None
        victim = None
        if len(engine.loaded) + len(engine.loading) >= engine.slots:
            victim = eviction_choice(engine.view(adapter), engine.loaded)
            if victim is None:
                raise AdapterUnavailableError(
                    upstream, f"has all {engine.slots} adapter slots in use"
                )
            del engine.loaded[victim]  # nobody may start using it now
        task = asyncio.create_task(
            self._load(engine, adapter, victim), name=f"load {adapter.name} {engine.deployment_id}"
        )
        engine.loading[adapter.name] = task
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved here
        return task

    async def _load(self, engine: _Engine, adapter: AdapterEntry, victim: str | None) -> None:
        link = self._links.get(engine.node_id)
        try:
            if link is None:
                raise NotFoundError("node link", engine.node_id)
            path = adapter.locations.get(engine.node_id)
            if path is None:
                raise NotFoundError(
                    "adapter", adapter.name, message=f"adapter {adapter.name!r} is not on node "
                    f"{engine.node_id}"
                )  # fmt: skip
            if victim is not None:
                log.info("deployment %s: unloading adapter %s (least recently used) for %s",
                         engine.deployment_id, victim, adapter.name)  # fmt: skip
                await link.unload_adapter(engine.deployment_id, engine.engine, victim)
                if self._metrics is not None:
                    self._metrics.unloaded(
                        victim, engine.base, engine.deployment_id, engine.node_id
                    )
            await link.load_adapter(engine.deployment_id, engine.engine, adapter.name, path)
        except BerthError:
            if self._metrics is not None:
                self._metrics.load_finished(
                    adapter.name, engine.base, engine.deployment_id, engine.node_id, "failed"
                )
            raise
        finally:
            engine.loading.pop(adapter.name, None)
        log.info("deployment %s: adapter %s loaded", engine.deployment_id, adapter.name)
        engine.loaded[adapter.name] = self._clock()
        if self._metrics is not None:
            self._metrics.load_finished(
                adapter.name, engine.base, engine.deployment_id, engine.node_id, "loaded"
            )

    def _forget_metric(self, engine: _Engine, name: str) -> None:
        if self._metrics is not None:
            self._metrics.forget(name, engine.base, engine.deployment_id, engine.node_id)
