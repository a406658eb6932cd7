"""Fair admission, the decisions: each deployment's slots, and the requests waiting for one,
in an order that is fair across keys. Pure: no ``await``, no clock; the async gate in front
of it is :mod:`berth.admission.gate`.

A request names its candidate deployments (the router's plan, best first) and each one's
capacity (:func:`berth.admission.capacity.gate_slots`). :meth:`SlotScheduler.try_take`
gives it the first candidate with a free slot. When every candidate is full it waits
(:meth:`SlotScheduler.enqueue`), and each slot given back (:meth:`SlotScheduler.release`)
goes to the next waiter that may use that deployment, in this order:

- tier priority first: a waiting request of a higher priority is served before any of a
  lower one;
- within a priority, round-robin across keys: the keys with requests waiting stand in a
  ring; a slot goes to the first key in the ring with a request for that deployment, which
  takes its oldest such request and goes to the back of the ring. A key with 50 requests
  waiting therefore gets one slot in turn with each other waiting key, and a key sending one
  request at a time waits for at most one slot given to each other key before its own;
- within a key, first come first served.

A slot given back with no waiter for it is free again. So a free slot never has a waiter
for it, and a new request taking one directly jumps no queue. The queue holds at most
``max_waiting`` requests in all; :meth:`SlotScheduler.enqueue` refuses beyond that.

The slots are this process's own, or, given the host's shared table (``shared``,
:class:`~berth.host.deployments.SharedDeployments`), the host's: a slot is taken and given
back in one locked step for every serving process, never more taken than the engine has,
and a slot given back goes round the processes with requests waiting for it (that module
says how fair that is); the order above then holds within each process.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from berth.host.deployments import SharedDeployments


class Candidate(Protocol):
    """A deployment a request may go to: its id and its slots (``None``: unknown)."""

    @property
    def deployment_id(self) -> str: ...

    @property
    def slots(self) -> int | None: ...


class Waiter:
    """One request waiting for a slot: its key, its tier's ``priority``, the public model
    name it asked for (for metrics), the ``deployments`` it may go to, and once a slot was
    given to it, ``granted`` (that deployment's id)."""

    __slots__ = ("deployments", "granted", "key_id", "model", "priority")

    def __init__(self, key_id: str, priority: int, model: str, deployments: Sequence[str]) -> None:
        self.key_id = key_id
        self.priority = priority
        self.model = model
        self.deployments = frozenset(deployments)
        self.granted: str | None = None


class SlotScheduler:
    """Slots in use per deployment and the waiting requests (see the module doc).

    ``max_waiting`` bounds the requests waiting at once (0: none wait; a request finding
    every slot taken is refused at once); ``shared``: the host's slots (``None``: this
    process's, in memory).
    """

    def __init__(self, max_waiting: int, shared: SharedDeployments | None = None) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must not be negative, got {max_waiting}")
        self.max_waiting = max_waiting
        self._shared = shared
        self._capacity: dict[str, int] = {}
        self._in_use: dict[str, int] = {}
        #: priority -> the ring of keys with requests waiting -> their requests, oldest first
        self._levels: dict[int, OrderedDict[str, deque[Waiter]]] = {}
        self._priorities: list[int] = []  # of _levels, highest first
        self._waiting = 0
        self._waiting_by_model: dict[str, int] = {}

    # -- slots --------------------------------------------------------------------------------

    def try_take(self, candidates: Sequence[Candidate]) -> str | None:
        """Take a slot at the first of ``candidates`` that has one free, and return its
        deployment id; ``None`` when all are full. A candidate whose slots are ``None``
        is never full and is not counted: a request that may go to it is not held at all,
        and the caller should check :func:`gated` first."""
        shared = self._shared
        if shared is not None:
            for candidate in candidates:
                capacity = candidate.slots
                if capacity is None or shared.take(candidate.deployment_id, capacity):
                    return candidate.deployment_id
            return None
        for candidate in candidates:
            deployment_id = candidate.deployment_id
            capacity = candidate.slots
            if capacity is None:
                return deployment_id
            self._capacity[deployment_id] = capacity
            used = self._in_use.get(deployment_id, 0)
            if used < capacity:
                self._in_use[deployment_id] = used + 1
                return deployment_id
        return None

    def take_over_capacity(self, candidate: Candidate) -> None:
        """Count a request at ``candidate`` even when it is full (a retry moved there from
        the deployment it held a slot at: it is already being served). Nothing for a
        candidate with unknown slots."""
        capacity = candidate.slots
        if capacity is None:
            return
        deployment_id = candidate.deployment_id
        if self._shared is not None:
            self._shared.take_over(deployment_id, capacity)
            return
        self._capacity[deployment_id] = capacity
        self._in_use[deployment_id] = self._in_use.get(deployment_id, 0) + 1

    def release(self, deployment_id: str) -> Waiter | None:
        """Give back a slot at ``deployment_id``: it goes to the next waiter for that
        deployment in fair order, which is returned (out of the queue, ``granted`` set), or,
        with none, it is free again (``None``). A deployment over its capacity (it was made
        smaller, :meth:`resize`) keeps the slot back instead. With the host's slots, the
        slot goes to this process's next waiter only in its turn among the processes with
        waiters (:mod:`berth.host.deployments`)."""
        shared = self._shared
        if shared is not None:
            waiter = shared.release(deployment_id, lambda: self._next_for(deployment_id))
            if waiter is not None:
                waiter.granted = deployment_id
            return waiter
        used = self._in_use.get(deployment_id, 0)
        capacity = self._capacity.get(deployment_id)
        if self._waiting and (capacity is None or used <= capacity):
            waiter = self._next_for(deployment_id)
            if waiter is not None:
                waiter.granted = deployment_id
                return waiter
        used -= 1
        if used > 0:
            self._in_use[deployment_id] = used
        else:  # forget a deployment with nothing in use: ended ones leave no trace
            self._in_use.pop(deployment_id, None)
            self._capacity.pop(deployment_id, None)
        return None

    def resize(self, deployment_id: str, slots: int | None) -> list[Waiter]:
        """``deployment_id`` has ``slots`` from now on (``None``: unknown, unbounded): the
        waiters for it that its new free slots take, out of the queue in fair order with
        ``granted`` set (none when it shrank: its requests in flight finish first)."""
        shared = self._shared
        if shared is not None:
            handed = shared.resize(deployment_id, slots, lambda: self._next_for(deployment_id))
            for given in handed:
                given.granted = deployment_id
            return handed
        granted = []
        if slots is None:
            self._capacity.pop(deployment_id, None)
        elif deployment_id in self._in_use:  # else the next request sets it
            self._capacity[deployment_id] = slots
        while slots is None or self._in_use.get(deployment_id, 0) < slots:
            waiter = self._next_for(deployment_id)
            if waiter is None:
                break
            waiter.granted = deployment_id
            self._in_use[deployment_id] = self._in_use.get(deployment_id, 0) + 1
            granted.append(waiter)
        return granted

    def in_use(self, deployment_id: str) -> int:
        """Slots in use at ``deployment_id`` now (on the host, with the host's slots)."""
        if self._shared is not None:
            return self._shared.in_use(deployment_id)
        return self._in_use.get(deployment_id, 0)

    def take_grants(self, rows: Iterable[int]) -> list[Waiter]:
        """The waiters that slots other processes handed this one get (``rows``: the rows
        of the wakes received; :meth:`SharedDeployments.take_grants`), out of the queue
        with ``granted`` set. Nothing without the host's slots."""
        shared = self._shared
        if shared is None:
            return []
        granted = []
        for deployment_id, waiter in shared.take_grants(rows, self._next_for):
            waiter.granted = deployment_id
            granted.append(waiter)
        return granted

    # -- the queue ----------------------------------------------------------------------------

    def enqueue(self, waiter: Waiter) -> bool:
        """Queue ``waiter`` behind its key's other waiting requests; ``False`` (and nothing
        queued) when ``max_waiting`` requests already wait."""
        if self._waiting >= self.max_waiting:
            return False
        ring = self._levels.get(waiter.priority)
        if ring is None:
            ring = self._levels[waiter.priority] = OrderedDict()
            self._priorities = sorted(self._levels, reverse=True)
        queue = ring.get(waiter.key_id)
        if queue is None:
            queue = ring[waiter.key_id] = deque()  # a key new to the ring joins at the back
        queue.append(waiter)
        self._count(waiter.model, 1)
        if self._shared is not None:
            self._shared.waiting(waiter.deployments, 1)
        return True

    def leave(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out of the queue (its client left, or it waited too long);
        ``False`` when it is no longer queued (a slot was given to it: the caller gives the
        slot back with :meth:`release`)."""
        if waiter.granted is not None:
            return False
        ring = self._levels.get(waiter.priority)
        queue = ring.get(waiter.key_id) if ring is not None else None
        if ring is None or queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del ring[waiter.key_id]
            if not ring:
                self._drop_level(waiter.priority)
        self._count(waiter.model, -1)
        if self._shared is not None:
            self._shared.waiting(waiter.deployments, -1)
        return True

    @property
    def waiting(self) -> int:
        """Requests waiting now."""
        return self._waiting

    def waiting_by_model(self) -> Iterator[tuple[str, int]]:
        """``(public model name, requests waiting)`` for every model with some."""
        return iter(self._waiting_by_model.items())

    # -- inside -------------------------------------------------------------------------------

    def _next_for(self, deployment_id: str) -> Waiter | None:
        for priority in self._priorities:
            ring = self._levels[priority]
            for key_id, queue in ring.items():
                for waiter in queue:
                    if deployment_id in waiter.deployments:
                        break
                else:
                    continue
                queue.remove(waiter)
                if queue:
                    ring.move_to_end(key_id)  # served: to the back of the ring
                else:
                    del ring[key_id]
                    if not ring:
                        self._drop_level(priority)
                self._count(waiter.model, -1)
                if self._shared is not None:
                    self._shared.waiting(waiter.deployments, -1)
                return waiter
        return None

    def _drop_level(self, priority: int) -> None:
        del self._levels[priority]
        self._priorities.remove(priority)

    def _count(self, model: str, step: int) -> None:
        self._waiting += step
        count = self._waiting_by_model.get(model, 0) + step
        if count:
            self._waiting_by_model[model] = count
        else:
            self._waiting_by_model.pop(model, None)


def gated(candidates: Sequence[Candidate]) -> bool:
    """Whether a request that may go to ``candidates`` is held to their slots: only when
    every one of them has known slots (one that does not takes any number of requests)."""
    for candidate in candidates:  # noqa: SIM110 (a loop, not all(...): it runs per request)
        if candidate.slots is None:
            return False
    return True
