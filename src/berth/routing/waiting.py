"""Requests waiting for an engine's first byte, and what happens to them when berth gives the
engine (or its node) up.

The dispatch loop (``gateway/dispatch.py``) registers each attempt while it waits for
the head of an engine's answer. When the leader gives up on a deployment or a node, every
attempt still waiting on it is woken at once, instead of waiting for the engine to be
stopped or for the read timeout:

- a deployment is *suspect* when a health probe failed (it may still answer: a slow probe is
  no proof that the engine is gone);
- it has *failed* when enough probes in a row failed, or its engine exited (it is being
  stopped);
- a node is *lost* when its link is dead or closed;
- it is *stopped* when it is being stopped (``berth stop``, a scale-in, an eviction).

Waking means cancelling the attempt's task. The cancellation closes its exchange with the
engine (berth's pooled connection to it is dropped, or the tunnel stream reset, on which the
agent closes its own connection to the engine), which is how llama.cpp, vLLM and SGLang
learn to stop generating an answer nobody would read. The dispatch loop then sends the
request to its next candidate. An attempt that has no other candidate keeps waiting on a
suspect deployment, and ends at once (502) on a failed or stopped one or a lost node.

Only attempts before the first byte are here: an answer already streaming to its client is
never sent twice (the one-retry-before-first-byte rule).

The other way round, an attempt tells whoever watches the engines (``on_engine_failed``: the
lifecycle manager) when an engine believed ready refused its connection or broke it before
answering, so that no new request goes there until a probe says it answers again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from berth.routing.resolver import Upstream

log = logging.getLogger(__name__)


class GiveUp(enum.Enum):
    """Why the leader stopped counting on an engine."""

    SUSPECT = "suspect"  # a health probe failed: it may still answer
    FAILED = "failed"  # its deployment failed: the engine is being stopped
    NODE_LOST = "node_lost"  # its node's link is dead or closed
    STOPPED = "stopped"  # its deployment is being stopped

    @property
    def final(self) -> bool:
        """Whether the engine will not answer any more (so waiting on it is pointless)."""
        return self is not GiveUp.SUSPECT


@dataclass(eq=False)
class WaitingAttempt:
    """One attempt waiting for an answer's head: its upstream, the task that waits, and
    whether the request has another candidate to go to (``elsewhere``)."""

    upstream: Upstream
    task: asyncio.Task[Any]
    elsewhere: bool
    #: set when the attempt was woken (its task cancelled) because its engine was given up
    given_up: GiveUp | None = None
    reason: str = ""


class WaitingAttempts:
    """The attempts waiting for a first byte, by deployment and by node (no I/O).

    :meth:`add` and :meth:`remove` are called by the dispatch loop on the event loop around
    each attempt; :meth:`give_up_deployment` and :meth:`give_up_node` by whoever gives up
    (the health watcher, the router when a link goes).
    """

    def __init__(self) -> None:
        self._by_deployment: dict[str, set[WaitingAttempt]] = {}
        self._by_node: dict[str, set[WaitingAttempt]] = {}
        #: hears of an engine believed ready that did not take an attempt (see the module doc)
        self.on_engine_failed: Callable[[Upstream, str], None] | None = None

    def engine_failed(self, upstream: Upstream, why: str) -> None:
        """An attempt found ``upstream``'s engine not taking requests (``why``: it refused
        the connection, or broke it before answering)."""
        if self.on_engine_failed is not None:
            self.on_engine_failed(upstream, why)

    def __len__(self) -> int:
        return sum(len(attempts) for attempts in self._by_deployment.values())

    def add(
        self, upstream: Upstream, task: asyncio.Task[Any], *, elsewhere: bool
    ) -> WaitingAttempt:
        """Register ``task``'s attempt on ``upstream``; ``elsewhere``: the request has another
        candidate it may be sent to if this one is given up."""
        attempt = WaitingAttempt(upstream, task, elsewhere)
        self._by_deployment.setdefault(upstream.deployment_id, set()).add(attempt)
        self._by_node.setdefault(upstream.node_id, set()).add(attempt)
        return attempt

    def remove(self, attempt: WaitingAttempt) -> None:
        """The attempt has its answer's head, failed or was abandoned."""
        upstream = attempt.upstream
        for table, key in (
            (self._by_deployment, upstream.deployment_id),
            (self._by_node, upstream.node_id),
        ):
            attempts = table.get(key)
            if attempts is not None:
                attempts.discard(attempt)
                if not attempts:
                    del table[key]

    def give_up_deployment(self, deployment_id: str, why: GiveUp, reason: str) -> int:
        """Wake the attempts waiting on the deployment (see the module docstring); returns
        how many were woken. ``reason`` is a phrase for logs and errors ("its engine failed a
        health probe")."""
        return self._wake(self._by_deployment.get(deployment_id, ()), why, reason)

    def give_up_node(self, node_id: str, reason: str) -> int:
        """Wake every attempt waiting on the node: its link is gone. Returns how many."""
        return self._wake(self._by_node.get(node_id, ()), GiveUp.NODE_LOST, reason)

    @staticmethod
    def _wake(attempts: set[WaitingAttempt] | tuple[()], why: GiveUp, reason: str) -> int:
        woken = 0
        for attempt in list(attempts):
            if attempt.given_up is not None:
                continue  # already woken: its task is cancelled once
            if not (why.final or attempt.elsewhere):
                continue  # nowhere else to go: it keeps waiting on the suspect engine
            attempt.given_up = why
            attempt.reason = reason
            attempt.task.cancel()
            woken += 1
        if woken:
            log.info("woke %d request(s) waiting for a first byte: %s", woken, reason)
        return woken
