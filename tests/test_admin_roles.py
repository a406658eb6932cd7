"""Roles of admin keys (``viewer``, ``operator``, ``admin``): every admin route declares one,
the admin app refuses a lower role with an OpenAI-shaped 403 naming the role needed, and the
keys live in the store with their role (migration 17 gives existing admin keys ``admin``).

The table tests walk the admin app as ``daemon/app.py`` builds it (every router, the console's
included), in-process, with the caller put in the request's state as the listener puts it; a
refused request never reaches the leader's services, so they are stand-ins. The same refusals
through a real leader, real keys made by the CLI and real TLS: ``test_admin_roles_leader.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import create_engine, text

from berth.admin.console import ConsoleGate
from berth.admin.roles import KEY_STATE, NO_KEY, SCHEMA_FIELD, check_roles_declared, needs
from berth.admission import SocketCaller
from berth.config import Settings
from berth.daemon.admin_routes import build_admin
from berth.errors import ConfigError
from berth.observability.request_log import RequestLog
from berth.paths import BerthHome
from berth.store import Store
from berth.store.migrations import MIGRATIONS, migrate
from berth.vocab.records import ApiKeyRecord
from berth.vocab.roles import Role, Tier, parse_role, role_of_tier

CREATED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
#: The only operations that change nothing though not a GET: a viewer may use them.
READS_BY_POST = {("post", "/admin/plan")}
#: What only an ``admin`` may do (the issue's list; more may be added, none taken away).
ADMIN_ONLY = {
    ("post", "/admin/shutdown"),
    ("post", "/admin/leader/step-down"),
    ("post", "/admin/ca/rotate"),
    ("post", "/admin/ca/retire"),
    ("post", "/admin/nodes/enroll"),
    ("delete", "/admin/nodes/{ident}"),
}


@pytest.fixture
def admin_app(tmp_path: Path) -> FastAPI:
    """The admin app with every router ``daemon/app.py`` includes (built by
    :func:`berth.daemon.admin_routes.build_admin`), over a stand-in graph."""
    home = BerthHome(tmp_path / "home")
    graph: Any = SimpleNamespace(
        settings=Settings.load(home),
        home=home,
        pid=0,
        leader_only=False,
        proxy=SimpleNamespace(router=None, request_log=RequestLog()),
        **dict.fromkeys(
            ("store", "lifecycle", "routes", "adapters", "scaling", "drains", "history",
             "leadership", "facts", "run", "ca", "metrics", "hub", "links", "admission",
             "authenticator", "pepper", "data_paths", "enrollment", "cluster_metrics",
             "cluster_url"),
        ),
    )  # fmt: skip
    gate = ConsoleGate(None, None, b"", check_expiry=lambda _record: None)  # type: ignore[arg-type]
    return build_admin(graph, gate)


def _key(role: Role | None, tier: str = Tier.ADMIN) -> ApiKeyRecord:
    return ApiKeyRecord("k-1", f"{role or tier}-key", tier, "sk-berth-abcd", CREATED, None,
                        role=role)  # fmt: skip


def _operations(app: FastAPI) -> list[tuple[str, str, str | None]]:
    """Every ``(method, path, x-berth-role)`` of the app's OpenAPI document."""
    found = []
    for path, operations in app.openapi()["paths"].items():
        for method, operation in operations.items():
            found.append((method, path, operation.get(SCHEMA_FIELD)))
    return found


def _concrete(path: str) -> str:
    """``path`` with each ``{param}`` filled in."""
    parts = [("x" if p.startswith("{") else p) for p in path.split("/")]
    return "/".join(parts)


@pytest.fixture
async def as_caller(admin_app: FastAPI) -> AsyncIterator[Any]:
    """``as_caller(caller)``: an HTTP client to the admin app whose requests come from
    ``caller``, put in the request state as the leader's listener puts it."""
    clients: list[httpx.AsyncClient] = []

    def client(caller: object) -> httpx.AsyncClient:
        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            scope = {**scope, "state": {**scope.get("state", {}), KEY_STATE: caller}}
            await admin_app(scope, receive, send)

        transport = httpx.ASGITransport(app=app)
        opened = httpx.AsyncClient(transport=transport, base_url="http://berth")
        clients.append(opened)
        return opened

    yield client
    for opened in clients:
        await opened.aclose()


