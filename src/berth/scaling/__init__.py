"""Scaling: services loaded on demand, unloaded when idle, scaled out and in.

- :mod:`.decisions`: what to do about one service at one moment (pure, with reasons);
- :mod:`.capacity`: how many requests one replica serves at once (the engine's slots);
- :mod:`.on_demand`: the request path's stage that holds a request until its service has a
  ready replica (bounded, one start per burst);
- :mod:`.controller`: the loop that looks at every service and asks the leader's
  :class:`~berth.scaling.fleet.Fleet` to start or stop replicas, and keeps the last
  decision for ``berth service show`` (:mod:`.status`: what it reports);
- :mod:`.metrics`, :mod:`.errors`, :mod:`.policy`.

This package sits above ``routing`` (it reads the route table and answers with routing's
errors) and below ``daemon``, which implements the fleet over its lifecycle manager and
wires the controller in.
"""

from berth.scaling.controller import ScalingController, route_services
from berth.scaling.errors import LoadError, LoadFailedError, LoadQueueFullError, LoadTimeoutError
from berth.scaling.fleet import Fleet
from berth.scaling.metrics import ScalingMetrics
from berth.scaling.on_demand import OnDemandStage
from berth.scaling.policy import ScalingPolicy
from berth.scaling.status import DecisionRecord, ReplicaUsage, ServiceStatus

__all__ = [
    "DecisionRecord",
    "Fleet",
    "LoadError",
    "LoadFailedError",
    "LoadQueueFullError",
    "LoadTimeoutError",
    "OnDemandStage",
    "ReplicaUsage",
    "ScalingController",
    "ScalingMetrics",
    "ScalingPolicy",
    "ServiceStatus",
    "route_services",
]
