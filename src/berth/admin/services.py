"""The admin API's service and route endpoints.

- ``GET /admin/services``; ``POST /admin/services`` ``{"name", "model", "engine", "runtime",
  "gpus", "ctx", "extra_args", "image", "node_label", "min_replicas", "max_replicas",
  "idle_timeout", "pinned", "priority", "capacity", "max_adapters", "first_byte_timeout_s",
  "stream_idle_timeout_s"}`` (201);
- ``GET /admin/services/{name}`` (with its active deployments and the scaling controller's
  last decision); ``PATCH`` it with new scaling settings or stream timeouts (``ScaleIn``,
  ``first_byte_timeout_s``, ``stream_idle_timeout_s``); ``DELETE`` it (409
  while a route names it or a deployment of it is active);
- ``POST /admin/services/{name}/deploy`` ``{"node"}`` (201): a deployment with the service's
  settings, serving the service's name, on ``node`` (else its ``node_label``, else ``local``);
- ``GET /admin/routes``; ``POST /admin/routes`` ``{"name", "service", "priority",
  "fallback"}`` (201; adds a target to the route, creating it if new);
  ``GET /admin/routes/{name}``; ``PATCH /admin/routes/{name}`` ``{"fallback"}`` (``null``
  clears it); ``DELETE /admin/routes/{name}[?service=S]`` (one target, or the whole route).

Every change to services or routes reloads the :class:`RouteResolver`'s table and the
scaling controller's services, so the proxy and the controller see it at once without ever
reading the database themselves.  Errors are the admin app's
OpenAI-shaped ones (404 unknown names, 409 names taken or in use, 400 bad values).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from fastapi import APIRouter

from berth.admin.deployments import deployment_view
from berth.admin.roles import needs
from berth.api import (
    DeployIn,
    Deployment,
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
from berth.api.services import idle_timeout_seconds
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.deployments.fleet import deploy_options, leader_only_refusal
from berth.deployments.lifecycle import LifecycleManager
from berth.errors import BerthError, ConfigError, NotFoundError, PolicyError
from berth.placement.result import Refusal
from berth.routing.errors import NoReadyDeploymentError
from berth.routing.routes import RouteResolver
from berth.scaling import DecisionRecord, ScalingController
from berth.scaling.capacity import replica_capacity
from berth.store import Store
from berth.vocab.engines import parse_engine_name, parse_runtime_name
from berth.vocab.records import RouteRecord, ScalingSettings, ServiceProfileRecord, StreamTimeouts
from berth.vocab.roles import Role


async def load_routes(
    store: Store,
    routes: RouteResolver,
    scaling: ScalingController | None = None,
    lifecycle: LifecycleManager | None = None,
) -> None:
    """Read every route and service name from ``store`` into ``routes``' table, the
    services into the scaling controller when there is one, and their ``capacity`` settings
    and stream timeouts into ``lifecycle``'s ready table (the fair admission gate's slots,
    the proxy's bounds on a stream)."""
    records = await asyncio.to_thread(store.list_routes)
    services = await asyncio.to_thread(store.list_service_profiles)
    routes.load(records, (s.name for s in services))
    if lifecycle is not None:
        lifecycle.set_service_capacities({s.name: s.scaling.capacity for s in services})
        lifecycle.set_service_timeouts({s.name: s.timeouts for s in services})
        lifecycle.set_service_routing_policies({s.name: s.routing_policy for s in services})
    if scaling is not None:
        scaling.services_changed(services)


def ready_count(lifecycle: LifecycleManager, name: str) -> int:
    """How many ready deployments on reachable nodes serve ``name``."""
    try:
        return len(lifecycle.candidates(name))
    except (NotFoundError, NoReadyDeploymentError):
        return 0


def scaling_view(record: ServiceProfileRecord, capacity: int | None = None) -> ServiceScaling:
    """A service's scaling settings for the admin API, with the capacity in force
    (``capacity``, the controller's, else counted here with the default settings)."""
    settings = record.scaling
    return ServiceScaling(
        min_replicas=settings.min_replicas,
        max_replicas=settings.max_replicas,
        idle_timeout_s=settings.idle_timeout_s,
        pinned=settings.pinned,
        priority=settings.priority,
        capacity=settings.capacity,
        replica_capacity=capacity if capacity is not None else replica_capacity(record),
    )


