"""The leadership loop: one leader's side of the store's lease (:mod:`berth.store.lease`).

With ``leader_ha`` on, every leader on a database runs a :class:`Leadership`.  It takes the
lease when it is free or has run out, renews it every third of ``leader_lease_s`` while it
holds it, and fences its store's cluster-state writes with the epoch it holds (a standby's
store is fenced with epoch 0, so it writes no cluster state at all).  Who owns it (the
``Leader``) asks :attr:`Leadership.is_active` before serving ``/v1`` or acting on agents,
and hears every change of role through :meth:`Leadership.subscribe`.

Stepping down happens three ways: a renewal the store refuses (another leader holds the
lease under a newer epoch, or it ran out while this process was stalled: SIGSTOP, a long
GC, a frozen VM); a lease that ran out by this process's own monotonic clock (better no
active than two); and :meth:`Leadership.stop`, which releases the lease so a standby takes
over at once.

The lease is kept by this leader's own clock, whatever the database call does: while it is
active a timer runs to the end of its lease (``lease_s`` after its last good renewal began),
and when it fires unrenewed this leader stands by at that moment, even with a renewal still
waiting on a database that stopped answering (a silent network partition).  That call ends
within the store's deadlines (:mod:`berth.store.deadlines`); an answer that comes back after
the lease ran out by this clock counts for nothing.  The lease's calls run on a thread of
their own, so they never wait behind the leader's other database calls (a slow database
fills the shared worker threads), and its looks begin a third of a lease apart however long
each takes.  The worker processes and serving
leaders of a cluster follow the same :attr:`Leadership.is_active` and role changes.

Without ``leader_ha`` there is no loop: the one leader is active with epoch 0 and its
store is not fenced (:func:`single_leader_view`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, TypeVar

from berth.errors import StoreError
from berth.humanize import age
from berth.store.errors import StandbyError
from berth.store.lease import LeaseState, Role
from berth.store.members import LeaderMember
from berth.store.store import Store

_log = logging.getLogger(__name__)

#: Renewals per lease: the active renews every ``lease_s / RENEWALS_PER_LEASE`` seconds.
RENEWALS_PER_LEASE: Final = 3

#: Hears a change of role (the new state).  Called on the event loop; must not block.
RoleListener = Callable[[LeaseState], None]

T = TypeVar("T")


def leader_id() -> str:
    """A fresh id for this leader process: ``HOST:PID:RANDOM`` (a restarted leader is a new
    one, so whatever the old process still does is behind the fence)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True)
class LeaderView:
    """What ``GET /admin/leader`` shows: this leader's ``role`` and ``id``, the lease's
    ``epoch`` (0 without ``leader_ha``), the active leader's ``active_address`` (``None``
    while nobody holds the lease) and whether leadership is shared (``ha``)."""

    role: Role
    id: str
    epoch: int
    active_address: str | None
    ha: bool


def standbys_seen(
    members: Sequence[LeaderMember], me: str, now_s: float, lease_s: float
) -> list[LeaderMember]:
    """The leaders other than ``me`` (a holder id) that ``leader_members`` says were noted
    less than ``lease_s`` before ``now_s`` (Unix seconds): those that could take the lease
    over if ``me`` handed it back.  Each notes itself every third of a lease."""
    return [m for m in members if m.holder != me and 0 <= now_s - m.seen_at < lease_s]


def step_down_refusal(
    members: Sequence[LeaderMember], me: str, now_s: float, lease_s: float, database: str
) -> str | None:
    """Why the active ``me`` should not step down at ``now_s``: no other leader seen within
    ``lease_s`` in ``members`` (``leader_members`` of ``database``, named as shown), naming
    what was checked and what was found; ``None`` when a standby was seen.  Pure."""
    if standbys_seen(members, me, now_s, lease_s):
        return None
    others = [m for m in members if m.holder != me]
    found = (
        "; ".join(
            f"{m.cluster_url} last seen {age(max(now_s - m.seen_at, 0.0))} ago" for m in others
        )
        if others
        else "no other leader at all"
    )
    return (
        f"refused: no other leader was seen within the lease ({lease_s:g} s) in "
        f"leader_members of {database} ({found}); stepping down would leave no active leader, "
        "and nothing would be served until one starts. Start a standby first (berth daemon "
        "start with leader_ha on another host), or pass --force to step down anyway"
    )


def single_leader_view(me: str, address: str) -> LeaderView:
    """The view of a leader without ``leader_ha``: always active, epoch 0."""
    return LeaderView("active", me, 0, address, ha=False)


