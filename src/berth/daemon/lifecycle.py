"""The lifecycle manager: deployments from request to ready, stop, failure and reconcile.

It is the only writer of deployment state.  Every change goes through the store's
``transition_deployment`` (which enforces ``store/states.py``) and is mirrored in an
in-memory table of ready deployments, which the proxy reads on every request without touching
the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from berth.agent.adopted import ADOPTED_ID_PREFIX
from berth.cluster.link import LOCAL_NODE_ID, AgentLink, EngineEndpoint, EngineReport
from berth.cluster.protocol.frames import AdoptedState, EngineState
from berth.cluster.protocol.ops import RUNTIME_CAPABILITIES
from berth.cluster.remote_link import RemoteLink, tunnel_url
from berth.errors import (
    BerthError,
    ConfigError,
    ConflictError,
    EngineError,
    InvalidTransitionError,
    NotFoundError,
)
from berth.routing.errors import NoReadyDeploymentError
from berth.routing.resolver import Upstream
from berth.runtime.engines import (
    DEFAULT_GPU_IMAGES,
    DEFAULT_IMAGES,
    DeploymentRequest,
    EngineName,
    check_image_reference,
    parse_engine_name,
    parse_runtime_name,
)
from berth.store import UNCHANGED, DeploymentRecord, Store, Unchanged
from berth.store.states import TERMINAL_STATES, DeploymentState

log = logging.getLogger(__name__)

#: Seconds a client is told to wait (``Retry-After``) for a model that is still loading.
LOADING_RETRY_AFTER_S = 5
#: Seconds between health probes of ready engines.
WATCH_INTERVAL_S = 5.0
#: Consecutive failed health probes after which a running engine counts as hung: it is
#: stopped and its deployment marked failed, so it stops receiving traffic.
UNHEALTHY_PROBES_TO_FAIL = 3

StateListener = Callable[[DeploymentRecord], None]
#: An engine as an agent reports it (in Hello) or the local core lists it.
Engine = EngineState | EngineReport


@dataclass(frozen=True)
class DeployOptions:
    """A request to deploy ``model_name`` on ``node_id``."""

    model_name: str
    engine: str
    node_id: str
    runtime: str = "process"
    gpus: tuple[int, ...] = ()
    ctx: int | None = None
    extra_args: tuple[str, ...] = ()
    served_model_name: str | None = None
    #: the container image (docker runtime only); ``None``: the engine's image setting
    image: str | None = None


class LifecycleManager:
    """Owns every deployment's state and the table the router reads.

    ``links`` maps node id to the ``AgentLink`` that reaches it.  ``on_state`` is called with
    the new record after every state change (metrics use it).  ``images`` is the container
    image per engine for the docker runtime (the ``*_image`` settings); ``gpu_images``
    replaces it for a deployment given GPUs (llama.cpp's default image has no CUDA).
    """

    def __init__(
        self,
        store: Store,
        links: dict[str, AgentLink],
        *,
        health_timeout_s: float,
        stop_grace_s: float,
        on_state: StateListener | None = None,
        watch_interval_s: float = WATCH_INTERVAL_S,
        images: Mapping[EngineName, str] = DEFAULT_IMAGES,
        gpu_images: Mapping[EngineName, str] = DEFAULT_GPU_IMAGES,
    ) -> None:
        self._store = store
        self._images = dict(images)
        self._gpu_images = dict(gpu_images)
        #: what a loading deployment is busy with (an image pull), by deployment id
        self._progress: dict[str, str] = {}
        self._links = links
        self._health_timeout_s = health_timeout_s
        self._stop_grace_s = stop_grace_s
        self._on_state = on_state
        self._watch_interval_s = watch_interval_s
        self._ready: dict[str, dict[str, Upstream]] = {}
        #: ready deployments whose node is unreachable: model -> deployment id -> node id
        self._parked: dict[str, dict[str, str]] = {}
        #: called with a node id when its link drops (the router forgets its affinity)
        self.on_node_lost: Callable[[str], object] | None = None
        self._known_models: set[str] = set()
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._failed_probes: dict[str, int] = {}
        #: local deployments whose runtime could not be asked at start-up (Docker down)
        self._unreconciled: set[str] = set()
        #: adopted endpoints as each node last reported them: node id -> name -> state
        self._adopted: dict[str, dict[str, AdoptedState]] = {}

    # -- the router's view (hot path: no I/O) --------------------------------------------

    def candidates(self, model: str) -> list[Upstream]:
        """Every ready deployment serving ``model`` on a reachable node (the router ranks
        them).

        Raises ``NotFoundError`` for a model berth does not know and
        ``NoReadyDeploymentError`` (503, ``Retry-After``) for one with no ready deployment.
        """
        ready = self._ready.get(model)
        if ready:
            return list(ready.values())
        parked = self._parked.get(model)
        if parked:
            nodes = ", ".join(sorted(set(parked.values())))
            detail = f"its ready deployments are on unreachable nodes ({nodes})"
            raise NoReadyDeploymentError(model, retry_after_s=LOADING_RETRY_AFTER_S, detail=detail)
        down = [f"{state.name} on node {node_id}"
                for node_id, states in self._adopted.items()
                for state in states.values() if state.served_model_name == model]  # fmt: skip
        if down:
            detail = f"its adopted endpoint does not answer ({', '.join(sorted(down))})"
            raise NoReadyDeploymentError(model, retry_after_s=LOADING_RETRY_AFTER_S, detail=detail)
        if model in self._known_models:
            raise NoReadyDeploymentError(model, retry_after_s=LOADING_RETRY_AFTER_S)
        raise NotFoundError("model", model)

    def progress(self, deployment_id: str) -> str | None:
        """What a loading deployment is busy with, e.g. ``pulling vllm/vllm-openai:latest:
        1.2 GB of 8.3 GB, 3/12 layers done``; ``None`` when nothing is reported."""
        return self._progress.get(deployment_id)

    def models(self) -> list[str]:
        """Public model names with at least one ready deployment."""
        return sorted(name for name, ready in self._ready.items() if ready)

    # -- start-up and shut-down ---------------------------------------------------------

    async def start(self) -> None:
        """Load known models, reconcile deployments left by a previous run, start watching."""
        await self.refresh_known_models()
        await self.reconcile()
        self._watcher = asyncio.create_task(self._watch(), name="berth-engine-watcher")

    async def shutdown(self) -> None:
        """Stop every engine on the leader's own node and mark its deployment stopped.

        Engines on agents keep running: their agents redial, and the next leader reconciles
        them when each says Hello again (:meth:`node_connected`).  A manager whose
        :meth:`start` did not finish changes nothing: the engines it may not have reconciled
        are left to the next start.
        """
        if self._watcher is None:
            return
        self._watcher.cancel()
        starting = list(self._starting.values())
        for task in starting:
            task.cancel()
        if starting:
            # Each cancelled start removes its half-started engine (or container) first.
            await asyncio.wait(starting, timeout=self._stop_grace_s + 30.0)
        everything = await asyncio.to_thread(self._store.list_deployments, active_only=True)
        active = [record for record in everything if record.node_id == LOCAL_NODE_ID]
        await asyncio.gather(*(self._stop_one(record) for record in active), return_exceptions=True)

    async def refresh_known_models(self) -> None:
        models = await asyncio.to_thread(self._store.list_models)
        active = await asyncio.to_thread(self._store.list_deployments, active_only=True)
        self._known_models = {m.name for m in models} | {d.served_model_name for d in active}

    async def reconcile(self) -> None:
        """Bring the store in line with the engines that really run.

        After a crash, engines in their own process groups survive, and so do containers.  A
        deployment that was ready and whose engine still runs is re-attached; one caught
        mid-start or mid-stop is stopped; one whose engine is gone is marked failed; one whose
        runtime cannot be asked (Docker down) is left alone and retried by the watcher.  Then
        every local engine no active deployment owns (a container the core took back by its
        labels) is stopped and logged.
        """
        active = await asyncio.to_thread(self._store.list_deployments, active_only=True)
        for record in active:
            if record.node_id != LOCAL_NODE_ID:
                continue  # reconciled when its agent says Hello (node_connected)
            try:
                await self._reconcile_local(record)
            except EngineError as exc:
                # Its runtime cannot tell yet (Docker down): not routed, tried again by the
                # watcher, never marked failed for it.
                log.warning("deployment %s cannot be reconciled yet: %s", record.id, exc)
                self._unreconciled.add(record.id)
        local = self._links.get(LOCAL_NODE_ID)
        if local is not None:
            owned = {r.id for r in active if r.node_id == LOCAL_NODE_ID}
            await self._stop_orphans(LOCAL_NODE_ID, local, await local.engines(), owned)

    async def _reconcile_local(self, record: DeploymentRecord) -> None:
        """Re-attach, stop or fail one local deployment found active after a restart.

        Raises ``EngineError`` when its runtime cannot say whether the engine runs.
        """
        link = self._links.get(record.node_id)
        runtime = parse_runtime_name(record.runtime)
        endpoint: EngineEndpoint | None = None
        if link is not None and (runtime == "docker" or record.pid is not None):
            endpoint = await link.reattach(record.id, record.pid or 0, record.port or 0, runtime)
        if endpoint is None:
            if record.state is DeploymentState.READY:
                what = "container" if runtime == "docker" else "engine"
                reason = f"{what} was gone when the daemon restarted"
            else:
                reason = f"daemon restarted while the deployment was {record.state}"
            await self._transition(record.id, DeploymentState.FAILED, failure_reason=reason)
        elif record.state is DeploymentState.READY:
            log.info("re-attached deployment %s (pid %d)", record.id, endpoint.pid)
            self._mark_ready(record, endpoint)
        else:
            assert link is not None
            reason = f"daemon restarted while the deployment was {record.state}"
            try:
                await link.stop_deployment(record.id, self._stop_grace_s)
            except EngineError as exc:
                reason = f"{reason}; stopping its engine failed: {exc}"
            await self._transition(record.id, DeploymentState.FAILED, failure_reason=reason)

    async def _retry_unreconciled(self) -> None:
        for deployment_id in list(self._unreconciled):
            record = await asyncio.to_thread(self._store.get_deployment, deployment_id)
            if not record.is_active:
                self._unreconciled.discard(deployment_id)
                continue
            try:
                await self._reconcile_local(record)
            except EngineError as exc:
                log.info("deployment %s still cannot be reconciled: %s", deployment_id, exc)
            else:
                self._unreconciled.discard(deployment_id)

    async def _stop_orphans(
        self, node_id: str, link: AgentLink, engines: Sequence[Engine], owned: set[str]
    ) -> None:
        """Stop the engines (processes or containers) of ``node_id`` that no active deployment
        in ``owned`` accounts for, and say so in the log."""
        for engine in engines:
            orphan = engine.deployment_id
            if orphan in owned or orphan in self._starting or self._links.get(node_id) is not link:
                continue
            log.warning("node %s runs engine %s (pid %d, port %d) that no active deployment "
                        "owns: stopping it", node_id, orphan, engine.pid, engine.port)  # fmt: skip
            with contextlib.suppress(NotFoundError, EngineError):
                await link.stop_deployment(orphan, self._stop_grace_s)

    async def node_connected(self, node_id: str, engines: Sequence[EngineState]) -> None:
        """An agent said Hello: reconcile its deployments with the engines it reports.

        A ready deployment whose engine runs is routed to again; one whose engine is gone is
        marked failed; one caught mid-start or mid-stop is stopped and marked failed; an
        engine no active deployment owns (an orphan) is stopped.
        """
        link = self._links.get(node_id)
        if link is None:
            return
        reported = {e.deployment_id: e for e in engines}
        active = await asyncio.to_thread(self._store.list_deployments, active_only=True)
        owned = {record.id for record in active if record.node_id == node_id}
        for record in active:
            if self._links.get(node_id) is not link:
                return  # that session ended (or was superseded) meanwhile
            if record.node_id != node_id or record.id in self._starting:
                continue
            try:
                await self._reconcile_one(node_id, link, record, reported.pop(record.id, None))
            except (InvalidTransitionError, NotFoundError) as exc:
                log.info("deployment %s changed while node %s reconnected: %s", record.id,
                         node_id, exc)  # fmt: skip
        await self._stop_orphans(node_id, link, list(reported.values()), owned)

    async def _reconcile_one(
        self, node_id: str, link: AgentLink, record: DeploymentRecord, engine: EngineState | None
    ) -> None:
        if engine is not None and engine.alive and record.state is DeploymentState.READY:
            url = tunnel_url(node_id, record.id)
            self._mark_ready(record, EngineEndpoint(record.id, url, engine.pid, engine.port))
            return
        if engine is None:
            reason = f"engine was gone when node {node_id} reconnected"
        else:
            reason = f"node {node_id} reconnected while the deployment was {record.state}"
            with contextlib.suppress(NotFoundError, EngineError):
                await link.stop_deployment(record.id, self._stop_grace_s)
        log.warning("deployment %s: %s", record.id, reason)
        await self._transition(record.id, DeploymentState.FAILED, failure_reason=reason)

    def adopted_reported(self, node_id: str, adopted: Sequence[AdoptedState]) -> None:
        """A node reported its adopted endpoints (in Hello, each heartbeat, or, for node
        ``local``, when the leader's own set changes): route to those whose last probe
        answered, under their served names; the others answer 503 naming them."""
        previous = self._adopted.get(node_id, {})
        current = {state.name: state for state in adopted}
        if current == previous:
            return
        for state in previous.values():
            self._unmark_ready(state.served_model_name, ADOPTED_ID_PREFIX + state.name)
        self._adopted[node_id] = current
        for state in current.values():
            endpoint_id = ADOPTED_ID_PREFIX + state.name
            self._parked.get(state.served_model_name, {}).pop(endpoint_id, None)
            if not state.alive:
                continue
            if node_id == LOCAL_NODE_ID:
                base_url = f"http://{state.host}:{state.port}"
            else:
                base_url = tunnel_url(node_id, endpoint_id)
            engine_model = None
            if state.engine_model != state.served_model_name:
                engine_model = state.engine_model
            upstream = Upstream(
                base_url=base_url,
                deployment_id=endpoint_id,
                node_id=node_id,
                model=state.served_model_name,
                engine_model=engine_model,
            )
            self._ready.setdefault(state.served_model_name, {})[endpoint_id] = upstream

    def adopted(self) -> dict[str, list[AdoptedState]]:
        """Adopted endpoints by node id, as last reported."""
        return {node: list(states.values()) for node, states in self._adopted.items()}

    def node_disconnected(self, node_id: str) -> None:
        """A node's link ended: stop routing to its deployments until it reconnects."""
        if self.on_node_lost is not None:
            self.on_node_lost(node_id)
        self._adopted.pop(node_id, None)  # reported again in the next Hello
        for model, upstreams in self._ready.items():
            for deployment_id in [d for d, u in upstreams.items() if u.node_id == node_id]:
                del upstreams[deployment_id]
                # Remembered, so a request for the model is told where its deployments are.
                self._parked.setdefault(model, {})[deployment_id] = node_id

    async def node_removed(self, node_id: str) -> None:
        """A node was removed: its deployments stop getting traffic and are marked failed.

        Its agent stops their engines itself when told it was removed.
        """
        self.node_disconnected(node_id)
        active = await asyncio.to_thread(self._store.list_deployments, active_only=True)
        for record in active:
            if record.node_id != node_id:
                continue
            starting = self._starting.get(record.id)
            if starting is not None:
                starting.cancel()
            await self._transition(
                record.id, DeploymentState.FAILED, failure_reason=f"node {node_id} was removed"
            )

    # -- commands --------------------------------------------------------------------------

    async def deploy(self, options: DeployOptions) -> DeploymentRecord:
        """Create a deployment and start its engine in the background.

        Returns the pending record at once; the state moves to loading, then ready or failed.
        Raises ``NotFoundError`` for an unknown model or node, ``ConfigError`` for an unknown
        engine or runtime.
        """
        engine = parse_engine_name(options.engine)
        runtime = parse_runtime_name(options.runtime)
        image: str | None = None
        if runtime == "docker":
            default = self._images[engine]
            if options.gpus and engine in self._gpu_images:
                default = self._gpu_images[engine]  # llama.cpp's default image is CPU-only
            image = check_image_reference(default if options.image is None else options.image)
        elif options.image:
            raise ConfigError("an image applies to the docker runtime only (--runtime docker)")
        node_id = label = LOCAL_NODE_ID
        if options.node_id != LOCAL_NODE_ID:
            node = await asyncio.to_thread(self._store.lookup_node, options.node_id)
            if node.status == "removed":
                raise NotFoundError("node", options.node_id)
            node_id, label = node.id, node.label
        link = self._links.get(node_id)
        if link is None:
            raise ConflictError(f"node {label} ({node_id}) is not connected")
        options = replace(options, node_id=node_id)
        if (
            runtime == "docker"
            and isinstance(link, RemoteLink)
            and RUNTIME_CAPABILITIES["docker"] not in link.capabilities
        ):
            raise ConflictError(
                f"node {label} offers no docker runtime (its agent found no Docker engine when "
                "it connected; `berth doctor` on that host says why)"
            )
        model = await asyncio.to_thread(self._store.get_model, options.model_name)
        model_path = model.path
        pull: tuple[str, str | None] | None = None
        if node_id == LOCAL_NODE_ID and model.source == "remote":
            raise ConfigError(
                f"model {model.name} has a path only on other nodes (berth models ls); run it "
                "there with --node LABEL"
            )
        if node_id != LOCAL_NODE_ID:
            located = await asyncio.to_thread(self._store.model_path_on_node, model.name, node_id)
            if located is not None:
                model_path = Path(located)
            elif model.repo_id is not None and isinstance(link, RemoteLink):
                pull = (model.repo_id, model.revision)  # the agent downloads it first
            else:
                raise ConfigError(
                    f"model {model.name} has no path on node {label}; add one with "
                    f"'berth models add {model.name} PATH --node {label}'"
                )
        if options.gpus:
            reserved = {
                gpu: state.name
                for state in self._adopted.get(node_id, {}).values()
                for gpu in state.gpus
            }
            taken = [f"GPU {g} by {reserved[g]}" for g in options.gpus if g in reserved]
            if taken:
                raise ConflictError(
                    f"node {label} reserves {', '.join(taken)} (an adopted endpoint): "
                    "choose other GPUs or unadopt it"
                )
            available = sorted(gpu.index for gpu in (await link.inventory()).gpus)
            missing = sorted(set(options.gpus) - set(available))
            if missing:
                have = ", ".join(map(str, available)) or "none"
                raise ConfigError(
                    f"node {options.node_id} has no GPU {', '.join(map(str, missing))} "
                    f"(GPUs: {have})"
                )
        served = options.served_model_name or model.name
        record = await asyncio.to_thread(
            self._store.create_deployment,
            model.name,
            engine,
            runtime,
            options.node_id,
            gpus=options.gpus,
            ctx=options.ctx,
            extra_args=options.extra_args,
            served_model_name=served,
            image=image,
        )
        self._known_models.add(served)
        self._notify(record)
        request = DeploymentRequest(
            deployment_id=record.id,
            model_name=model.name,
            model_path=Path(model_path),
            engine=engine,
            port=0,
            log_path=Path(),
            gpus=options.gpus,
            ctx=options.ctx,
            extra_args=options.extra_args,
            served_model_name=served,
            runtime=runtime,
            image=image,
        )
        task = asyncio.create_task(self._run_start(record, link, request, pull), name=record.id)
        self._starting[record.id] = task
        task.add_done_callback(lambda _t: self._starting.pop(record.id, None))
        return record

    async def stop(self, deployment_id: str) -> DeploymentRecord:
        """Stop a deployment (cancelling its start if it is still loading).

        Returns the final record.  Raises ``NotFoundError`` for an unknown id and
        ``ConflictError`` for one that is already stopped or failed.
        """
        record = await asyncio.to_thread(self._store.get_deployment, deployment_id)
        if record.state in TERMINAL_STATES or record.state is DeploymentState.STOPPING:
            raise ConflictError(f"deployment {deployment_id} is already {record.state}")
        starting = self._starting.get(deployment_id)
        if starting is not None:
            starting.cancel()
            # The cancelled start stops its half-started engine; wait for that, so "stopped"
            # is only reported once no engine process is left.
            await asyncio.wait({starting})
        return await self._stop_one(record)

    async def wait_settled(self, deployment_id: str, timeout_s: float) -> DeploymentRecord:
        """Wait until the deployment leaves pending/loading (for tests and ``berth run``)."""
        task = self._starting.get(deployment_id)
        if task is not None:
            await asyncio.wait({task}, timeout=timeout_s)
        return await asyncio.to_thread(self._store.get_deployment, deployment_id)

    # -- internals ---------------------------------------------------------------------------

    async def _run_start(
        self,
        record: DeploymentRecord,
        link: AgentLink,
        request: DeploymentRequest,
        pull: tuple[str, str | None] | None = None,
    ) -> None:
        try:
            await self._transition(record.id, DeploymentState.LOADING)
            if pull is not None:
                assert isinstance(link, RemoteLink)
                log.info("deployment %s: node %s pulls %s", record.id, link.node_id, pull[0])
                located = await link.pull_model(*pull)
                await asyncio.to_thread(
                    self._store.set_model_location, record.model_name, link.node_id, located
                )
                request = replace(request, model_path=Path(located))

            async def record_spawn(pid: int, port: int) -> None:
                # Recorded before the engine is healthy, so a crash mid-load can be cleaned up.
                await asyncio.to_thread(
                    self._store.update_deployment_runtime, record.id, port=port, pid=pid
                )

            def record_progress(line: str) -> None:
                if record.id in self._starting:  # a late line must not outlive the start
                    self._progress[record.id] = line

            endpoint = await link.start_deployment(
                request,
                self._health_timeout_s,
                on_spawned=record_spawn,
                on_progress=record_progress,
            )
        except asyncio.CancelledError:
            return  # stop() owns the transition to stopping/stopped
        except BerthError as exc:
            log.warning("deployment %s failed to start: %s", record.id, exc)
            await self._transition(record.id, DeploymentState.FAILED, failure_reason=str(exc))
            return
        except Exception as exc:  # a bug must not leave the deployment loading forever
            log.exception("deployment %s: unexpected failure while starting", record.id)
            reason = f"unexpected error while starting: {type(exc).__name__}: {exc}"
            await self._transition(record.id, DeploymentState.FAILED, failure_reason=reason)
            return
        current = await asyncio.to_thread(self._store.get_deployment, record.id)
        if current.state is not DeploymentState.LOADING:
            return
        ready = await self._transition(
            record.id, DeploymentState.READY, port=endpoint.port, pid=endpoint.pid
        )
        if self._links.get(record.node_id) is not link:
            # The node's link dropped as the start finished: routed again when its agent
            # reconnects and reports the engine (node_connected).
            log.warning("deployment %s is ready but node %s is gone", record.id, record.node_id)
            return
        self._mark_ready(ready, endpoint)
        log.info("deployment %s ready at %s", record.id, endpoint.base_url)

    async def _stop_one(self, record: DeploymentRecord) -> DeploymentRecord:
        self._unmark_ready(record.served_model_name, record.id)
        try:
            record = await self._transition(record.id, DeploymentState.STOPPING)
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
            return await self._transition(
                record.id, DeploymentState.FAILED, failure_reason=f"stop failed: {exc}"
            )
        return await self._transition(record.id, DeploymentState.STOPPED)

    async def _transition(
        self,
        deployment_id: str,
        target: DeploymentState,
        *,
        port: int | Unchanged = UNCHANGED,
        pid: int | Unchanged = UNCHANGED,
        failure_reason: str | Unchanged = UNCHANGED,
    ) -> DeploymentRecord:
        record = await asyncio.to_thread(
            self._store.transition_deployment,
            deployment_id,
            target,
            port=port,
            pid=pid,
            failure_reason=failure_reason,
        )
        if target is not DeploymentState.LOADING:
            self._progress.pop(record.id, None)
        if target in TERMINAL_STATES:
            self._unmark_ready(record.served_model_name, record.id)
        self._notify(record)
        return record

    def _mark_ready(self, record: DeploymentRecord, endpoint: EngineEndpoint) -> None:
        upstream = Upstream(
            base_url=endpoint.base_url,
            deployment_id=record.id,
            node_id=record.node_id,
            model=record.served_model_name,
        )
        self._ready.setdefault(record.served_model_name, {})[record.id] = upstream
        self._parked.get(record.served_model_name, {}).pop(record.id, None)

    def _unmark_ready(self, model: str, deployment_id: str) -> None:
        self._ready.get(model, {}).pop(deployment_id, None)
        self._parked.get(model, {}).pop(deployment_id, None)

    def _notify(self, record: DeploymentRecord) -> None:
        if self._on_state is not None:
            self._on_state(record)

    async def _watch(self) -> None:
        """Mark ready deployments whose engine died as failed, so they stop getting traffic."""
        while True:
            await asyncio.sleep(self._watch_interval_s)
            if self._unreconciled:
                await self._retry_unreconciled()
            # All at once: a node that answers slowly must not delay the others' checks.
            # Adopted endpoints are probed by the node that adopted them (and never stopped).
            upstreams = [u for ready in self._ready.values() for u in ready.values()
                         if not u.deployment_id.startswith(ADOPTED_ID_PREFIX)]  # fmt: skip
            await asyncio.gather(*(self._check_alive_logged(u) for u in upstreams))

    async def _check_alive_logged(self, upstream: Upstream) -> None:
        try:
            await self._check_alive(upstream)
        except BerthError as exc:
            # The watcher must outlive one bad probe; the next round retries.
            log.warning("probing deployment %s failed: %s", upstream.deployment_id, exc)

    async def _check_alive(self, upstream: Upstream) -> None:
        link = self._links.get(upstream.node_id)
        if link is None:
            return
        deployment_id = upstream.deployment_id
        result = await link.probe(deployment_id)
        if result == "healthy":
            self._failed_probes.pop(deployment_id, None)
            return
        if result == "unhealthy":
            failures = self._failed_probes.get(deployment_id, 0) + 1
            self._failed_probes[deployment_id] = failures
            log.warning("deployment %s failed health probe %d", deployment_id, failures)
            if failures < UNHEALTHY_PROBES_TO_FAIL:
                return
            reason = f"engine stopped answering health checks ({failures} probes in a row)"
        else:
            reason = "engine exited unexpectedly (its process or container is gone)"
        log.warning("deployment %s: %s", deployment_id, reason)
        self._failed_probes.pop(deployment_id, None)
        self._unmark_ready(upstream.model, deployment_id)
        try:
            await link.stop_deployment(deployment_id, self._stop_grace_s)
        except NotFoundError:
            pass
        except EngineError as exc:  # still failed: it is not routed to any more either way
            reason = f"{reason}; stopping what was left failed: {exc}"
        await self._transition(deployment_id, DeploymentState.FAILED, failure_reason=reason)
