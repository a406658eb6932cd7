"""Carrying the restart policy out: an ended engine's deployment waits out its backoff, then
its engine is started again on the same node, under the same deployment id.

The leader supervises, for every node alike: an engine's end is found by the health watch
(:mod:`berth.deployments.reconcile`: a probe found it ``gone``, or hung for ``probes_to_fail``
probes), by an agent's Hello that no longer lists it, or by a restart's start that failed.
Each finder stops what is left of the engine and calls :meth:`Supervisor.ended`, which reads
the engine log's tail over the node's link, asks :func:`berth.deployments.restarts.decide_restart`
and writes the answer: ``restarting`` or ``crashloop`` with a timer, or ``failed``.  When
the timer fires, ``start_again`` (the lifecycle manager's) moves the deployment to
``loading`` and starts its engine from its recorded spec through the node's link, as a first
start does.  A stop wins over a pending restart: :meth:`cancel` ends the timer first.

The history :func:`decide_restart` needs (restarts in a row, when the deployment became
ready) lives here, in memory: a leader that restarts starts every deployment's backoff anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime

from berth.cluster.leader.agent_link import AgentLink
from berth.deployments.restarts import (
    Backoff,
    Ending,
    GiveUp,
    RestartHistory,
    decide_restart,
)
from berth.deployments.transitions import StateWriter
from berth.errors import BerthError
from berth.observability.metrics import ProxyMetrics
from berth.store import Store
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import DeploymentState

log = logging.getLogger(__name__)

#: Engine log lines kept as a deployment's last exit log.
EXIT_LOG_TAIL_LINES = 20
#: Seconds reading that tail over a node's link may take (a slow node must not hold the
#: restart up).
EXIT_LOG_TIMEOUT_S = 5.0
#: Characters of the tail kept (a line of a runaway log can be long).
EXIT_LOG_MAX_CHARS = 4000

#: Starts the deployment's engine again once its backoff is over, told how it last ended.
StartAgain = Callable[[str, Ending], Awaitable[None]]
#: Told of each restart carried out: the deployment's record (now loading, its restart count
#: raised) and how its engine had ended.
RestartListener = Callable[[DeploymentRecord, Ending], None]
#: Writes one audit-log event (:meth:`berth.cluster.pki.enrollment.AuditLog.append`).
Audit = Callable[[Mapping[str, object]], None]


def restart_reporter(metrics: ProxyMetrics, audit: Audit | None) -> RestartListener:
    """The leader's :data:`RestartListener`: each restart counted in
    ``berth_deployment_restarts_total`` and written to the audit log as a
    ``deployment_restarted`` event (its deployment, model, node, restart count, reason and
    how the engine had ended)."""

    def restarted(record: DeploymentRecord, ending: Ending) -> None:
        metrics.deployment_restarted(
            record.id, model=record.served_model_name, node=record.node_id, reason=ending.cause
        )
        if audit is None:
            return
        event: dict[str, object] = {
            "event": "deployment_restarted",
            "at": datetime.now(UTC).isoformat(),
            "deployment": record.id,
            "model": record.served_model_name,
            "node": record.node_id,
            "restart_count": record.restart_count,
            "reason": ending.cause,
            "exit": ending.detail,
        }
        try:
            audit(event)
        except OSError as exc:  # an unwritable audit log must not stop a restart
            log.warning("cannot write the audit log (%s): %s", exc, event)

    return restarted


class Supervisor:
    """Decides and schedules the restarts of ended engines (see the module docstring).

    ``start_again(deployment_id, ending)`` is called when a backoff is over; ``clock`` is
    monotonic seconds (a fake in tests).
    """

    def __init__(
        self,
        store: Store,
        writer: StateWriter,
        start_again: StartAgain,
        *,
        backoff: Backoff = Backoff(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._writer = writer
        self._start_again = start_again
        self._backoff = backoff
        self._clock = clock
        self._history: dict[str, RestartHistory] = {}
        #: the pending restarts: their backoff timers, then their start, by deployment id
        self._timers: dict[str, asyncio.Task[None]] = {}

    def became_ready(self, deployment_id: str) -> None:
        """The deployment is ready (its engine answers health): the reset time counts from
        now."""
        history = self._history.get(deployment_id, RestartHistory())
        self._history[deployment_id] = replace(history, ready_since=self._clock(), ever_ready=True)

    def is_pending(self, deployment_id: str) -> bool:
        """Whether a restart of the deployment is waiting out its backoff (or starting)."""
        return deployment_id in self._timers

    async def ended(
        self,
        deployment_id: str,
        ending: Ending,
        *,
        link: AgentLink | None,
        reason: str,
    ) -> DeploymentRecord:
        """The deployment's engine ended as ``ending`` says (what was left of it is already
        stopped); ``reason`` is the sentence a failure keeps.  Writes ``restarting``,
        ``crashloop`` or ``failed`` with the last exit and the log's tail read over ``link``,
        and returns the record written.

        Raises ``InvalidTransitionError`` when the deployment moved on meanwhile (a stop).
        """
        record = await asyncio.to_thread(self._store.get_deployment, deployment_id)
        tail = await self._log_tail(link, deployment_id)
        history = self._history.get(deployment_id) or RestartHistory(
            ever_ready=record.state is DeploymentState.READY or record.restart_count > 0
        )
        if record.state is not DeploymentState.READY:
            history = replace(history, ready_since=None)
        decision = decide_restart(
            record.restart_policy, ending, history, self._clock(), self._backoff
        )
        if isinstance(decision, GiveUp):
            self._history.pop(deployment_id, None)
            failure = reason if decision.first_start else f"{reason}; {decision.reason}"
            log.warning("deployment %s failed: %s", deployment_id, failure)
            return await self._writer.transition(
                deployment_id,
                DeploymentState.FAILED,
                failure_reason=failure,
                last_exit=ending.detail,
                last_exit_log=tail,
            )
        target = DeploymentState.CRASHLOOP if decision.crashloop else DeploymentState.RESTARTING
        written = await self._writer.transition(
            deployment_id, target, last_exit=ending.detail, last_exit_log=tail
        )
        self._history[deployment_id] = replace(history, streak=decision.streak, ready_since=None)
        log.warning("deployment %s: %s", deployment_id, decision.reason)
        self._timers[deployment_id] = asyncio.create_task(
            self._restart_after(deployment_id, decision.delay_s, ending),
            name=f"berth-restart-{deployment_id}",
        )
        return written

    async def cancel(self, deployment_id: str) -> None:
        """Cancel the deployment's pending restart, if any, and forget its history (it is
        being stopped); returns once the timer is gone."""
        self._history.pop(deployment_id, None)
        timer = self._timers.pop(deployment_id, None)
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
            await asyncio.wait({timer})

    async def shutdown(self) -> None:
        """Cancel every pending restart (the leader stops)."""
        timers = list(self._timers.values())
        self._timers.clear()
        for timer in timers:
            timer.cancel()
        if timers:
            await asyncio.wait(timers)

    async def _restart_after(self, deployment_id: str, delay_s: float, ending: Ending) -> None:
        try:
            await asyncio.sleep(delay_s)
            await self._start_again(deployment_id, ending)
        except BerthError as exc:  # the deployment changed meanwhile (a stop raced it)
            log.info("restart of deployment %s not carried out: %s", deployment_id, exc)
        finally:
            if self._timers.get(deployment_id) is asyncio.current_task():
                del self._timers[deployment_id]

    async def _log_tail(self, link: AgentLink | None, deployment_id: str) -> str | None:
        """The engine log's last lines as the node has them; ``None`` when it cannot say."""
        if link is None:
            return None
        chunks: list[bytes] = []
        with contextlib.suppress(BerthError, TimeoutError):
            async with asyncio.timeout(EXIT_LOG_TIMEOUT_S):
                async for chunk in link.logs(
                    deployment_id, tail_lines=EXIT_LOG_TAIL_LINES, follow=False
                ):
                    chunks.append(chunk)
        text = b"".join(chunks).decode("utf-8", "replace").strip()
        return text[-EXIT_LOG_MAX_CHARS:] or None
