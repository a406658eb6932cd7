"""The admin API's typed contract (``berth.api``): every route declares its answer, the
OpenAPI schema describes it, the JSON keeps its shape through the CLI, and the client turns
the daemon's errors into berth's error types.

The admin app is built in-process, as ``daemon/admin_routes.py`` builds it, over a stand-in
for the leader's graph that carries only what building the routes reads: no request here
reaches the store or the lifecycle manager.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import TypeAdapter
from starlette.routing import BaseRoute

from berth.admin.app import build_admin_app
from berth.admin.deployments import deployment_view
from berth.admin.keys import key_view
from berth.admin.nodes import node_detail_view
from berth.admin.status import LeaderFacts, RunState
from berth.api import Deployment, ServiceIn
from berth.api.client import DaemonClient, error_from_response
from berth.api.pulls import PullIn
from berth.cli.common import request_body
from berth.config import Settings
from berth.daemon.admin_routes import admin_routers
from berth.daemon.link_wait import LinkWait
from berth.errors import (
    AuthError,
    BerthError,
    ConfigError,
    ConflictError,
    DaemonError,
    EngineError,
    NotFoundError,
    RateLimitError,
)
from berth.paths import BerthHome
from berth.vocab.gpu import GpuInfo
from berth.vocab.records import ApiKeyRecord, DeploymentRecord, NodeHardware, NodeRecord
from berth.vocab.roles import Tier
from berth.vocab.states import DeploymentState

#: Routes that answer text, not JSON: Prometheus' exposition format and an engine's log.
TEXT_ROUTES = {"/metrics", "/admin/deployments/{deployment_id}/logs"}

CREATED = datetime(2025, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)
UPDATED = datetime(2025, 3, 4, 5, 6, 8, tzinfo=UTC)


@pytest.fixture
def graph(tmp_path: Path) -> Any:
    """What building the admin routes reads of the leader's graph; ``run`` says ``ready``."""
    home = BerthHome(tmp_path / "home")
    facts = LeaderFacts(1, 0.0, home, "https://leader:11501", (), leader_only=False)
    names = (
        "store lifecycle routes adapters scaling leadership ca metrics links hub admission drains"
    )
    stand_ins = dict.fromkeys([*names.split(), "authenticator", "data_paths", "history"])
    return SimpleNamespace(
        **stand_ins,
        settings=Settings.load(home),
        home=home,
        pid=1,
        pepper=b"p" * 32,
        leader_only=False,
        facts=facts,
        run=RunState(),
        enrollment=None,
        cluster_metrics=None,
        proxy=SimpleNamespace(router=None),
    )


@pytest.fixture
def admin(graph: Any) -> FastAPI:
    """The admin app as the daemon puts it together (the console's routes aside)."""
    return build_admin_app(admin_routers(graph), tiers=graph.settings.tiers)


@pytest.fixture
async def http(admin: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=admin)
    async with httpx.AsyncClient(transport=transport, base_url="http://berth") as client:
        yield client


