"""The admin API's contract, shared by the daemon that serves it and the programs that call
it (the CLI, ``berth doctor``).

Pydantic models, one module per resource: the leader itself (:mod:`.leader`), registered
models (:mod:`.models`), deployments, keys, nodes, services and routes, routing explanations,
placement plans (:mod:`.plans`), the metrics snapshot and the usage ledger.  The daemon's
routes declare them as FastAPI response models (so ``/admin/openapi.json`` describes every
answer) and build them from the store's records; :class:`berth.api.client.DaemonClient`
talks to a daemon over its Unix socket and decodes every answer into them.  Request bodies
(``*In``) are here too: the daemon validates them, the CLI builds them.

This package sits above ``store`` and below ``daemon``, ``cli`` and ``doctor``: it imports
base modules, runtime's engine and runtime names, the store's closed sets and deployment
states, and nothing from ``daemon`` or ``cli``.
"""

from berth.api.adapters import Adapter, AdapterIn, AdapterLoaded, AdapterRemoved, AddedAdapter
from berth.api.base import ApiModel, ErrorBody, ErrorDetail, Timestamp, describe_invalid
from berth.api.deployments import Deployment, DeploymentIn, ListedDeployment
from berth.api.keys import (
    ApiKey,
    CreatedApiKey,
    KeyChangeIn,
    KeyIn,
    KeyLimitsOut,
    KeyUseOut,
)
from berth.api.leader import (
    DaemonInfo,
    Health,
    LeaderStatus,
    ListenerInfo,
    Readiness,
    RuntimeInfo,
    SettingsReport,
    SettingValue,
    ShutdownAccepted,
    StepDownAccepted,
    StepDownIn,
)
from berth.api.metrics import (
    DeploymentColumns,
    DeploymentSampleOut,
    GpuColumns,
    GpuSampleOut,
    MetricsSnapshot,
    NodeMetrics,
    NodeSampleOut,
    NodeSeriesColumns,
)
from berth.api.models import (
    LocatedModel,
    ModelCopy,
    ModelDetail,
    ModelIn,
    ModelRemoved,
    ModelShapeOut,
    RegisteredModel,
)
from berth.api.nodes import (
    AdoptedEndpoint,
    DataPathName,
    EnrollIn,
    EnrollmentIssued,
    Gpu,
    NodeDetail,
    NodeDetailWithAdopted,
    NodeSummary,
)
from berth.api.plans import (
    EstimateInput,
    EvictionOut,
    GpuOptionOut,
    Plan,
    PlanIn,
    VramEstimateOut,
)
from berth.api.routing import DroppedCandidate, LastDecision, RankedCandidate, RoutingExplanation
from berth.api.services import (
    DeployIn,
    FallbackIn,
    Route,
    RouteIn,
    RouteRemoved,
    RouteService,
    ScaleIn,
    ScalingDecisionOut,
    Service,
    ServiceDeployment,
    ServiceDetail,
    ServiceIn,
    ServiceScaling,
)
from berth.api.usage import (
    DEFAULT_SINCE,
    SINCE_DAYS_PATTERN,
    USAGE_GROUPINGS,
    UsageGrouping,
    UsageReport,
    UsageRow,
    parse_grouping,
    parse_since,
)

__all__ = [
    "DEFAULT_SINCE",
    "SINCE_DAYS_PATTERN",
    "USAGE_GROUPINGS",
    "Adapter",
    "AdapterIn",
    "AdapterLoaded",
    "AdapterRemoved",
    "AddedAdapter",
    "AdoptedEndpoint",
    "ApiKey",
    "ApiModel",
    "CreatedApiKey",
    "DaemonInfo",
    "DataPathName",
    "DeployIn",
    "Deployment",
    "DeploymentColumns",
    "DeploymentIn",
    "DeploymentSampleOut",
    "DroppedCandidate",
    "EnrollIn",
    "EnrollmentIssued",
    "ErrorBody",
    "ErrorDetail",
    "EstimateInput",
    "EvictionOut",
    "FallbackIn",
    "Gpu",
    "GpuColumns",
    "GpuOptionOut",
    "GpuSampleOut",
    "Health",
    "KeyChangeIn",
    "KeyIn",
    "KeyLimitsOut",
    "KeyUseOut",
    "LastDecision",
    "LeaderStatus",
    "ListedDeployment",
    "ListenerInfo",
    "LocatedModel",
    "MetricsSnapshot",
    "ModelCopy",
    "ModelDetail",
    "ModelIn",
    "ModelRemoved",
    "ModelShapeOut",
    "NodeDetail",
    "NodeDetailWithAdopted",
    "NodeMetrics",
    "NodeSampleOut",
    "NodeSeriesColumns",
    "NodeSummary",
    "Plan",
    "PlanIn",
    "RankedCandidate",
    "Readiness",
    "RegisteredModel",
    "Route",
    "RouteIn",
    "RouteRemoved",
    "RouteService",
    "RoutingExplanation",
    "RuntimeInfo",
    "ScaleIn",
    "ScalingDecisionOut",
    "Service",
    "ServiceDeployment",
    "ServiceDetail",
    "ServiceIn",
    "ServiceScaling",
    "SettingValue",
    "SettingsReport",
    "ShutdownAccepted",
    "StepDownAccepted",
    "StepDownIn",
    "Timestamp",
    "UsageGrouping",
    "UsageReport",
    "UsageRow",
    "VramEstimateOut",
    "describe_invalid",
    "parse_grouping",
    "parse_since",
]
