"""Keeping the store in line with the engines that really run.

Four moments: the leader's start (engines of node ``local`` that outlived a crash, and
containers the local core took back), an agent's Hello (the engines it reports), an engine's
exit the moment its runtime sees it (:meth:`Reconciler.engine_ended`: node ``local``'s core
calls it, an agent reports it over its link at once), and every watch interval (health
probes of ready engines).  A ready deployment whose engine runs is
routed to again; one caught mid-start is stopped and failed; one whose engine is gone, or
stopped answering health checks, is failed; an engine no active deployment owns is stopped.

The health watch, every ``watch_interval_s``: each ready engine is probed with a timeout of
its own (``probe_timeout_s``, below the interval, so a hung engine costs one short wait, not
the link's control timeout).  One failed probe makes the deployment *suspect*: out of routing
for new requests at once (:meth:`ReadyTable.mark_suspect`), and the requests waiting on it
for a first byte are sent to another candidate (:mod:`berth.routing.waiting`).  The next
probe that answers puts it back.  ``probes_to_fail`` failed probes in a row fail it: its
waiting requests end or move on at once, then its engine is stopped.  A probe the node could
not answer (its link or its runtime failed) makes the deployment suspect too, without
counting towards failing it: the engine itself may be fine.  After the probes, the engines
that answered are handed to ``after_probes`` when one is set (the prefix policy reads their
cache signals then: :mod:`berth.routing.cache_probe`), within the same round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from berth.cluster.leader.agent_link import LOCAL_NODE_ID, AgentLink, EngineEndpoint, EngineReport
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.protocol.payloads import EngineState
from berth.deployments.ready_table import ReadyTable
from berth.deployments.restarts import EndCause, Ending
from berth.deployments.supervisor import Supervisor
from berth.deployments.transitions import StateWriter
from berth.errors import BerthError, EngineError, InvalidTransitionError, NotFoundError
from berth.routing.resolver import Upstream
from berth.routing.waiting import GiveUp, WaitingAttempts
from berth.runtime.base import EngineExit
from berth.store import Store
from berth.vocab.engines import parse_runtime_name
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import DeploymentState

log = logging.getLogger(__name__)

#: Seconds between health probes of ready engines (the ``probe_interval_s`` setting).
WATCH_INTERVAL_S = 5.0
#: Seconds one probe may take (the ``probe_timeout_s`` setting).
PROBE_TIMEOUT_S = 2.0
#: Consecutive failed health probes after which a running engine counts as hung: it is
#: stopped and its deployment marked failed (the ``probes_to_fail`` setting).
UNHEALTHY_PROBES_TO_FAIL = 3

#: An engine as an agent reports it (in Hello) or the local core lists it.
Engine = EngineState | EngineReport


class Reconciler:
    """Reconciles deployments with engines, at start-up, on reconnect and while watching.

    ``is_starting(deployment_id)`` says whether the lifecycle manager is starting it now
    (such a deployment is left alone: its start owns it).  ``waiting`` holds the requests
    waiting for a first byte, woken when a deployment is given up (``None``: no proxy).
    ``supervisor`` decides whether an engine found ended is started again (``None``: it
    fails, as under the restart policy ``never``).
    """

    def __init__(
        self,
        store: Store,
        links: LinkRegistry,
        table: ReadyTable,
        writer: StateWriter,
        *,
        stop_grace_s: float,
        is_starting: Callable[[str], bool],
        watch_interval_s: float = WATCH_INTERVAL_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        probes_to_fail: int = UNHEALTHY_PROBES_TO_FAIL,
        waiting: WaitingAttempts | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self._store = store
        self._supervisor = supervisor
        self._links = links
        self._table = table
        self._writer = writer
        self._stop_grace_s = stop_grace_s
        self._is_starting = is_starting
        self._watch_interval_s = watch_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._probes_to_fail = probes_to_fail
        self._waiting = waiting
        self._failed_probes: dict[str, int] = {}
        #: deployments whose ended engine is being dealt with (stopped, restarted or failed)
        self._ending: dict[str, asyncio.Task[None]] = {}
        #: local deployments whose runtime could not be asked at start-up (Docker down)
        self._unreconciled: set[str] = set()
        #: heard after each round, with the engines that answered their probe
        self.after_probes: Callable[[Sequence[Upstream]], Awaitable[None]] | None = None

    # -- the leader's start -----------------------------------------------------------------

    async def reconcile_local(self) -> None:
        """Bring node ``local``'s deployments in line with the engines that survived.

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
            await self._stop_orphans(local, await local.engines(), owned)

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
            await self._writer.transition(record.id, DeploymentState.FAILED, failure_reason=reason)
        elif record.state is DeploymentState.READY:
            log.info("re-attached deployment %s (pid %d)", record.id, endpoint.pid)
            self._writer.route(record, endpoint)
        else:
            assert link is not None
            reason = f"daemon restarted while the deployment was {record.state}"
            try:
                await link.stop_deployment(record.id, self._stop_grace_s)
            except EngineError as exc:
                reason = f"{reason}; stopping its engine failed: {exc}"
            await self._writer.transition(record.id, DeploymentState.FAILED, failure_reason=reason)

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
        self, link: AgentLink, engines: Sequence[Engine], owned: set[str]
    ) -> None:
        """Stop the engines (processes or containers) on ``link``'s node that no active
        deployment in ``owned`` accounts for, and say so in the log."""
        for engine in engines:
            orphan = engine.deployment_id
            if orphan in owned or self._is_starting(orphan) or not self._links.is_current(link):
                continue
            log.warning(
                "node %s runs engine %s (pid %d, port %d) that no active deployment owns: "
                "stopping it",
                link.node_id,
                orphan,
                engine.pid,
                engine.port,
            )
            with contextlib.suppress(NotFoundError, EngineError):
                await link.stop_deployment(orphan, self._stop_grace_s)

    # -- an agent's Hello ---------------------------------------------------------------------

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
            if not self._links.is_current(link):
                return  # that session ended (or was superseded) meanwhile
            if record.node_id != node_id or self._is_starting(record.id):
                continue
            if self._supervisor is not None and self._supervisor.is_pending(record.id):
                continue  # waiting out its backoff: its restart owns it
            try:
                await self._reconcile_one(link, record, reported.pop(record.id, None))
            except (InvalidTransitionError, NotFoundError) as exc:
                log.info("deployment %s changed while node %s reconnected: %s", record.id,
                         node_id, exc)  # fmt: skip
        await self._stop_orphans(link, list(reported.values()), owned)

    async def _reconcile_one(
        self, link: AgentLink, record: DeploymentRecord, engine: EngineState | None
    ) -> None:
        node_id = link.node_id
        if engine is not None and engine.alive and record.state is DeploymentState.READY:
            endpoint = EngineEndpoint(record.id, "", engine.pid, engine.port, remote=True)
            self._writer.route(record, endpoint)
            return
        if engine is None:
            reason = f"engine was gone when node {node_id} reconnected"
            if record.state is DeploymentState.READY:
                ending = Ending("gone", f"gone when node {node_id} reconnected")
                await self._ended(link, record.id, ending, reason)
                return
        else:
            reason = f"node {node_id} reconnected while the deployment was {record.state}"
            with contextlib.suppress(NotFoundError, EngineError):
                await link.stop_deployment(record.id, self._stop_grace_s)
        log.warning("deployment %s: %s", record.id, reason)
        await self._writer.transition(record.id, DeploymentState.FAILED, failure_reason=reason)

    # -- watching -----------------------------------------------------------------------------

    async def watch(self) -> None:
        """Forever, one round every ``watch_interval_s``: probe the ready engines (see the
        module docstring), and retry local deployments that could not be reconciled."""
        loop = asyncio.get_running_loop()
        next_round = loop.time() + self._watch_interval_s
        while True:
            # Rounds start one interval apart, however long the probes took (each is
            # bounded), so a hung engine is noticed within an interval and a probe timeout.
            await asyncio.sleep(max(0.0, next_round - loop.time()))
            next_round = loop.time() + self._watch_interval_s
            if self._unreconciled:
                await self._retry_unreconciled()
            # All at once: a node that answers slowly must not delay the others' checks.
            upstreams = self._table.engines_to_watch()
            answered = await asyncio.gather(*(self._check_alive_logged(u) for u in upstreams))
            if self.after_probes is not None:
                healthy = [u for u, ok in zip(upstreams, answered, strict=True) if ok]
                try:
                    await self.after_probes(healthy)
                except BerthError as exc:  # the watch must outlive it; the next round retries
                    log.warning("after the health probes: %s", exc)

    async def _check_alive_logged(self, upstream: Upstream) -> bool:
        """:meth:`_check_alive`: whether the engine answered its probe."""
        try:
            return await self._check_alive(upstream)
        except BerthError as exc:
            # The watcher must outlive one bad probe; the next round retries.
            log.warning("probing deployment %s failed: %s", upstream.deployment_id, exc)
            return False

    async def _check_alive(self, upstream: Upstream) -> bool:
        """Probe ``upstream``'s engine and act on the answer; whether it answered healthy."""
        link = self._links.get(upstream.node_id)
        if link is None:
            return False
        deployment_id = upstream.deployment_id
        try:
            result = await link.probe(deployment_id, self._probe_timeout_s)
        except EngineError as exc:
            # The node could not say (its link or its runtime failed): not routed to while
            # that lasts, but not held against the engine.
            self._suspect(upstream, f"could not be probed ({exc})")
            return False
        if result == "healthy":
            self._failed_probes.pop(deployment_id, None)
            if self._table.clear_suspect(deployment_id):
                log.info("deployment %s answers its health probe again: routed to", deployment_id)
            return True
        if result == "unhealthy":
            failures = self._failed_probes.get(deployment_id, 0) + 1
            self._failed_probes[deployment_id] = failures
            log.warning("deployment %s failed health probe %d of %d", deployment_id, failures,
                        self._probes_to_fail)  # fmt: skip
            if failures < self._probes_to_fail:
                why = f"failed a health probe (no 200 within {self._probe_timeout_s:g} s)"
                self._suspect(upstream, why)
                return False
            reason = f"engine stopped answering health checks ({failures} probes in a row)"
            ending = Ending("unhealthy", f"stopped after {failures} failed health probes")
        else:
            if deployment_id in self._ending:
                return False  # its exit was heard first: being dealt with
            # Asked before the stop forgets it.
            reason, ending = _exit_words(link.last_exit(deployment_id))
        self._take_out(upstream, reason)
        await self._stop_and_end(link, deployment_id, ending, reason)
        return False

    def engine_ended(self, node_id: str, deployment_id: str, exited: EngineExit | None) -> None:
        """The ready engine of ``deployment_id`` on ``node_id`` ended by itself, as its
        runtime saw it (``exited``: how, when known): out of routing now, before the next
        request, its waiting requests moved on; then, in the background, what is left of it
        stopped and the restart policy applied, as when a probe finds an engine gone.  An
        engine that is not ready here (starting: its start owns it; stopping) is left
        alone."""
        upstream = self._table.ready_upstream(deployment_id)
        link = self._links.get(node_id)
        if upstream is None or upstream.node_id != node_id or link is None:
            return
        if deployment_id in self._ending:
            return
        reason, ending = _exit_words(exited)
        self._take_out(upstream, reason)
        task = asyncio.create_task(
            self._stop_and_end(link, deployment_id, ending, reason), name=f"ended-{deployment_id}"
        )
        self._ending[deployment_id] = task
        task.add_done_callback(lambda done: self._ending_done(deployment_id, done))

    async def stop_ending(self) -> None:
        """Cancel what is being done about ended engines (the leader stops leading)."""
        tasks = list(self._ending.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _ending_done(self, deployment_id: str, task: asyncio.Task[None]) -> None:
        if self._ending.get(deployment_id) is task:
            del self._ending[deployment_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("dealing with the ended engine of deployment %s failed", deployment_id,
                      exc_info=task.exception())  # fmt: skip

    def _take_out(self, upstream: Upstream, reason: str) -> None:
        """The engine is gone: no request goes to it from now on, and those waiting on it
        for a first byte move on at once, not after the stop's grace."""
        deployment_id = upstream.deployment_id
        log.warning("deployment %s: %s", deployment_id, reason)
        self._failed_probes.pop(deployment_id, None)
        self._table.unmark(upstream.model, deployment_id)
        if self._waiting is not None:
            self._waiting.give_up_deployment(deployment_id, GiveUp.FAILED, "failed")

    async def _stop_and_end(
        self, link: AgentLink, deployment_id: str, ending: Ending, reason: str
    ) -> None:
        """Stop what is left of an ended engine, then apply the restart policy."""
        try:
            await link.stop_deployment(deployment_id, self._stop_grace_s)
        except NotFoundError:
            pass
        except EngineError as exc:  # still failed: it is not routed to any more either way
            reason = f"{reason}; stopping what was left failed: {exc}"
            await self._writer.transition(
                deployment_id, DeploymentState.FAILED, failure_reason=reason
            )
            return
        await self._ended(link, deployment_id, ending, reason)

    async def _ended(
        self, link: AgentLink, deployment_id: str, ending: Ending, reason: str
    ) -> None:
        """The engine ended and nothing of it is left: restart it or fail it, as the
        restart policy says (``reason`` is the failure's sentence)."""
        if self._supervisor is None:
            await self._writer.transition(
                deployment_id, DeploymentState.FAILED, failure_reason=reason
            )
            return
        await self._supervisor.ended(deployment_id, ending, link=link, reason=reason)

    def engine_refused(self, upstream: Upstream, why: str) -> None:
        """A request found the engine of ``upstream``, believed ready, not taking it (``why``:
        it refused the connection, or broke it before answering): suspect, out of routing
        until a probe answers (the engine may have ended: its end, heard or probed, fails or
        restarts it)."""
        if self._table.ready_upstream(upstream.deployment_id) is not None:
            self._suspect(upstream, why)

    def _suspect(self, upstream: Upstream, why: str) -> None:
        """Take the deployment out of routing for new requests and move its waiting ones."""
        deployment_id = upstream.deployment_id
        if self._table.mark_suspect(deployment_id, why):
            log.warning("deployment %s %s: out of routing until a probe answers",
                        deployment_id, why)  # fmt: skip
        if self._waiting is not None:
            self._waiting.give_up_deployment(deployment_id, GiveUp.SUSPECT, why)


def _exit_words(exited: EngineExit | None) -> tuple[str, Ending]:
    """The failure's sentence and the restart policy's :class:`Ending` of an engine that
    exited as ``exited`` says (``None``: how is not known)."""
    if exited is None:
        reason = "engine exited unexpectedly (its process or container is gone)"
        return reason, Ending("gone", "exited (its process or container is gone)")
    cause: EndCause = "signal" if exited.signal is not None else "exit"
    reason = f"engine exited unexpectedly ({exited.describe()})"
    return reason, Ending(cause, exited.describe(), exited.code)
