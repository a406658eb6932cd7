"""The deployment state machine's states, as the admin API names them (``pending`` …
``failed``); the machine itself is :mod:`berth.daemon.states`."""

from __future__ import annotations

from berth.daemon.states import DeploymentState

__all__ = ["DeploymentState"]