def decision_view(record: DecisionRecord | None) -> ScalingDecisionOut | None:
    if record is None:
        return None
    return ScalingDecisionOut(
        action=record.action,
        reason=record.reason,
        at=record.at_datetime,
        deployment_ids=list(record.deployment_ids),
    )


def service_view(
    record: ServiceProfileRecord,
    lifecycle: LifecycleManager,
    routes: list[str],
    scaling: ScalingController | None = None,
) -> Service:
    """A service for the admin API, with the routes that name it, its ready count, its
    scaling settings and (with a controller) its replicas by state and queued requests."""
    status = scaling.status(record.name) if scaling is not None else None
    return Service(
        name=record.name,
        model=record.model_name,
        engine=parse_engine_name(record.engine),
        runtime=parse_runtime_name(record.runtime),
        gpus=list(record.gpus),
        ctx=record.ctx,
        extra_args=list(record.extra_args),
        image=record.image,
        node_label=record.node_label,
        created_at=record.created_at,
        routes=routes,
        ready=ready_count(lifecycle, record.name),
        scaling=scaling_view(record, status.capacity if status is not None else None),
        replicas=dict(status.replicas) if status is not None else {},
        queued=status.queued if status is not None else 0,
        max_adapters=record.max_adapters,
        restart_policy=record.restart_policy,
        first_byte_timeout_s=record.timeouts.first_byte_timeout_s,
        stream_idle_timeout_s=record.timeouts.stream_idle_timeout_s,
        routing_policy=record.routing_policy,
    )


def route_view(record: RouteRecord, lifecycle: LifecycleManager, routes: RouteResolver) -> Route:
    """A route for the admin API: its services (priority, ready count), its fallback, and
    which services would answer a request now (``serving``; ``reason`` when none)."""
    serving: list[str] = []
    reason: str | None = None
    try:
        upstreams = routes.candidates(record.name)
        serving = sorted({u.engine_model or u.model for u in upstreams})
    except (NotFoundError, NoReadyDeploymentError) as exc:
        reason = str(exc)
    return Route(
        name=record.name,
        services=[
            RouteService(
                service=t.service, priority=t.priority, ready=ready_count(lifecycle, t.service)
            )
            for t in record.targets
        ],
        fallback=record.fallback,
        serving=serving,
        reason=reason,
        created_at=record.created_at,
    )


@dataclass
class _Catalog:
    """What the service and route endpoints read and change: the store, the lifecycle
    manager and the resolver's table (reloaded after every write), and the controller."""

    store: Store
    lifecycle: LifecycleManager
    routes: RouteResolver
    default_runtime: str
    leader_only: bool
    scaling: ScalingController | None
    # Reloads run one at a time, so the last one starts after the last write and wins.
    reloading: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def reload(self) -> None:
        async with self.reloading:
            await load_routes(self.store, self.routes, self.scaling, self.lifecycle)

    def routes_naming(self, name: str) -> list[str]:
        table = self.routes.table
        return sorted(r for r, tiers in table.tiers.items() if any(name in t for t in tiers))

    def view(self, record: ServiceProfileRecord, routes: list[str] | None = None) -> Service:
        named = self.routes_naming(record.name) if routes is None else routes
        return service_view(record, self.lifecycle, named, self.scaling)

    async def detail(self, record: ServiceProfileRecord) -> ServiceDetail:
        name = record.name
        active = await asyncio.to_thread(self.store.list_deployments, active_only=True)
        deployments = [
            ServiceDeployment(id=d.id, node_id=d.node_id, state=d.state, port=d.port)
            for d in active
            if d.served_model_name == name
        ]
        status = self.scaling.status(name) if self.scaling is not None else None
        return self.view(record).extended(
            ServiceDetail,
            deployments=deployments,
            last_decision=decision_view(status.last_action if status else None),
            decision=decision_view(status.decision if status else None),
        )


def scaled(current: ScalingSettings, body: ScaleIn) -> ScalingSettings:
    """``current`` with the scaling settings ``body`` names (the others kept)."""
    changed = current
    if body.min_replicas is not None:
        changed = replace(changed, min_replicas=body.min_replicas)
    if body.max_replicas is not None:
        changed = replace(changed, max_replicas=body.max_replicas)
    if body.idle_timeout is not None:
        changed = replace(changed, idle_timeout_s=idle_timeout_seconds(body.idle_timeout))
    if body.pinned is not None:
        changed = replace(changed, pinned=body.pinned)
    if body.priority is not None:
        changed = replace(changed, priority=body.priority)
    if body.capacity is not None:
        changed = replace(changed, capacity=body.capacity)
    return changed