def test_every_route_declares_a_role_and_the_schema_names_it(admin_app: FastAPI) -> None:
    check_roles_declared(admin_app)  # every route, those outside the schema included
    operations = _operations(admin_app)
    assert len(operations) >= 50, operations
    for method, path, role in operations:
        assert role in ("viewer", "operator", "admin", "none"), (method, path, role)
        if path.startswith("/admin"):
            assert role != "none", f"{method.upper()} {path} is open to any key"
        else:
            assert path in ("/healthz", "/readyz", "/metrics", "/ui/session"), path
        if method == "get" and path.startswith("/admin"):
            assert role == "viewer", f"GET {path} needs {role}: every read is a viewer's"
    writes = {(m, p) for m, p, r in operations if m != "get" and p.startswith("/admin")}
    viewer_writes = {(m, p) for m, p, r in operations if (m, p) in writes and r == "viewer"}
    assert viewer_writes == READS_BY_POST
    admin_only = {(m, p) for m, p, r in operations if r == "admin"}
    assert admin_only >= ADMIN_ONLY, ADMIN_ONLY - admin_only


def test_a_route_added_without_a_role_is_refused_at_build(admin_app: FastAPI) -> None:
    @admin_app.post("/admin/new-thing")
    async def new_thing() -> dict[str, str]:
        return {}

    with pytest.raises(RuntimeError, match=r"POST /admin/new-thing"):
        check_roles_declared(admin_app)

    @admin_app.post("/admin/declared-thing", dependencies=[needs(Role.OPERATOR)])
    async def declared_thing() -> dict[str, str]:
        return {}

    with pytest.raises(RuntimeError) as refused:
        check_roles_declared(admin_app)
    assert "declared-thing" not in str(refused.value)


