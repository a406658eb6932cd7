"""Placement by fit, from plain values: free VRAM as placement counts it, where deployments
go (fit, spread of replicas, force), the CPU-only default, and each VRAM refusal."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from berth.errors import ConfigError, ConflictError
from berth.placement import (
    EvictionPolicy,
    GpuFacts,
    GpuReservation,
    NodeFacts,
    Placement,
    PlacementRequest,
    Refusal,
    ReplicaAt,
    Resident,
    VramEstimate,
    plan_placement,
)
from berth.vocab.records import ModelRecord

MODEL = ModelRecord(
    "m", Path("/models/m.gguf"), "local", None, None, 0, datetime(2025, 1, 1, tzinfo=UTC)
)


def estimate(need_mb: int = 10_000, **fields: Any) -> VramEstimate:
    """A llama.cpp estimate of ``need_mb`` (all weights, for round numbers)."""
    values: dict[str, Any] = {
        "engine": "llamacpp", "weights_mb": need_mb, "kv_cache_mb": 0, "overhead_mb": 0,
        "gpu_count": 1, "ctx": 4096, "cache_type": "f16", "budget_fraction": None,
        "budget_flag": None, "holds_fraction": None, "inputs": (),
    }  # fmt: skip
    values.update(fields)
    return VramEstimate(**values)


def gpu(
    index: int, total_mb: int = 24_000, free_mb: int | None = None, *held: Resident
) -> GpuFacts:
    return GpuFacts(index, "L4", total_mb, total_mb if free_mb is None else free_mb, held)


def node(node_id: str, *gpus: GpuFacts, **fields: Any) -> NodeFacts:
    values: dict[str, Any] = {
        "connected": True,
        "leader_host": node_id == "local",
        "model_location": None if node_id == "local" else Path(f"/{node_id}/m.gguf"),
        "gpus": gpus,
    }
    values.update(fields)
    return NodeFacts(node_id, f"{node_id}-label", **values)


def ask(**fields: Any) -> PlacementRequest:
    values: dict[str, Any] = {
        "model": MODEL,
        "engine": "llamacpp",
        "runtime": "process",
        "estimate": estimate(),
    }
    values.update(fields)
    return PlacementRequest(**values)


# -- free VRAM as placement counts it ------------------------------------------------------------


@pytest.mark.parametrize(
    ("facts", "free_mb"),
    [
        (gpu(0, 24_000, 24_000), 24_000),  # nothing there
        # a simulated GPU reports all free: berth's own deployments fill it
        (gpu(0, 24_000, 24_000, Resident("d-1", "a", 9_000), Resident("d-2", "b", 5_000)), 10_000),
        # a real GPU already shows a ready engine's memory: the total term decides
        (gpu(0, 24_000, 14_000, Resident("d-1", "a", 9_000)), 14_000),
        # one still loading is not in the report yet: taken off what is reported free
        (gpu(0, 24_000, 20_000, Resident("d-1", "a", 9_000, starting=True)), 11_000),
        # something berth did not start uses memory: the report decides
        (gpu(0, 24_000, 4_000, Resident("d-1", "a", 2_000)), 4_000),
        # estimates beyond the GPU: nothing free, never negative
        (gpu(0, 8_000, 8_000, Resident("d-1", "a", 9_000)), 0),
    ],
    ids=["empty", "simulated, two residents", "real, ready", "real, loading", "real, foreign",
         "overfull"],
)  # fmt: skip
def test_free_vram_is_the_smaller_of_the_report_and_berths_own_count(
    facts: GpuFacts, free_mb: int
) -> None:
    assert facts.free_mb == free_mb


# -- where a deployment goes ---------------------------------------------------------------------

A = node("a", gpu(0, 24_000, 20_000), gpu(1, 24_000, 12_000))
B = node("b", gpu(0, 48_000, 30_000))
CPU = node("local")

PLACED: list[tuple[str, PlacementRequest, list[NodeFacts], tuple[str, tuple[int, ...]], str]] = [
    (
        "the GPU with the most left free after it",
        ask(),
        [A, B],
        ("b", (0,)),
        "node b-label GPU 0 (L4, 46.9 GiB, 29.3 GiB free): fits, takes 9.77 GiB of 29.3 GiB free",
    ),
    (
        "replicas of a service spread over nodes first",
        ask(replicas=(ReplicaAt("b", (0,)),)),
        [A, B],
        ("a", (0,)),
        "replicas of this service per node: a-label 0, b-label 1; the fewest first",
    ),
    (
        "then over GPUs",
        ask(replicas=(ReplicaAt("a", (0,)), ReplicaAt("b", (0,)))),
        [A, B],
        ("a", (1,)),
        "node a-label GPU 1 (L4, 23.4 GiB, 11.7 GiB free): fits, takes 9.77 GiB of 11.7 GiB free",
    ),
    (
        "a named node without a GPU named: its best GPU",
        ask(node_id="a"),
        [A, B],
        ("a", (0,)),
        "node a-label GPU 0 (L4, 23.4 GiB, 19.5 GiB free): fits, takes 9.77 GiB of 19.5 GiB free",
    ),
    (
        "a GPU asked for that fits",
        ask(node_id="a", gpus=(1,)),
        [A, B],
        ("a", (1,)),
        "GPU 1 on node a-label, none reserved",
    ),
    (
        "a GPU asked for that does not fit, forced",
        ask(node_id="a", gpus=(1,), estimate=estimate(15_000), force=True),
        [A, B],
        ("a", (1,)),
        "forced (--force): node a-label GPU 1 (L4, 23.4 GiB, 11.7 GiB free): no room, needs "
        "14.6 GiB, 11.7 GiB free",
    ),
    (
        "nothing fits, forced: the most free VRAM",
        ask(estimate=estimate(40_000), force=True),
        [A, B],
        ("b", (0,)),
        "forced (--force), the most free VRAM: node b-label GPU 0 (L4, 46.9 GiB, 29.3 GiB free): "
        "no room, needs 39.1 GiB, 29.3 GiB free",
    ),
    (
        "no node reports GPUs: the leader's host, no VRAM check",
        ask(estimate=None, estimate_problem="no connected node reports GPUs"),
        [CPU, node("c")],
        ("local", ()),
        "no connected node reports GPUs: the leader's own host, no VRAM check (the engine runs "
        "on its CPU)",
    ),
    (
        "a named CPU node: no VRAM check",
        ask(node_id="c"),
        [CPU, node("c"), B],
        ("c", ()),
        "node c-label reports no GPUs: no VRAM check (the engine runs on its CPU)",
    ),
    (
        "a named GPU node without an estimate: every GPU, unchecked",
        ask(node_id="a", estimate=None, estimate_problem="its files are elsewhere"),
        [A],
        ("a", ()),
        "no VRAM check: its files are elsewhere; the engine is given no GPU list (it sees every "
        "GPU)",
    ),
    (
        "GPU indexes without a node: the leader's host",
        ask(gpus=(0,)),
        [node("local", gpu(0)), A],
        ("local", (0,)),
        "GPU 0 on node local-label, none reserved",
    ),
    (
        "a GPU an adopted endpoint reserves is passed over",
        ask(),
        [replace(B, reserved_gpus=(GpuReservation(0, "vllm-outside"),)), A],
        ("a", (0,)),
        "node a-label GPU 0 (L4, 23.4 GiB, 19.5 GiB free): fits, takes 9.77 GiB of 19.5 GiB free",
    ),
    (
        "two GPUs of one node for a two-GPU estimate",
        ask(estimate=estimate(10_000, gpu_count=2)),
        [B, A],
        ("a", (0, 1)),
        "node a-label GPU 1 (L4, 23.4 GiB, 11.7 GiB free): fits, takes 9.77 GiB of 11.7 GiB free",
    ),
    (
        "a node whose model must be pulled is still a candidate",
        ask(model=replace(MODEL, source="hub", repo_id="org/m", revision=None)),
        [node("p", gpu(0), model_location=None, can_pull=True)],
        ("p", (0,)),
        "node p-label has no path for model m: it downloads org/m from the hub first",
    ),
]


@pytest.mark.parametrize(
    ("request_", "nodes", "where", "reason"),
    [c[1:] for c in PLACED],
    ids=[c[0] for c in PLACED],
)
def test_a_deployment_goes_where_it_fits(
    request_: PlacementRequest,
    nodes: list[NodeFacts],
    where: tuple[str, tuple[int, ...]],
    reason: str,
) -> None:
    placed = plan_placement(request_, nodes)
    assert isinstance(placed, Placement), placed
    assert (placed.node_id, placed.gpus) == where
    assert reason in placed.reasons, placed.reasons
    assert placed.estimate == (
        request_.estimate if nodes[0].gpus or request_.gpus else placed.estimate
    )


REFUSED: list[tuple[str, PlacementRequest, list[NodeFacts], str, type[Exception], str]] = [
    (
        "nothing has room now",
        ask(estimate=estimate(35_000)),
        [A, B],
        "vram_no_room",
        ConflictError,
        "no GPU can take model m: it needs 34.2 GiB (weights 34.2 GiB + KV cache 0 MiB + "
        "overhead 0 MiB at ctx 4096, f16); the most free VRAM seen is 29.3 GiB (node b-label "
        "GPU 0)",
    ),
    (
        "bigger than every GPU: a context too large",
        ask(estimate=estimate(60_000)),
        [A, B],
        "vram_too_large",
        ConfigError,
        "no GPU can take model m: it needs 58.6 GiB (weights 58.6 GiB + KV cache 0 MiB + "
        "overhead 0 MiB at ctx 4096, f16); the most free VRAM seen is 29.3 GiB (node b-label "
        "GPU 0); ask for a smaller --ctx, a smaller quantisation, or more GPUs",
    ),
    (
        "a GPU asked for without room",
        ask(node_id="a", gpus=(1,), estimate=estimate(15_000)),
        [A],
        "vram_no_room",
        ConflictError,
        "model m does not fit GPU 1 on node a-label: GPU 1: needs 14.6 GiB, 11.7 GiB free "
        "(estimate 14.6 GiB (weights 14.6 GiB + KV cache 0 MiB + overhead 0 MiB at ctx 4096, "
        "f16)); choose other GPUs, leave --gpu out to place it by fit, or --force",
    ),
    (
        "a GPU asked for that is too small",
        ask(node_id="a", gpus=(0,), estimate=estimate(30_000)),
        [A],
        "vram_too_large",
        ConfigError,
        "model m does not fit GPU 0 on node a-label: GPU 0: needs 29.3 GiB, more than the GPU's "
        "23.4 GiB (estimate 29.3 GiB (weights 29.3 GiB + KV cache 0 MiB + overhead 0 MiB at ctx "
        "4096, f16)); choose other GPUs, leave --gpu out to place it by fit, or --force",
    ),
    (
        "GPUs to choose from but no estimate",
        ask(estimate=None, estimate_problem="model m has paths only on other nodes"),
        [A],
        "estimate_unknown",
        ConfigError,
        "cannot place model m by free VRAM: model m has paths only on other nodes; name a node "
        "with --node LABEL to run it there without a VRAM check",
    ),
    (
        "a leader that runs no engines, and no GPU node",
        ask(),
        [node("c")],
        "no_node",
        ConflictError,
        "no connected node reports GPUs, and this leader runs no engines (leader_only is set): "
        "name a node with --node LABEL (`berth nodes ls` lists them)",
    ),
    (
        "every GPU node lacks the model",
        ask(),
        [replace(A, model_location=None)],
        "no_node",
        ConflictError,
        "no node with GPUs can run model m: model m has no path on node a-label; add one with "
        "'berth models add m PATH --node a-label'",
    ),
    (
        "every GPU node lacks the model, beside a CPU leader",
        ask(),
        [CPU, replace(A, model_location=None)],
        "no_node",
        ConflictError,
        "no node with GPUs can run model m: model m has no path on node a-label; add one with "
        "'berth models add m PATH --node a-label' (or run it on the leader's CPU with --node "
        "local)",
    ),
]


@pytest.mark.parametrize(
    ("request_", "nodes", "reason", "error", "message"),
    [c[1:] for c in REFUSED],
    ids=[c[0] for c in REFUSED],
)
def test_a_deployment_that_fits_nowhere_is_refused_with_the_estimate(
    request_: PlacementRequest,
    nodes: list[NodeFacts],
    reason: str,
    error: type[Exception],
    message: str,
) -> None:
    refused = plan_placement(request_, nodes)
    assert isinstance(refused, Refusal), refused
    assert (refused.reason, refused.message) == (reason, message)
    assert type(refused.error()) is error


# -- evictions through placement -----------------------------------------------------------------

NOW = 50_000.0
FULL = node(
    "a",
    gpu(0, 24_000, 24_000, Resident("d-old", "old", 20_000, started_at=NOW - 3600,
                                    last_request_at=NOW - 1800)),
    gpu(1, 24_000, 24_000, Resident("d-new", "new", 20_000, started_at=NOW - 3600,
                                    last_request_at=NOW - 10)),
)  # fmt: skip


def test_a_refusal_names_the_eviction_that_would_make_room() -> None:
    request = ask(eviction=EvictionPolicy(NOW, 60.0))
    refused = plan_placement(request, [FULL])
    assert isinstance(refused, Refusal) and refused.reason == "vram_no_room"
    assert refused.eviction is not None and refused.eviction.deployment_ids == ("d-old",)
    assert refused.message.endswith("; on node a-label GPU 0; stopping idle d-old would make room")


def test_when_allowed_the_least_recently_used_is_evicted_first() -> None:
    placed = plan_placement(ask(eviction=EvictionPolicy(NOW, 60.0, allowed=True)), [FULL])
    assert isinstance(placed, Placement)
    assert (placed.gpus, placed.eviction and placed.eviction.deployment_ids) == ((0,), ("d-old",))
    assert any(line.startswith("stop d-old (old): last request 30m ago") for line in placed.reasons)


def test_a_busy_or_young_resident_blocks_the_eviction_and_the_refusal_says_why() -> None:
    young = node("a", gpu(0, 24_000, 24_000, Resident("d-1", "one", 20_000, started_at=NOW - 5)))
    refused = plan_placement(ask(eviction=EvictionPolicy(NOW, 60.0, allowed=True)), [young])
    assert isinstance(refused, Refusal) and refused.eviction is None
    assert refused.message.endswith(
        "; no eviction makes room: stopping every idle deployment would not make room (GPU 0 "
        "is short of 5.86 GiB); kept: d-1: resident 5s, under the minimum residency of 1m"
    )


def test_without_an_eviction_policy_nothing_is_looked_at() -> None:
    refused = plan_placement(ask(), [FULL])
    assert isinstance(refused, Refusal) and refused.eviction is None
    assert "evict" not in refused.message


def test_vllm_holds_its_fraction_of_the_gpu_it_lands_on() -> None:
    vllm = estimate(8_000, engine="vllm", budget_fraction=0.9,
                    budget_flag="--gpu-memory-utilization", holds_fraction=0.9)  # fmt: skip
    # a 24000 MiB GPU with 20000 free cannot give vLLM its 21600; the 48000 one can
    placed = plan_placement(ask(estimate=vllm), [node("a", gpu(0, 24_000, 20_000)),
                                                 node("b", gpu(0, 48_000, 48_000))])  # fmt: skip
    assert isinstance(placed, Placement) and placed.node_id == "b"
    assert "fits, takes 42.2 GiB of 46.9 GiB free" in placed.reasons[-1]


def test_a_cordoned_node_takes_nothing_new_and_is_named_as_left_out() -> None:
    """Cordoned nodes are skipped by placement by fit (on-demand loads and scale-out place
    by fit too), and a start asked of one is refused, naming the way back."""
    roomy = node("a", gpu(0, 80_000), cordoned=True)
    small = node("b", gpu(0, 24_000))
    placed = plan_placement(ask(), [roomy, small])
    assert isinstance(placed, Placement) and placed.node_id == "b"
    assert placed.reasons[0] == (
        "left out: node a-label is cordoned: nothing new is placed there "
        "(berth nodes uncordon a-label)"
    )
    only = plan_placement(ask(), [roomy])
    assert isinstance(only, Refusal) and only.reason == "no_node"
    assert "node a-label is cordoned" in only.message
    named = plan_placement(ask(node_id="a"), [roomy, small])
    assert isinstance(named, Refusal) and named.reason == "node_cordoned"
    assert isinstance(named.error(), ConflictError)
    leader = node("local", cordoned=True)  # no GPUs anywhere: the leader's host, cordoned
    assert plan_placement(ask(), [leader]) == Refusal(
        "node_cordoned",
        "node local-label is cordoned: nothing new is placed there "
        "(berth nodes uncordon local-label)",
        "local",
    )
