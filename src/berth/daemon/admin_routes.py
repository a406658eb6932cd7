"""The admin app of a built leader: each router of :mod:`berth.admin` given the objects of the
graph it uses, and nothing else.

The order is the schema's and the routes' (``/admin/openapi.json`` lists them so): the
leader's own state, models, deployments, keys, nodes, cordons and drains, the CA, metrics,
the Overview's history and leaders, routing, adapters, plans, pulls, the step-down and
shutdown routes, services and routes, and the console.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI

from berth.admin.adapters import build_adapter_router
from berth.admin.app import build_admin_app
from berth.admin.ca import build_ca_router
from berth.admin.console import ConsoleGate, build_console_router
from berth.admin.deployments import build_deployment_router
from berth.admin.drains import build_drain_router
from berth.admin.keys import build_key_router
from berth.admin.metrics import build_metrics_router
from berth.admin.models import build_model_router
from berth.admin.nodes import build_node_router
from berth.admin.overview import build_overview_router, leader_members
from berth.admin.plans import build_plan_router
from berth.admin.pulls import build_pull_router, leader_pull_jobs
from berth.admin.routing import build_routing_router
from berth.admin.services import build_service_router
from berth.admin.status import build_status_router, build_stop_router
from berth.api import LeaderMember
from berth.daemon.graph import LeaderGraph


def admin_routers(graph: LeaderGraph) -> list[APIRouter]:
    """Every admin router but the console's, in the order of the module doc."""
    settings, store, lifecycle = graph.settings, graph.store, graph.lifecycle
    runtime, leader_only = settings.default_runtime, graph.leader_only
    return [
        build_status_router(
            graph.facts, graph.run, settings, graph.ca, graph.metrics, graph.leadership
        ),
        build_model_router(store, lifecycle, graph.links),
        build_deployment_router(
            store,
            lifecycle,
            graph.hub,
            graph.links,
            default_runtime=runtime,
            leader_only=leader_only,
        ),
        build_key_router(store, graph.admission, graph.authenticator, graph.pepper, settings.tiers),
        build_node_router(
            store,
            graph.hub,
            graph.links,
            graph.data_paths,
            graph.enrollment,
            lifecycle,
            graph.drains,
            leader_only=leader_only,
        ),
        build_drain_router(store, graph.drains),
        build_ca_router(graph.ca, store),
        build_metrics_router(graph.cluster_metrics),
        build_overview_router(graph.history, lambda: _leaders(graph)),
        build_routing_router(graph.proxy.router),
        build_adapter_router(store, graph.adapters),
        build_plan_router(
            store,
            lifecycle,
            default_runtime=runtime,
            leader_only=leader_only,
            adapters=graph.adapters,
        ),
        build_pull_router(
            leader_pull_jobs(store, lifecycle, graph.adapters, graph.home.models_dir)
        ),
        build_stop_router(graph.leadership, store, settings, graph.run, pid=graph.pid),
        build_service_router(
            store,
            lifecycle,
            graph.routes,
            default_runtime=runtime,
            leader_only=leader_only,
            scaling=graph.scaling,
        ),
    ]


async def _leaders(graph: LeaderGraph) -> list[LeaderMember]:
    """``GET /admin/leaders``: every leader on the store, this one's load with it."""
    return await leader_members(
        graph.store, graph.leadership, me=f"pid:{graph.pid}", cluster_url=graph.cluster_url,
        metrics=graph.metrics, history=graph.history,
    )  # fmt: skip


def build_admin(graph: LeaderGraph, console: ConsoleGate) -> FastAPI:
    """The admin app of ``graph``'s leader, the console's routes behind ``console``."""
    routers = [*admin_routers(graph), build_console_router(console, graph.proxy.request_log)]
    return build_admin_app(routers, tiers=graph.settings.tiers)
