"""The scaling controller: keeps each service between its replica bounds.

It watches every service's deployments (the lifecycle manager tells it of each state
change), what they have in flight and when they were last used (the router's signal board),
and the requests waiting for a load (:class:`~berth.scaling.on_demand.DemandBoard`).  Every
``interval_s``, and at once when requests start waiting or the settings change, it asks
:func:`berth.scaling.decisions.decide` what to do about each service and carries the
answer out through its :class:`Fleet` (the daemon's adapter over the lifecycle manager):
start a replica (placed by the lifecycle manager's placement, evicting idle deployments of
other services when it needs their VRAM) or stop some.  Each stop is written to the audit
log with its reason, and the last decision about each service is kept for
``berth service show``.

Only one start per service is under way at a time, so a burst of requests on a cold service
starts exactly one deployment.  Event-loop only; no store access (the daemon hands it the
services and deployments).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from berth.errors import BerthError, ConflictError, NotFoundError, PolicyError
from berth.routing.routes import RouteTable
from berth.scaling.capacity import replica_capacity
from berth.scaling.decisions import (
    Decision,
    Hold,
    Replica,
    ServiceLoad,
    StartCause,
    Stop,
    StopCause,
    busy_since,
    decide,
)
from berth.scaling.decisions import Start as StartDecision
from berth.scaling.fleet import Activity, Audit, Fleet
from berth.scaling.metrics import ScalingMetrics
from berth.scaling.on_demand import DemandBoard, LoadFailure, OnDemandStage
from berth.scaling.policy import ScalingPolicy
from berth.scaling.status import DecisionRecord, ReplicaUsage, ServiceStatus
from berth.vocab.records import DeploymentRecord, ServiceProfileRecord
from berth.vocab.states import TERMINAL_STATES, DeploymentState

log = logging.getLogger(__name__)

_STARTING = (DeploymentState.PENDING, DeploymentState.LOADING)

#: The priority of the service whose start is being placed, in that start's task: the
#: eviction choice may then stop only deployments of services of at most that priority.
_starting_priority: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "berth_starting_priority", default=None
)


@dataclass
class _Tracked:
    deployment_id: str
    service: str
    node_id: str
    state: DeploymentState
    ready_since: float | None


def route_services(table: RouteTable, model: str) -> tuple[str, ...]:
    """The services a request for ``model`` would load: the highest-priority services of the
    route ``model`` (its fallbacks are never loaded: they answer only what is ready);
    empty when ``model`` is not a route."""
    tiers = table.tiers.get(model)
    return tiers[0] if tiers else ()


class ScalingController:
    """Keeps every service between its replica bounds (see the module docstring).

    ``route_services(model)`` names the services a request for ``model`` would load, in the
    order to try (the route's highest-priority services; empty when ``model`` is no route).
    ``audit`` writes one event to the audit log.  ``clock`` is monotonic seconds, shared with
    ``activity``; ``wall_clock`` gives epoch seconds for what leaves the controller.
    """

    def __init__(
        self,
        fleet: Fleet,
        activity: Activity,
        *,
        route_services: Callable[[str], Sequence[str]],
        policy: ScalingPolicy | None = None,
        metrics: ScalingMetrics | None = None,
        audit: Audit | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._fleet = fleet
        self._activity = activity
        self._route_services = route_services
        self.policy = policy or ScalingPolicy()
        self.metrics = metrics or ScalingMetrics()
        self._audit = audit
        self._clock = clock
        self._wall_clock = wall_clock
        self.board = DemandBoard()
        self.stage = OnDemandStage(self, self.board, self.policy, self.metrics, clock=clock)
        self._services: dict[str, ServiceProfileRecord] = {}
        self._replicas: dict[str, _Tracked] = {}
        self._placing: dict[str, asyncio.Task[None]] = {}
        self._notes: dict[str, str] = {}
        self._stopping: dict[str, asyncio.Task[None]] = {}
        self._busy_since: dict[str, float] = {}
        self._last_action: dict[str, DecisionRecord] = {}
        self._decision: dict[str, DecisionRecord] = {}
        self._loop: asyncio.Task[None] | None = None
        #: nodes being drained: their replicas are leaving (:mod:`berth.scaling.decisions`)
        self._draining: frozenset[str] = frozenset()

    # -- start-up and shut-down -----------------------------------------------------------

    def start(
        self, services: Iterable[ServiceProfileRecord], active: Iterable[DeploymentRecord]
    ) -> None:
        """Take the services and their active deployments as they are now, and start looking
        every ``interval_s``.  A deployment found ready counts as ready from now, so a
        restarted leader gives each its full idle timeout; replicas tracked before (a
        leader that stood by meanwhile) are forgotten."""
        self._replicas.clear()
        self.services_changed(services)
        for record in active:
            self.deployment_changed(record)
        self._loop = asyncio.create_task(self._run(), name="berth-scaling")

    async def close(self) -> None:
        """Stop looking, and cancel the starts and stops under way."""
        tasks = [t for t in (self._loop, *self._placing.values(), *self._stopping.values()) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                self.tick()
            except Exception:  # the loop must outlive a bug in one look
                log.exception("scaling: a look at the services failed")

    # -- what it hears --------------------------------------------------------------------

    def services_changed(self, services: Iterable[ServiceProfileRecord]) -> None:
        """The services are now ``services`` (after any change to them): removed ones are
        forgotten, and each is looked at again at once."""
        current = {s.name: s for s in services}
        for gone in set(self._services) - set(current):
            self.metrics.forget(gone)
            self.board.forget(gone)
            for table in (self._busy_since, self._last_action, self._decision, self._notes):
                table.pop(gone, None)
        for name, service in current.items():
            failure = self.board.failure(name)
            before = self._services.get(name)
            if failure is not None and failure.policy_refused and before != service:
                self.board.clear_failure(name)  # changed: worth trying again
        self._services = current
        if self._loop is not None:
            self.tick()

    def deployment_changed(self, record: DeploymentRecord) -> None:
        """A deployment's state changed (the lifecycle manager's state listener).  Only
        deployments serving a service's name are its replicas."""
        service = record.served_model_name
        tracked = self._replicas.get(record.id)
        if service not in self._services and tracked is None:
            return
        if record.state in TERMINAL_STATES:
            self._replicas.pop(record.id, None)
            never_ready = tracked is None or tracked.ready_since is None
            if record.state is DeploymentState.FAILED and never_ready:
                # A start that failed: its waiters hear why, and no new one starts at once.
                reason = f"deployment {record.id} failed: {record.failure_reason or 'no reason'}"
                self.board.failed(service, LoadFailure(reason, self._clock()))
        else:
            if tracked is None:
                tracked = self._replicas[record.id] = _Tracked(
                    record.id, service, record.node_id, record.state, None
                )
            tracked.state = record.state
            if record.state is DeploymentState.READY and tracked.ready_since is None:
                tracked.ready_since = self._clock()
        self.board.changed(service)
        self._count(service)

    def set_draining_nodes(self, nodes: frozenset[str]) -> None:
        """The nodes being drained are now ``nodes``: their replicas are leaving (the drain
        replaces and stops them; the controller counts them towards no surplus)."""
        self._draining = frozenset(nodes)

    def evicted(self, deployment_id: str, for_service: str, reason: str) -> None:
        """The fleet stops ``deployment_id`` to make room for ``for_service``: audited and
        counted, with placement's reason line."""
        tracked = self._replicas.get(deployment_id)
        service = tracked.service if tracked is not None else None
        self._write_audit(
            "deployment_evicted",
            deployment_id,
            service,
            reason=f"to make room for service {for_service}: {reason}",
        )
        if service is not None:
            self.metrics.unloaded(service, "evicted")
            self._record(
                service,
                DecisionRecord(
                    "stop", f"evicted for service {for_service}: {reason}", self._wall_clock(),
                    (deployment_id,),
                ),
                action=True,
            )  # fmt: skip

    # -- the on-demand stage's questions (LoadStarter) ------------------------------------

    def loadable_service(self, model: str) -> str | None:
        """The first service behind route ``model`` berth may start (``max_replicas`` at
        least 1); ``None`` for any other name."""
        for name in self._route_services(model):
            service = self._services.get(name)
            if service is not None and service.scaling.max_replicas > 0:
                return name
        return None

    def demand(self, service: str) -> None:
        """Requests wait for ``service``: look at it now (starting a replica if none is
        ready or starting)."""
        if service in self._services:
            self._look(service, self._clock())

    def load_progress(self, service: str) -> str:
        """How far ``service``'s load got, for the 503 of a request that waited too long."""
        starting = [t for t in self._replicas.values() if t.service == service
                    and t.state in _STARTING]  # fmt: skip
        if starting:
            parts = []
            for t in starting:
                progress = self._fleet.progress(t.deployment_id)
                line = f"deployment {t.deployment_id} on node {t.node_id} is {t.state}"
                parts.append(f"{line} ({progress})" if progress else line)
            return "; ".join(parts)
        if service in self._placing:
            return self._notes.get(service, "its replica is being placed")
        ready = [t for t in self._replicas.values() if t.service == service
                 and t.state is DeploymentState.READY]  # fmt: skip
        if ready:
            nodes = ", ".join(sorted({t.node_id for t in ready}))
            return f"its ready deployments are on unreachable nodes ({nodes})"
        decision = self._decision.get(service)
        return decision.reason if decision is not None else "no replica is starting"

    # -- what others read -----------------------------------------------------------------

    def status(self, service: str) -> ServiceStatus | None:
        """``service`` as the controller sees it; ``None`` for one it does not know."""
        record = self._services.get(service)
        if record is None:
            return None
        return ServiceStatus(
            replicas=self._counts(service),
            queued=self.board.waiting(service),
            capacity=replica_capacity(record, default_slots=self.policy.default_slots),
            last_action=self._last_action.get(service),
            decision=self._decision.get(service),
        )

    def usage(self, deployment_id: str) -> ReplicaUsage:
        """How ``deployment_id`` is used, for the eviction choice (a deployment of no
        service: only what is in flight on it)."""
        in_flight = self._activity.in_flight(deployment_id)
        last = self._activity.last_active_at(deployment_id)
        last_wall = None if last is None else self._wall_clock() - (self._clock() - last)
        tracked = self._replicas.get(deployment_id)
        service = self._services.get(tracked.service) if tracked is not None else None
        if service is None:
            return ReplicaUsage(last_wall, in_flight, 0, protected=False)
        asking = _starting_priority.get()
        outranks = asking is not None and service.scaling.priority > asking
        active = sum(
            1 for t in self._replicas.values()
            if t.service == service.name and t.deployment_id not in self._stopping
        )  # fmt: skip
        at_floor = active <= service.scaling.min_replicas
        return ReplicaUsage(
            last_wall,
            in_flight,
            self.board.waiting(service.name),
            protected=service.scaling.pinned or outranks or at_floor,
        )

    # -- looking and acting -----------------------------------------------------------------

    def tick(self) -> None:
        """Look at every service once (the loop does this every ``interval_s``)."""
        now = self._clock()
        for name in list(self._services):
            self._look(name, now)

    def _look(self, name: str, now: float) -> None:
        service = self._services[name]
        if name in self._placing:
            self._record(name, DecisionRecord(
                "hold", self._notes.get(name, "a replica is being placed"), self._wall_clock()
            ))  # fmt: skip
            return
        load = self._load(service, now)
        started = busy_since(load, now)
        if started is None:
            self._busy_since.pop(name, None)
        else:
            self._busy_since[name] = started
        decision = decide(
            ServiceLoad(load.name, load.settings, load.capacity, load.replicas, load.queued,
                        started),
            now,
            scale_out_after_s=self.policy.scale_out_after_s,
        )  # fmt: skip
        self._act(service, decision, now)

    def _load(self, service: ServiceProfileRecord, now: float) -> ServiceLoad:
        routable = self._fleet.routable(service.name)
        replicas = tuple(
            Replica(
                deployment_id=t.deployment_id,
                node_id=t.node_id,
                state=DeploymentState.STOPPING if t.deployment_id in self._stopping else t.state,
                in_flight=self._activity.in_flight(t.deployment_id),
                ready_since=t.ready_since,
                last_request_at=self._last_request(t),
                routable=t.deployment_id in routable,
                leaving=t.node_id in self._draining,
            )
            for t in self._replicas.values()
            if t.service == service.name
        )
        return ServiceLoad(
            service.name,
            service.scaling,
            replica_capacity(service, default_slots=self.policy.default_slots),
            replicas,
            self.board.waiting(service.name),
            self._busy_since.get(service.name),
        )

    def _last_request(self, tracked: _Tracked) -> float | None:
        last = self._activity.last_active_at(tracked.deployment_id)
        if last is None or tracked.ready_since is None or last < tracked.ready_since:
            return None
        return last

    def _act(self, service: ServiceProfileRecord, decision: Decision, now: float) -> None:
        name = service.name
        wall = self._wall_clock()
        if isinstance(decision, StartDecision):
            failure = self.board.failure(name)
            # After a refusal (no room), a request may try again at once; the controller's
            # own starts (min_replicas, scale out) and any start after an engine failed wait.
            retry_now = decision.cause == "on_demand" and not (failure and failure.engine_failed)
            if failure is not None and failure.policy_refused and not retry_now:
                reason = (
                    f"{decision.reason}; the last start was refused by the agent policy, "
                    "not tried again until the service changes or a request asks for it"
                )
                self._record(name, DecisionRecord("hold", f"{reason}: {failure.reason}", wall))
                return
            recent = failure is not None and now - failure.at < self.policy.failed_load_hold_s
            if failure is not None and recent and not retry_now:
                wait = self.policy.failed_load_hold_s - (now - failure.at)
                reason = f"{decision.reason}; the last start failed, next try in {wait:.0f} s"
                self._record(name, DecisionRecord("hold", f"{reason}: {failure.reason}", wall))
                return
            self._record(name, DecisionRecord("start", decision.reason, wall), action=True)
            log.info("scaling: service %s: start a replica: %s", name, decision.reason)
            self.board.clear_failure(name)
            self._placing[name] = asyncio.create_task(
                self._start(service, decision.cause), name=f"berth-scale-{name}"
            )
        elif isinstance(decision, Stop):
            ids = tuple(d for d in decision.deployment_ids if d not in self._stopping)
            if not ids:
                return
            self._record(name, DecisionRecord("stop", decision.reason, wall, ids), action=True)
            log.info("scaling: service %s: stop %s: %s", name, ", ".join(ids), decision.reason)
            for deployment_id in ids:
                self._stopping[deployment_id] = asyncio.create_task(
                    self._stop(name, deployment_id, decision.cause, decision.reason),
                    name=f"berth-unload-{deployment_id}",
                )
            self._count(name)
        else:
            assert isinstance(decision, Hold)
            self._record(name, DecisionRecord("hold", decision.reason, wall))

    async def _start(self, service: ServiceProfileRecord, cause: StartCause) -> None:
        name = service.name
        _starting_priority.set(service.scaling.priority)  # this task's context only

        def note(line: str) -> None:
            self._notes[name] = line
            self.board.changed(name)

        try:
            deployment_id = await self._fleet.start_replica(
                service, note, lambda evicted, reason: self.evicted(evicted, name, reason)
            )
        except BerthError as exc:
            log.warning("scaling: service %s: the start was refused: %s", name, exc)
            self.metrics.loaded(name, "refused")
            self._record(name, DecisionRecord(
                "hold", f"the start was refused: {exc}", self._wall_clock()
            ), action=True)  # fmt: skip
            refused = isinstance(exc, PolicyError)
            self.board.failed(
                name,
                LoadFailure(str(exc), self._clock(), engine_failed=False, policy_refused=refused),
            )
        except Exception as exc:  # a bug must not leave the service's waiters hanging
            log.exception("scaling: service %s: unexpected failure while starting", name)
            reason = f"unexpected error while starting: {type(exc).__name__}: {exc}"
            self.board.failed(name, LoadFailure(reason, self._clock()))
        else:
            self.metrics.loaded(name, cause)
            log.info("scaling: service %s: replica %s placed", name, deployment_id)
        finally:
            self._placing.pop(name, None)
            self._notes.pop(name, None)
            self.board.changed(name)

    async def _stop(self, service: str, deployment_id: str, cause: StopCause, reason: str) -> None:
        outcome = "stopped"
        try:
            await self._fleet.stop_replica(deployment_id)
        except (ConflictError, NotFoundError) as exc:
            outcome = f"already gone: {exc}"
        except BerthError as exc:
            outcome = f"stop failed: {exc}"
            log.warning("scaling: stopping %s failed: %s", deployment_id, exc)
        finally:
            self._stopping.pop(deployment_id, None)
        self.metrics.unloaded(service, cause)
        why = "idle" if cause == "idle" else "above max_replicas"
        self._write_audit(
            "deployment_unloaded", deployment_id, service, reason=f"{why}: {reason}",
            outcome=outcome,
        )  # fmt: skip
        self._count(service)

    # -- bookkeeping ------------------------------------------------------------------------

    def _record(self, service: str, record: DecisionRecord, *, action: bool = False) -> None:
        self._decision[service] = record
        if action:
            self._last_action[service] = record

    def _counts(self, service: str) -> dict[DeploymentState, int]:
        counts: dict[DeploymentState, int] = {}
        for t in self._replicas.values():
            if t.service == service:
                state = DeploymentState.STOPPING if t.deployment_id in self._stopping else t.state
                counts[state] = counts.get(state, 0) + 1
        return counts

    def _count(self, service: str) -> None:
        if service in self._services:
            self.metrics.replicas(service, self._counts(service))

    def _write_audit(
        self, event: str, deployment_id: str, service: str | None, **fields: str
    ) -> None:
        if self._audit is None:
            return
        entry: dict[str, object] = {
            "event": event,
            "at": datetime.fromtimestamp(self._wall_clock(), UTC).isoformat(),
            "deployment": deployment_id,
            "service": service,
            **fields,
        }
        try:
            self._audit(entry)
        except OSError as exc:  # an unwritable audit log must not stop scaling
            log.warning("scaling: cannot write the audit log (%s): %s", exc, entry)