def retimed(current: StreamTimeouts, body: ScaleIn) -> StreamTimeouts:
    """``current`` with the stream timeouts ``body`` names (the others kept)."""
    first, idle = body.first_byte_timeout_s, body.stream_idle_timeout_s
    return StreamTimeouts(
        current.first_byte_timeout_s if first is None else first,
        current.stream_idle_timeout_s if idle is None else idle,
    )


def build_service_router(
    store: Store,
    lifecycle: LifecycleManager,
    routes: RouteResolver,
    *,
    default_runtime: str,
    leader_only: bool = False,
    scaling: ScalingController | None = None,
) -> APIRouter:
    """The endpoints of the module doc over the store, the deployment manager and the
    proxy's route table (``routes``, reloaded after every change).

    ``leader_only``: this leader runs no engines, so a deployment on node ``local`` is
    refused (409) with what to do instead.  ``scaling``: the scaling controller, told of
    every change to services and asked for their replicas and last decisions.
    """
    catalog = _Catalog(store, lifecycle, routes, default_runtime, leader_only, scaling)
    router = APIRouter()
    _add_service_routes(router, catalog)
    _add_route_routes(router, catalog)
    return router


def _add_service_routes(router: APIRouter, catalog: _Catalog) -> None:
    """``/admin/services[/{name}[/deploy]]`` onto ``router``."""
    store = catalog.store

    @router.get("/admin/services", dependencies=[needs(Role.VIEWER)])
    async def list_services() -> list[Service]:
        records = await asyncio.to_thread(store.list_service_profiles)
        return [catalog.view(r) for r in records]

    @router.post("/admin/services", status_code=201, dependencies=[needs(Role.OPERATOR)])
    async def create_service(body: ServiceIn) -> Service:
        settings = ScalingSettings(
            min_replicas=body.min_replicas,
            max_replicas=body.max_replicas,
            idle_timeout_s=idle_timeout_seconds(body.idle_timeout),
            pinned=body.pinned,
            priority=body.priority,
            capacity=body.capacity,
        )
        record = await asyncio.to_thread(
            store.create_service_profile,
            body.name,
            body.model,
            body.engine,
            catalog.default_runtime if body.runtime is None else body.runtime,
            gpus=body.gpus,
            ctx=body.ctx,
            extra_args=body.extra_args,
            image=body.image,
            node_label=body.node_label,
            scaling=settings,
            max_adapters=body.max_adapters,
            restart_policy=body.restart,
            timeouts=StreamTimeouts(body.first_byte_timeout_s, body.stream_idle_timeout_s),
            routing_policy=body.routing_policy,
        )
        refused = await _policy_refusal(catalog.lifecycle, record)
        if refused is not None:
            await asyncio.to_thread(store.delete_service_profile, record.name)
            raise refused
        await catalog.reload()
        return catalog.view(record, [])

    @router.get("/admin/services/{name}", dependencies=[needs(Role.VIEWER)])
    async def show_service(name: str) -> ServiceDetail:
        return await catalog.detail(await asyncio.to_thread(store.get_service_profile, name))

    @router.patch("/admin/services/{name}", dependencies=[needs(Role.OPERATOR)])
    async def scale_service(name: str, body: ScaleIn) -> ServiceDetail:
        scaling = (body.min_replicas, body.max_replicas, body.idle_timeout, body.pinned,
                   body.priority, body.capacity)  # fmt: skip
        timing = body.first_byte_timeout_s is not None or body.stream_idle_timeout_s is not None
        if timing:
            record = await asyncio.to_thread(
                store.update_service_timeouts, name, lambda current: retimed(current, body)
            )
        policy = body.routing_policy
        if any(value is not None for value in scaling) or not (timing or policy):
            record = await asyncio.to_thread(
                store.update_service_scaling, name, lambda current: scaled(current, body)
            )
        if body.restart is not None:
            record = await asyncio.to_thread(store.set_service_restart_policy, name, body.restart)
        if policy is not None:
            own = None if policy == "default" else policy
            record = await asyncio.to_thread(store.set_service_routing_policy, name, own)
        await catalog.reload()
        return await catalog.detail(record)

    @router.delete("/admin/services/{name}", dependencies=[needs(Role.OPERATOR)])
    async def remove_service(name: str) -> Service:
        record = await asyncio.to_thread(store.delete_service_profile, name)
        await catalog.reload()
        return catalog.view(record, [])

    @router.post(
        "/admin/services/{name}/deploy", status_code=201, dependencies=[needs(Role.OPERATOR)]
    )
    async def deploy_service(name: str, body: DeployIn | None = None) -> Deployment:
        record = await asyncio.to_thread(store.get_service_profile, name)
        node = await _deploy_node(store, record, body.node if body else None)
        force = body.force if body else False
        if catalog.leader_only and node == LOCAL_NODE_ID:
            raise leader_only_refusal(name)
        deployment = await catalog.lifecycle.deploy(deploy_options(record, node, force=force))
        return deployment_view(deployment, catalog.lifecycle)


