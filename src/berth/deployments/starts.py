"""Carrying a start out: a placed deployment's engine started on its node, or a restart's.

The lifecycle manager decides and records where a deployment goes; :class:`EngineStarts`
then marks it loading, finds (or pulls) the model on the node, asks the node's link to start
the engine, and marks it ready, or hands a failed start to the restart policy
(:class:`~berth.deployments.supervisor.Supervisor`, which it owns: a restart after its backoff
comes back here through ``start_again``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from berth.cluster.leader.agent_link import AgentLink
from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.lora_plan import LoraPlan
from berth.deployments.restarts import Backoff, Ending
from berth.deployments.signing import SpecSigning, is_spec_refusal
from berth.deployments.supervisor import RestartListener, Supervisor
from berth.deployments.transitions import StateWriter
from berth.errors import BerthError, EngineError, PolicyError
from berth.placement import ModelAt, ModelPull, Placement
from berth.store import Store
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import EngineName, RuntimeName
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import RESTARTING_STATES, DeploymentState

log = logging.getLogger(__name__)


class EngineStarts:
    """The starts in flight (:attr:`starting`, by deployment id: the lifecycle manager
    cancels one to stop it) and the restart policy (:attr:`supervisor`).

    ``health_timeout_s`` bounds an engine's start until it answers its health probe;
    ``restart_backoff`` paces restarts; ``on_restart`` hears of each one carried out.
    """

    def __init__(
        self,
        store: Store,
        links: LinkRegistry,
        writer: StateWriter,
        *,
        health_timeout_s: float,
        restart_backoff: Backoff,
        on_restart: RestartListener | None,
        signing: SpecSigning,
    ) -> None:
        self._signing = signing
        self._store = store
        self._links = links
        self._writer = writer
        self._health_timeout_s = health_timeout_s
        self._on_restart = on_restart
        self._starting: dict[str, asyncio.Task[None]] = {}
        self.supervisor = Supervisor(store, writer, self._start_again, backoff=restart_backoff)

    @property
    def starting(self) -> dict[str, asyncio.Task[None]]:
        """The start task of each deployment whose engine is being started."""
        return self._starting

    def begin(
        self,
        record: DeploymentRecord,
        link: AgentLink,
        placement: Placement,
        engine: EngineName,
        lora: LoraPlan,
    ) -> None:
        """Start ``record``'s engine on ``link``'s node as ``placement`` says, in the
        background (the task is in :attr:`starting` until it ends)."""

        async def request() -> DeploymentRequest:
            await self._writer.transition(record.id, DeploymentState.LOADING)
            model_path = await self._model_path(record, link, placement.model)
            built = start_request(record, model_path, engine, placement.runtime, lora)
            return await self._signing.sign_accepted(built)  # the one place that signs

        self._track(record.id, self._carry_out_start(record, link, request))

    def _track(self, deployment_id: str, start: Coroutine[Any, Any, None]) -> None:
        """Run ``start`` as the deployment's start task, in :attr:`starting` until it ends."""
        task = asyncio.create_task(start, name=deployment_id)
        self._starting[deployment_id] = task
        task.add_done_callback(lambda _t: self._starting.pop(deployment_id, None))

    async def _start_again(self, deployment_id: str, ending: Ending) -> None:
        """The restart policy's backoff is over: start the deployment's engine again on its
        node, as its signed spec says (the supervisor's ``start_again``;
        :meth:`SpecSigning.for_restart`)."""
        record = await asyncio.to_thread(self._store.get_deployment, deployment_id)
        if record.state not in RESTARTING_STATES:
            return  # stopped meanwhile
        record = await self._writer.transition(
            deployment_id, DeploymentState.LOADING, restart_count=record.restart_count + 1
        )
        log.info("deployment %s: restart %d after its engine %s", deployment_id,
                 record.restart_count, ending.detail)  # fmt: skip
        if self._on_restart is not None:
            self._on_restart(record, ending)
        link = self._links.get(record.node_id)

        async def request() -> DeploymentRequest:
            if link is None:
                raise EngineError(f"node {record.node_id} is not connected")
            return self._signing.for_restart(record)  # what was signed, verified

        self._track(record.id, self._carry_out_start(record, link, request))

    async def _carry_out_start(
        self,
        record: DeploymentRecord,
        link: AgentLink | None,
        request: Callable[[], Awaitable[DeploymentRequest]],
    ) -> None:
        """Start the engine ``request()`` describes on ``link``'s node, then mark the
        deployment ready; a start that fails goes to the restart policy (a first start
        fails, a restart's backs off again)."""
        try:
            built = await request()
            assert link is not None  # request() raised otherwise
            self._signing.check_node(link, record.id)

            async def record_spawn(pid: int, port: int) -> None:
                # Recorded before the engine is healthy, so a crash mid-load can be cleaned up.
                await asyncio.to_thread(
                    self._store.update_deployment_runtime, record.id, port=port, pid=pid
                )

            def record_progress(line: str) -> None:
                if record.id in self._starting:  # a late line must not outlive the start
                    self._writer.set_progress(record.id, line)

            endpoint = await link.start_deployment(
                built,
                self._health_timeout_s,
                on_spawned=record_spawn,
                on_progress=record_progress,
            )
        except asyncio.CancelledError:
            return  # stop() owns the transition to stopping/stopped
        except BerthError as exc:
            # A refusal by a spec check or by the node's policy is permanent: no restart can
            # help, so fail it at once, saying why (not a crashloop of refusals).
            if is_spec_refusal(exc) or isinstance(exc, PolicyError):
                log.error("deployment %s was not started: %s", record.id, exc)
                await self._writer.transition(
                    record.id, DeploymentState.FAILED, failure_reason=str(exc)
                )
                return
            log.warning("deployment %s failed to start: %s", record.id, exc)
            await self._start_failed(record, link, str(exc))
            return
        except Exception as exc:  # a bug must not leave the deployment loading forever
            log.exception("deployment %s: unexpected failure while starting", record.id)
            reason = f"unexpected error while starting: {type(exc).__name__}: {exc}"
            await self._start_failed(record, link, reason)
            return
        current = await asyncio.to_thread(self._store.get_deployment, record.id)
        if current.state is not DeploymentState.LOADING:
            return
        await self._writer.transition(
            record.id,
            DeploymentState.READY,
            endpoint=endpoint,
            # A link that dropped as the start finished: routed again when its agent
            # reconnects and reports the engine (node_connected).
            routable=lambda: self._links.is_current(link),
            port=endpoint.port,
            pid=endpoint.pid,
        )
        self.supervisor.became_ready(record.id)
        if not self._links.is_current(link):
            log.warning("deployment %s is ready but node %s is gone", record.id, record.node_id)
            return
        if endpoint.remote:
            log.info("deployment %s ready on node %s (port %d there, through its agent)",
                     record.id, record.node_id, endpoint.port)  # fmt: skip
        else:
            log.info("deployment %s ready at %s", record.id, endpoint.base_url)

    async def _start_failed(
        self, record: DeploymentRecord, link: AgentLink | None, reason: str
    ) -> None:
        """A start failed with ``reason``: failed, or restarted later (a restart's)."""
        first_line = reason.strip().splitlines()[0] if reason.strip() else "start failed"
        ending = Ending("start_failed", f"start failed: {first_line[:200]}")
        await self.supervisor.ended(record.id, ending, link=link, reason=reason)

    async def _model_path(
        self, record: DeploymentRecord, link: AgentLink, source: ModelAt | ModelPull
    ) -> Path:
        """Where the model is on the node; one the node must pull is downloaded first, and
        its path there recorded."""
        if isinstance(source, ModelAt):
            return source.path
        log.info("deployment %s: node %s pulls %s", record.id, link.node_id, source.repo_id)
        located = await link.pull_model(source.repo_id, source.revision)
        await asyncio.to_thread(
            self._store.set_model_location, record.model_name, link.node_id, located
        )
        return Path(located)


def start_request(
    record: DeploymentRecord,
    model_path: Path,
    engine: EngineName,
    runtime: RuntimeName,
    lora: LoraPlan,
) -> DeploymentRequest:
    """What the node is asked to start for ``record`` (a first start's or a restart's)."""
    return DeploymentRequest(
        deployment_id=record.id,
        model_name=record.model_name,
        model_path=model_path,
        engine=engine,
        port=0,  # the agent core picks the port and the log file on its host
        log_path=Path(),
        gpus=record.gpus,
        ctx=record.ctx,
        extra_args=record.extra_args,
        served_model_name=record.served_model_name,
        runtime=runtime,
        image=record.image,
        adapter_slots=lora.slots,
        max_lora_rank=lora.max_rank,
        lora_target_modules=lora.target_modules,
        lora_files=lora.files,
    )
