"""Placement as a pure function: every refusal reason and every shape of success, from plain
values; then the facts the lifecycle manager gathers for it from a link."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from berth.cluster.protocol.ops import OP_CAPABILITIES, RUNTIME_CAPABILITIES
from berth.deployments.placement_facts import gather_node_facts, offered_runtimes
from berth.deployments.ready_table import ReadyTable
from berth.errors import ConfigError, ConflictError
from berth.placement import (
    CONFLICT_REASONS,
    GpuFacts,
    GpuReservation,
    ModelAt,
    ModelPull,
    NodeFacts,
    Placement,
    PlacementPolicy,
    PlacementRequest,
    Refusal,
    RefusalReason,
    plan_placement,
)
from berth.store import Store
from berth.vocab.images import DEFAULT_GPU_IMAGES, DEFAULT_IMAGES
from berth.vocab.records import ModelRecord
from support.fakes import FakeLink

# The shared ``store`` fixture (conftest.py), with this model.
pytestmark = pytest.mark.store_models(("tiny", "tiny.gguf"))

POLICY = PlacementPolicy(
    images={"llamacpp": "example/llama:7", "vllm": "example/vllm:1", "sglang": "example/sgl:2"},
    gpu_images={"llamacpp": "example/llama:7-cuda"},
)


def model(**fields: Any) -> ModelRecord:
    values: dict[str, Any] = {
        "name": "tiny",
        "path": Path("/leader/models/tiny.gguf"),
        "source": "local",
        "repo_id": None,
        "revision": None,
        "size_bytes": 4,
        "created_at": datetime(2025, 1, 1, tzinfo=UTC),
    }
    values.update(fields)
    return ModelRecord(**values)


HUB_MODEL = model(source="hub", repo_id="org/tiny", revision="v2")
REMOTE_ONLY = model(source="remote")


def gpu(index: int) -> GpuFacts:
    return GpuFacts(index, "H100", 81_559, 81_559)


LEADER = NodeFacts(
    "local", "local", connected=True, leader_host=True, runtimes=frozenset({"process", "docker"})
)
AGENT = NodeFacts(
    "n-1",
    "gpu-a",
    connected=True,
    runtimes=frozenset({"process", "docker"}),
    can_pull=True,
    model_location=Path("/agent/models/tiny.gguf"),
    gpus=(gpu(0), gpu(1)),
)


def ask(
    node_id: str = "local", the_model: ModelRecord | None = None, **fields: Any
) -> PlacementRequest:
    values: dict[str, Any] = {
        "model": the_model or model(),
        "engine": "llamacpp",
        "runtime": "process",
        "node_id": node_id,
    }
    values.update(fields)
    return PlacementRequest(**values)


# -- refusals ------------------------------------------------------------------------------------

REFUSALS: list[tuple[str, PlacementRequest, list[NodeFacts], RefusalReason, str]] = [
    (
        "an image for the process runtime",
        ask(image="x/y:1"),
        [LEADER],
        "image_without_docker",
        "an image applies to the docker runtime only (--runtime docker)",
    ),
    (
        "an empty image",
        ask(runtime="docker", image=""),
        [LEADER],
        "image_invalid",
        "the docker image name is empty",
    ),
    (
        "an image that is no reference",
        ask(runtime="docker", image="Bad Image!!"),
        [LEADER],
        "image_invalid",
        "'Bad Image!!' is not a docker image reference (repository[:tag], e.g. "
        "vllm/vllm-openai:latest)",
    ),
    (
        "an image setting that is no reference",
        ask(runtime="docker", gpus=(0,), node_id="n-1"),
        [AGENT],
        "image_invalid",
        "'bad image' is not a docker image reference (repository[:tag], e.g. "
        "vllm/vllm-openai:latest)",
    ),
    (
        "a node without a link",
        ask(node_id="n-1"),
        [replace(AGENT, connected=False)],
        "node_not_connected",
        "node gpu-a (n-1) is not connected",
    ),
    (
        "a node nobody gathered facts for",
        ask(node_id="n-9"),
        [LEADER, AGENT],
        "node_not_connected",
        "node n-9 (n-9) is not connected",
    ),
    (
        "docker on an agent that found no Docker engine",
        ask(node_id="n-1", runtime="docker"),
        [replace(AGENT, runtimes=frozenset({"process"}))],
        "runtime_unavailable",
        "node gpu-a offers no docker runtime (its agent found no Docker engine when it "
        "connected; `berth doctor` on that host says why)",
    ),
    (
        "a model with paths on other nodes only, on the leader's host",
        ask(the_model=REMOTE_ONLY),
        [LEADER],
        "model_elsewhere",
        "model tiny has a path only on other nodes (berth models ls); run it there with "
        "--node LABEL",
    ),
    (
        "a local model with no path on the agent",
        ask(node_id="n-1"),
        [replace(AGENT, model_location=None)],
        "model_not_on_node",
        "model tiny has no path on node gpu-a; add one with "
        "'berth models add tiny PATH --node gpu-a'",
    ),
    (
        "a hub model on an agent that cannot pull",
        ask(node_id="n-1", the_model=HUB_MODEL),
        [replace(AGENT, model_location=None, can_pull=False)],
        "model_not_on_node",
        "model tiny has no path on node gpu-a; add one with "
        "'berth models add tiny PATH --node gpu-a'",
    ),
    (
        "a GPU an adopted endpoint declares",
        ask(node_id="n-1", gpus=(0, 1)),
        [replace(AGENT, reserved_gpus=(GpuReservation(0, "outside"), GpuReservation(1, "other")))],
        "gpu_reserved",
        "node gpu-a reserves GPU 0 by outside, GPU 1 by other (an adopted endpoint): choose "
        "other GPUs or unadopt it",
    ),
    (
        "a GPU the node lacks",
        ask(node_id="n-1", gpus=(1, 3, 2)),
        [AGENT],
        "gpu_missing",
        "node n-1 has no GPU 2, 3 (GPUs: 0, 1)",
    ),
    (
        "a GPU on a node with none",
        ask(gpus=(7,)),
        [LEADER],
        "gpu_missing",
        "node local has no GPU 7 (GPUs: none)",
    ),
]


@pytest.mark.parametrize(
    ("request_", "nodes", "reason", "message"),
    [case[1:] for case in REFUSALS],
    ids=[case[0] for case in REFUSALS],
)
def test_each_refusal_names_its_reason_and_says_why(
    request_: PlacementRequest, nodes: list[NodeFacts], reason: RefusalReason, message: str
) -> None:
    policy = replace(POLICY, gpu_images={"llamacpp": "bad image"})
    refused = plan_placement(request_, nodes, policy)
    assert isinstance(refused, Refusal)
    assert (refused.reason, refused.message) == (reason, message)
    error = refused.error()
    assert isinstance(error, ConflictError if reason in CONFLICT_REASONS else ConfigError)
    assert str(error) == message


@pytest.mark.parametrize(
    ("request_", "nodes", "first"),
    [
        # the image is the request's own problem: told before anything about the node
        (
            ask(node_id="n-1", image="x/y:1"),
            [replace(AGENT, connected=False)],
            "image_without_docker",
        ),
        (
            ask(node_id="n-1", runtime="docker", the_model=REMOTE_ONLY),
            [replace(AGENT, runtimes=frozenset({"process"}), model_location=None)],
            "runtime_unavailable",
        ),
        (
            ask(node_id="n-1", gpus=(5,)),
            [replace(AGENT, model_location=None)],
            "model_not_on_node",
        ),
        (
            ask(node_id="n-1", gpus=(0, 5)),
            [replace(AGENT, reserved_gpus=(GpuReservation(0, "outside"),))],
            "gpu_reserved",
        ),
    ],
    ids=[
        "image before node",
        "runtime before model",
        "model before GPUs",
        "reserved before missing",
    ],
)
def test_the_first_failing_check_is_the_refusal(
    request_: PlacementRequest, nodes: list[NodeFacts], first: RefusalReason
) -> None:
    refused = plan_placement(request_, nodes, POLICY)
    assert isinstance(refused, Refusal) and refused.reason == first


# -- placements ----------------------------------------------------------------------------------

PLACEMENTS: list[tuple[str, PlacementRequest, list[NodeFacts], dict[str, Any], str]] = [
    (
        "a process on the leader's host, from the registered path",
        ask(),
        [LEADER],
        {
            "node_id": "local",
            "runtime": "process",
            "image": None,
            "gpus": (),
            "model": ModelAt(Path("/leader/models/tiny.gguf")),
        },
        "model tiny at /leader/models/tiny.gguf on the leader's host",
    ),
    (
        "a container with the engine's image setting",
        ask(runtime="docker"),
        [LEADER],
        {"runtime": "docker", "image": "example/llama:7"},
        "image example/llama:7 (the llamacpp image setting)",
    ),
    (
        "a container with GPUs gets the engine's GPU image",
        ask(node_id="n-1", runtime="docker", gpus=(1,)),
        [AGENT],
        {"node_id": "n-1", "label": "gpu-a", "image": "example/llama:7-cuda", "gpus": (1,)},
        "image example/llama:7-cuda (the llamacpp image for GPUs)",
    ),
    (
        "an engine without a GPU image keeps its own with GPUs",
        ask(node_id="n-1", runtime="docker", engine="vllm", gpus=(0,)),
        [AGENT],
        {"image": "example/vllm:1"},
        "image example/vllm:1 (the vllm image setting)",
    ),
    (
        "the image asked for, stripped",
        ask(runtime="docker", image="  mine/llama:dev "),
        [LEADER],
        {"image": "mine/llama:dev"},
        "image mine/llama:dev (as asked)",
    ),
    (
        "an agent with the model's path recorded",
        ask(node_id="n-1", the_model=HUB_MODEL),
        [LEADER, AGENT],
        {"node_id": "n-1", "model": ModelAt(Path("/agent/models/tiny.gguf"))},
        "model tiny at /agent/models/tiny.gguf on node gpu-a",
    ),
    (
        "an agent that pulls a hub model first",
        ask(node_id="n-1", the_model=HUB_MODEL),
        [replace(AGENT, model_location=None)],
        {"model": ModelPull("org/tiny", "v2")},
        "node gpu-a has no path for model tiny: it downloads org/tiny at v2 from the hub first",
    ),
    (
        "GPUs that exist, beside one an adopted endpoint holds",
        ask(node_id="n-1", gpus=(1,)),
        [replace(AGENT, reserved_gpus=(GpuReservation(0, "outside"),))],
        {"gpus": (1,)},
        "GPU 1 on node gpu-a, none reserved",
    ),
]


@pytest.mark.parametrize(
    ("request_", "nodes", "expected", "reason"),
    [case[1:] for case in PLACEMENTS],
    ids=[case[0] for case in PLACEMENTS],
)
def test_each_placement_says_where_what_and_why(
    request_: PlacementRequest, nodes: list[NodeFacts], expected: dict[str, Any], reason: str
) -> None:
    placed = plan_placement(request_, nodes, POLICY)
    assert isinstance(placed, Placement), placed
    for name, value in expected.items():
        assert getattr(placed, name) == value, name
    assert reason in placed.reasons
    assert any("is connected and offers the" in line for line in placed.reasons)


def test_the_default_policy_is_the_engines_default_images() -> None:
    placed = plan_placement(ask(runtime="docker"), [LEADER])
    assert isinstance(placed, Placement) and placed.image == DEFAULT_IMAGES["llamacpp"]
    placed = plan_placement(ask(node_id="n-1", runtime="docker", gpus=(0,)), [AGENT])
    assert isinstance(placed, Placement) and placed.image == DEFAULT_GPU_IMAGES["llamacpp"]


def test_placement_is_a_pure_function_of_its_inputs() -> None:
    request = ask(node_id="n-1", the_model=HUB_MODEL, runtime="docker", gpus=(0,))
    nodes = [replace(AGENT, model_location=None)]
    assert plan_placement(request, nodes, POLICY) == plan_placement(request, nodes, POLICY)
    assert nodes == [replace(AGENT, model_location=None)]  # its inputs are left as they were


# -- the facts the lifecycle manager gathers -----------------------------------------------------


@pytest.mark.parametrize(
    ("capabilities", "runtimes", "can_pull"),
    [
        (set(OP_CAPABILITIES.values()) | set(RUNTIME_CAPABILITIES.values()),
         {"process", "docker"}, True),
        (set(OP_CAPABILITIES.values()) - {"op.pull"}, {"process"}, False),
        (set(), {"process"}, False),  # an agent from before capabilities: processes only
    ],
    ids=["everything", "no docker, no pull", "nothing advertised"],
)  # fmt: skip
async def test_a_links_capabilities_become_runtimes_and_pulling(
    store: Store, capabilities: set[str], runtimes: set[str], can_pull: bool
) -> None:
    node = store.enroll_node("gpu-a", "ab" * 32)
    store.set_model_location("tiny", node.id, "/agent/tiny.gguf")
    link = FakeLink(node_id=node.id)
    link.capabilities = frozenset(capabilities)
    assert offered_runtimes(link) == runtimes
    facts = await gather_node_facts(
        store, ReadyTable(), link, node_id=node.id, label="gpu-a",
        model=store.get_model("tiny"), gpus=(),
    )  # fmt: skip
    assert (facts.connected, facts.leader_host) == (True, False)
    assert (facts.runtimes, facts.can_pull) == (runtimes, can_pull)
    assert facts.model_location == Path("/agent/tiny.gguf")
    assert facts.gpus == ()  # given: no round trip to the agent


async def test_a_node_without_a_link_is_gathered_as_not_connected(store: Store) -> None:
    facts = await gather_node_facts(
        store, ReadyTable(), None, node_id="n-1", label="gpu-a",
        model=store.get_model("tiny"),
    )  # fmt: skip
    assert facts == NodeFacts("n-1", "gpu-a", connected=False)
