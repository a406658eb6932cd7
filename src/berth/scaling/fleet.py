"""What the scaling controller asks of the leader (:class:`Fleet`, which the daemon
implements over its lifecycle manager in ``berth.deployments.fleet``) and reads of the router
(:class:`Activity`), and the callbacks it hands out."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from berth.vocab.records import ServiceProfileRecord

#: Writes one audit-log event (``cluster.pki.enrollment.AuditLog.append``).
Audit = Callable[[Mapping[str, object]], None]
#: Takes a line saying what a start is busy with (an eviction), for the waiting requests.
ProgressNote = Callable[[str], None]
#: Told of each deployment a start evicts, before it is stopped: its id and the reason.
EvictionNote = Callable[[str, str], None]


class Fleet(Protocol):
    """What the controller asks of the leader; the daemon implements it over the lifecycle
    manager (``berth.deployments.fleet``)."""

    async def start_replica(
        self, service: ServiceProfileRecord, note: ProgressNote, evicted: EvictionNote
    ) -> str:
        """Deploy one replica of ``service`` (placement chooses where, evicting idle
        deployments when it must, each told to ``evicted`` before it is stopped);
        the new deployment's id once it exists (pending).  Raises ``BerthError`` when it is
        refused (nothing fits: the message names the estimate)."""
        ...

    async def stop_replica(self, deployment_id: str) -> None:
        """Stop the deployment; ``ConflictError`` when it is already stopping or stopped."""
        ...

    def progress(self, deployment_id: str) -> str | None:
        """What a loading deployment is busy with (an image pull), if it says."""
        ...

    def routable(self, service: str) -> frozenset[str]:
        """The ids of the service's ready deployments the router can reach now."""
        ...


class Activity(Protocol):
    """Requests on each deployment, as the router counts them (``routing.signals``)."""

    def in_flight(self, deployment_id: str) -> int: ...

    def last_active_at(self, deployment_id: str) -> float | None:
        """When a request last started or finished on it, on the controller's clock."""
        ...
