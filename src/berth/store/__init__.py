"""The state database: SQLAlchemy 2 models, versioned migrations, the :class:`Store` facade.

Callers use :class:`Store` and the frozen records; the ORM tables stay inside this package.
"""

from berth.store.drains import MOVE_STEPS, DrainMove, MoveStep, NodeDrain
from berth.store.migrations import LATEST_VERSION
from berth.store.records import (
    DEFAULT_RESTART_POLICY,
    RESTART_POLICIES,
    ROUTING_POLICIES,
    AdapterRecord,
    ApiKeyRecord,
    DeploymentRecord,
    ModelLocation,
    ModelRecord,
    ModelSource,
    NodeCertificate,
    NodeHardware,
    NodeRecord,
    NodeStatus,
    RestartPolicy,
    RouteRecord,
    RouteTarget,
    RoutingPolicy,
    ScalingSettings,
    ServiceProfileRecord,
    StreamTimeouts,
    UsageRecord,
)
from berth.store.store import Store
from berth.store.values import UNCHANGED, Unchanged

__all__ = [
    "DEFAULT_RESTART_POLICY",
    "LATEST_VERSION",
    "MOVE_STEPS",
    "RESTART_POLICIES",
    "ROUTING_POLICIES",
    "UNCHANGED",
    "AdapterRecord",
    "ApiKeyRecord",
    "DeploymentRecord",
    "DrainMove",
    "ModelLocation",
    "ModelRecord",
    "ModelSource",
    "MoveStep",
    "NodeCertificate",
    "NodeDrain",
    "NodeHardware",
    "NodeRecord",
    "NodeStatus",
    "RestartPolicy",
    "RouteRecord",
    "RouteTarget",
    "RoutingPolicy",
    "ScalingSettings",
    "ServiceProfileRecord",
    "Store",
    "StreamTimeouts",
    "Unchanged",
    "UsageRecord",
]
