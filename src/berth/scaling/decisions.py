"""What the scaling controller does about one service, decided from plain values.

:func:`decide` is pure: it takes the service's load at one moment (:class:`ServiceLoad`: its
settings, its replicas with what each has in flight and when it was last used, the requests
waiting at the leader) and the current time, and returns one :class:`Start`, :class:`Stop`
or :class:`Hold`, each with the reason a person reads in ``berth service show``.  The
controller (:mod:`berth.scaling.controller`) gathers the values and carries the decision
out.  The rules, in the order they are looked at:

Replicas on a node being drained are *leaving* (the drain moves each: its replacement
starts elsewhere first, then it stops): they count towards ``min_replicas`` until they
stop, but not towards ``max_replicas``, and the controller stops none of them itself, so a
drain's replacement is never taken for a surplus.

1. **above max_replicas**: more active replicas than ``max_replicas`` (it was lowered):
   stop the surplus, those still starting first, then the least recently used of those
   with nothing in flight; one with requests in flight is waited for;
2. **below min_replicas**: start one;
3. **on demand**: requests wait and no replica is ready or starting: start one (unless
   ``max_replicas`` is 0);
4. a replica is **starting**: wait for it (one start at a time per service);
5. **scale out**: every ready replica has had its capacity in flight or queued
   (:func:`saturated`) for ``scale_out_after_s``: start one, up to ``max_replicas``;
6. **idle**: ready replicas with nothing in flight, nothing queued for the service, and no
   request for ``idle_timeout_s`` (counted from when they became ready if they never had
   one) are stopped, least recently used first, down to ``min_replicas``;
7. otherwise hold.

Times are seconds on one clock (the controller's); only differences matter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from berth.humanize import duration
from berth.vocab.records import ScalingSettings
from berth.vocab.states import RESTARTING_STATES, DeploymentState

_STARTING = frozenset({DeploymentState.PENDING, DeploymentState.LOADING})
# A replica waiting out a restart's backoff counts: it comes back by itself.
_ACTIVE = _STARTING | {DeploymentState.READY} | RESTARTING_STATES


@dataclass(frozen=True)
class Replica:
    """One deployment of the service: its ``state``, requests ``in_flight`` on it, when it
    became ready (``ready_since``; ``None`` while starting), when a request last started or
    finished on it (``last_request_at``; ``None``: none since it became ready) and whether
    the router can reach it (``routable``: ready on a connected node)."""

    deployment_id: str
    node_id: str
    state: DeploymentState
    in_flight: int = 0
    ready_since: float | None = None
    last_request_at: float | None = None
    routable: bool = True
    leaving: bool = False

    @property
    def last_used_at(self) -> float:
        """Its last request, else when it became ready (0 for one never ready)."""
        if self.last_request_at is not None:
            return self.last_request_at
        return self.ready_since if self.ready_since is not None else 0.0


@dataclass(frozen=True)
class ServiceLoad:
    """A service at one moment: its ``settings``, the ``capacity`` of one replica (requests
    at once), its ``replicas`` (stopping ones are left out by :func:`decide`), the requests
    ``queued`` at the leader for it, and since when :func:`saturated` has held without a
    break (``busy_since``; ``None``: not saturated now)."""

    name: str
    settings: ScalingSettings
    capacity: int
    replicas: tuple[Replica, ...] = ()
    queued: int = 0
    busy_since: float | None = None


StartCause = Literal["min_replicas", "on_demand", "scale_out"]
StopCause = Literal["idle", "above_max"]


@dataclass(frozen=True)
class Start:
    """Start one replica, because of ``cause``; ``reason`` for people."""

    cause: StartCause
    reason: str


@dataclass(frozen=True)
class Stop:
    """Stop ``deployment_ids`` (in this order), because of ``cause``; ``reason`` for
    people, one line for all of them."""

    cause: StopCause
    deployment_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Hold:
    """Change nothing; ``reason`` says why."""

    reason: str


Decision = Start | Stop | Hold


def active_replicas(replicas: Sequence[Replica]) -> list[Replica]:
    """The replicas that count: starting or ready (not stopping)."""
    return [r for r in replicas if r.state in _ACTIVE]


def saturated(load: ServiceLoad) -> bool:
    """Whether every ready, routable replica has at least its capacity in flight or queued:
    the free slots of all of them together are no more than the requests waiting at the
    leader.  ``False`` with no such replica (that is an on-demand start, not a scale-out)."""
    ready = [r for r in load.replicas if r.state is DeploymentState.READY and r.routable]
    if not ready:
        return False
    free_slots = sum(max(0, load.capacity - r.in_flight) for r in ready)
    return load.queued >= free_slots


def busy_since(load: ServiceLoad, now: float) -> float | None:
    """``load.busy_since`` carried to ``now``: kept while :func:`saturated` holds, ``now``
    when it starts holding, ``None`` once it does not."""
    if not saturated(load):
        return None
    return load.busy_since if load.busy_since is not None else now


def decide(load: ServiceLoad, now: float, *, scale_out_after_s: float) -> Decision:
    """What to do about the service (see the module docstring for the rules and their
    order).  ``scale_out_after_s`` is how long it must have been saturated before another
    replica starts."""
    settings = load.settings
    active = active_replicas(load.replicas)
    starting = [r for r in active if r.state in _STARTING]
    ready = [r for r in active if r.state is DeploymentState.READY]
    bounds = f"min {settings.min_replicas}, max {settings.max_replicas}"
    staying = [r for r in active if not r.leaving]
    if len(staying) > settings.max_replicas:
        return _above_max(load, staying, now)
    if len(active) < settings.min_replicas:
        return Start(
            "min_replicas",
            f"{len(active)} replica(s) running, below min_replicas {settings.min_replicas}",
        )
    routable = [r for r in ready if r.routable]
    if load.queued and not routable and not starting:
        if settings.max_replicas == 0:
            return Hold(f"{load.queued} request(s) wait, but max_replicas is 0: none started")
        restarting = [r.deployment_id for r in active if r.state in RESTARTING_STATES]
        if restarting and len(active) >= settings.max_replicas:
            return Hold(
                f"{load.queued} request(s) wait for {', '.join(restarting)} to restart "
                f"(max_replicas {settings.max_replicas})"
            )
        if len(active) >= settings.max_replicas:
            return Hold(
                f"{load.queued} request(s) wait; every replica is on an unreachable node and "
                f"max_replicas is {settings.max_replicas}"
            )
        return Start("on_demand", f"on demand: {load.queued} request(s) wait and none is ready")
    if starting:
        names = ", ".join(r.deployment_id for r in starting)
        return Hold(f"{names} starting ({len(ready)} ready; {bounds})")
    if load.busy_since is not None and saturated(load):
        busy_s = now - load.busy_since
        in_flight = sum(r.in_flight for r in ready)
        what = (
            f"every replica had its capacity ({load.capacity}) in flight or queued for "
            f"{duration(round(busy_s))}: {in_flight} in flight, {load.queued} queued over "
            f"{len(ready)} replica(s)"
        )
        if len(staying) >= settings.max_replicas:
            return Hold(f"{what}; at max_replicas {settings.max_replicas}")
        if busy_s >= scale_out_after_s:
            return Start("scale_out", what)
        return Hold(f"{what}; another starts after {duration(scale_out_after_s)}")
    idle = _idle(load, ready, now)
    if idle is not None:
        return idle
    timeout = settings.idle_timeout_s
    after = "never stopped for idleness" if timeout is None else f"idle timeout {duration(timeout)}"
    return Hold(f"{len(ready)} ready, {len(starting)} starting ({bounds}; {after})")


def _above_max(load: ServiceLoad, active: Sequence[Replica], now: float) -> Decision:
    surplus = len(active) - load.settings.max_replicas
    # Those serving nothing go first: waiting to restart, then still starting.
    starting = [r for r in active if r.state in RESTARTING_STATES]
    starting += [r for r in active if r.state in _STARTING]
    quiet = sorted(
        (r for r in active if r.state is DeploymentState.READY and r.in_flight == 0),
        key=lambda r: (r.last_used_at, r.deployment_id),
    )
    chosen = [*starting, *quiet][:surplus]
    what = f"{len(active)} replica(s), above max_replicas {load.settings.max_replicas}"
    if not chosen:
        busy = ", ".join(f"{r.deployment_id} ({r.in_flight} in flight)" for r in active)
        return Hold(f"{what}: waiting for requests to finish on {busy}")
    return Stop("above_max", tuple(r.deployment_id for r in chosen), what)


def _idle(load: ServiceLoad, ready: Sequence[Replica], now: float) -> Stop | None:
    timeout = load.settings.idle_timeout_s
    if timeout is None or load.queued:
        return None
    idle = sorted(
        (r for r in ready
         if not r.leaving and r.in_flight == 0 and now - r.last_used_at >= timeout),
        key=lambda r: (r.last_used_at, r.deployment_id),
    )  # fmt: skip
    active = len([r for r in active_replicas(load.replicas) if not r.leaving])
    room = active - load.settings.min_replicas
    chosen = idle[: max(0, room)]
    if not chosen:
        return None
    oldest = now - chosen[0].last_used_at
    reason = (
        f"no request for {duration(round(oldest))} (idle timeout {duration(timeout)}); "
        f"{active - len(chosen)} left (min_replicas {load.settings.min_replicas})"
    )
    return Stop("idle", tuple(r.deployment_id for r in chosen), reason)
