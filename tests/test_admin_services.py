"""The service and route admin endpoints in-process, with the proxy in front of a stand-in
engine: a real SQLite store, the real lifecycle manager over an in-memory link."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from berth.admin.services import build_service_router, load_routes
from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.lifecycle import LifecycleManager
from berth.errors import BerthError
from berth.observability.metrics import ProxyMetrics
from berth.openai_errors import error_from_exception
from berth.routing.routes import RouteResolver
from berth.store import Store
from berth.vocab.records import StreamTimeouts
from support.fakes import FakeLink
from support.proxy_fixtures import running_proxy, sample
from support.standin_engine import Head, Hold, Reply, StandinEngine

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Leader:
    """The parts under test: the admin API client, the proxy client, and what they share."""

    admin: httpx.AsyncClient
    v1: httpx.AsyncClient
    store: Store
    lifecycle: LifecycleManager
    routes: RouteResolver
    engine: StandinEngine
    metrics: ProxyMetrics

    async def ok(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self.admin.request(method, path, **kwargs)
        assert response.status_code < 300, response.text
        return response.json()

    async def deploy(self, service: str) -> str:
        record = await self.ok("POST", f"/admin/services/{service}/deploy")
        settled = await self.lifecycle.wait_settled(record["id"], 5)
        assert str(settled.state) == "ready", settled
        return str(record["id"])

    async def chat(self, model: str) -> httpx.Response:
        return await self.v1.post("/v1/chat/completions", json={"model": model, **CHAT})


def admin_app(
    store: Store, lifecycle: LifecycleManager, routes: RouteResolver, *, leader_only: bool = False
) -> FastAPI:
    """The service router with the admin app's error translation."""
    app = FastAPI()

    @app.exception_handler(BerthError)
    async def _berth_error(_request: Request, exc: BerthError) -> Response:
        status, body, headers = error_from_exception(exc)
        return Response(body, status_code=status, headers=headers, media_type="application/json")

    router = build_service_router(
        store, lifecycle, routes, default_runtime="process", leader_only=leader_only
    )
    app.include_router(router)
    return app


# The shared ``store`` fixture (conftest.py), with a model file that exists.
pytestmark = pytest.mark.store_models(("tiny", "tiny.gguf"))


@pytest.fixture
async def app_leader(
    store: Store, engine: StandinEngine, metrics: ProxyMetrics
) -> AsyncIterator[Leader]:
    lifecycle = LifecycleManager(
        store,
        LinkRegistry([FakeLink(base_url=engine.base_url)]),
        health_timeout_s=5,
        stop_grace_s=1,
    )
    await lifecycle.start()
    routes = RouteResolver(lifecycle)
    await load_routes(store, routes)
    transport = httpx.ASGITransport(app=admin_app(store, lifecycle, routes))
    try:
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://berth") as admin,
            running_proxy(routes, metrics) as url,  # type: ignore[arg-type]
            httpx.AsyncClient(base_url=url) as v1,
        ):
            yield Leader(admin, v1, store, lifecycle, routes, engine, metrics)
    finally:
        await lifecycle.shutdown()


async def make_services(leader: Leader, *names: str) -> None:
    for name in names:
        await leader.ok("POST", "/admin/services", json={"name": name, "model": "tiny"})


def error(response: httpx.Response, status: int, code: str | None = None) -> str:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    if code is not None:
        assert body["code"] == code, body
    return str(body["message"])


