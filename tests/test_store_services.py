"""The store's service profiles and routes, on a real SQLite database."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.store import RouteTarget, Store
from berth.store.states import DeploymentState


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path / 'berth.db'}") as store:
        store.migrate()
        store.ensure_local_node()
        store.add_model("tiny", "/models/tiny.gguf")
        store.add_model("big", "/models/big")
        yield store


@pytest.fixture
def services(store: Store) -> Store:
    """The store with services a, b, c (on model tiny) and d (on big)."""
    for name in ("a", "b", "c"):
        store.create_service_profile(name, "tiny", "llamacpp", "process")
    store.create_service_profile("d", "big", "vllm", "process", gpus=(0, 1))
    return store


def test_a_service_keeps_every_setting(store: Store) -> None:
    store.enroll_node("gpu-a", "sha256:" + "a" * 64)
    created = store.create_service_profile(
        "chat-big",
        "big",
        " VLLM",
        "docker",
        gpus=(0, 1),
        ctx=8192,
        extra_args=("--max-num-seqs", "64"),
        image="vllm/vllm-openai:v0.9.2",
        node_label="gpu-a",
    )

    assert store.get_service_profile("chat-big") == created
    assert (created.engine, created.runtime, created.gpus) == ("vllm", "docker", (0, 1))
    assert (created.ctx, created.extra_args) == (8192, ("--max-num-seqs", "64"))
    assert (created.image, created.node_label) == ("vllm/vllm-openai:v0.9.2", "gpu-a")
    assert created.created_at.tzinfo is not None
    assert [s.name for s in store.list_service_profiles()] == ["chat-big"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model_name": "nope"}, NotFoundError, "model 'nope' not found"),
        ({"engine": "tgi"}, ConfigError, "unknown engine 'tgi'"),
        ({"runtime": "k8s"}, ConfigError, "unknown runtime 'k8s'"),
        ({"gpus": (-1,)}, ConfigError, "must not be negative"),
        ({"ctx": 0}, ConfigError, "positive number of tokens"),
        ({"image": "x:1"}, ConfigError, "docker runtime only"),
        ({"runtime": "docker", "image": " "}, ConfigError, "image name is empty"),
        ({"node_label": "gpu-z"}, NotFoundError, r"node 'gpu-z' not found \(nodes: local\)"),
    ],
)
def test_bad_service_settings_are_refused_and_nothing_is_stored(
    store: Store, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    arguments: dict[str, object] = {
        "name": "s",
        "model_name": "tiny",
        "engine": "llamacpp",
        "runtime": "process",
        **kwargs,
    }
    with pytest.raises(error, match=match):
        store.create_service_profile(**arguments)  # type: ignore[arg-type]
    assert store.list_service_profiles() == []


def test_a_removed_node_is_not_a_valid_label(store: Store) -> None:
    node = store.enroll_node("gpu-a", "sha256:" + "a" * 64)
    store.remove_node(node.id)
    with pytest.raises(NotFoundError, match="'gpu-a' not found"):
        store.create_service_profile("s", "tiny", "llamacpp", "process", node_label="gpu-a")


def test_a_taken_service_name_is_a_conflict(services: Store) -> None:
    with pytest.raises(ConflictError, match="service 'a' already exists"):
        services.create_service_profile("a", "big", "vllm", "process")
    assert services.get_service_profile("a").model_name == "tiny"


def test_unknown_service_is_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError, match="service 'x' not found"):
        store.get_service_profile("x")
    with pytest.raises(NotFoundError, match="service 'x' not found"):
        store.delete_service_profile("x")


def test_a_model_a_service_uses_cannot_be_removed(services: Store) -> None:
    with pytest.raises(ConflictError, match=r"model 'big' is used by service\(s\) d"):
        services.remove_model("big")
    services.delete_service_profile("d")
    services.remove_model("big")


def test_a_service_with_an_active_deployment_cannot_be_deleted(services: Store) -> None:
    deployment = services.create_deployment(
        "tiny", "llamacpp", "process", "local", served_model_name="a"
    )
    with pytest.raises(ConflictError, match=rf"active deployment\(s\) {deployment.id}"):
        services.delete_service_profile("a")
    services.transition_deployment(deployment.id, DeploymentState.FAILED)
    assert services.delete_service_profile("a").name == "a"


def test_route_targets_come_highest_priority_first(services: Store) -> None:
    services.add_route("chat", "b", priority=5)
    services.add_route("chat", "c", priority=10)
    route = services.add_route("chat", "a", priority=5)

    assert route.targets == (RouteTarget("c", 10), RouteTarget("a", 5), RouteTarget("b", 5))
    assert services.get_route("chat") == route
    assert [r.name for r in services.list_routes()] == ["chat"]


def test_a_used_service_cannot_be_deleted_and_the_error_names_the_routes(
    services: Store,
) -> None:
    services.add_route("chat", "a")
    services.add_route("code", "a")
    with pytest.raises(ConflictError, match=r"used by route\(s\) chat, code"):
        services.delete_service_profile("a")
    assert services.get_service_profile("a").name == "a"


def test_route_refusals(services: Store) -> None:
    services.add_route("chat", "a")
    with pytest.raises(NotFoundError, match="service 'nope' not found"):
        services.add_route("chat", "nope")
    with pytest.raises(ConflictError, match="service 'a' is already behind route 'chat'"):
        services.add_route("chat", "a", priority=3)
    with pytest.raises(NotFoundError, match="route 'nope' not found"):
        services.add_route("code", "b", fallback="nope")
    with pytest.raises(NotFoundError, match="route 'nope' not found"):
        services.get_route("nope")
    # A refused call leaves nothing half-made: no route "code" without a target.
    assert [r.name for r in services.list_routes()] == ["chat"]


@pytest.mark.parametrize(
    ("chain", "fallback_of", "to", "loop"),
    [
        ([], "a", "a", "a -> a"),
        (["b"], "a", "b", None),
        (["b", "a"], "a", "b", "a -> b -> a"),
        (["b", "c", "a"], "a", "b", "a -> b -> c -> a"),
    ],
)
def test_a_fallback_that_would_loop_is_refused(
    services: Store, chain: list[str], fallback_of: str, to: str, loop: str | None
) -> None:
    """Routes a, b, c each on service a; ``chain`` sets b -> c -> a ... then ``fallback_of``
    is pointed at ``to``."""
    for name in ("a", "b", "c"):
        services.add_route(name, "a")
    for here, there in itertools.pairwise(chain):
        services.set_route_fallback(here, there)
    if loop is None:
        assert services.set_route_fallback(fallback_of, to).fallback == to
        return
    with pytest.raises(ConfigError, match=f"would loop \\({loop}\\)"):
        services.set_route_fallback(fallback_of, to)
    with pytest.raises(ConfigError, match="would loop"):
        services.add_route(fallback_of, "b", fallback=to)
    assert services.get_route(fallback_of).fallback is None


def test_a_fallback_given_again_replaces_the_first_and_can_be_cleared(services: Store) -> None:
    services.add_route("small", "a")
    services.add_route("tiny", "b")
    services.add_route("chat", "c", fallback="small")
    assert services.add_route("chat", "d", fallback="tiny").fallback == "tiny"
    assert services.add_route("chat", "a").fallback == "tiny"  # no --fallback: unchanged
    assert services.set_route_fallback("chat", None).fallback is None


def test_removing_targets_then_the_route(services: Store) -> None:
    services.add_route("chat", "a", priority=2)
    services.add_route("chat", "b")

    left = services.remove_route("chat", "a")
    assert left is not None and left.targets == (RouteTarget("b", 0),)
    with pytest.raises(NotFoundError, match="service 'a' is not behind route 'chat'"):
        services.remove_route("chat", "a")
    assert services.remove_route("chat", "b") is None  # the last target takes the route along
    with pytest.raises(NotFoundError, match="route 'chat' not found"):
        services.remove_route("chat")
    services.delete_service_profile("a")


def test_a_route_another_falls_back_to_cannot_be_removed(services: Store) -> None:
    services.add_route("small", "a")
    services.add_route("chat", "b", fallback="small")
    with pytest.raises(ConflictError, match=r"fallback of route\(s\) chat"):
        services.remove_route("small")
    with pytest.raises(ConflictError, match=r"fallback of route\(s\) chat"):
        services.remove_route("small", "a")  # its last target
    assert services.get_route("small").targets == (RouteTarget("a", 0),)
    services.set_route_fallback("chat", None)
    assert services.remove_route("small") is None


def test_routes_survive_a_reopen(tmp_path: Path, services: Store) -> None:
    services.add_route("small", "a")
    services.add_route("chat", "b", priority=7, fallback="small")
    url = str(services.engine.url)
    services.close()
    with Store(url) as reopened:
        reopened.migrate()
        (chat, small) = reopened.list_routes()
        assert (chat.name, chat.targets, chat.fallback) == ("chat", (RouteTarget("b", 7),), "small")
        assert small.name == "small"


def test_a_service_cannot_take_a_models_or_a_running_deployments_name(store: Store) -> None:
    with pytest.raises(ConflictError, match="'tiny' is already a model's name"):
        store.create_service_profile("tiny", "tiny", "llamacpp", "process")
    running = store.create_deployment("big", "vllm", "process", "local", served_model_name="chat")
    with pytest.raises(ConflictError, match="'chat' is already a model's name or a running"):
        store.create_service_profile("chat", "tiny", "llamacpp", "process")
    store.transition_deployment(running.id, DeploymentState.FAILED, failure_reason="gone")
    assert store.create_service_profile("chat", "tiny", "llamacpp", "process").name == "chat"