def _add_route_routes(router: APIRouter, catalog: _Catalog) -> None:
    """``/admin/routes[/{name}]`` onto ``router``."""
    store, lifecycle, routes = catalog.store, catalog.lifecycle, catalog.routes

    @router.get("/admin/routes", dependencies=[needs(Role.VIEWER)])
    async def list_routes() -> list[Route]:
        records = await asyncio.to_thread(store.list_routes)
        return [route_view(r, lifecycle, routes) for r in records]

    @router.post("/admin/routes", status_code=201, dependencies=[needs(Role.OPERATOR)])
    async def add_route(body: RouteIn) -> Route:
        record = await asyncio.to_thread(
            store.add_route, body.name, body.service, priority=body.priority, fallback=body.fallback
        )
        await catalog.reload()
        return route_view(record, lifecycle, routes)

    @router.get("/admin/routes/{name:path}", dependencies=[needs(Role.VIEWER)])
    async def show_route(name: str) -> Route:
        record = await asyncio.to_thread(store.get_route, name)
        return route_view(record, lifecycle, routes)

    @router.patch("/admin/routes/{name:path}", dependencies=[needs(Role.OPERATOR)])
    async def set_fallback(name: str, body: FallbackIn) -> Route:
        record = await asyncio.to_thread(store.set_route_fallback, name, body.fallback)
        await catalog.reload()
        return route_view(record, lifecycle, routes)

    @router.delete("/admin/routes/{name:path}", dependencies=[needs(Role.OPERATOR)])
    async def remove_route(name: str, service: str | None = None) -> RouteRemoved:
        left = await asyncio.to_thread(store.remove_route, name, service)
        await catalog.reload()
        return RouteRemoved(
            removed=name,
            service=service,
            route=None if left is None else route_view(left, lifecycle, routes),
        )


async def _policy_refusal(
    lifecycle: LifecycleManager, record: ServiceProfileRecord
) -> PolicyError | None:
    """The refusal of a new service ``record`` whose replicas the agent policy refuses
    wherever placement would put them (a dry-run plan answering ``node_policy``), else
    ``None``: a refusal that time may lift (no room, no node connected) or a plan that
    cannot be made yet leaves the service to be created."""
    try:
        planned = await lifecycle.plan(deploy_options(record, record.node_label))
    except BerthError:
        return None
    result = planned.result
    if isinstance(result, Refusal) and result.reason == "node_policy":
        error = result.error()
        assert isinstance(error, PolicyError)
        return error
    return None


async def _deploy_node(store: Store, record: ServiceProfileRecord, node: str | None) -> str | None:
    """The node (id or label) a deployment of ``record`` goes to: ``node``, else the
    service's ``node_label``, else ``None`` (placement chooses by fit).  A ``node`` that is
    not the service's ``node_label`` is refused (:class:`ConfigError`): the service pins
    where it runs."""
    if node is None:
        return record.node_label
    if record.node_label is not None:
        chosen = await asyncio.to_thread(store.lookup_node, node)
        if chosen.label != record.node_label:
            raise ConfigError(
                f"service {record.name!r} runs on node {record.node_label} (its node_label), "
                f"not {chosen.label}"
            )
    return node
