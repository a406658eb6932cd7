"""The deployment state machine.

::

    pending ──▶ loading ──▶ ready ──▶ stopping ──▶ stopped
                  ▲  │        │
                  │  ▼        ▼
          restarting | crashloop

    loading, ready ──▶ restarting | crashloop ──▶ loading
    pending, loading, ready, restarting, crashloop, stopping ──▶ failed
    pending, loading, ready, restarting, crashloop ──▶ stopping

``stopping`` is reachable from every state that is not terminal (a stop during start-up, or
while a restart waits: the stop wins, the pending restart is cancelled).  ``stopped`` and
``failed`` are terminal.  A failed deployment keeps its reason.

``restarting`` and ``crashloop`` are the restart policy's (:mod:`berth.deployments.restarts`):
an engine of a deployment that was ready ended (it exited, was killed by a signal, or was
stopped after its failed health probes) and the deployment waits out its backoff before it
is started again on the same node (then ``loading``).  ``crashloop`` is ``restarting`` once
the deployment has been restarted ``crashloop_restarts`` times in a row without staying
ready for ``restart_reset_after_s`` (its backoff is long by then); it keeps restarting, its
backoff doubling up to the cap.  A restart whose start fails goes back to ``restarting`` or
``crashloop`` from ``loading``.
"""

from __future__ import annotations

from enum import StrEnum


class DeploymentState(StrEnum):
    PENDING = "pending"
    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"
    CRASHLOOP = "crashloop"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


_ALLOWED: dict[DeploymentState, frozenset[DeploymentState]] = {
    DeploymentState.PENDING: frozenset(
        {DeploymentState.LOADING, DeploymentState.STOPPING, DeploymentState.FAILED}
    ),
    DeploymentState.LOADING: frozenset(
        {
            DeploymentState.READY,
            DeploymentState.RESTARTING,
            DeploymentState.CRASHLOOP,
            DeploymentState.STOPPING,
            DeploymentState.FAILED,
        }
    ),
    DeploymentState.READY: frozenset(
        {
            DeploymentState.RESTARTING,
            DeploymentState.CRASHLOOP,
            DeploymentState.STOPPING,
            DeploymentState.FAILED,
        }
    ),
    DeploymentState.RESTARTING: frozenset(
        {DeploymentState.LOADING, DeploymentState.STOPPING, DeploymentState.FAILED}
    ),
    DeploymentState.CRASHLOOP: frozenset(
        {DeploymentState.LOADING, DeploymentState.STOPPING, DeploymentState.FAILED}
    ),
    DeploymentState.STOPPING: frozenset({DeploymentState.STOPPED, DeploymentState.FAILED}),
    DeploymentState.STOPPED: frozenset(),
    DeploymentState.FAILED: frozenset(),
}

TERMINAL_STATES = frozenset({DeploymentState.STOPPED, DeploymentState.FAILED})
#: Waiting out a restart's backoff: no engine runs, one will be started again.
RESTARTING_STATES = frozenset({DeploymentState.RESTARTING, DeploymentState.CRASHLOOP})


def can_transition(current: DeploymentState, target: DeploymentState) -> bool:
    """Whether the state machine allows ``current`` → ``target``."""
    return target in _ALLOWED[current]
