"""Service profiles and routes: ``/admin/services``, ``/admin/routes``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator

from berth.api.base import (
    MAX_ADAPTER_SLOTS,
    MAX_EXTRA_ARGS,
    MAX_GPUS,
    ApiInput,
    ApiModel,
    CtxTokens,
    DockerImage,
    EngineIn,
    ExtraArg,
    GpuIndex,
    RuntimeIn,
    Timestamp,
    named_pattern,
)
from berth.api.models import MODEL_NAME_PATTERN, no_parent_segments
from berth.humanize import parse_duration
from berth.vocab.engines import EngineName, RuntimeName
from berth.vocab.policies import DEFAULT_RESTART_POLICY, RestartPolicy, RoutingPolicy
from berth.vocab.records import MAX_STREAM_TIMEOUT_S
from berth.vocab.states import DeploymentState

#: What an idle timeout may be given as: a duration (``"30s"``, ``"10m"``, ``"2h"``, or a
#: number of seconds), or ``"never"`` (not stopped for idleness).
NEVER = "never"
_INT32 = 2**31 - 1


def idle_timeout_seconds(value: str | float | None) -> float | None:
    """Seconds of an idle timeout as the API takes it: a duration string or number of
    seconds; ``"never"`` (any case) and ``None`` are ``None``.  ``ValueError`` when it does
    not parse (the message names the accepted forms)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() == NEVER:
            return None
        return parse_duration(value)
    return parse_duration(str(value))


#: An idle timeout as the schema states it: ``never``, or a duration of
#: :func:`berth.humanize.parse_duration` (a number of seconds, or numbers with units run
#: together: ``90``, ``30s``, ``1h30m``), or a number of seconds.
_NUMBER = r"[0-9]{1,15}(\.[0-9]{1,15})?"
IDLE_TIMEOUT_PATTERN = rf"^(never|{_NUMBER}|({_NUMBER}(ms|s|m|h|d))+)$"
IdleTimeoutIn = Annotated[
    str | float,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": IDLE_TIMEOUT_PATTERN},
                {"type": "number", "minimum": 0},
            ],
            "examples": ["10m", 600, "never"],
        }
    ),
]


def _check_idle_timeout(value: str | float | None) -> str | float | None:
    idle_timeout_seconds(value)  # raises ValueError, which pydantic reports on the field
    return value


#: Service names: letters, digits and ``. _ - :``, starting with a letter or digit.  They
#: become the engine's served model name and a URL path segment.
SERVICE_NAME_PATTERN = named_pattern(
    r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$",
    "a valid service name: up to 128 letters, digits, '.', '_', ':' and '-', "
    "starting with a letter or digit",
)
#: Route names are what clients put in ``"model"``: the rules of model names (``org/m:q4``).
ROUTE_NAME_PATTERN = MODEL_NAME_PATTERN


class ServiceIn(ApiInput):
    """``POST /admin/services``: a model and how to deploy it.

    ``engine`` and ``runtime`` as a user typed them (checked by the store); ``runtime``
    ``None`` is the leader's ``default_runtime`` setting, recorded on the service.  ``gpus``
    are device indexes (0 to 1023), ``ctx`` the context length in tokens, ``node_label`` the
    node its deployments run on (``None``: chosen at deploy time), ``max_adapters`` their LoRA
    slots (vLLM, SGLang; ``None``: 1 when the model has adapters, else LoRA off).

    Scaling (:class:`berth.store.ScalingSettings`): ``min_replicas`` kept running (0: on
    demand), ``max_replicas`` berth starts at most, ``idle_timeout`` (``"10m"``, seconds, or
    ``"never"``/``None``: never stopped for idleness), ``pinned`` (never evicted),
    ``priority`` (a start evicts only services of at most its priority), ``capacity``
    (requests one replica serves at once; ``None``: the engine's slots).  ``min_replicas``
    above ``max_replicas`` is refused by the store (400).

    Streamed answers (:class:`berth.store.StreamTimeouts`): ``first_byte_timeout_s`` and
    ``stream_idle_timeout_s``, seconds (0: off; ``None``: the leader's settings).
    """

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "name": "chat",
                    "model": "llama-3.1-8b-q4",
                    "engine": "llamacpp",
                    "ctx": 8192,
                    "min_replicas": 0,
                    "max_replicas": 2,
                    "idle_timeout": "10m",
                }
            ]
        }
    )

    name: str = Field(pattern=SERVICE_NAME_PATTERN)
    model: str = Field(min_length=1, max_length=200)
    engine: EngineIn = "llamacpp"
    runtime: RuntimeIn | None = None
    gpus: list[GpuIndex] = Field(default_factory=list, max_length=MAX_GPUS)
    ctx: CtxTokens | None = None
    extra_args: list[ExtraArg] = Field(default_factory=list, max_length=MAX_EXTRA_ARGS)
    image: DockerImage | None = None
    node_label: str | None = Field(default=None, min_length=1, max_length=63)
    min_replicas: int = Field(default=0, ge=0, le=_INT32)
    max_replicas: int = Field(default=1, ge=0, le=_INT32)
    idle_timeout: IdleTimeoutIn | None = None
    pinned: bool = False
    priority: int = Field(default=0, ge=-_INT32, le=_INT32)
    capacity: int | None = Field(default=None, ge=1, le=_INT32)

    _idle_timeout = field_validator("idle_timeout")(_check_idle_timeout)
    max_adapters: int | None = Field(default=None, ge=1, le=MAX_ADAPTER_SLOTS)
    #: its deployments' restart policy (``berth run --restart``)
    restart: RestartPolicy = DEFAULT_RESTART_POLICY
    first_byte_timeout_s: float | None = Field(default=None, ge=0, le=MAX_STREAM_TIMEOUT_S)
    stream_idle_timeout_s: float | None = Field(default=None, ge=0, le=MAX_STREAM_TIMEOUT_S)
    #: how the router picks among its deployments (``None``: the leader's routing_policy)
    routing_policy: RoutingPolicy | None = None


