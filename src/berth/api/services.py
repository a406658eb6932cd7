"""Service profiles and routes: ``/admin/services``, ``/admin/routes``."""

from __future__ import annotations

from pydantic import Field, field_validator

from berth.api.base import ApiModel, Timestamp
from berth.runtime.base import RuntimeName
from berth.runtime.engines import EngineName
from berth.store.states import DeploymentState

#: Service names: letters, digits and ``. _ - :``, starting with a letter or digit.  They
#: become the engine's served model name and a URL path segment.
SERVICE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
#: Route names are what clients put in ``"model"``: the rules of model names (``org/m:q4``).
ROUTE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$"


class ServiceIn(ApiModel):
    """``POST /admin/services``: a model and how to deploy it.

    ``engine`` and ``runtime`` as a user typed them (checked by the store); ``runtime``
    ``None`` is the leader's ``default_runtime`` setting, recorded on the service.  ``gpus``
    are device indexes (0 to 1023), ``ctx`` the context length in tokens, ``node_label`` the
    node its deployments run on (``None``: chosen at deploy time), ``max_adapters`` their LoRA
    slots (vLLM, SGLang; ``None``: 1 when the model has adapters, else LoRA off).
    """

    name: str = Field(pattern=SERVICE_NAME_PATTERN)
    model: str
    engine: str = "llamacpp"
    runtime: str | None = None
    gpus: list[int] = Field(default_factory=list, max_length=64)
    ctx: int | None = Field(default=None, gt=0, le=2**31 - 1)
    extra_args: list[str] = Field(default_factory=list)
    image: str | None = Field(default=None, max_length=512)
    node_label: str | None = None
    max_adapters: int | None = Field(default=None, ge=1, le=2**31 - 1)

    @field_validator("gpus")
    @classmethod
    def _gpu_indexes(cls, gpus: list[int]) -> list[int]:
        if any(not 0 <= gpu <= 1023 for gpu in gpus):
            raise ValueError("GPU indexes are 0 to 1023")
        return gpus


class DeployIn(ApiModel):
    """``POST /admin/services/{name}/deploy``: the node (id or label) to deploy on;
    ``None``: the service's ``node_label``, else where its VRAM estimate fits (replicas
    spread over nodes first).  ``force`` as for a deployment (``DeploymentIn``)."""

    node: str | None = None
    force: bool = False


class RouteIn(ApiModel):
    """``POST /admin/routes``: put ``service`` behind the route ``name`` (created if new) at
    ``priority`` (higher is tried first); ``fallback`` sets the route's fallback route."""

    name: str = Field(pattern=ROUTE_NAME_PATTERN)
    service: str
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    fallback: str | None = None

    @field_validator("name")
    @classmethod
    def _no_parent_segments(cls, name: str) -> str:
        if ".." in name:
            raise ValueError("must not contain '..'")
        return name


class FallbackIn(ApiModel):
    """``PATCH /admin/routes/{name}``: the route's fallback; ``None`` clears it."""

    fallback: str | None


class Service(ApiModel):
    """A service profile, with the routes that name it and how many ready deployments on
    reachable nodes serve it (``ready``)."""

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
    max_adapters: int | None = None


class ServiceDeployment(ApiModel):
    """An active deployment of a service."""

    id: str
    node_id: str
    state: DeploymentState
    port: int | None


class ServiceDetail(Service):
    """``GET /admin/services/{name}``: the service and its active deployments."""

    deployments: list[ServiceDeployment]


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
