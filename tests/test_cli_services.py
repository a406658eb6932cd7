"""``berth service`` and ``berth route`` through the real CLI, a real leader and a real agent.

Two services of one model sit behind the route ``chat``: ``big`` on the leader's host
(priority 10) and ``small`` pinned to the agent's node (priority 5).  Clients use ``chat``;
the engines are ``tests/support/fake_llama_server.py``, which answer with their served name (the
service's), so each answer says which service served it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from support.cluster_harness import Cluster, served_by_node, started_cluster
from support.fake_llama_server import ANSWER

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def services_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("services")
    with started_cluster(root, {"BERTH_STOP_GRACE_S": "5"}) as cluster:
        cluster.add_agent("gpu-a")
        gguf = str(root / "tiny.gguf")
        cluster.admin("POST", "/admin/models", json={"name": "tiny", "path": gguf})
        model = {"name": "tiny", "path": gguf, "node": "gpu-a"}
        cluster.admin("POST", "/admin/models", json=model)
        yield cluster


def fails(cluster: Cluster, *args: str) -> str:
    """Run a command that must fail with one ``error:`` line and exit 2; return the line."""
    result = cluster.berth(*args, check=False)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr.strip()


def state(cluster: Cluster) -> tuple[Any, Any]:
    """Every service and route, as the admin API lists them."""
    return cluster.admin("GET", "/admin/services"), cluster.admin("GET", "/admin/routes")


def rows(table: str) -> list[list[str]]:
    """The cells of each body row of a rich table."""
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in table.splitlines()]


def deployment_of(printed: str) -> str:
    found = re.search(r"\b(d-[0-9a-f]{8}) ready\b", printed)
    assert found, printed
    return found.group(1)


def test_a_route_serves_by_priority_and_moves_on_when_a_service_stops(
    services_cluster: Cluster,
) -> None:
    created = services_cluster.berth(
        "service", "create", "big", "--model", "tiny", "--ctx", "512"
    ).stdout
    assert "service big created: model tiny, llamacpp (process), ctx 512, any node" in created
    services_cluster.berth(
        "service", "create", "small", "-m", "tiny", "--node-label", "gpu-a", "-x", "-v"
    )
    services_cluster.berth("route", "create", "chat", "--service", "big", "--priority", "10")
    routed = services_cluster.berth(
        "route", "create", "chat", "--service", "small", "--priority", "5"
    )
    assert "chat: big (priority 10), small (priority 5); now served by nothing ready" in (
        routed.stdout
    )
    services_cluster.berth("route", "create", "main", "--service", "big", "--fallback", "chat")

    big = deployment_of(services_cluster.berth("service", "deploy", "big").stdout)
    small_out = services_cluster.berth(
        "service", "deploy", "small"
    ).stdout  # to its node_label, gpu-a
    small = deployment_of(small_out)
    agent = services_cluster.agents["gpu-a"]
    assert f"node {agent.node_id}" in small_out
    assert services_cluster.deployment(small)["served_model_name"] == "small"
    shown = services_cluster.berth("service", "show", "small").stdout
    assert "small: model tiny, llamacpp (process), args -v, node gpu-a" in shown
    assert f"deployment {small}: ready on node {agent.node_id}, port" in shown

    with services_cluster.openai() as client:
        assert sorted(m.id for m in client.models.list()) == ["chat", "main"]
        answer = client.chat.completions.create(model="chat", messages=CHAT)  # type: ignore[arg-type]
        assert answer.choices[0].message.content == ANSWER
        assert answer.model == "big"  # the higher priority answers
    assert served_by_node(services_cluster, "chat") == {"local": 1}

    listed = {
        r["name"]: r for r in json.loads(services_cluster.berth("route", "ls", "--json").stdout)
    }
    assert listed["chat"]["serving"] == ["big"] and listed["main"]["fallback"] == "chat"
    services = rows(services_cluster.berth("service", "ls").stdout)
    assert [
        "big",
        "tiny",
        "llamacpp (process)",
        "-",
        "-",
        "512",
        "0-1",
        "never",
        "1",
        "chat, main",
    ] in services
    assert [
        "small",
        "tiny",
        "llamacpp (process)",
        "gpu-a",
        "-",
        "-",
        "0-1",
        "never",
        "1",
        "chat",
    ] in services

    services_cluster.admin("POST", f"/admin/deployments/{big}/stop")
    with services_cluster.openai() as client:
        answer = client.chat.completions.create(model="chat", messages=CHAT)  # type: ignore[arg-type]
        assert answer.model == "small"  # the lower priority, on the agent
        # main has nothing of its own ready: its fallback, chat, answers
        answer = client.chat.completions.create(model="main", messages=CHAT)  # type: ignore[arg-type]
        assert answer.model == "small"
        assert sorted(m.id for m in client.models.list()) == ["chat", "main"]
    assert served_by_node(services_cluster, "chat") == {"local": 1, agent.node_id: 1}
    assert served_by_node(services_cluster, "main") == {agent.node_id: 1}

    table = rows(services_cluster.berth("route", "ls").stdout)
    assert ["chat", "big (10, 0), small (5, 1)", "-", "small"] in table
    assert ["main", "big (0, 0)", "chat", "small"] in table

    services_cluster.admin("POST", f"/admin/deployments/{small}/stop")
    shown = services_cluster.berth("route", "show", "chat").stdout
    assert "now served by nothing ready" in shown and "small (" in shown
    # With nothing behind it ready, a request loads the route's first service on demand
    # (services are on demand unless told otherwise: --min-replicas 0) and is answered.
    with services_cluster.openai() as client:
        answer = client.chat.completions.create(model="chat", messages=CHAT)  # type: ignore[arg-type]
        assert answer.model == "big"
    (loaded,) = [
        r
        for r in services_cluster.admin("GET", "/admin/deployments?active=true")
        if r["service"] == "big"
    ]
    assert loaded["state"] == "ready" and loaded["id"] != big
    shown = services_cluster.berth("service", "show", "big").stdout
    assert "last decision: start" in shown and "on demand: 1 request(s) wait" in shown


def test_bad_input_fails_with_one_line_and_changes_nothing(services_cluster: Cluster) -> None:
    services_cluster.admin("POST", "/admin/services", json={"name": "svc", "model": "tiny"})
    services_cluster.admin("POST", "/admin/routes", json={"name": "svc-route", "service": "svc"})
    before = state(services_cluster)

    assert "model 'nope' not found" in fails(
        services_cluster, "service", "create", "x", "--model", "nope"
    )
    assert "service 'svc' already exists" in fails(
        services_cluster, "service", "create", "svc", "--model", "tiny"
    )
    assert "name:" in fails(services_cluster, "service", "create", "bad name", "--model", "tiny")
    assert "node 'nowhere' not found (nodes: gpu-a, local)" in fails(
        services_cluster, "service", "create", "x", "--model", "tiny", "--node-label", "nowhere"
    )
    assert "service 'nope' not found" in fails(services_cluster, "service", "deploy", "nope")
    assert "used by route(s) svc-route" in fails(services_cluster, "service", "rm", "svc")
    assert "service 'nope' not found" in fails(
        services_cluster, "route", "create", "r", "--service", "nope"
    )
    assert "would loop (svc-route -> svc-route)" in fails(
        services_cluster, "route", "fallback", "svc-route", "svc-route"
    )
    assert "route 'nope' not found" in fails(services_cluster, "route", "rm", "nope")
    assert "give a fallback route, or --none" in fails(
        services_cluster, "route", "fallback", "svc-route"
    )
    # scaling settings: refused with the reason, before or by the daemon
    create = ("service", "create", "x", "--model", "tiny")
    assert "min_replicas (2) is above max_replicas (1)" in fails(
        services_cluster, *create, "--min-replicas", "2", "--max-replicas", "1"
    )
    assert "min_replicas: Input should be greater than or equal to 0" in fails(
        services_cluster, *create, "--min-replicas", "-1"
    )
    assert "'10 min' is not a duration: use a number and a unit, e.g. 30s, 10m, 2h" in fails(
        services_cluster, *create, "--idle-timeout", "10 min"
    )
    assert "min_replicas (5) is above max_replicas (1)" in fails(
        services_cluster, "service", "scale", "svc", "--min", "5"
    )
    assert "max_replicas: Input should be greater than or equal to 0" in fails(
        services_cluster, "service", "scale", "svc", "--max", "-1"
    )
    assert "give at least one of --min, --max" in fails(services_cluster, "service", "scale", "svc")
    assert "service 'nope' not found" in fails(
        services_cluster, "service", "scale", "nope", "--max", "2"
    )
    assert state(services_cluster) == before

    # A service pinned to a node is not deployed elsewhere.
    pinned = {"name": "pinned", "model": "tiny", "node_label": "gpu-a"}
    services_cluster.admin("POST", "/admin/services", json=pinned)
    assert "runs on node gpu-a (its node_label), not local" in fails(
        services_cluster, "service", "deploy", "pinned", "--node", "local"
    )

    removed = services_cluster.berth("route", "rm", "svc-route").stdout
    assert "route svc-route removed" in removed
    assert "service svc removed" in services_cluster.berth("service", "rm", "svc").stdout


def test_a_service_s_stream_timeouts_are_set_on_create_and_changed(
    services_cluster: Cluster,
) -> None:
    created = services_cluster.berth(
        "service", "create", "timed", "--model", "tiny", "--first-byte-timeout", "30"
    ).stdout
    assert "first byte within 30s" in created
    changed = services_cluster.berth("service", "timeouts", "timed", "--stream-idle", "0").stdout
    assert "first byte within 30s" in changed and "stream silence at most: no bound" in changed
    shown = json.loads(services_cluster.berth("service", "show", "timed", "--json").stdout)
    assert (shown["first_byte_timeout_s"], shown["stream_idle_timeout_s"]) == (30.0, 0.0)
    assert "give --first-byte, --stream-idle or both" in fails(
        services_cluster, "service", "timeouts", "timed"
    )
    assert "service 'nope' not found" in fails(
        services_cluster, "service", "timeouts", "nope", "--first-byte", "5"
    )
    services_cluster.berth("service", "rm", "timed")