async def test_a_route_serves_its_highest_priority_service_then_the_next(
    app_leader: Leader,
) -> None:
    await make_services(app_leader, "big", "small")
    await app_leader.ok(
        "POST", "/admin/routes", json={"name": "chat", "service": "big", "priority": 10}
    )
    route = await app_leader.ok("POST", "/admin/routes", json={"name": "chat", "service": "small"})
    assert route["serving"] == [] and "no ready deployment" in route["reason"]
    big = await app_leader.deploy("big")
    await app_leader.deploy("small")

    models = (await app_leader.v1.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == ["chat"]  # not the services' own names
    answer = await app_leader.chat("chat")
    assert answer.status_code == 200, answer.text
    assert app_leader.engine.requests[-1].json()["model"] == "big"  # rewritten for the engine
    assert app_leader.engine.requests[-1].json()["messages"] == CHAT["messages"]
    labels = {"model": "chat", "deployment": big, "node": "local", "status_class": "2xx"}
    assert sample(app_leader.metrics, "berth_proxy_requests_total", **labels) == 1

    await app_leader.lifecycle.stop(big)
    assert (await app_leader.chat("chat")).status_code == 200
    assert app_leader.engine.requests[-1].json()["model"] == "small"
    shown = await app_leader.ok("GET", "/admin/routes/chat")
    assert shown["serving"] == ["small"]
    assert [(s["service"], s["priority"], s["ready"]) for s in shown["services"]] == [
        ("big", 10, 0),
        ("small", 0, 1),
    ]


async def test_a_fallback_route_answers_when_nothing_behind_the_route_is_ready(
    app_leader: Leader,
) -> None:
    await make_services(app_leader, "main", "spare")
    await app_leader.ok("POST", "/admin/routes", json={"name": "backup", "service": "spare"})
    route = await app_leader.ok(
        "POST", "/admin/routes", json={"name": "chat", "service": "main", "fallback": "backup"}
    )
    assert route["fallback"] == "backup"

    refused = await app_leader.chat("chat")
    message = error(refused, 503, "no_ready_deployment")
    assert "main (not deployed)" in message and "fallback route 'backup'" in message
    assert refused.headers["retry-after"] == "5"

    await app_leader.deploy("spare")
    assert (await app_leader.chat("chat")).status_code == 200
    assert app_leader.engine.requests[-1].json()["model"] == "spare"
    models = (await app_leader.v1.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == ["backup", "chat"]


async def test_route_changes_reach_the_proxy_at_once(app_leader: Leader) -> None:
    await make_services(app_leader, "svc")
    await app_leader.deploy("svc")
    error(await app_leader.chat("svc"), 404, "model_not_found")  # a service is not a public name
    error(await app_leader.v1.get("/v1/models/svc"), 404, "model_not_found")

    await app_leader.ok("POST", "/admin/routes", json={"name": "org/chat:v1", "service": "svc"})
    assert (await app_leader.chat("org/chat:v1")).status_code == 200
    assert (await app_leader.v1.get("/v1/models/org/chat:v1")).status_code == 200

    removed = await app_leader.ok("DELETE", "/admin/routes/org/chat:v1")
    assert removed == {"removed": "org/chat:v1", "service": None, "route": None}
    error(await app_leader.chat("org/chat:v1"), 404, "model_not_found")


async def test_direct_deployments_keep_their_names(app_leader: Leader) -> None:
    await make_services(app_leader, "svc")
    await app_leader.ok("POST", "/admin/routes", json={"name": "chat", "service": "svc"})
    from berth.deployments.lifecycle import DeployOptions

    record = await app_leader.lifecycle.deploy(DeployOptions("tiny", "llamacpp", "local"))
    await app_leader.lifecycle.wait_settled(record.id, 5)
    models = (await app_leader.v1.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == ["chat", "tiny"]
    assert (await app_leader.chat("tiny")).status_code == 200
    assert app_leader.engine.requests[-1].json()["model"] == "tiny"


async def test_services_list_show_and_remove(app_leader: Leader) -> None:
    created = await app_leader.ok(
        "POST",
        "/admin/services",
        json={"name": "svc", "model": "tiny", "ctx": 512, "extra_args": ["--flash-attn"]},
    )
    assert (created["runtime"], created["ctx"], created["extra_args"]) == (
        "process",
        512,
        ["--flash-attn"],
    )
    deployment = await app_leader.deploy("svc")
    await app_leader.ok("POST", "/admin/routes", json={"name": "chat", "service": "svc"})

    (listed,) = await app_leader.ok("GET", "/admin/services")
    assert (listed["name"], listed["ready"], listed["routes"]) == ("svc", 1, ["chat"])
    shown = await app_leader.ok("GET", "/admin/services/svc")
    assert [d["id"] for d in shown["deployments"]] == [deployment]

    message = error(await app_leader.admin.delete("/admin/services/svc"), 409)
    assert "used by route(s) chat" in message
    await app_leader.ok("DELETE", "/admin/routes/chat", params={"service": "svc"})
    message = error(await app_leader.admin.delete("/admin/services/svc"), 409)
    assert f"active deployment(s) {deployment}" in message
    await app_leader.lifecycle.stop(deployment)
    await app_leader.ok("DELETE", "/admin/services/svc")
    assert await app_leader.ok("GET", "/admin/services") == []


async def test_bad_input_is_refused_with_openai_errors(app_leader: Leader) -> None:
    await make_services(app_leader, "svc")
    admin = app_leader.admin
    cases: list[tuple[str, str, dict[str, Any] | None, int, str | None]] = [
        ("POST", "/admin/services", {"name": "x", "model": "nope"}, 404, "model_not_found"),
        ("POST", "/admin/services", {"name": "svc", "model": "tiny"}, 409, None),
        ("POST", "/admin/services", {"name": "x", "model": "tiny", "engine": "tgi"}, 400, None),
        (
            "POST",
            "/admin/services",
            {"name": "x", "model": "tiny", "node_label": "gpu-z"},
            404,
            "node_not_found",
        ),
        ("GET", "/admin/services/nope", None, 404, "service_not_found"),
        ("POST", "/admin/services/nope/deploy", None, 404, "service_not_found"),
        ("POST", "/admin/services/svc/deploy", {"node": "gpu-z"}, 404, "node_not_found"),
        ("GET", "/admin/routes/nope", None, 404, "route_not_found"),
        ("DELETE", "/admin/routes/nope", None, 404, "route_not_found"),
        ("POST", "/admin/routes", {"name": "chat", "service": "nope"}, 404, "service_not_found"),
        (
            "POST",
            "/admin/routes",
            {"name": "chat", "service": "svc", "fallback": "chat"},
            400,
            None,
        ),
        ("PATCH", "/admin/routes/nope", {"fallback": None}, 404, "route_not_found"),
    ]
    for method, path, body, status, code in cases:
        error(await admin.request(method, path, json=body), status, code)
    assert await app_leader.ok("GET", "/admin/routes") == []
    assert [s["name"] for s in await app_leader.ok("GET", "/admin/services")] == ["svc"]

    await app_leader.ok("POST", "/admin/routes", json={"name": "chat", "service": "svc"})
    error(await admin.post("/admin/routes", json={"name": "chat", "service": "svc"}), 409)
    message = error(await admin.patch("/admin/routes/chat", json={"fallback": "chat"}), 400)
    assert "would loop (chat -> chat)" in message


async def test_a_service_pinned_to_a_node_refuses_another(app_leader: Leader) -> None:
    node = app_leader.store.enroll_node("gpu-a", "sha256:" + "a" * 64)
    await app_leader.ok(
        "POST", "/admin/services", json={"name": "svc", "model": "tiny", "node_label": "gpu-a"}
    )
    message = error(
        await app_leader.admin.post("/admin/services/svc/deploy", json={"node": "local"}), 400
    )
    assert "runs on node gpu-a (its node_label), not local" in message
    # Its own node is asked for (and is not connected here): the lifecycle's refusal.
    message = error(await app_leader.admin.post("/admin/services/svc/deploy"), 409)
    assert f"node gpu-a ({node.id}) is not connected" in message


async def test_a_leader_only_leader_refuses_a_deployment_on_its_own_host(
    tmp_path: Path,
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'berth.db'}")
    store.migrate()
    store.ensure_local_node()
    store.add_model("tiny", str(tmp_path / "tiny.gguf"), source="remote")
    store.create_service_profile("svc", "tiny", "llamacpp", "process")
    lifecycle = LifecycleManager(store, LinkRegistry(), health_timeout_s=5, stop_grace_s=1)
    app = admin_app(store, lifecycle, RouteResolver(lifecycle), leader_only=True)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://berth") as admin:
            message = error(await admin.post("/admin/services/svc/deploy"), 409)
            assert "leader_only is set" in message and "--node LABEL" in message
    finally:
        store.close()


async def test_out_of_range_numbers_are_refused_before_the_database(app_leader: Leader) -> None:
    huge = 10**30
    for path, body in (
        ("/admin/services", {"name": "s1", "model": "tiny", "ctx": huge}),
        ("/admin/services", {"name": "s2", "model": "tiny", "gpus": [huge]}),
        ("/admin/routes", {"name": "r1", "service": "s1", "priority": huge}),
    ):
        response = await app_leader.admin.post(path, json=body)
        assert response.status_code == 422, (path, response.text)  # the admin API's validation
        # the field, or the item of it (``gpus``' first index)
        location = response.json()["detail"][0]["loc"]
        assert {"ctx", "gpus", "priority"} & set(location), location


async def test_a_service_carries_its_restart_policy_to_its_deployments(
    app_leader: Leader,
) -> None:
    admin = app_leader.admin
    body = {"name": "svc", "model": "tiny", "restart": "always"}
    created = await app_leader.ok("POST", "/admin/services", json=body)
    assert created["restart_policy"] == "always"
    deployed = await app_leader.ok("POST", "/admin/services/svc/deploy")
    assert deployed["restart_policy"] == "always"
    changed = await app_leader.ok("PATCH", "/admin/services/svc", json={"restart": "never"})
    assert changed["restart_policy"] == "never"
    assert app_leader.store.get_service_profile("svc").restart_policy == "never"
    for method, path, bad in (
        ("POST", "/admin/services", {"name": "x", "model": "tiny", "restart": "sometimes"}),
        ("PATCH", "/admin/services/svc", {"restart": "sometimes"}),
    ):
        # This test app keeps FastAPI's 422 (the admin app turns it into a 400 error body).
        refused = await admin.request(method, path, json=bad)
        assert refused.status_code == 422
        assert "'on-failure', 'always' or 'never'" in refused.text
    assert app_leader.store.get_service_profile("svc").restart_policy == "never"


async def test_a_service_s_stream_timeouts_reach_the_proxy_and_can_be_changed(
    app_leader: Leader,
) -> None:
    body = {"name": "quick", "model": "tiny", "first_byte_timeout_s": 0.3}
    created = await app_leader.ok("POST", "/admin/services", json=body)
    assert (created["first_byte_timeout_s"], created["stream_idle_timeout_s"]) == (0.3, None)
    await app_leader.ok("POST", "/admin/routes", json={"name": "fast", "service": "quick"})
    await app_leader.deploy("quick")
    # Accepted, then silent: the proxy's own setting (120 s) would wait; the service's does not.
    app_leader.engine.script(Reply((Head(200, "text/event-stream"), Hold())))
    answer = await app_leader.v1.post(
        "/v1/chat/completions", json={"model": "fast", "stream": True, **CHAT}
    )
    assert error(answer, 504, "first_byte_timeout")

    changed = await app_leader.ok(
        "PATCH", "/admin/services/quick", json={"stream_idle_timeout_s": 0}
    )
    assert (changed["first_byte_timeout_s"], changed["stream_idle_timeout_s"]) == (0.3, 0)
    assert changed["scaling"]["max_replicas"] == 1  # the scaling settings are untouched
    (upstream,) = app_leader.lifecycle.candidates("quick")
    assert upstream.timeouts == StreamTimeouts(0.3, 0.0)  # the ready deployment carries them
    refused = await app_leader.admin.patch(
        "/admin/services/quick", json={"first_byte_timeout_s": -1}
    )
    assert refused.status_code == 422  # the admin API's validation, before the store
    assert refused.json()["detail"][0]["loc"][-1] == "first_byte_timeout_s"


async def test_a_service_s_routing_policy_reaches_its_deployments_and_can_be_reset(
    app_leader: Leader,
) -> None:
    body = {"name": "cached", "model": "tiny", "routing_policy": "prefix"}
    created = await app_leader.ok("POST", "/admin/services", json=body)
    assert created["routing_policy"] == "prefix"
    await app_leader.ok("POST", "/admin/routes", json={"name": "chat-cached", "service": "cached"})
    await app_leader.deploy("cached")
    (upstream,) = app_leader.lifecycle.candidates("cached")
    assert upstream.routing_policy == "prefix"  # the ready deployment carries it
    reset = await app_leader.ok(
        "PATCH", "/admin/services/cached", json={"routing_policy": "default"}
    )
    assert reset["routing_policy"] is None
    assert reset["scaling"]["max_replicas"] == 1  # the scaling settings are untouched
    (upstream,) = app_leader.lifecycle.candidates("cached")
    assert upstream.routing_policy is None
    refused = await app_leader.admin.patch(
        "/admin/services/cached", json={"routing_policy": "random"}
    )
    assert refused.status_code == 422
