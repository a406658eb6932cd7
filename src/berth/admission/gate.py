"""Fair admission, the waiting: the async gate the proxy passes between the router and the
engine (the decisions are :class:`~berth.admission.fair_queue.SlotScheduler`'s).

::

    held = await gate.acquire(key_id, priority, model, plan)   # a deployment id, or None
        ... dispatch to that deployment first, relay the answer ...
    gate.release(held)

The proxy splits :meth:`SlotGate.acquire` in two so that a request finding a free slot
costs no ``await``: :meth:`SlotGate.take_free` (synchronous: a slot taken at once, or why
not) and, only when it must wait, :meth:`SlotGate.wait`.

A request whose candidates all have known slots takes a free one at once, or waits in the
fair queue until one is given back to it, at most ``timeout_s``. Full queue: 503
``queue_full``; waited too long: 503 ``queue_timeout`` (both with ``Retry-After``; the
errors are :class:`~berth.admission.errors.QueueRefusedError`'s).
A request cancelled while waiting (its client left) leaves the queue at once and never
reaches an engine. A request that may go to a deployment of unknown slots is not held
(``None``).

Given the host's shared slots (``slots``, :class:`~berth.host.deployments.SharedDeployments`)
the gate counts in them, and watches its process's wake socket while anything of it has
waited: a slot another process hands to this one wakes the request it goes to.

The gate also keeps what ``/metrics`` shows of it (:class:`QueueStats`): requests waiting
per model, and how long the requests that waited waited.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import time
from collections.abc import Callable, Sequence
from typing import Final, Literal

from berth.admission.errors import QueueFullError, QueueTimeoutError
from berth.admission.fair_queue import Candidate, SlotScheduler, Waiter
from berth.host.deployments import SharedDeployments


class Wait(enum.Enum):
    """What :meth:`SlotGate.take_free` returns for a request that must wait for a slot."""

    MUST_WAIT = "must wait"


MUST_WAIT: Final = Wait.MUST_WAIT

#: Requests that may wait at once, by default (the ``queue_max_requests`` setting).
DEFAULT_MAX_WAITING = 1024
#: Seconds a request may wait for a slot, by default (the ``queue_timeout_s`` setting).
DEFAULT_TIMEOUT_S = 60.0
#: ``Retry-After`` seconds of a request refused by a full queue.
QUEUE_FULL_RETRY_S = 1.0
#: Bounds of the wait-time histogram, in seconds (Prometheus' defaults, reaching to minutes).
WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class QueueStats:
    """What the queue did since the leader started, for ``/metrics``: per model, a histogram
    of the seconds waited by requests that waited (``waits``: bucket counts, the last one
    ``+Inf``; ``wait_sum_s``) and the requests that left it without a slot (``dropped``:
    ``(model, reason)`` -> count, ``reason`` ``queue_full``, ``queue_timeout`` or
    ``client_left``)."""

    __slots__ = ("dropped", "wait_sum_s", "waits")

    def __init__(self) -> None:
        self.waits: dict[str, list[int]] = {}
        self.wait_sum_s: dict[str, float] = {}
        self.dropped: dict[tuple[str, str], int] = {}

    def waited(self, model: str, seconds: float) -> None:
        counts = self.waits.get(model)
        if counts is None:
            counts = self.waits[model] = [0] * (len(WAIT_BUCKETS_S) + 1)
        counts[bisect.bisect_left(WAIT_BUCKETS_S, seconds)] += 1
        self.wait_sum_s[model] = self.wait_sum_s.get(model, 0.0) + seconds

    def drop(self, model: str, reason: str) -> None:
        pair = (model, reason)
        self.dropped[pair] = self.dropped.get(pair, 0) + 1


class SlotGate:
    """Holds requests to their deployments' slots, fairly (see the module doc).

    ``max_waiting``: requests that may wait at once; ``timeout_s``: the longest wait;
    ``clock``: monotonic seconds; ``slots``: the host's shared slots (``None``: this
    process's).
    """

    def __init__(
        self,
        *,
        max_waiting: int = DEFAULT_MAX_WAITING,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        slots: SharedDeployments | None = None,
    ) -> None:
        self.scheduler = SlotScheduler(max_waiting, slots)
        self._shared = slots
        self._watching: asyncio.AbstractEventLoop | None = None
        self.timeout_s = timeout_s
        self.stats = QueueStats()
        self._clock = clock
        self._wakers: dict[Waiter, asyncio.Future[str]] = {}

    async def acquire(
        self, key_id: str, priority: int, model: str, candidates: Sequence[Candidate]
    ) -> str | None:
        """A slot for a request of the key ``key_id`` (its tier's ``priority``) for the
        public model ``model``, at one of ``candidates`` (best first): the id of the
        deployment it holds a slot at, which the caller gives back with :meth:`release`, or
        ``None`` when the request is not held (a candidate's slots are unknown).

        Raises :class:`QueueFullError` or :class:`QueueTimeoutError` (503), and
        ``CancelledError`` when cancelled while waiting; in each case nothing is held.
        """
        held = self.take_free(candidates)
        if held is not MUST_WAIT:
            return held
        return await self.wait(key_id, priority, model, candidates)

    def take_free(self, candidates: Sequence[Candidate]) -> str | Literal[Wait.MUST_WAIT] | None:
        """:meth:`acquire` without waiting: the id of the deployment a free slot was taken
        at, ``None`` when the request is not held (a candidate's slots are unknown), or
        :data:`MUST_WAIT` when every candidate is full (then :meth:`wait`)."""
        for candidate in candidates:  # gated(candidates), inlined: this runs per request
            if candidate.slots is None:
                return None
        held = self.scheduler.try_take(candidates)
        return MUST_WAIT if held is None else held

    async def wait(
        self, key_id: str, priority: int, model: str, candidates: Sequence[Candidate]
    ) -> str:
        """Wait in the fair queue for a slot at one of ``candidates``, all full when
        :meth:`take_free` looked (same arguments and errors as :meth:`acquire`)."""
        scheduler = self.scheduler
        waiter = Waiter(key_id, priority, model, [c.deployment_id for c in candidates])
        if not scheduler.enqueue(waiter):
            self.stats.drop(model, "queue_full")
            raise QueueFullError(
                f"every slot of {model!r} is taken and the leader's admission queue is full "
                f"(queue_max_requests = {scheduler.max_waiting})",
                key_id=key_id,
                retry_after_s=QUEUE_FULL_RETRY_S,
            )
        loop = asyncio.get_running_loop()
        if self._shared is not None and self._watching is not loop:
            self._watch(loop)
        waker: asyncio.Future[str] = loop.create_future()
        self._wakers[waiter] = waker
        begun = self._clock()
        try:
            async with asyncio.timeout(self.timeout_s):
                held = await waker
        except TimeoutError:
            if waiter.granted is not None:  # given a slot just as time ran out: take it
                held = waiter.granted
            else:
                scheduler.leave(waiter)
                self.stats.drop(model, "queue_timeout")
                raise QueueTimeoutError(
                    f"no slot of {model!r} came free within {self.timeout_s:g} s (queue_timeout_s)",
                    key_id=key_id,
                    retry_after_s=max(1.0, self.timeout_s / 10),
                ) from None
        except asyncio.CancelledError:
            if waiter.granted is not None:  # given a slot nobody will use: pass it on
                self.release(waiter.granted)
            else:
                scheduler.leave(waiter)
            self.stats.drop(model, "client_left")
            raise
        finally:
            self._wakers.pop(waiter, None)
        self.stats.waited(model, self._clock() - begun)
        return held

    def release(self, deployment_id: str) -> None:
        """Give back the slot at ``deployment_id`` a request held: the next waiter for it
        wakes up with it."""
        waiter = self.scheduler.release(deployment_id)
        if waiter is None:
            return
        waker = self._wakers.get(waiter)
        if waker is not None and not waker.done():
            waker.set_result(deployment_id)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        # Wakes from other processes (slots handed to this one) are read on ``loop``.
        box = self._shared.wake_box if self._shared is not None else None
        if box is None:
            return
        loop.add_reader(box.fileno(), self._woken)
        self._watching = loop

    def _woken(self) -> None:
        box = self._shared.wake_box if self._shared is not None else None
        if box is None:
            return
        for waiter in self.scheduler.take_grants(box.drain()):
            waker = self._wakers.get(waiter)
            if waker is not None and not waker.done() and waiter.granted is not None:
                waker.set_result(waiter.granted)

    def resize(self, deployment_id: str, slots: int | None) -> None:
        """``deployment_id`` has ``slots`` from now on (a service's ``capacity`` changed):
        waiters its new free slots take wake up with them."""
        for waiter in self.scheduler.resize(deployment_id, slots):
            waker = self._wakers.get(waiter)
            if waker is not None and not waker.done():
                waker.set_result(deployment_id)

    def move(self, held: str, to: Candidate) -> str | None:
        """A request holding a slot at ``held`` is being served by ``to`` (a retry went
        there): give ``held`` back and count the request at ``to``, over its capacity if it
        must be. Returns what to give back later (``to``'s id, or ``None`` when its slots
        are unknown)."""
        self.release(held)
        self.scheduler.take_over_capacity(to)
        return to.deployment_id if to.slots is not None else None
