"""The on-demand stage of the request path: a request for a service with nothing ready is
held at the leader until a replica is ready.

Where it sits: after admission (the key's limits) and before the router's plan is walked
(and, with fair admission, before the slot queue)::

    admission ─▶ plan (nothing ready?) ─▶ OnDemandStage.until_ready ─▶ plan ─▶ dispatch

:meth:`OnDemandStage.until_ready` is given the request's model and a ``plan`` callable (the
router's), which raises :class:`~berth.routing.errors.NoReadyDeploymentError` while nothing
serves the model.  For a route whose service may be loaded it asks the controller for a
replica (:meth:`LoadStarter.demand`: the controller starts one only if none is ready or
starting, so a burst starts exactly one), then waits: every change to the service's
deployments wakes the waiters, which call ``plan`` again.  Bounded: at most
``load_queue_max`` requests wait per service (the next is answered 503 at once), each for at
most ``load_wait_s`` (then 503 with the load's progress), and a request whose client leaves
is cancelled by the proxy and leaves the queue at once (its ``finally``).  Nothing is sent to
the client while it waits, so a stream's first byte is the engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from berth.routing.errors import NoReadyDeploymentError
from berth.scaling.errors import LoadFailedError, LoadQueueFullError, LoadTimeoutError
from berth.scaling.metrics import ScalingMetrics, WaitOutcome
from berth.scaling.policy import ScalingPolicy

T = TypeVar("T")


@dataclass(frozen=True)
class LoadFailure:
    """A load that did not happen: ``reason`` for people, ``at`` on the stage's clock.

    ``engine_failed``: the deployment was made but its engine failed to start (a new request
    does not try again for ``failed_load_hold_s``); otherwise placement refused it (no room
    now: the next request tries again, since room may have freed).  ``policy_refused``: the
    refusal was a node's agent policy, which time does not change: the controller does not
    try again on its own until the service changes (a request still may, and hears why).
    """

    reason: str
    at: float
    engine_failed: bool = True
    policy_refused: bool = False


class LoadStarter(Protocol):
    """What the on-demand stage asks of the scaling controller."""

    def loadable_service(self, model: str) -> str | None:
        """The service a request for ``model`` (a route) loads, ``None`` when it loads none
        (not a route, or nothing behind it may be started)."""
        ...

    def demand(self, service: str) -> None:
        """Requests wait for ``service``: start a replica unless one is ready or starting."""
        ...

    def load_progress(self, service: str) -> str:
        """How far the service's load got, for a person (``deployment d-… on node gpu-a:
        loading, 12 s``)."""
        ...


class DemandBoard:
    """Per service: how many requests wait, the signal that wakes them, the last failed
    load.  Memory only, event-loop only."""

    def __init__(self) -> None:
        self._waiting: dict[str, int] = {}
        self._signals: dict[str, asyncio.Event] = {}
        self._failures: dict[str, LoadFailure] = {}

    def waiting(self, service: str) -> int:
        return self._waiting.get(service, 0)

    def join(self, service: str) -> None:
        self._waiting[service] = self._waiting.get(service, 0) + 1

    def leave(self, service: str) -> None:
        left = self._waiting.get(service, 0) - 1
        if left > 0:
            self._waiting[service] = left
        else:
            self._waiting.pop(service, None)

    def signal(self, service: str) -> asyncio.Event:
        """The event the next change of ``service`` sets."""
        event = self._signals.get(service)
        if event is None:
            event = self._signals[service] = asyncio.Event()
        return event

    def changed(self, service: str) -> None:
        """Something about ``service``'s replicas changed: wake whoever waits."""
        event = self._signals.pop(service, None)
        if event is not None:
            event.set()

    def failed(self, service: str, failure: LoadFailure) -> None:
        self._failures[service] = failure
        self.changed(service)

    def failure(self, service: str) -> LoadFailure | None:
        return self._failures.get(service)

    def clear_failure(self, service: str) -> None:
        self._failures.pop(service, None)

    def forget(self, service: str) -> None:
        """The service was removed: wake its waiters (they find it gone) and forget it."""
        self.changed(service)
        self._failures.pop(service, None)


class OnDemandStage:
    """Holds requests until their service is ready (see the module docstring).

    ``clock`` is monotonic seconds, the controller's clock.
    """

    def __init__(
        self,
        starter: LoadStarter,
        board: DemandBoard,
        policy: ScalingPolicy,
        metrics: ScalingMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._starter = starter
        self._board = board
        self._policy = policy
        self._metrics = metrics
        self._clock = clock

    async def until_ready(self, model: str, plan: Callable[[], T]) -> T:
        """``plan()`` once it stops raising ``NoReadyDeploymentError``, loading the service
        of ``model`` if needed.

        Raises what ``plan`` raises when ``model`` loads no service (not a route, say);
        :class:`LoadQueueFullError` when ``load_queue_max`` requests already wait;
        :class:`LoadFailedError` when the load was refused or its engine failed (after an
        engine failed, also for ``failed_load_hold_s`` without trying again);
        :class:`LoadTimeoutError`
        after ``load_wait_s``.  Cancelling the caller (its client left) leaves the queue.
        """
        try:
            return plan()
        except NoReadyDeploymentError:
            service = self._starter.loadable_service(model)
            if service is None:
                raise
        board, policy = self._board, self._policy
        joined = self._clock()
        failure = board.failure(service)
        held = failure is not None and failure.engine_failed
        if failure is not None and held and joined - failure.at < policy.failed_load_hold_s:
            self._metrics.waited(service, "failed", 0.0)
            raise self._failed(model, service, failure)
        if board.waiting(service) >= policy.load_queue_max:
            self._metrics.waited(service, "queue_full", 0.0)
            raise LoadQueueFullError(
                model,
                service,
                f"{board.waiting(service)} requests already wait for service {service!r} to "
                f"load (load_queue_max {policy.load_queue_max}); try again later",
                retry_after_s=policy.retry_after_s,
            )
        board.join(service)
        self._metrics.queue_depth(service, board.waiting(service))
        outcome: WaitOutcome = "client_gone"
        try:
            self._starter.demand(service)
            deadline = joined + policy.load_wait_s
            while True:
                signal = board.signal(service)  # taken before plan(), so no change is missed
                try:
                    answer = plan()
                except NoReadyDeploymentError:
                    pass
                else:
                    outcome = "ready"
                    return answer
                failure = board.failure(service)
                if failure is not None and failure.at >= joined:
                    outcome = "failed"
                    raise self._failed(model, service, failure)
                remaining = deadline - self._clock()
                if remaining <= 0:
                    outcome = "timeout"
                    raise LoadTimeoutError(
                        model,
                        service,
                        f"model {model!r} is not ready after {policy.load_wait_s:g} s: "
                        f"{self._starter.load_progress(service)}",
                        retry_after_s=policy.retry_after_s,
                    )
                with contextlib.suppress(TimeoutError):  # the loop's next turn answers it
                    await asyncio.wait_for(signal.wait(), remaining)
        finally:
            board.leave(service)
            self._metrics.queue_depth(service, board.waiting(service))
            self._metrics.waited(service, outcome, self._clock() - joined)

    def _failed(self, model: str, service: str, failure: LoadFailure) -> LoadFailedError:
        return LoadFailedError(
            model,
            service,
            f"service {service!r} could not be loaded: {failure.reason}",
            retry_after_s=self._policy.retry_after_s,
        )
