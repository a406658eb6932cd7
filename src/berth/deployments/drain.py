"""Carrying drains out: the I/O half of :mod:`berth.placement.drain`.

:class:`DrainRunner` runs on the active leader only (started with the other leader-only
loops).  Every ``interval_s``, and at once when a drain is asked for (:meth:`wake`), it
reads the cordoned nodes and their moves from the store (:mod:`berth.store.drains`), the
deployments, the services and the requests in flight on each deployment, asks
:func:`berth.placement.drain.plan_drain` what to do about each deployment of each draining
node, and does it, writing each step to the store *before* acting on it:

- **replace**: a deployment like it is placed elsewhere (a service's replica as the scaling
  controller would start one, evicting idle deployments when it must; a deployment of its
  own with the same model, engine, runtime, context, arguments, image and served name,
  placed by fit) through the lifecycle manager, whose placement skips cordoned nodes;
- **retire**: the replacement is ready: the old one gets no new request
  (:meth:`LifecycleManager.retire`);
- **stop**: the old one is stopped (in the background: a stop waits out its engine's grace);
- **leave**: nothing, but the reason is written.

Which deployments are retired is also the store's: each look retires those whose move says
so and routes to any other again, so a new leader (whose routing table starts empty of
retirements) keeps them out of routing.  The nodes being drained are told to the scaling
controller (``on_draining``), which then counts their replicas as leaving.  Each
replacement, stop and leave is written to the audit log (``audit``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from berth.deployments.fleet import deploy_options
from berth.deployments.lifecycle import DEFAULT_MIN_RESIDENCY_S, DeployOptions, LifecycleManager
from berth.errors import BerthError, ConflictError, NotFoundError
from berth.placement import EvictionPolicy
from berth.placement.drain import (
    RETRY_S,
    SETTLE_S,
    Action,
    DrainPlan,
    OnNode,
    Replacement,
    after_refusal,
    plan_drain,
)
from berth.store import Store
from berth.vocab.drains import MoveStep, NodeDrain
from berth.vocab.records import DeploymentRecord, ServiceProfileRecord
from berth.vocab.states import DeploymentState

log = logging.getLogger(__name__)

#: Seconds between two looks at the drains.
INTERVAL_S = 1.0

#: Writes one audit-log event.
Audit = Callable[[Mapping[str, object]], None]


class DrainRunner:
    """Carries the store's drains out on this leader (see the module docstring).

    ``in_flight(deployment_id)`` is the router's count of requests in flight on a
    deployment; ``on_draining(nodes)`` hears the set of nodes being drained after every
    look.  ``clock`` gives epoch seconds (the moves' times).
    """

    def __init__(
        self,
        store: Store,
        lifecycle: LifecycleManager,
        *,
        in_flight: Callable[[str], int],
        on_draining: Callable[[frozenset[str]], None] = lambda _nodes: None,
        audit: Audit | None = None,
        interval_s: float = INTERVAL_S,
        settle_s: float = SETTLE_S,
        retry_s: float = RETRY_S,
        min_residency_s: float = DEFAULT_MIN_RESIDENCY_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._lifecycle = lifecycle
        self._in_flight = in_flight
        self._on_draining = on_draining
        self._audit = audit
        self._interval_s = interval_s
        self._settle_s = settle_s
        self._retry_s = retry_s
        self._min_residency_s = min_residency_s
        self._clock = clock
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stops: dict[str, asyncio.Task[None]] = {}
        #: the last plan of each draining node, for the admin API's reasons
        self.plans: dict[str, DrainPlan] = {}

    # -- start and stop -------------------------------------------------------------------

    def start(self) -> None:
        """Look at the drains now and every ``interval_s`` (a new leader resumes them)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="berth-drains")

    async def stop(self) -> None:
        """Stop looking and cancel the stops under way (a new leader finishes them)."""
        tasks = [t for t in (self._task, *self._stops.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._stops.clear()
        self.plans.clear()

    def wake(self) -> None:
        """Look at the drains now (one was asked for, or called off)."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # the loop must outlive a bug or a store outage in one look
                log.exception("drain: a look at the drains failed")
            self._wake.clear()
            try:
                async with asyncio.timeout(self._interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    # -- one look -------------------------------------------------------------------------

    async def tick(self) -> None:
        """Look at every drain once and act on what :func:`plan_drain` says."""
        drains = await asyncio.to_thread(self._store.node_drains)
        self._on_draining(frozenset(d.node_id for d in drains if d.draining))
        self._keep_retired(drains)
        started = [d for d in drains if d.drain_started_at is not None]
        self.plans = {n: p for n, p in self.plans.items() if n in {d.node_id for d in started}}
        if not started:
            return
        active = await asyncio.to_thread(self._store.list_deployments, True)
        services = {s.name: s for s in await asyncio.to_thread(self._store.list_service_profiles)}
        labels = {n.id: n.label for n in await asyncio.to_thread(self._store.list_nodes, True)}
        for drain in started:
            await self._look(drain, labels.get(drain.node_id, drain.node_id), active, services)

    def _keep_retired(self, drains: list[NodeDrain]) -> None:
        wanted = {m.deployment_id for d in drains for m in d.moves if m.step == "retired"}
        for deployment_id in wanted - self._lifecycle.retired():
            self._lifecycle.retire(deployment_id)
        for deployment_id in self._lifecycle.retired() - wanted:
            self._lifecycle.unretire(deployment_id)

    async def _look(
        self,
        drain: NodeDrain,
        label: str,
        active: list[DeploymentRecord],
        services: dict[str, ServiceProfileRecord],
    ) -> None:
        by_id = {r.id: r for r in active}
        on_node = [r for r in active if r.node_id == drain.node_id]
        ready_by_name: dict[str, int] = {}
        for r in active:
            if r.state is DeploymentState.READY and r.node_id != drain.node_id:
                ready_by_name[r.served_model_name] = ready_by_name.get(r.served_model_name, 0) + 1
        deployments = [
            OnNode(
                deployment_id=r.id,
                served_model_name=r.served_model_name,
                state=r.state,
                service=r.served_model_name if r.served_model_name in services else None,
                pinned_to=(
                    services[r.served_model_name].node_label
                    if r.served_model_name in services
                    else None
                ),
                in_flight=self._in_flight(r.id),
                ready_elsewhere=ready_by_name.get(r.served_model_name, 0),
            )
            for r in on_node
        ]
        for move in drain.moves:  # a moved deployment that ended: done (its last state)
            if move.deployment_id not in by_id and move.step != "stopped":
                ended = await self._record(move.deployment_id)
                state = ended.state if ended is not None else DeploymentState.STOPPED
                deployments.append(OnNode(move.deployment_id, "", state))
        replacements: dict[str, Replacement] = {}
        for move in drain.moves:
            if move.replacement_id is None:
                continue
            found = by_id.get(move.replacement_id) or await self._record(move.replacement_id)
            replacements[move.replacement_id] = Replacement(
                move.replacement_id,
                found.state if found is not None else None,
                found.failure_reason if found is not None else None,
            )
        now = self._clock()
        plan = plan_drain(
            drain, label, deployments, replacements,
            now=now, settle_s=self._settle_s, retry_s=self._retry_s,
        )  # fmt: skip
        self.plans[drain.node_id] = plan
        records = {r.id: r for r in on_node}
        for action in plan.actions:
            await self._act(drain, action, records.get(action.deployment_id), services, now)
        if plan.finished and drain.finished_at is None:
            await asyncio.to_thread(self._store.finish_drain, drain.node_id, now)
            left = [a.deployment_id for a in plan.actions if a.kind == "leave"]
            log.info("drain: node %s drained%s", label, f"; left {', '.join(left)}" if left else "")
            self._write_audit("node_drained", node=drain.node_id, left=", ".join(left))

    async def _record(self, deployment_id: str) -> DeploymentRecord | None:
        try:
            return await asyncio.to_thread(self._store.get_deployment, deployment_id)
        except NotFoundError:
            return None

    async def _act(
        self,
        drain: NodeDrain,
        action: Action,
        record: DeploymentRecord | None,
        services: dict[str, ServiceProfileRecord],
        now: float,
    ) -> None:
        node_id, deployment_id = drain.node_id, action.deployment_id
        move = drain.move(deployment_id)
        match action.kind:
            case "done":
                if move is not None and move.step != "stopped":
                    await self._write(
                        node_id, deployment_id, "stopped", now, replacement_id=move.replacement_id,
                        retired_at=move.retired_at, note=action.reason,
                    )  # fmt: skip
            case "wait":
                pass
            case "retire":
                self._lifecycle.retire(deployment_id)
                await self._write(
                    node_id, deployment_id, "retired", now, replacement_id=action.replacement_id,
                    retired_at=now, note=action.reason,
                )  # fmt: skip
                log.info("drain: %s gets no new requests: %s", deployment_id, action.reason)
            case "leave":
                if move is None or move.step != "left" or move.note != action.reason:
                    await self._write(node_id, deployment_id, "left", now, note=action.reason)
                    log.info("drain: %s left on node %s: %s", deployment_id, node_id, action.reason)
                    self._write_audit(
                        "drain_left", node=node_id, deployment=deployment_id, reason=action.reason
                    )
            case "stop":
                if move is None or move.step != "stopped":
                    await self._write(
                        node_id, deployment_id, "stopped", now,
                        replacement_id=move.replacement_id if move is not None else None,
                        retired_at=move.retired_at if move is not None else None,
                        note=action.reason,
                    )  # fmt: skip
                self._stop(node_id, deployment_id, action.reason)
            case "replace":
                if record is not None:
                    await self._replace(drain, record, services, action, now)
            case _:  # pragma: no cover - the kinds are a closed Literal
                raise AssertionError(action.kind)

    async def _replace(
        self,
        drain: NodeDrain,
        record: DeploymentRecord,
        services: dict[str, ServiceProfileRecord],
        action: Action,
        now: float,
    ) -> None:
        node_id = drain.node_id
        self._lifecycle.unretire(record.id)  # it serves until its replacement is ready
        await self._write(node_id, record.id, "replacing", now, note=action.reason)
        service = services.get(record.served_model_name)
        try:
            if service is not None:
                replacement = await self._lifecycle.deploy(
                    deploy_options(service, service.node_label),
                    eviction=EvictionPolicy(self._clock(), self._min_residency_s, allowed=True),
                )
            else:
                replacement = await self._lifecycle.deploy(_same_as(record))
        except BerthError as exc:
            refused = after_refusal(record.id, str(exc), force=drain.force)
            if refused.kind != "leave":
                log.info("drain: no replacement for %s: %s", record.id, exc)
                await self._act(drain, refused, record, services, now)
                return
            await self._write(node_id, record.id, "left", now, note=refused.reason)
            before = drain.move(record.id)
            if before is None or before.note != refused.reason:  # said once, not every try
                log.info("drain: %s left on node %s: %s", record.id, node_id, refused.reason)
                self._write_audit(
                    "drain_left", node=node_id, deployment=record.id, reason=refused.reason
                )
            return
        note = f"its replacement {replacement.id} is starting on node {replacement.node_id}"
        await self._write(
            node_id, record.id, "replacing", now, replacement_id=replacement.id, note=note
        )
        log.info("drain: %s is replaced by %s on node %s", record.id, replacement.id,
                 replacement.node_id)  # fmt: skip
        self._write_audit(
            "drain_replacement", node=node_id, deployment=record.id,
            replacement=replacement.id, replacement_node=replacement.node_id,
        )  # fmt: skip

    def _stop(self, node_id: str, deployment_id: str, reason: str) -> None:
        if deployment_id in self._stops:
            return

        async def stop() -> None:
            outcome = "stopped"
            try:
                stopped = await self._lifecycle.stop(deployment_id)
                if stopped.state is DeploymentState.FAILED:
                    outcome = f"stop failed: {stopped.failure_reason}"
            except (ConflictError, NotFoundError) as exc:
                outcome = f"already gone: {exc}"
            except BerthError as exc:
                outcome = f"stop failed: {exc}"
                log.warning("drain: stopping %s failed: %s", deployment_id, exc)
            finally:
                self._stops.pop(deployment_id, None)
            log.info("drain: %s on node %s %s: %s", deployment_id, node_id, outcome, reason)
            self._write_audit(
                "drain_stopped", node=node_id, deployment=deployment_id, reason=reason,
                outcome=outcome,
            )  # fmt: skip

        self._stops[deployment_id] = asyncio.create_task(
            stop(), name=f"berth-drain-{deployment_id}"
        )

    async def _write(
        self,
        node_id: str,
        deployment_id: str,
        step: MoveStep,
        now: float,
        *,
        replacement_id: str | None = None,
        retired_at: float | None = None,
        note: str | None = None,
    ) -> None:
        await asyncio.to_thread(
            self._store.record_drain_move,
            node_id,
            deployment_id,
            step,
            now,
            replacement_id=replacement_id,
            retired_at=retired_at,
            note=note,
        )

    def _write_audit(self, event: str, **fields: str) -> None:
        if self._audit is None:
            return
        entry = {"event": event, "at": datetime.fromtimestamp(self._clock(), UTC).isoformat()}
        try:
            self._audit({**entry, **fields})
        except OSError as exc:  # an unwritable audit log must not stop a drain
            log.warning("drain: cannot write the audit log (%s): %s", exc, entry)


def _same_as(record: DeploymentRecord) -> DeployOptions:
    """A deployment like ``record`` (not a service's), placed by fit on another node."""
    return DeployOptions(
        model_name=record.model_name,
        engine=record.engine,
        runtime=record.runtime,
        ctx=record.ctx,
        extra_args=record.extra_args,
        served_model_name=record.served_model_name,
        image=record.image,
        max_adapters=record.adapter_slots,
        restart_policy=record.restart_policy,
    )
