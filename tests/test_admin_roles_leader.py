"""Roles of admin keys through a real leader: keys made by the real CLI with ``--role``, shown
by ``berth key ls``, and refused over real TLS by the leader's own listener (the key read
from the store, the role checked by the route). The in-process table tests of every route:
``test_admin_roles.py``."""

from __future__ import annotations

import re

import httpx
import pytest

from support.cluster_harness import Cluster

pytestmark = pytest.mark.slow

#: What only an ``admin`` may do, among them what must not happen here (shutdown).
ADMIN_ONLY = [
    ("POST", "/admin/shutdown"),
    ("POST", "/admin/leader/step-down"),
    ("POST", "/admin/ca/rotate"),
    ("POST", "/admin/ca/retire"),
    ("POST", "/admin/nodes/enroll"),
]


def _secret(output: str) -> str:
    found = re.search(r"sk-berth-\S+", output)
    assert found, output
    return found.group(0)


def _client(cluster: Cluster, secret: str) -> httpx.Client:
    return httpx.Client(
        base_url=cluster.base_url,
        verify=cluster.tls(),
        timeout=60.0,
        headers={"Authorization": f"Bearer {secret}"},
    )


def test_keys_with_roles_are_refused_what_their_role_cannot_do(cluster: Cluster) -> None:
    made = cluster.berth("key", "create", "watcher", "--tier", "admin", "--role", "viewer")
    assert "created admin key" in made.stdout and "with the viewer role" in made.stdout
    viewer = _secret(made.stdout)
    operator = _secret(
        cluster.berth("key", "create", "ops", "--tier", "admin", "--role", "operator").stdout
    )
    refused = cluster.berth("key", "create", "app", "--role", "viewer", check=False)
    assert refused.returncode != 0
    assert "a role is for admin keys only" in refused.stderr

    listed = cluster.berth("key", "ls").stdout
    assert "ROLE" in listed
    assert re.search(r"watcher\s.*admin\s.*viewer", listed), listed
    assert re.search(r"ops\s.*admin\s.*operator", listed), listed

    with _client(cluster, viewer) as api:
        assert api.get("/admin/keys").status_code == 200
        schema = api.get("/admin/openapi.json").json()
        writes = [
            (method.upper(), path)
            for path, operations in schema["paths"].items()
            for method, operation in operations.items()
            if path.startswith("/admin") and operation["x-berth-role"] != "viewer"
        ]
        assert len(writes) >= 25
        for method, path in writes:
            concrete = re.sub(r"\{[^}]+\}", "x", path)
            answer = api.request(method, concrete, json={})
            assert answer.status_code == 403, (method, path, answer.text)
            assert answer.json()["error"]["code"] == "role_too_low"
            assert "key 'watcher' has the viewer role" in answer.json()["error"]["message"]

    with _client(cluster, operator) as api:
        for method, path in ADMIN_ONLY:
            answer = api.request(method, path, json={})
            assert answer.status_code == 403, (method, path, answer.text)
            assert answer.json()["error"] == {
                "message": "this endpoint needs the admin role; key 'ops' has the operator role",
                "type": "permission_error",
                "param": None,
                "code": "role_too_low",
            }
        boss = api.post("/admin/keys", json={"name": "boss", "tier": "admin"})
        assert boss.status_code == 403, boss.text
        app = api.post("/admin/keys", json={"name": "app", "tier": "standard"})
        assert app.status_code == 201, app.text
        assert app.json()["role"] is None
        assert api.delete(f"/admin/keys/{app.json()['id']}").status_code == 200
        assert api.delete("/admin/keys/watcher").status_code == 403  # an admin key

    # The socket is the host's root user: full admin, roles given there.
    changed = cluster.admin("PATCH", "/admin/keys/ops", json={"role": "viewer"})
    assert changed["role"] == "viewer"
    with _client(cluster, operator) as api:  # the change is seen at once
        answer = api.post("/admin/keys", json={"name": "app2"})
        assert answer.status_code == 403, answer.text
    # The leader refused its shutdown: it still answers.
    assert cluster.admin("GET", "/admin/info")["pid"] == cluster.leader_pid()
