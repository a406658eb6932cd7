"""What the scaling controller reports: the decisions it made (:class:`DecisionRecord`),
each service as it sees it (:class:`ServiceStatus`, for ``berth service show``) and how
each deployment is used (:class:`ReplicaUsage`, for the eviction choice)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from berth.vocab.states import DeploymentState

ScalingActionName = Literal["start", "stop", "hold"]


@dataclass(frozen=True)
class DecisionRecord:
    """A decision as ``berth service show`` gives it: the action, why, when (epoch
    seconds), and the deployments it concerns."""

    action: ScalingActionName
    reason: str
    at: float
    deployment_ids: tuple[str, ...] = ()

    @property
    def at_datetime(self) -> datetime:
        return datetime.fromtimestamp(self.at, UTC)


@dataclass(frozen=True)
class ServiceStatus:
    """A service as the controller sees it: active replicas by state, requests waiting for
    a load, the capacity of one replica, its last start or stop and its latest decision."""

    replicas: Mapping[DeploymentState, int]
    queued: int
    capacity: int
    last_action: DecisionRecord | None
    decision: DecisionRecord | None


@dataclass(frozen=True)
class ReplicaUsage:
    """How a deployment is used, for the eviction choice: when its last request started or
    finished (epoch seconds; ``None``: none since it became ready), requests in flight and
    waiting for its service, and whether it may not be evicted now (``protected``: its
    service is pinned, has a higher priority than the service being placed, or would drop
    below its ``min_replicas``)."""

    last_request_at: float | None
    in_flight: int
    queued: int
    protected: bool
