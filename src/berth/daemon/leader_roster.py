"""Which leaders agents may dial, and whether this one takes them (docs/ha.md).

With ``leader_ha`` each leader runs a :class:`LeaderRoster`: every third of the lease it
notes its own cluster URL in the store (``leader_members``, :mod:`berth.store.members`) and
reads every leader's back.  The hub asks it (as its
:class:`~berth.cluster.leader.hub.AgentGate`) before it takes an agent: the active takes it and
lists every leader's cluster URL in Welcome; a standby refuses it with ``NOT_LEADER`` naming
the active's cluster URL (the member row whose process holds the lease), so the agent
goes there at once.  Enrollment URIs carry the same list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from berth.cluster.protocol.errors import not_leader_reason
from berth.errors import StoreError
from berth.store.leadership import RENEWALS_PER_LEASE, Leadership
from berth.store.members import FORGET_AFTER_S, LeaderMember
from berth.store.store import Store

_log = logging.getLogger(__name__)


class LeaderRoster:
    """This leader's entry among the shared leaders, and the others' (see the module doc).

    ``cluster_url`` is where agents dial this leader; ``lease_s`` the lease, a third of which
    is the refresh interval; ``clock`` gives Unix seconds for ``seen_at``.
    """

    def __init__(
        self,
        store: Store,
        leadership: Leadership,
        *,
        cluster_url: str,
        lease_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._leadership = leadership
        self._cluster_url = cluster_url.rstrip("/")
        self._interval_s = lease_s / RENEWALS_PER_LEASE
        self._clock = clock
        self._members: list[LeaderMember] = []
        self._task: asyncio.Task[None] | None = None

    def leaders(self) -> list[str]:
        """Every leader's cluster URL, this one's included."""
        urls = [m.cluster_url for m in self._members]
        return urls if self._cluster_url in urls else [self._cluster_url, *urls]

    def active_cluster_url(self) -> str | None:
        """The cluster URL of the leader holding the lease, when it is known."""
        if self._leadership.is_active:
            return self._cluster_url
        holder = self._leadership.state.active
        for member in self._members:
            if holder is not None and member.holder == holder:
                return member.cluster_url
        return None

    def refusal(self) -> str | None:
        """``None`` while this leader is active, else the ``NOT_LEADER`` close reason."""
        if self._leadership.is_active:
            return None
        return not_leader_reason(self.active_cluster_url())

    async def start(self) -> None:
        """Note this leader and read the others once, then every third of the lease."""
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="leader-roster")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def refresh(self) -> None:
        """One note and read; a store error is logged and the last list kept."""
        try:
            self._members = await asyncio.to_thread(self._note_and_read)
        except StoreError as exc:
            _log.warning("leader roster: the store did not answer: %s", exc)

    def _note_and_read(self) -> list[LeaderMember]:
        now_s = self._clock()
        self._store.note_leader_member(self._cluster_url, self._leadership.me, now_s)
        forgotten = self._store.forget_leader_members(now_s - FORGET_AFTER_S)
        if forgotten:
            _log.info("leader roster: forgot %d leader(s) not seen for 7 days", forgotten)
        return self._store.leader_members()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh()