class Leadership:
    """One leader's lease loop on ``store`` (see the module doc).

    ``me`` is this leader's id (:func:`leader_id`), ``address`` the URL clients and
    operators should use to reach it (its public listener), ``lease_s`` the
    ``leader_lease_s`` setting.  ``monotonic`` is the clock of the local expiry check.
    """

    def __init__(
        self,
        store: Store,
        *,
        me: str,
        address: str,
        lease_s: float,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self._store = store
        self._me = me
        self._address = address
        self._lease_s = lease_s
        self._monotonic = monotonic
        self._state = LeaseState("standby", 0, None, None, 0.0)
        self._held_since: float | None = None  # monotonic start of the last good renewal
        self._listeners: list[RoleListener] = []
        self._task: asyncio.Task[None] | None = None
        self._active = asyncio.Event()
        self._expiry: asyncio.TimerHandle | None = None  # the end of the lease held
        #: the lease's calls: never queued behind the leader's other database calls
        self._calls: ThreadPoolExecutor | None = None

    @property
    def me(self) -> str:
        """This leader's id."""
        return self._me

    @property
    def state(self) -> LeaseState:
        """The lease as this leader last saw it."""
        return self._state

    @property
    def is_active(self) -> bool:
        """Whether this leader holds the lease now: the store said so at its last renewal,
        and less than ``lease_s`` has passed since that renewal began."""
        if self._state.role != "active" or self._held_since is None:
            return False
        return self._monotonic() - self._held_since < self._lease_s

    def view(self) -> LeaderView:
        """This leader as ``GET /admin/leader`` shows it."""
        active = self.is_active
        address = self._address if active else self._state.active_address
        return LeaderView(
            "active" if active else "standby", self._me, self._state.epoch, address, ha=True
        )

    def refusal(self) -> StandbyError:
        """What a standby answers on ``/v1``: 503 naming the active leader, to retry in a
        renewal's time (a third of the lease) when there is one, else in a lease's."""
        address = self.view().active_address
        wait_s = self._lease_s / RENEWALS_PER_LEASE if address else self._lease_s
        return StandbyError(address, retry_after_s=wait_s)

    async def wait_active(self) -> None:
        """Return once this leader holds the lease (at once when it does)."""
        await self._active.wait()

    def subscribe(self, listener: RoleListener) -> None:
        """Call ``listener`` with the new state at every change of role."""
        self._listeners.append(listener)

    async def start(self) -> None:
        """Fence the store as a standby's, try the lease once (so a lone leader is active
        when this returns), then keep at it in a task."""
        self._store.fence(0)
        await self.tick()
        self._task = asyncio.create_task(self._run(), name="leadership")

    async def stop(self, *, release: bool = True) -> None:
        """End the loop; with ``release``, hand the lease back when this leader holds it,
        so a standby need not wait for it to run out.  Its store stays fenced."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._cancel_expiry()
        held = self._state
        if release and held.role == "active":
            try:
                await self._call(self._store.release_lease, self._me, held.epoch)
            except StoreError as exc:
                _log.warning("leadership: cannot release the lease: %s", exc)
        self._set(LeaseState("standby", held.epoch, None, None, held.expires_at), None)
        calls, self._calls = self._calls, None
        if calls is not None:
            calls.shutdown(wait=False)  # a call that hangs ends within its deadline

    async def _run(self) -> None:
        # Looks begin a third of a lease apart, however long each takes (on a database 200 ms
        # away a renewal is five round trips, 2 s): timed from the end of the last one, the
        # renewals of a slow database would come later than the lease lasts.
        loop = asyncio.get_running_loop()
        interval = self._lease_s / RENEWALS_PER_LEASE
        next_at = loop.time() + interval
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at = loop.time() + interval
            await self.tick()

    async def tick(self) -> None:
        """One look at the lease: renew it when active, else try to take it.  A store
        error changes nothing but the local expiry (see the module doc); it is logged.  An
        answer that comes after the lease ran out by this leader's clock is not taken as
        holding it."""
        began = self._monotonic()
        held = self._state
        try:
            if held.role == "active":
                new = await self._call(self._store.renew_lease, self._me, held.epoch, self._lease_s)
            else:
                new = await self._call(
                    self._store.acquire_lease, self._me, self._address, self._lease_s
                )
        except StoreError as exc:
            _log.warning("leadership: the store did not answer the lease call: %s", exc)
            if self._state.role == "active" and not self.is_active:
                self._lapse()
            return
        if new.role == "active" and self._monotonic() - began >= self._lease_s:
            _log.warning(
                "leadership: the lease call took %.1f s, past the %g s lease; not taken as "
                "holding it",
                self._monotonic() - began,
                self._lease_s,
            )
            new = LeaseState("standby", new.epoch, None, None, new.expires_at)
        self._set(new, began if new.role == "active" else None)

    async def _call(self, call: Callable[..., T], *args: object) -> T:
        """``call(*args)`` on the lease's own thread."""
        if self._calls is None:
            self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease")
        return await asyncio.get_running_loop().run_in_executor(self._calls, call, *args)

    def _lapse(self) -> None:
        """The lease ran out by this leader's clock, unrenewed: stand by now."""
        self._cancel_expiry()
        held = self._state
        if held.role != "active":
            return
        if self.is_active:  # renewed since the timer was set
            self._arm_expiry()
            return
        _log.warning(
            "leadership: the lease (epoch %d) ran out unrenewed by this leader's clock; "
            "standing by",
            held.epoch,
        )
        self._set(LeaseState("standby", held.epoch, None, None, held.expires_at), None)

    def _arm_expiry(self) -> None:
        """Set the timer to the end of the lease this leader holds (none when it holds none)."""
        self._cancel_expiry()
        if self._state.role != "active" or self._held_since is None:
            return
        remaining_s = self._held_since + self._lease_s - self._monotonic()
        self._expiry = asyncio.get_running_loop().call_later(max(0.0, remaining_s), self._lapse)

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _set(self, new: LeaseState, held_since: float | None) -> None:
        old = self._state
        self._state = new
        self._held_since = held_since
        self._arm_expiry()
        if new.role == "active" and new.epoch != self._store.fence_epoch:
            self._store.fence(new.epoch)
        if new.role == "active":
            self._active.set()
        else:
            self._active.clear()
        if new.role != old.role:
            _log.info(
                "leadership: %s (epoch %d%s)",
                new.role,
                new.epoch,
                "" if new.role == "active" else f", active {new.active_address or 'none'}",
            )
            for listener in self._listeners:
                listener(new)
