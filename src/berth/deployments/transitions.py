"""The one writer of deployment state.

Every change goes through the store's ``transition_deployment`` (which enforces
``vocab/states.py``), then the ready table, the loading progress and the state listener
(metrics) are brought in line with the new record, so none of them can disagree with the
store.  The lifecycle manager's commands and its reconciler both write through here.

READY is the one move the table leads: a deployment is routed to its endpoint *before* the
store says ready (and unrouted again if the write fails), so whoever reads READY (a poller
of the store, the state listener, a waiter on :meth:`StateWriter.next_change`) finds it in
the table.  A ready deployment routed again without a write (re-attached after a restart, its
agent back) is routed here too (:meth:`StateWriter.route`), so the table's ready entries come
from this one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from berth.cluster.leader.agent_link import EngineEndpoint
from berth.deployments.ready_table import ReadyTable
from berth.store import UNCHANGED, Store, Unchanged
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import RESTARTING_STATES, TERMINAL_STATES, DeploymentState

#: Hears the new record after every state change.
StateListener = Callable[[DeploymentRecord], None]


class StateWriter:
    """Writes deployment transitions and keeps what mirrors them in step.

    ``table`` loses a deployment when it stops, fails or waits to restart; ``on_state``
    hears every record written.  :meth:`progress` is what a loading deployment is busy with
    (an image pull), kept only while it loads.
    """

    def __init__(
        self, store: Store, table: ReadyTable, on_state: StateListener | None = None
    ) -> None:
        self._store = store
        self._table = table
        self._on_state = on_state
        #: what a loading deployment is busy with, by deployment id
        self._progress: dict[str, str] = {}
        #: set (and replaced) at every record written: see :meth:`next_change`
        self._changed = asyncio.Event()

    async def transition(
        self,
        deployment_id: str,
        target: DeploymentState,
        *,
        endpoint: EngineEndpoint | None = None,
        routable: Callable[[], bool] | None = None,
        port: int | Unchanged = UNCHANGED,
        pid: int | Unchanged = UNCHANGED,
        failure_reason: str | Unchanged = UNCHANGED,
        restart_count: int | Unchanged = UNCHANGED,
        last_exit: str | Unchanged = UNCHANGED,
        last_exit_log: str | Unchanged | None = UNCHANGED,
    ) -> DeploymentRecord:
        """Move the deployment to ``target``; the new record (the keyword arguments are
        written with it: :meth:`berth.store.Store.transition_deployment`).

        To READY with ``endpoint``: the table routes the deployment there before the store
        is written, unless ``routable`` (checked just before) says no (its node's link
        dropped meanwhile: it is routed again when the agent reports the engine).

        Raises ``NotFoundError`` for an unknown id and ``InvalidTransitionError`` for a
        move ``vocab/states.py`` does not allow (nothing changes then, the table included).
        """
        routed: DeploymentRecord | None = None
        if target is DeploymentState.READY and endpoint is not None:
            before = await asyncio.to_thread(self._store.get_deployment, deployment_id)
            if routable is None or routable():
                self._table.mark_ready(before, endpoint)
                routed = before
        try:
            record = await asyncio.to_thread(
                self._store.transition_deployment,
                deployment_id,
                target,
                port=port,
                pid=pid,
                failure_reason=failure_reason,
                restart_count=restart_count,
                last_exit=last_exit,
                last_exit_log=last_exit_log,
            )
        except BaseException:  # not written (or cancelled: its stop owns the record)
            if routed is not None:
                self._table.unmark(routed.served_model_name, routed.id)
            raise
        if target is not DeploymentState.LOADING:
            self._progress.pop(record.id, None)
        if target in TERMINAL_STATES or target in RESTARTING_STATES:  # no engine serves it
            self._table.unmark(record.served_model_name, record.id)
        self.notify(record)
        return record

    def route(self, record: DeploymentRecord, endpoint: EngineEndpoint) -> None:
        """Route a deployment the store already says is ready to ``endpoint`` again (its
        engine re-attached after a restart, or reported alive by its reconnected agent)."""
        if record.state is not DeploymentState.READY:
            raise ValueError(f"deployment {record.id} is {record.state}, not ready")
        self._table.mark_ready(record, endpoint)

    def notify(self, record: DeploymentRecord) -> None:
        """Tell the state listener of ``record`` (also for a record just created)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if self._on_state is not None:
            self._on_state(record)

    def next_change(self) -> asyncio.Event:
        """An event set at the next record written (any deployment's); take it before
        reading the store, so a change between the read and the wait is not missed."""
        return self._changed

    def set_progress(self, deployment_id: str, line: str) -> None:
        self._progress[deployment_id] = line

    def progress(self, deployment_id: str) -> str | None:
        """What a loading deployment is busy with, e.g. ``pulling vllm/vllm-openai:latest:
        1.2 GB of 8.3 GB, 3/12 layers done``; ``None`` when nothing is reported."""
        return self._progress.get(deployment_id)