class ScaleIn(ApiInput):
    """``PATCH /admin/services/{name}``: new scaling settings, or stream timeouts; a field
    left ``None`` keeps its value (``idle_timeout`` ``"never"`` clears the timeout).  Checked
    as a whole after the change: ``min_replicas`` above ``max_replicas`` is refused (400),
    nothing changed."""

    min_replicas: int | None = Field(default=None, ge=0, le=_INT32)
    max_replicas: int | None = Field(default=None, ge=0, le=_INT32)
    idle_timeout: IdleTimeoutIn | None = None
    pinned: bool | None = None
    priority: int | None = Field(default=None, ge=-_INT32, le=_INT32)
    capacity: int | None = Field(default=None, ge=1, le=_INT32)
    #: the restart policy of its deployments started from now on
    restart: RestartPolicy | None = None
    first_byte_timeout_s: float | None = Field(default=None, ge=0, le=MAX_STREAM_TIMEOUT_S)
    stream_idle_timeout_s: float | None = Field(default=None, ge=0, le=MAX_STREAM_TIMEOUT_S)
    #: its routing policy from the next request on (``default``: the leader's setting again)
    routing_policy: RoutingPolicy | Literal["default"] | None = None

    _idle_timeout = field_validator("idle_timeout")(_check_idle_timeout)


class DeployIn(ApiInput):
    """``POST /admin/services/{name}/deploy``: the node (id or label) to deploy on;
    ``None``: the service's ``node_label``, else where its VRAM estimate fits (replicas
    spread over nodes first).  ``force`` as for a deployment (``DeploymentIn``)."""

    node: str | None = None
    force: bool = False


class RouteIn(ApiInput):
    """``POST /admin/routes``: put ``service`` behind the route ``name`` (created if new) at
    ``priority`` (higher is tried first); ``fallback`` sets the route's fallback route."""

    name: str = Field(pattern=ROUTE_NAME_PATTERN)
    service: str = Field(min_length=1, max_length=200)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    fallback: str | None = Field(default=None, min_length=1, max_length=200)

    _name = field_validator("name")(no_parent_segments)


class FallbackIn(ApiInput):
    """``PATCH /admin/routes/{name}``: the route's fallback; ``None`` clears it."""

    fallback: str | None


class ServiceScaling(ApiModel):
    """A service's scaling settings (see :class:`ServiceIn`); ``capacity`` as set
    (``None``: the engine's slots) and ``replica_capacity`` the number in force."""

    min_replicas: int
    max_replicas: int
    idle_timeout_s: float | None
    pinned: bool
    priority: int
    capacity: int | None
    replica_capacity: int


ScalingAction = Literal["start", "stop", "hold"]


class ScalingDecisionOut(ApiModel):
    """One decision of the scaling controller about a service: ``start`` a replica, ``stop``
    ``deployment_ids``, or ``hold``; ``reason`` says why, ``at`` when it was taken."""

    action: ScalingAction
    reason: str
    at: Timestamp
    deployment_ids: list[str] = Field(default_factory=list)


class Service(ApiModel):
    """A service profile, with the routes that name it and how many ready deployments on
    reachable nodes serve it (``ready``).  ``replicas`` counts its active deployments by
    state; ``queued`` is how many requests wait for it to load (on demand).  The stream
    timeouts are the service's own (``None``: the leader's settings, 0: off)."""

    name: str
    model: str
    engine: EngineName
    runtime: RuntimeName
    gpus: list[int]
    ctx: int | None
    extra_args: list[str]
    image: str | None
    node_label: str | None
    created_at: Timestamp
    routes: list[str]
    ready: int
    scaling: ServiceScaling
    replicas: dict[DeploymentState, int] = Field(default_factory=dict)
    queued: int = 0
    max_adapters: int | None = None
    restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY
    first_byte_timeout_s: float | None = None
    stream_idle_timeout_s: float | None = None
    #: its own routing policy (``None``: the leader's routing_policy setting)
    routing_policy: RoutingPolicy | None = None


class ServiceDeployment(ApiModel):
    """An active deployment of a service."""

    id: str
    node_id: str
    state: DeploymentState
    port: int | None


class ServiceDetail(Service):
    """``GET /admin/services/{name}``: the service and its active deployments, with the
    scaling controller's last action about it (``last_decision``: the last start or stop,
    ``None`` before the first) and what it decided at its last look (``decision``)."""

    deployments: list[ServiceDeployment]
    last_decision: ScalingDecisionOut | None = None
    decision: ScalingDecisionOut | None = None


class RouteService(ApiModel):
    """A service behind a route: its priority and its ready deployments."""

    service: str
    priority: int
    ready: int


class Route(ApiModel):
    """A route (a public model name): its services, highest priority first, its fallback,
    and which services would answer a request now (``serving``; ``reason`` says why none
    would, ``None`` when some would)."""

    name: str
    services: list[RouteService]
    fallback: str | None
    serving: list[str]
    reason: str | None
    created_at: Timestamp


class RouteRemoved(ApiModel):
    """``DELETE /admin/routes/{name}[?service=S]``: the route, the service taken out
    (``None``: the whole route), and what is left of the route (``None``: nothing)."""

    removed: str
    service: str | None
    route: Route | None