async def test_a_viewer_gets_403_naming_the_role_on_every_write_route(
    admin_app: FastAPI, as_caller: Any
) -> None:
    viewer = as_caller(_key(Role.VIEWER))
    refused = 0
    for method, path, role in _operations(admin_app):
        if method == "get" or not path.startswith("/admin") or (method, path) in READS_BY_POST:
            continue
        answer = await viewer.request(method.upper(), _concrete(path), json={})
        assert answer.status_code == 403, (method, path, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "permission_error"
        assert error["code"] == "role_too_low"
        assert error["message"] == (
            f"this endpoint needs the {role} role; key 'viewer-key' has the viewer role"
        )
        refused += 1
    assert refused >= 25


async def test_an_operator_gets_403_on_shutdown_the_ca_and_leaders(
    admin_app: FastAPI, as_caller: Any
) -> None:
    operator = as_caller(_key(Role.OPERATOR))
    for method, path, role in _operations(admin_app):
        if role != "admin":
            continue
        answer = await operator.request(method.upper(), _concrete(path), json={})
        assert answer.status_code == 403, (method, path, answer.text)
        assert answer.json()["error"]["message"] == (
            "this endpoint needs the admin role; key 'operator-key' has the operator role"
        )


async def test_admin_keys_need_the_admin_role_even_from_an_operator(as_caller: Any) -> None:
    operator = as_caller(_key(Role.OPERATOR))
    answer = await operator.post("/admin/keys", json={"name": "boss", "tier": "admin"})
    assert answer.status_code == 403
    assert answer.json()["error"]["message"] == (
        "creating an admin key needs the admin role; key 'operator-key' has the operator role"
    )


async def test_callers_without_an_admin_role_are_refused(as_caller: Any) -> None:
    for caller in (NO_KEY, _key(None, tier="standard")):
        answer = await as_caller(caller).get("/admin/keys")
        assert answer.status_code == 403, caller
        assert answer.json()["error"]["message"] == "this endpoint needs an admin key"


async def test_the_socket_and_an_admin_key_pass_the_role_check(as_caller: Any) -> None:
    for caller in (SocketCaller.CLI, _key(Role.ADMIN), _key(None)):
        answer = await as_caller(caller).get("/admin/config")
        assert answer.status_code == 200, (caller, answer.text)


def test_roles_parse_and_belong_to_admin_keys_only() -> None:
    assert parse_role(" Operator ") is Role.OPERATOR
    with pytest.raises(ConfigError, match="unknown role 'root': use one of viewer, operator"):
        parse_role("root")
    assert role_of_tier("admin", None) is Role.ADMIN
    assert role_of_tier("standard", None) is None
    with pytest.raises(ConfigError, match="a role is for admin keys only"):
        role_of_tier("standard", "viewer")
    assert Role.ADMIN.allows(Role.OPERATOR) and not Role.VIEWER.allows(Role.OPERATOR)


@pytest.mark.store_engines
def test_the_store_keeps_a_keys_role_through_its_changes(store: Store) -> None:
    viewer = store.add_api_key("watch", "admin", "h1", "sk-1", role="viewer")
    assert viewer.role is Role.VIEWER
    assert store.find_api_key("h1") == viewer
    assert store.add_api_key("boss", "admin", "h2", "sk-2").role is Role.ADMIN
    assert store.add_api_key("app", "standard", "h3", "sk-3").role is None
    with pytest.raises(ConfigError, match="a role is for admin keys only"):
        store.add_api_key("app2", "standard", "h4", "sk-4", role="operator")

    assert store.update_api_key("watch", role="operator").role is Role.OPERATOR
    assert store.update_api_key("watch", expires_at=None).role is Role.OPERATOR  # kept
    moved_out = store.update_api_key("watch", tier="standard")
    assert (moved_out.tier, moved_out.role) == ("standard", None)
    moved_in = store.update_api_key("app", tier="admin")
    assert (moved_in.tier, moved_in.role) == ("admin", Role.ADMIN)
    with pytest.raises(ConfigError, match="a role is for admin keys only"):
        store.update_api_key("watch", role="viewer")


@pytest.mark.store_engines
def test_migration_17_makes_every_existing_admin_key_an_admin(db_url: str) -> None:
    if db_url.startswith("sqlite:///"):
        Path(db_url.removeprefix("sqlite:///")).parent.mkdir(parents=True)
    engine = create_engine(db_url)
    migrate(engine, migrations=tuple(m for m in MIGRATIONS if m.version < 17))
    insert = text(
        "INSERT INTO api_keys (id, name, tier, key_hash, prefix, created_at) "
        "VALUES (:id, :name, :tier, :hash, 'sk-berth-x', :at)"
    )
    with engine.begin() as conn:
        conn.execute(insert, {"id": "k-1", "name": "ops", "tier": "admin", "hash": "a",
                              "at": CREATED})  # fmt: skip
        conn.execute(insert, {"id": "k-2", "name": "app", "tier": "standard", "hash": "b",
                              "at": CREATED})  # fmt: skip
    engine.dispose()
    with Store(db_url) as migrated:
        migrated.migrate()
        roles = {k.name: k.role for k in migrated.list_api_keys()}
    assert roles == {"ops": Role.ADMIN, "app": None}


@pytest.mark.store_engines
def test_a_role_this_berth_does_not_know_reads_as_the_lowest(store: Store) -> None:
    store.add_api_key("odd", "admin", "h1", "sk-1")
    with store._write() as session:  # a row as a newer berth might write it
        session.execute(text("UPDATE api_keys SET role = 'auditor' WHERE name = 'odd'"))
    assert store.lookup_api_key("odd").role is Role.VIEWER


def test_the_console_session_names_its_role() -> None:
    from berth.api.console import SessionInfo

    shown = SessionInfo(key_name="watch", role=Role.VIEWER, csrf_token="t", expires_at=1.0)
    assert json.loads(shown.model_dump_json())["role"] == "viewer"
