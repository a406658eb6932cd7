"""The lifecycle manager: deployments from request to ready, stop, failure and reconcile.

It is the only writer of deployment state (through :class:`StateWriter`) and the keeper of
the :class:`ReadyTable` the proxy reads on every request without touching the database.
Its parts, each with one reason to change:

- here: the commands (plan, deploy, stop) and carrying out a start; where a deployment goes
  is decided by :func:`berth.placement.plan_placement` from facts gathered by
  :mod:`berth.deployments.placement_facts`, with VRAM estimates from
  :mod:`berth.deployments.estimates`;
- :mod:`berth.deployments.reconcile`: the store against the engines that really run (at start,
  on an agent's Hello, every watch interval);
- :mod:`berth.deployments.ready_table`: the table of ready upstreams the proxy resolves from;
- :mod:`berth.deployments.transitions`: the one path by which a state is written;
- :mod:`berth.deployments.starts`: carrying a start out (a placement's, or a restart's after
  its backoff, which :mod:`berth.deployments.supervisor` asks for under the restart policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

from berth.admission.capacity import DEFAULT_SLOTS
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.pki.signing_key import SpecSigner
from berth.cluster.protocol.payloads import AdoptedState, EngineState
from berth.deployments.estimates import VramEstimator
from berth.deployments.lora_plan import plan_lora
from berth.deployments.placement_facts import UsageLookup, no_usage
from berth.deployments.planner import (
    DEFAULT_MIN_RESIDENCY_S,
    DeployOptions,
    PlannedDeployment,
    Planner,
)
from berth.deployments.ready_table import LOADING_RETRY_AFTER_S, ReadyTable
from berth.deployments.reconcile import (
    PROBE_TIMEOUT_S,
    UNHEALTHY_PROBES_TO_FAIL,
    WATCH_INTERVAL_S,
    Reconciler,
)
from berth.deployments.restarts import Backoff
from berth.deployments.signing import SpecSigning
from berth.deployments.starts import EngineStarts
from berth.deployments.supervisor import RestartListener
from berth.deployments.transitions import StateListener, StateWriter
from berth.errors import (
    ConflictError,
    EngineError,
    InvalidTransitionError,
    NotFoundError,
    StoreError,
)
from berth.placement import (
    Eviction,
    EvictionPolicy,
    PlacementPolicy,
    Refusal,
)
from berth.routing.resolver import Upstream
from berth.routing.waiting import GiveUp, WaitingAttempts
from berth.runtime.base import EngineExit
from berth.store import Store
from berth.vocab.engines import EngineName
from berth.vocab.images import DEFAULT_GPU_IMAGES, DEFAULT_IMAGES
from berth.vocab.policies import RoutingPolicy
from berth.vocab.records import DeploymentRecord, StreamTimeouts
from berth.vocab.states import TERMINAL_STATES, DeploymentState

log = logging.getLogger(__name__)

#: Told of each deployment a placement evicts, before it is stopped: its id and the
#: eviction choice's reason line.
EvictionListener = Callable[[str, str], None]

#: the states :meth:`LifecycleManager.wait_settled` waits out
_STARTING = frozenset({DeploymentState.PENDING, DeploymentState.LOADING})

__all__ = [
    "DEFAULT_MIN_RESIDENCY_S",
    "LOADING_RETRY_AFTER_S",
    "WATCH_INTERVAL_S",
    "DeployOptions",
    "EvictionListener",
    "LifecycleManager",
    "PlannedDeployment",
    "RestartListener",
    "StateListener",
]


class LifecycleManager:
    """Owns every deployment's state and the table the router reads.

    ``links`` is the leader's registry of live links (the hub attaches and detaches remote
    ones).  ``on_state`` is called with the new record after every state change (metrics
    use it).  ``images`` is the container image per engine for the docker runtime (the
    ``*_image`` settings); ``gpu_images`` replaces it for a deployment given GPUs
    (llama.cpp's default image has no CUDA).  ``usage`` tells placement how each
    deployment is used (for the eviction choice); ``min_residency_s`` is the eviction
    choice's minimum residency.  ``watch_interval_s``, ``probe_timeout_s`` and
    ``probes_to_fail`` drive the health watch (:mod:`berth.deployments.reconcile`), which wakes
    the requests in ``waiting`` when it gives a deployment up; a stop (``berth stop``, a
    scale-in, an eviction, shutdown) wakes them too.  ``slots_changed(deployment_id,
    slots)`` hears of a ready deployment whose slots at the fair admission gate changed
    (:meth:`set_service_capacities`; the daemon passes :meth:`berth.admission.SlotGate.resize`);
    ``default_slots`` are a ready deployment's slots there when its engine does not say.
    ``restart_backoff`` paces the restart policy's restarts (:mod:`berth.deployments.restarts`);
    ``on_restart`` hears of each one carried out.  ``check_agent_policies``: placement
    leaves out nodes whose agent policy would refuse (off only to test the agents' own
    refusal).
    ``signer`` is the cluster's spec signing
    key (``None``: a key made in memory, for a leader without a home); the first start of a
    deployment placed here is signed with it, and no other start runs without a valid
    signature (:mod:`berth.deployments.signing`); ``require_agent_spec_check`` refuses starts
    on agents that do not check signatures themselves.
    """

    def __init__(
        self,
        store: Store,
        links: LinkRegistry,
        *,
        health_timeout_s: float,
        stop_grace_s: float,
        on_state: StateListener | None = None,
        watch_interval_s: float = WATCH_INTERVAL_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        probes_to_fail: int = UNHEALTHY_PROBES_TO_FAIL,
        waiting: WaitingAttempts | None = None,
        images: Mapping[EngineName, str] = DEFAULT_IMAGES,
        gpu_images: Mapping[EngineName, str] = DEFAULT_GPU_IMAGES,
        usage: UsageLookup = no_usage,
        min_residency_s: float = DEFAULT_MIN_RESIDENCY_S,
        slots_changed: Callable[[str, int | None], None] | None = None,
        restart_backoff: Backoff = Backoff(),
        on_restart: RestartListener | None = None,
        default_slots: int = DEFAULT_SLOTS,
        check_agent_policies: bool = True,
        signer: SpecSigner | None = None,
        require_agent_spec_check: bool = False,
    ) -> None:
        self._store = store
        #: signs what deploy() accepted, checks every later start (berth.deployments.signing)
        self.signing = SpecSigning(
            store,
            signer if signer is not None else SpecSigner.in_memory(),
            require_agent_check=require_agent_spec_check,
        )
        self._links = links
        self._policy = PlacementPolicy(
            check_agent_policies=check_agent_policies,
            images=dict(images),
            gpu_images=dict(gpu_images),
        )
        self._estimator = VramEstimator()
        #: one placement at a time: the next sees the last one's record (and its VRAM)
        self._placing = asyncio.Lock()
        self._stop_grace_s = stop_grace_s
        self._waiting = waiting
        self._table = ReadyTable(on_slots=slots_changed, default_slots=default_slots)
        self._planner = Planner(
            store,
            links,
            self._table,
            self._policy,
            estimator=self._estimator,
            usage=usage,
            min_residency_s=min_residency_s,
        )
        self._writer = StateWriter(store, self._table, on_state)
        self._starts = EngineStarts(
            store,
            links,
            self._writer,
            health_timeout_s=health_timeout_s,
            restart_backoff=restart_backoff,
            on_restart=on_restart,
            signing=self.signing,
        )
        #: the starts in flight by deployment id, and the restart policy (both the starts')
        self._starting = self._starts.starting
        self._supervisor = self._starts.supervisor
        self._reconciler = Reconciler(
            store,
            links,
            self._table,
            self._writer,
            stop_grace_s=stop_grace_s,
            is_starting=self._starting.__contains__,
            watch_interval_s=watch_interval_s,
            probe_timeout_s=probe_timeout_s,
            probes_to_fail=probes_to_fail,
            waiting=waiting,
            supervisor=self._supervisor,
        )
        self._watcher: asyncio.Task[None] | None = None
        if waiting is not None:  # a request that finds an engine not taking it says so
            waiting.on_engine_failed = self._reconciler.engine_refused

    # -- the router's view (hot path: no I/O) --------------------------------------------

    def candidates(self, model: str) -> list[Upstream]:
        """Every ready deployment serving ``model`` on a reachable node (the router ranks
        them).

        Raises ``NotFoundError`` for a model berth does not know and
        ``NoReadyDeploymentError`` (503, ``Retry-After``) for one with no ready deployment.
        """
        return self._table.candidates(model)

    def models(self) -> list[str]:
        """Public model names with at least one ready deployment."""
        return self._table.models()

    @property
    def table_loaded(self) -> bool:
        """Whether the ready table knows the model names (:meth:`start` loads them)."""
        return self._table.loaded

    def routed(self, deployment_id: str) -> bool:
        """Whether requests go to the deployment now (ready, on a linked node)."""
        return self._table.ready_upstream(deployment_id) is not None

    def progress(self, deployment_id: str) -> str | None:
        """What a loading deployment is busy with, e.g. ``pulling vllm/vllm-openai:latest:
        1.2 GB of 8.3 GB, 3/12 layers done``; ``None`` when nothing is reported."""
        return self._writer.progress(deployment_id)

    def adopted(self) -> dict[str, list[AdoptedState]]:
        """Adopted endpoints by node id, as last reported."""
        return self._table.adopted()

    def retire(self, deployment_id: str) -> None:
        """Send no new request to the deployment while another of its model can take it
        (a drain moved it: its replacement is ready); requests in flight go on."""
        self._table.retire(deployment_id)

    def unretire(self, deployment_id: str) -> None:
        """Route to a retired deployment again."""
        self._table.unretire(deployment_id)

    def retired(self) -> frozenset[str]:
        """The deployments :meth:`retire` took out of routing (until they stop)."""
        return self._table.retired()

    def after_probes(self, listener: Callable[[Sequence[Upstream]], Awaitable[None]]) -> None:
        """From now on, after each round of health probes, ``listener`` hears the ready
        engines that answered (the prefix policy reads their cache signals then)."""
        self._reconciler.after_probes = listener

    # -- start-up and shut-down ---------------------------------------------------------

    async def start(self) -> None:
        """Load known models, reconcile deployments left by a previous run, start watching."""
        await self.refresh_known_models()
        await self._reconciler.reconcile_local()
        self._watcher = asyncio.create_task(self._reconciler.watch(), name="berth-engine-watcher")

    async def stand_down(self) -> None:
        """Stop the loops only the store's leader runs (the engine watcher, the restart
        policy's pending restarts, the starts in flight) and stop no engine: this leader
        lost the lease (docs/ha.md); the engines on agents run on for the new active.
        Call it once the agents' links are closed, so that a start cut short here (which
        removes its half-started engine first) reaches no agent.  :meth:`start` may be
        called again afterwards; a manager not started changes nothing."""
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await self._reconciler.stop_ending()
        await self._supervisor.shutdown()
        starting = list(self._starting.values())
        for task in starting:
            task.cancel()
        if starting:
            await asyncio.wait(starting, timeout=self._stop_grace_s + 30.0)

    async def shutdown(self) -> None:
        """Stop every engine on the leader's own node and mark its deployment stopped.

        Engines on agents keep running: their agents redial, and the next leader reconciles
        them when each says Hello again (:meth:`node_connected`).  A manager whose
        :meth:`start` did not finish changes nothing: the engines it may not have reconciled
        are left to the next start; so does one whose store is out of reach (logged), which
        cannot tell which deployments this node runs.
        """
        if self._watcher is None:
            return
        self._watcher.cancel()
        await self._reconciler.stop_ending()
        await self._supervisor.shutdown()  # no restart may begin while engines are stopped
        starting = list(self._starting.values())
        for task in starting:
            task.cancel()
        if starting:
            # Each cancelled start removes its half-started engine (or container) first.
            await asyncio.wait(starting, timeout=self._stop_grace_s + 30.0)
        try:
            everything = await asyncio.to_thread(self._store.list_deployments, active_only=True)
        except StoreError as exc:
            # Which engines this node runs is in the store: out of reach, they are left as
            # they are, for the next start to take back or stop (or the warden).
            log.error("shutdown: cannot list the deployments, engines left running: %s", exc)
            return
        active = [record for record in everything if record.node_id == LOCAL_NODE_ID]
        outcomes = await asyncio.gather(
            *(self._stop_one(record) for record in active), return_exceptions=True
        )
        for record, outcome in zip(active, outcomes, strict=True):
            # Shutting down goes on for the others; each failure is kept in the log.
            if isinstance(outcome, ConflictError):
                continue  # stopped meanwhile by another caller
            if isinstance(outcome, BaseException):
                log.error("shutdown: stopping deployment %s on node %s failed: %s",
                          record.id, record.node_id, outcome, exc_info=outcome)  # fmt: skip
            elif outcome.state is DeploymentState.FAILED:
                log.warning("shutdown: deployment %s: %s", record.id, outcome.failure_reason)

    async def refresh_known_models(self) -> None:
        """Re-read the names that answer 503 rather than 404 while nothing serves them."""
        models = await asyncio.to_thread(self._store.list_models)
        active = await asyncio.to_thread(self._store.list_deployments, active_only=True)
        self._table.set_known_models(
            {m.name for m in models} | {d.served_model_name for d in active}
        )

    def set_service_capacities(self, capacities: Mapping[str, int | None]) -> None:
        """The services' ``capacity`` settings (service name -> setting, ``None``: the
        engine's slots), held at the fair admission gate for the deployments serving each
        name from now on (:meth:`ReadyTable.set_service_capacities`)."""
        self._table.set_service_capacities(capacities)

    def set_service_timeouts(self, timeouts: Mapping[str, StreamTimeouts]) -> None:
        """The stream timeouts of each service (by name) hold for the deployments serving
        its name from now on (:meth:`ReadyTable.set_service_timeouts`)."""
        self._table.set_service_timeouts(timeouts)

    def set_service_routing_policies(self, policies: Mapping[str, RoutingPolicy | None]) -> None:
        """The routing policy of each service (by name; ``None``: the leader's setting)
        holds for the deployments serving its name from the next request on
        (:meth:`ReadyTable.set_service_routing_policies`)."""
        self._table.set_service_routing_policies(policies)

    # -- nodes (the hub's NodeListener, and node removal) ---------------------------------

    async def node_connected(self, node_id: str, engines: Sequence[EngineState]) -> None:
        """An agent said Hello: reconcile its deployments with the engines it reports
        (:meth:`berth.deployments.reconcile.Reconciler.node_connected`)."""
        await self._reconciler.node_connected(node_id, engines)

    def adopted_reported(self, node_id: str, adopted: Sequence[AdoptedState]) -> None:
        """A node reported its adopted endpoints (in Hello, each heartbeat, or, for node
        ``local``, when the leader's own set changes): route to those whose last probe
        answered, under their served names; the others answer 503 naming them."""
        self._table.adopted_reported(node_id, adopted)

    def engine_ended(self, node_id: str, deployment_id: str, exited: EngineExit | None) -> None:
        """A ready engine on ``node_id`` ended by itself, the moment its runtime saw it (node
        ``local``'s core, or an agent's report over its link; ``exited``: how, when known):
        out of routing now, then stopped and restarted or failed by its restart policy
        (:meth:`berth.deployments.reconcile.Reconciler.engine_ended`).  A leader that does
        not lead (a standby) leaves it to the active."""
        if self._watcher is None:
            return
        self._reconciler.engine_ended(node_id, deployment_id, exited)

    def node_disconnected(self, node_id: str) -> None:
        """A node's link ended: stop routing to its deployments until it reconnects (a
        request for their model is told where they are)."""
        self._table.park_node(node_id)

    async def node_removed(self, node_id: str) -> None:
        """A node was removed: its deployments stop getting traffic and are marked failed.

        Its agent stops their engines itself when told it was removed.
        """
        self.node_disconnected(node_id)
        active = await asyncio.to_thread(self._store.list_deployments, active_only=True)
        for record in active:
            if record.node_id != node_id:
                continue
            await self._supervisor.cancel(record.id)
            starting = self._starting.get(record.id)
            if starting is not None:
                starting.cancel()
            await self._writer.transition(
                record.id, DeploymentState.FAILED, failure_reason=f"node {node_id} was removed"
            )

    @property
    def estimator(self) -> VramEstimator:
        """The model shapes and deployment estimates placement uses (``berth models show``
        reads the same cache)."""
        return self._estimator

    # -- commands --------------------------------------------------------------------------

    async def plan(
        self, options: DeployOptions, *, eviction: EvictionPolicy | None = None
    ) -> PlannedDeployment:
        """Where a deployment of ``options`` would go, and why: a dry run (nothing changes).
        See :meth:`berth.deployments.planner.Planner.plan`."""
        return await self._planner.plan(options, eviction=eviction)

    async def deploy(
        self,
        options: DeployOptions,
        *,
        eviction: EvictionPolicy | None = None,
        on_evict: EvictionListener | None = None,
    ) -> DeploymentRecord:
        """Create a deployment and start its engine in the background.

        Where it goes is :meth:`plan`'s answer (``eviction``: see there).  When placement
        chose deployments to evict, each is told to ``on_evict(deployment_id, reason)`` and
        stopped first, under the same placement lock, so no other placement sees the room
        before this one takes it.  Returns the pending record at once; the state moves to
        loading, then ready or failed.  Raises what :meth:`plan` raises, ``ConfigError`` for
        a placement refused as a bad request and ``ConflictError`` for one refused by the
        cluster's state (:class:`berth.placement.Refusal`) or an eviction whose stop failed.
        """
        async with self._placing:  # the next placement counts this one's VRAM
            planned = await self._planner.plan(options, eviction=eviction)
            placement = planned.result
            if isinstance(placement, Refusal):
                raise placement.error()
            link = self._links.get(placement.node_id)  # the start goes over this one
            if link is None:
                raise ConflictError(
                    f"node {placement.label} ({placement.node_id}) is not connected"
                )
            adapters = await asyncio.to_thread(self._store.list_adapters, planned.model.name)
            lora = plan_lora(
                planned.engine,
                placement.runtime,
                placement.node_id,
                adapters,
                max_adapters=options.max_adapters,
                node_serves_adapters="op.load_adapter" in link.capabilities,
            )
            # Stops come last: a refusal above must not have cost another deployment.
            if placement.eviction is not None:
                await self._evict(placement.eviction, on_evict)
            served = options.served_model_name or planned.model.name
            record = await asyncio.to_thread(
                self._store.create_deployment,
                planned.model.name,
                planned.engine,
                planned.runtime,
                placement.node_id,
                gpus=placement.gpus,
                ctx=options.ctx,
                extra_args=options.extra_args,
                served_model_name=served,
                image=placement.image,
                adapter_slots=lora.slots,
                lora_adapters=lora.names,
                restart_policy=options.restart_policy,
            )
            self._estimator.remember(record.id, planned.estimate)
        log.info("deployment %s placed: %s", record.id, "; ".join(placement.reasons))
        self._table.add_known_model(served)
        self._writer.notify(record)
        self._starts.begin(record, link, placement, planned.engine, lora)
        return record

    async def stop(self, deployment_id: str) -> DeploymentRecord:
        """Stop a deployment (cancelling its start if it is still loading).

        Returns the final record.  Raises ``NotFoundError`` for an unknown id and
        ``ConflictError`` for one that is already stopped or failed.
        """
        record = await asyncio.to_thread(self._store.get_deployment, deployment_id)
        if record.state in TERMINAL_STATES or record.state is DeploymentState.STOPPING:
            raise ConflictError(f"deployment {deployment_id} is already {record.state}")
        # A stop wins over a pending restart: its timer goes first, then any start it began.
        await self._supervisor.cancel(deployment_id)
        starting = self._starting.get(deployment_id)
        if starting is not None:
            starting.cancel()
            # The cancelled start stops its half-started engine; wait for that, so "stopped"
            # is only reported once no engine process is left.
            await asyncio.wait({starting})
        return await self._stop_one(record)

    async def _evict(self, eviction: Eviction, on_evict: EvictionListener | None) -> None:
        """Stop ``eviction``'s deployments in order (the placement lock is held); one that
        is already stopping or gone frees its room anyway.  Raises ``ConflictError`` when a
        stop fails (its engine may still hold the memory)."""
        for deployment_id, reason in zip(eviction.deployment_ids, eviction.reasons, strict=True):
            log.info("evicting deployment %s: %s", deployment_id, reason)
            if on_evict is not None:
                on_evict(deployment_id, reason)
            try:
                stopped = await self.stop(deployment_id)
            except (ConflictError, NotFoundError):
                continue
            if stopped.state is DeploymentState.FAILED:
                raise ConflictError(
                    f"cannot make room: stopping deployment {deployment_id} failed: "
                    f"{stopped.failure_reason}"
                )

    async def wait_settled(self, deployment_id: str, timeout_s: float) -> DeploymentRecord:
        """Wait up to ``timeout_s`` seconds until the deployment leaves pending/loading and
        its start has finished (so a ready one is routed); its record then, still pending
        or loading if the time ran out.

        A record can be read from the store before its start task exists (the row is
        written first): such a caller waits for the state writer's next changes, not for a
        task that is not there yet.  Raises ``NotFoundError`` for an unknown id.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            changed = self._writer.next_change()
            task = self._starting.get(deployment_id)
            if task is not None:
                await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
            record = await asyncio.to_thread(self._store.get_deployment, deployment_id)
            remaining_s = deadline - loop.time()
            if record.state not in _STARTING or remaining_s <= 0:
                return record
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining_s):
                    await changed.wait()

    async def _stop_one(self, record: DeploymentRecord) -> DeploymentRecord:
        self._table.unmark(record.served_model_name, record.id)
        if self._waiting is not None:
            # Its requests waiting for a first byte go elsewhere now, not after the stop.
            self._waiting.give_up_deployment(record.id, GiveUp.STOPPED, "is being stopped")
        try:
            record = await self._writer.transition(record.id, DeploymentState.STOPPING)
        except InvalidTransitionError:  # another stop got there first
            current = await asyncio.to_thread(self._store.get_deployment, record.id)
            raise ConflictError(f"deployment {record.id} is already {current.state}") from None
        link = self._links.get(record.node_id)
        try:
            if link is not None:
                await link.stop_deployment(record.id, self._stop_grace_s)
        except NotFoundError:
            pass  # the engine never started, or was already gone
        except EngineError as exc:
            return await self._writer.transition(
                record.id, DeploymentState.FAILED, failure_reason=f"stop failed: {exc}"
            )
        return await self._writer.transition(record.id, DeploymentState.STOPPED)
