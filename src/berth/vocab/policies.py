"""The policies a deployment or a service names: how its engine is restarted
(:data:`RestartPolicy`) and how the router picks among its deployments
(:data:`RoutingPolicy`), each with the check that turns text into one."""

from __future__ import annotations

from typing import Literal

from berth.errors import ConfigError

#: How the router picks among a model's ready deployments (``routing_policy``, and a
#: service's own): ``least-load``: the scorer's order (affinity, in flight, p95);
#: ``prefix``: the one whose engine served the longest prefix of the prompt, within a
#: bound on load (``berth.routing.prefix``).
RoutingPolicy = Literal["least-load", "prefix"]
ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("least-load", "prefix")

#: When a deployment's engine is started again after it ended (``docs/fleet.md``, Restarts):
#: ``on-failure`` after a non-zero exit, a kill by a signal or a stop after failed health
#: probes; ``always`` after an exit with code 0 too; ``never``: it fails, as it ends.
RestartPolicy = Literal["on-failure", "always", "never"]
RESTART_POLICIES: tuple[RestartPolicy, ...] = ("on-failure", "always", "never")
DEFAULT_RESTART_POLICY: RestartPolicy = "on-failure"


def check_restart_policy(policy: str) -> RestartPolicy:
    """``policy`` as a :data:`RestartPolicy`; ``ConfigError`` naming the valid ones."""
    for known in RESTART_POLICIES:
        if policy == known:
            return known
    raise ConfigError(
        f"unknown restart policy {policy!r}: choose one of {', '.join(RESTART_POLICIES)}"
    )


def check_routing_policy(policy: str) -> RoutingPolicy:
    """``policy`` as a :data:`RoutingPolicy`; ``ConfigError`` naming the valid ones."""
    for known in ROUTING_POLICIES:
        if policy == known:
            return known
    raise ConfigError(
        f"unknown routing policy {policy!r}: choose one of {', '.join(ROUTING_POLICIES)}"
    )
