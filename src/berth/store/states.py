"""The deployment state machine.

::

    pending ──▶ loading ──▶ ready ──▶ stopping ──▶ stopped
       │           │          │          │
       └───────────┴──────────┴──────────┴──▶ failed

``stopping`` is also reachable from ``pending`` and ``loading`` (a stop during start-up).
``stopped`` and ``failed`` are terminal.  A failed deployment keeps its reason.
"""

from __future__ import annotations

from enum import StrEnum


class DeploymentState(StrEnum):
    PENDING = "pending"
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


_ALLOWED: dict[DeploymentState, frozenset[DeploymentState]] = {
    DeploymentState.PENDING: frozenset(
        {DeploymentState.LOADING, DeploymentState.STOPPING, DeploymentState.FAILED}
    ),
    DeploymentState.LOADING: frozenset(
        {DeploymentState.READY, DeploymentState.STOPPING, DeploymentState.FAILED}
    ),
    DeploymentState.READY: frozenset({DeploymentState.STOPPING, DeploymentState.FAILED}),
    DeploymentState.STOPPING: frozenset({DeploymentState.STOPPED, DeploymentState.FAILED}),
    DeploymentState.STOPPED: frozenset(),
    DeploymentState.FAILED: frozenset(),
}

TERMINAL_STATES = frozenset({DeploymentState.STOPPED, DeploymentState.FAILED})


def can_transition(current: DeploymentState, target: DeploymentState) -> bool:
    """Whether the state machine allows ``current`` → ``target``."""
    return target in _ALLOWED[current]
