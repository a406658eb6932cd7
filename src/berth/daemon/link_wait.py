"""The wait for the agents' links after a leader starts leading: part of ``/readyz``.

A leader that has just started, or has just taken the lease over from another, routes
nothing to an agent's deployment until that agent has dialled it and said Hello (the
lifecycle then puts the deployment back in its ready table).  Answering ``/readyz`` 200
before then sends a load balancer's clients to a leader that answers them
``503 no_ready_deployment``: tried as a new operator would, 145 of them in 0.7 s after a
takeover (issue 41).

So when a leader starts leading, :meth:`LinkWait.begin` notes the deployments the store
says are ``ready`` on agents (node ``local``'s are taken back by the lifecycle's own start,
before this); :meth:`LinkWait.pending` says what is still missing until every one of them
is routed again, or until the wait's bound has passed.  The bound is the ``node_timeout_s``
setting: the moment this leader marks the nodes still without a link unreachable anyway
(:meth:`berth.cluster.leader.hub.NodeHub.mark_detached_unreachable`), so a leader whose
agent is gone for good becomes ready then, and serves the rest.  Once done, it stays done:
a link that drops later is the router's business (the deployment is parked, the request
told where it is), not a reason to send every client away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.store import Store
from berth.vocab.states import DeploymentState

_log = logging.getLogger(__name__)


class LinkWait:
    """The deployments on agents a leader waits for before it says it serves.

    ``expected``: deployment id -> its node's label; ``routed(deployment_id)`` says whether requests
    go to it now (:meth:`berth.deployments.lifecycle.LifecycleManager.routed`); ``wait_s``:
    the bound in seconds from now, on ``clock`` (monotonic seconds).
    """

    def __init__(
        self,
        expected: Mapping[str, str],
        routed: Callable[[str], bool],
        *,
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._expected = dict(expected)
        self._routed = routed
        self._wait_s = wait_s
        self._clock = clock
        self._began = clock()
        self._done = not self._expected

    @classmethod
    async def begin(cls, store: Store, routed: Callable[[str], bool], *, wait_s: float) -> LinkWait:
        """A wait for every deployment ``store`` lists as ready on an agent's node.  Raises
        ``StoreError`` when the store does not answer."""
        active = await asyncio.to_thread(store.list_deployments, active_only=True)
        on_agents = [
            record
            for record in active
            if record.state is DeploymentState.READY and record.node_id != LOCAL_NODE_ID
        ]
        labels: dict[str, str] = {}
        if on_agents:
            labels = {node.id: node.label for node in await asyncio.to_thread(store.list_nodes)}
        expected = {r.id: labels.get(r.node_id, r.node_id) for r in on_agents}
        if expected:
            nodes = ", ".join(sorted(set(expected.values())))
            _log.info(
                "readiness: waiting for the links of node(s) %s (%d ready deployment(s)), at "
                "most %.0f s (node_timeout_s)",
                nodes,
                len(expected),
                wait_s,
            )
        return cls(expected, routed, wait_s=wait_s)

    @property
    def done(self) -> bool:
        """Whether the wait is over (every deployment routed, or the bound passed)."""
        return self._done

    def pending(self) -> str | None:
        """``None`` once the wait is over, else what it waits for: the nodes, their
        deployments and the seconds left, e.g. ``waiting for the link of node gpu-a
        (deployment d-1), at most 12 s more``."""
        if self._done:
            return None
        missing = {d: n for d, n in self._expected.items() if not self._routed(d)}
        elapsed_s = self._clock() - self._began
        if not missing:
            self._done = True
            _log.info("readiness: every deployment on agents is routed again (%.1f s)", elapsed_s)
            return None
        nodes = sorted(set(missing.values()))
        if elapsed_s >= self._wait_s:
            self._done = True
            _log.warning(
                "readiness: serving without node(s) %s (deployments %s): no link within "
                "%.0f s (node_timeout_s)",
                ", ".join(nodes),
                ", ".join(sorted(missing)),
                self._wait_s,
            )
            return None
        links = "link of node" if len(nodes) == 1 else "links of nodes"
        deployments = "deployment" if len(missing) == 1 else "deployments"
        return (
            f"waiting for the {links} {', '.join(nodes)} ({deployments} "
            f"{', '.join(sorted(missing))}), at most {self._wait_s - elapsed_s:.0f} s more"
        )
