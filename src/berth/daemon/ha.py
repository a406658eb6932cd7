"""A leader's part in shared leadership (the ``leader_ha`` setting; docs/ha.md).

:class:`SharedLeadership` is what the ``Leader`` owns when leadership is shared: the lease
loop (:class:`~berth.store.leadership.Leadership`, which ``/readyz``, ``/admin/leader`` and
the ``/v1`` guard read), the roster of leaders (:class:`~berth.daemon.leader_roster.
LeaderRoster`, which the hub and enrollment ask), the key sync
(:class:`~berth.auth.key_sync.KeySync`), and the gate on the leader-only loops: the
``start_leading`` it is given (reconcile, the engine watcher, scaling) runs once this
leader holds the lease, at once when it does at start, later when a standby takes over.
:func:`build_shared_leadership` builds it with the rest of the leader, so its listeners
answer as a standby's from the start.

A leader that held the lease and lost it (another took over while it was stalled, or the
store was out of reach past the lease) must not go on acting on its stale view; its writes
are fenced from the moment the lease is another's.  Given a ``stop_leading`` (a leader-only
``Leader``), it *demotes*: ``stop_leading`` stops the leader-only loops and sends its
agents to the active, then it waits for the lease again like any standby, and may lead
again later (``start_leading`` once more).  Without one, ``on_lost`` is called (a
``Leader`` that runs engines on its own host stops; its supervisor starts it again, as a
standby).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from berth.admission import Admission
from berth.auth.authenticator import Authenticator
from berth.auth.key_sync import KeySync
from berth.cluster.leader.hub import NodeHub
from berth.cluster.pki.enrollment import EnrollmentService
from berth.daemon.leader_roster import LeaderRoster
from berth.store import Store
from berth.store.leadership import Leadership, leader_id
from berth.store.lease import LeaseState

_log = logging.getLogger(__name__)


def build_shared_leadership(
    store: Store,
    authenticator: Authenticator,
    admission: Admission,
    hub: NodeHub,
    enrollment: EnrollmentService,
    *,
    address: str,
    cluster_url: str,
    lease_s: float,
) -> SharedLeadership:
    """This leader's part in shared leadership over ``store``: a lease loop under a fresh
    :func:`~berth.store.leadership.leader_id`, reachable at ``address`` (its public
    listener's URL) and holding leases of ``lease_s``; the roster noting ``cluster_url``
    (the URL its agents dial), which answers for the ``hub`` (a standby sends agents to the
    active) and for ``enrollment`` (every leader's URL in a new URI); key changes followed
    into ``authenticator`` and ``admission``. Nothing starts until
    :meth:`SharedLeadership.start`."""
    leadership = Leadership(store, me=leader_id(), address=address, lease_s=lease_s)
    roster = LeaderRoster(store, leadership, cluster_url=cluster_url, lease_s=lease_s)
    hub.agent_gate = roster
    enrollment.leaders = roster.leaders
    return SharedLeadership(leadership, roster, KeySync(store, authenticator, admission))


class SharedLeadership:
    """Shared leadership (see the module doc): ``leadership``, the lease loop; ``roster``,
    the leaders the store lists, for agents (the active takes them, a standby names the
    active); ``key_sync``, the key changes other leaders write."""

    def __init__(self, leadership: Leadership, roster: LeaderRoster, key_sync: KeySync) -> None:
        self.leadership = leadership
        self.roster = roster
        self._key_sync = key_sync
        self._start_leading: Callable[[], Awaitable[None]] | None = None
        self._on_lost: Callable[[], None] | None = None
        self._leading = False
        self._stopping = False
        self._stop_leading: Callable[[], Awaitable[None]] | None = None
        self._waiting: asyncio.Task[None] | None = None
        self._demoting: asyncio.Task[None] | None = None

    @property
    def leading(self) -> bool:
        """Whether the leader-only loops were started (this leader became active)."""
        return self._leading

    async def start(
        self,
        start_leading: Callable[[], Awaitable[None]],
        stop_leading: Callable[[], Awaitable[None]] | None = None,
        *,
        on_lost: Callable[[], None],
    ) -> None:
        """Follow key changes, take part in the lease, and call ``start_leading`` now, or
        once the lease is this leader's.  ``stop_leading``, when given, is called when the
        lease is lost after leading, and this leader stands by again (see the module doc);
        without it, ``on_lost`` is called (the ``Leader`` stops, to come back as a
        standby)."""
        self._start_leading = start_leading
        self._stop_leading = stop_leading
        self._on_lost = on_lost
        await self._key_sync.start()
        self.leadership.subscribe(self._role_changed)
        await self.leadership.start()
        await self.roster.start()
        if self.leadership.is_active:
            await self._lead()
        else:
            _log.info(
                "leadership: standby; the active leader is %s",
                self.leadership.view().active_address or "none yet",
            )
            self._waiting = asyncio.create_task(self._lead_when_active(), name="standby")

    async def hand_over(self) -> None:
        """Hand the lease back now, before the Leader drains its requests (a clean stop, or
        ``berth leader step-down``): a standby takes new requests at its next look while
        this one finishes what is in flight; it takes no lease again.  Key sync goes on
        until :meth:`stop`."""
        self._stopping = True
        await self._cancel_tasks()
        await self.leadership.stop(release=True)

    async def stop(self) -> None:
        """Stop waiting, following and leasing; the lease is handed back when held, so a
        standby takes over at once."""
        self._stopping = True
        await self._cancel_tasks()
        await self._key_sync.stop()
        await self.roster.stop()
        await self.leadership.stop(release=True)

    async def _cancel_tasks(self) -> None:
        """Stop waiting for the lease; a demotion under way is finished first (its
        ``stop_leading`` must not be cut half way)."""
        if self._demoting is not None:
            await asyncio.shield(self._demoting)
            self._demoting = None
        if self._waiting is not None:
            self._waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._waiting
            self._waiting = None

    async def _lead_when_active(self) -> None:
        await self.leadership.wait_active()
        await self._lead()

    async def _lead(self) -> None:
        state = self.leadership.state
        _log.info("leadership: active under epoch %d; starting the leader's loops", state.epoch)
        self._leading = True
        assert self._start_leading is not None, "start() gave it"
        await self._start_leading()

    def _role_changed(self, state: LeaseState) -> None:
        if state.role != "standby" or not self._leading or self._stopping:
            return
        if self._stop_leading is None:
            _log.error(
                "leadership: lost the lease (epoch %d is now %s's); stopping, to come back "
                "as a standby",
                state.epoch,
                state.active_address or "nobody",
            )
            self._lost()
            return
        _log.error(
            "leadership: lost the lease (epoch %d is now %s's); stepping down to standby",
            state.epoch,
            state.active_address or "nobody",
        )
        self._leading = False
        self._demoting = asyncio.create_task(self._demote(), name="demote")

    async def _demote(self) -> None:
        """Stop leading (the leader-only loops, the agents' links), then wait for the lease
        again like any standby."""
        assert self._stop_leading is not None, "_role_changed checked"
        try:
            await self._stop_leading()
        except Exception:  # a failed demotion must not leave a standby that would lead twice
            _log.exception("leadership: stepping down failed; stopping instead")
            self._lost()
            return
        _log.info(
            "leadership: standby; the active leader is %s",
            self.leadership.view().active_address or "none yet",
        )
        if not self._stopping:
            self._waiting = asyncio.create_task(self._lead_when_active(), name="standby")

    def _lost(self) -> None:
        assert self._on_lost is not None, "start() gave it"
        self._on_lost()