def _api_routes(routes: Sequence[BaseRoute]) -> Iterator[APIRoute]:
    """Every ``APIRoute``, also inside included routers (FastAPI 0.16x includes a router
    as one entry holding the ``original_router``; older ones copied its routes)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _api_routes(included.routes)


def test_every_route_declares_its_answer(admin: FastAPI) -> None:
    routes = list(_api_routes(admin.routes))
    assert len(routes) >= 30, [r.path for r in routes]

    for route in routes:
        if route.path in TEXT_ROUTES:
            assert route.response_class is PlainTextResponse, route.path
        else:
            assert route.response_model is not None, f"{route.methods} {route.path}"
    assert {r.path for r in routes} >= TEXT_ROUTES


async def test_the_schema_describes_every_answer_and_error(http: httpx.AsyncClient) -> None:
    schema = (await http.get("/admin/openapi.json")).json()
    components = schema["components"]["schemas"]

    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            (ok,) = [code for code in responses if code.startswith("2")]
            content = responses[ok]["content"]
            if path in TEXT_ROUTES:
                assert list(content) == ["text/plain"], (method, path)
                continue
            assert content["application/json"]["schema"], (method, path)
            # Errors are OpenAI-shaped 400s, never FastAPI's 422 validation body.
            assert "422" not in responses, (method, path)
            error = responses["4XX"]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorBody"}, (method, path)

    listed = schema["paths"]["/admin/deployments"]["get"]["responses"]["200"]
    assert listed["content"]["application/json"]["schema"]["items"] == {
        "$ref": "#/components/schemas/ListedDeployment"
    }
    deployment = components["ListedDeployment"]["properties"]
    assert set(components["DeploymentState"]["enum"]) == {s.value for s in DeploymentState}
    assert deployment["engine"]["enum"] == ["llamacpp", "vllm", "sglang"]
    assert deployment["created_at"]["format"] == "date-time"
    shown = schema["paths"]["/admin/nodes/{ident}"]["get"]["responses"]["200"]
    assert shown["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/NodeDetailWithAdopted"
    }


async def test_readyz_says_starting_with_503_then_ready(
    graph: Any, http: httpx.AsyncClient
) -> None:
    starting = await http.get("/readyz")
    graph.run.ready = True
    not_leading = await http.get("/readyz")  # started, its leader-only loops not yet
    graph.run.serving = LinkWait({}, lambda _: False, wait_s=0.0)  # no agent to wait for
    ready = await http.get("/readyz")

    assert (starting.status_code, starting.json()) == (503, {"status": "starting"})
    assert (not_leading.status_code, not_leading.json()) == (503, {"status": "starting"})
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
    assert (await http.get("/healthz")).json() == {"status": "ok"}


def _deployment() -> DeploymentRecord:
    return DeploymentRecord(
        "d-00000002",
        "m",
        "vllm",
        "docker",
        "n-1",
        DeploymentState.FAILED,
        None,
        None,
        (),
        None,
        (),
        "svc",
        "boom\nline",
        CREATED,
        CREATED,
        image="img:1",
    )


def _node() -> NodeRecord:
    gpus = (
        GpuInfo(0, "H100", "GPU-1", 81920, 1024, 37),
        GpuInfo(1, "H100", "GPU-2", 81920, 0, None),
    )
    hardware = NodeHardware("h", 16, 64000, gpus)
    return NodeRecord(
        "local", "local", "ready", None, "0.1.0", None, (), hardware, 1700000000.25, CREATED
    )


# What the admin API sent before its answers were typed (captured from the dict builders).
BEFORE = {
    "deployment": {
        "created_at": "2025-03-04T05:06:07.123456+00:00",
        "ctx": None,
        "engine": "vllm",
        "extra_args": [],
        "failure_reason": "boom\nline",
        "gpus": [],
        "id": "d-00000002",
        "image": "img:1",
        "model_name": "m",
        "node_id": "n-1",
        "pid": None,
        "port": None,
        "progress": None,
        "runtime": "docker",
        "served_model_name": "svc",
        "state": "failed",
        "updated_at": "2025-03-04T05:06:07.123456+00:00",
        # added with restart policies (additive: older clients ignore them)
        "last_exit": None,
        "last_exit_log": None,
        "restart_count": 0,
        "restart_policy": "on-failure",
    },
    "node": {
        "advertised_address": None,
        "agent_version": "0.1.0",
        "capabilities": [],
        "cert_fingerprint": None,
        "cert_not_after": None,
        "cert_renewal_error": None,
        # added with cordon and drain (additive: older clients ignore it)
        "maintenance": None,
        "connected": False,
        "cpu_count": 16,
        "created_at": "2025-03-04T05:06:07.123456+00:00",
        "data_path": None,
        "data_path_reason": None,
        "data_path_since": None,
        "gpu_count": 2,
        "gpus": [
            {
                "index": 0,
                "memory_total_mb": 81920,
                "memory_used_mb": 1024,
                "name": "H100",
                "utilization_pct": 37,
                "uuid": "GPU-1",
            },
            {
                "index": 1,
                "memory_total_mb": 81920,
                "memory_used_mb": 0,
                "name": "H100",
                "utilization_pct": None,
                "uuid": "GPU-2",
            },
        ],
        "hostname": "h",
        "id": "local",
        "label": "local",
        "last_heartbeat_at": 1700000000.25,
        "memory_total_mb": 64000,
        "protocol_version": None,
        "status": "ready",
        "vram_total_mb": 163840,
    },
    "key": {
        "created_at": "2025-03-04T05:06:07.123456+00:00",
        "expires_at": None,
        "id": "k-2",
        "limits": {
            "daily_tokens": None,
            "max_concurrency": None,
            "models": None,
            "monthly_tokens": None,
            "rpm": None,
            "tpm": None,
        },
        "name": "b",
        "overridden": [],
        "prefix": "sk-x",
        "revoked_at": "2025-03-04T05:06:08+00:00",
        "role": None,  # an admin key's role (issue 44); a standard key has none
        "tier": "standard",
        "use": {
            "day_tokens": 0,
            "in_flight": 0,
            "month_tokens": 0,
            "requests_remaining": None,
            "tokens_remaining": None,
        },
    },
}


@pytest.mark.parametrize(
    ("name", "answer"),
    [
        ("deployment", lambda: deployment_view(_deployment())),
        ("node", lambda: node_detail_view(_node(), connected=False)),
        (
            "key",
            lambda: key_view(ApiKeyRecord("k-2", "b", Tier.STANDARD, "sk-x", CREATED, UPDATED)),
        ),
    ],
)
def test_answers_keep_their_json_and_survive_the_cli_round_trip(name: str, answer: Any) -> None:
    model = answer()
    adapter: TypeAdapter[Any] = TypeAdapter(type(model))
    sent = adapter.dump_json(model)

    assert json.loads(sent) == BEFORE[name]
    # The CLI decodes the answer and prints it again (`--json`): the same bytes.
    assert adapter.dump_json(adapter.validate_json(sent)) == sent
    # Numbers keep their JSON type (== takes 37 for 37.0; the text does not).
    assert json.dumps(json.loads(sent), sort_keys=True) == json.dumps(BEFORE[name], sort_keys=True)


@pytest.mark.parametrize(
    ("status", "body", "headers", "kind", "exit_code"),
    [
        (400, {"type": "invalid_request_error"}, {}, ConfigError, 2),
        (401, {"type": "authentication_error"}, {}, AuthError, 1),
        (404, {"type": "invalid_request_error", "code": "model_not_found"}, {}, NotFoundError, 2),
        (409, {"type": "invalid_request_error"}, {}, ConflictError, 2),
        (429, {"type": "rate_limit_error"}, {"retry-after": "7"}, RateLimitError, 1),
        (502, {"type": "engine_error"}, {}, EngineError, 1),
        (503, {"type": "server_error"}, {}, BerthError, 1),
    ],
)
def test_daemon_errors_become_berths_error_types(
    status: int,
    body: dict[str, str],
    headers: dict[str, str],
    kind: type[BerthError],
    exit_code: int,
) -> None:
    response = httpx.Response(
        status,
        json={"error": {"message": "the daemon's words", "param": None, **body}},
        headers=headers,
        request=httpx.Request("GET", "http://berth/admin/models/x"),
    )

    error = error_from_response(response)

    assert type(error) is kind
    assert str(error) == "the daemon's words"
    assert (error.http_status, error.exit_code) == (status, exit_code)
    if isinstance(error, NotFoundError):
        assert error.kind == "model"
    if isinstance(error, RateLimitError):
        assert error.retry_after_s == 7


def test_an_error_that_is_not_json_keeps_its_text() -> None:
    response = httpx.Response(
        500, text="upstream broke", request=httpx.Request("GET", "http://berth/admin/x")
    )

    error = error_from_response(response)

    assert (type(error), str(error), error.exit_code) == (BerthError, "upstream broke", 1)


def test_the_client_decodes_answers_into_models_and_refuses_a_strange_one(
    tmp_path: Path,
) -> None:
    answers = {
        "/admin/deployments/d-00000002": deployment_view(_deployment()).model_dump_json(),
        "/admin/nodes/local": '{"id": "local"}',
    }

    def daemon(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=answers[request.url.path].encode())

    home = BerthHome(tmp_path)
    with DaemonClient(home, transport=httpx.MockTransport(daemon)) as client:
        deployment = client.deployment("d-00000002")
        assert isinstance(deployment, Deployment)
        assert deployment.state is DeploymentState.FAILED and deployment.port is None

        with pytest.raises(DaemonError, match="GET /admin/nodes/local is not what this berth"):
            client.node("local")


async def test_a_body_the_cli_refuses_is_refused_with_the_daemons_words(
    http: httpx.AsyncClient,
) -> None:
    body = {"name": "bad name", "model": "tiny"}
    answer = await http.post("/admin/services", json=body)

    with pytest.raises(ConfigError) as refused:
        request_body(ServiceIn, name="bad name", model="tiny")

    assert answer.status_code == 400
    assert str(refused.value) == answer.json()["error"]["message"]
    assert str(refused.value).startswith("name: 'bad name' is not a valid service name: up to 128")


def test_a_value_off_a_pattern_is_refused_in_words_not_the_regular_expression() -> None:
    with pytest.raises(ConfigError) as refused:
        request_body(PullIn, repo="bad repo!!")

    assert str(refused.value) == (
        "repo: 'bad repo!!' is not a Hugging Face repository id: ORG/NAME (or NAME) of "
        "letters, digits, '.', '_' and '-', each part starting with a letter or digit"
    )


def test_a_validators_message_is_shown_without_pydantics_value_error_prefix() -> None:
    with pytest.raises(ConfigError) as refused:
        request_body(ServiceIn, name="chat", model="tiny", idle_timeout="5 minutes")

    message = str(refused.value)
    assert message.startswith("idle_timeout: '5 minutes' is not a duration"), message
    assert "Value error" not in message


@pytest.mark.parametrize(
    ("headers", "sent"),
    [({}, "no content-type"), ({"content-type": "text/plain"}, "content-type: text/plain")],
)
async def test_a_json_body_without_its_content_type_is_told_which_to_send(
    http: httpx.AsyncClient, headers: dict[str, str], sent: str
) -> None:
    raw = json.dumps({"name": "web", "model": "tiny"}).encode()
    answer = await http.post("/admin/services", content=raw, headers=headers)

    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["message"] == f"expected content-type: application/json (the request has {sent})"
    assert error["type"] == "invalid_request_error"
