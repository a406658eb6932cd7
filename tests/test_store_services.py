"""The store's service profiles and routes, on a real SQLite database."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.store import Store
from berth.vocab.records import RouteTarget, StreamTimeouts
from berth.vocab.states import DeploymentState

# The shared ``store`` fixture (conftest.py), with these models.
pytestmark = [
    pytest.mark.store_models(("tiny", "/models/tiny.gguf"), ("big", "/models/big")),
    pytest.mark.store_engines,
]


@pytest.fixture
def store_with_services(store: Store) -> Store:
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


def test_a_taken_service_name_is_a_conflict(store_with_services: Store) -> None:
    with pytest.raises(ConflictError, match="service 'a' already exists"):
        store_with_services.create_service_profile("a", "big", "vllm", "process")
    assert store_with_services.get_service_profile("a").model_name == "tiny"


def test_unknown_service_is_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError, match="service 'x' not found"):
        store.get_service_profile("x")
    with pytest.raises(NotFoundError, match="service 'x' not found"):
        store.delete_service_profile("x")


def test_a_model_a_service_uses_cannot_be_removed(store_with_services: Store) -> None:
    with pytest.raises(ConflictError, match=r"model 'big' is used by service\(s\) d"):
        store_with_services.remove_model("big")
    store_with_services.delete_service_profile("d")
    store_with_services.remove_model("big")


def test_a_service_with_an_active_deployment_cannot_be_deleted(store_with_services: Store) -> None:
    deployment = store_with_services.create_deployment(
        "tiny", "llamacpp", "process", "local", served_model_name="a"
    )
    with pytest.raises(ConflictError, match=rf"active deployment\(s\) {deployment.id}"):
        store_with_services.delete_service_profile("a")
    store_with_services.transition_deployment(deployment.id, DeploymentState.FAILED)
    assert store_with_services.delete_service_profile("a").name == "a"


def test_route_targets_come_highest_priority_first(store_with_services: Store) -> None:
    store_with_services.add_route("chat", "b", priority=5)
    store_with_services.add_route("chat", "c", priority=10)
    route = store_with_services.add_route("chat", "a", priority=5)

    assert route.targets == (RouteTarget("c", 10), RouteTarget("a", 5), RouteTarget("b", 5))
    assert store_with_services.get_route("chat") == route
    assert [r.name for r in store_with_services.list_routes()] == ["chat"]


def test_a_used_service_cannot_be_deleted_and_the_error_names_the_routes(
    store_with_services: Store,
) -> None:
    store_with_services.add_route("chat", "a")
    store_with_services.add_route("code", "a")
    with pytest.raises(ConflictError, match=r"used by route\(s\) chat, code"):
        store_with_services.delete_service_profile("a")
    assert store_with_services.get_service_profile("a").name == "a"


def test_route_refusals(store_with_services: Store) -> None:
    store_with_services.add_route("chat", "a")
    with pytest.raises(NotFoundError, match="service 'nope' not found"):
        store_with_services.add_route("chat", "nope")
    with pytest.raises(ConflictError, match="service 'a' is already behind route 'chat'"):
        store_with_services.add_route("chat", "a", priority=3)
    with pytest.raises(NotFoundError, match="route 'nope' not found"):
        store_with_services.add_route("code", "b", fallback="nope")
    with pytest.raises(NotFoundError, match="route 'nope' not found"):
        store_with_services.get_route("nope")
    # A refused call leaves nothing half-made: no route "code" without a target.
    assert [r.name for r in store_with_services.list_routes()] == ["chat"]


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
    store_with_services: Store, chain: list[str], fallback_of: str, to: str, loop: str | None
) -> None:
    """Routes a, b, c each on service a; ``chain`` sets b -> c -> a ... then ``fallback_of``
    is pointed at ``to``."""
    for name in ("a", "b", "c"):
        store_with_services.add_route(name, "a")
    for here, there in itertools.pairwise(chain):
        store_with_services.set_route_fallback(here, there)
    if loop is None:
        assert store_with_services.set_route_fallback(fallback_of, to).fallback == to
        return
    with pytest.raises(ConfigError, match=f"would loop \\({loop}\\)"):
        store_with_services.set_route_fallback(fallback_of, to)
    with pytest.raises(ConfigError, match="would loop"):
        store_with_services.add_route(fallback_of, "b", fallback=to)
    assert store_with_services.get_route(fallback_of).fallback is None


def test_a_fallback_given_again_replaces_the_first_and_can_be_cleared(
    store_with_services: Store,
) -> None:
    store_with_services.add_route("small", "a")
    store_with_services.add_route("tiny", "b")
    store_with_services.add_route("chat", "c", fallback="small")
    assert store_with_services.add_route("chat", "d", fallback="tiny").fallback == "tiny"
    assert store_with_services.add_route("chat", "a").fallback == "tiny"  # no --fallback: unchanged
    assert store_with_services.set_route_fallback("chat", None).fallback is None


def test_removing_targets_then_the_route(store_with_services: Store) -> None:
    store_with_services.add_route("chat", "a", priority=2)
    store_with_services.add_route("chat", "b")

    left = store_with_services.remove_route("chat", "a")
    assert left is not None and left.targets == (RouteTarget("b", 0),)
    with pytest.raises(NotFoundError, match="service 'a' is not behind route 'chat'"):
        store_with_services.remove_route("chat", "a")
    assert (
        store_with_services.remove_route("chat", "b") is None
    )  # the last target takes the route along
    with pytest.raises(NotFoundError, match="route 'chat' not found"):
        store_with_services.remove_route("chat")
    store_with_services.delete_service_profile("a")


def test_a_route_another_falls_back_to_cannot_be_removed(store_with_services: Store) -> None:
    store_with_services.add_route("small", "a")
    store_with_services.add_route("chat", "b", fallback="small")
    with pytest.raises(ConflictError, match=r"fallback of route\(s\) chat"):
        store_with_services.remove_route("small")
    with pytest.raises(ConflictError, match=r"fallback of route\(s\) chat"):
        store_with_services.remove_route("small", "a")  # its last target
    assert store_with_services.get_route("small").targets == (RouteTarget("a", 0),)
    store_with_services.set_route_fallback("chat", None)
    assert store_with_services.remove_route("small") is None


def test_routes_survive_a_reopen(tmp_path: Path, store_with_services: Store) -> None:
    store_with_services.add_route("small", "a")
    store_with_services.add_route("chat", "b", priority=7, fallback="small")
    url = str(store_with_services.engine.url)
    store_with_services.close()
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


def test_a_service_s_stream_timeouts_are_kept_checked_and_changed(store: Store) -> None:
    plain = store.create_service_profile("plain", "tiny", "llamacpp", "process")
    assert plain.timeouts == StreamTimeouts()  # the leader's settings
    own = StreamTimeouts(first_byte_timeout_s=30.0, stream_idle_timeout_s=0.0)
    created = store.create_service_profile("own", "tiny", "llamacpp", "process", timeouts=own)
    assert created.timeouts == own == store.get_service_profile("own").timeouts
    for bad in (StreamTimeouts(first_byte_timeout_s=-1.0),
                StreamTimeouts(stream_idle_timeout_s=float("nan"))):  # fmt: skip
        with pytest.raises(ConfigError, match="must be 0 \\(off\\) to 86400 seconds"):
            store.create_service_profile("bad", "tiny", "llamacpp", "process", timeouts=bad)
        with pytest.raises(ConfigError):
            store.update_service_timeouts("own", lambda _current, bad=bad: bad)
    assert store.get_service_profile("own").timeouts == own  # nothing changed
    changed = store.update_service_timeouts(
        "own", lambda current: StreamTimeouts(current.first_byte_timeout_s, 90.0)
    )
    assert changed.timeouts == StreamTimeouts(30.0, 90.0)
    assert changed.scaling == created.scaling
    with pytest.raises(NotFoundError):
        store.update_service_timeouts("nope", lambda current: current)


def test_a_service_s_routing_policy_is_kept_checked_and_changed(store: Store) -> None:
    assert (
        store.create_service_profile("plain", "tiny", "llamacpp", "process").routing_policy is None
    )
    own = store.create_service_profile(
        "own", "tiny", "llamacpp", "process", routing_policy="prefix"
    )
    assert own.routing_policy == "prefix" == store.get_service_profile("own").routing_policy
    with pytest.raises(ConfigError, match="unknown routing policy 'random'"):
        store.create_service_profile("bad", "tiny", "llamacpp", "process", routing_policy="random")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="least-load, prefix"):
        store.set_service_routing_policy("own", "random")  # type: ignore[arg-type]
    assert store.set_service_routing_policy("own", "least-load").routing_policy == "least-load"
    assert store.set_service_routing_policy("own", None).routing_policy is None
    with pytest.raises(NotFoundError):
        store.set_service_routing_policy("nope", "prefix")
