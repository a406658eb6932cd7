"""The eviction choice as a pure function: who may be stopped, in which order, and how many."""

from __future__ import annotations

from dataclasses import replace

import pytest

from berth.placement import Eviction, EvictionRefusal, GpuFacts, Resident, choose_eviction

NOW = 10_000.0
MIN_RESIDENCY_S = 60.0


def resident(
    deployment_id: str, vram_mb: int, *, idle_s: float = 600, **fields: object
) -> Resident:
    """A deployment started 1 h ago, last asked ``idle_s`` seconds ago."""
    values: dict[str, object] = {
        "started_at": NOW - 3600,
        "last_request_at": NOW - idle_s,
    }
    values.update(fields)
    return Resident(deployment_id, f"m-{deployment_id}", vram_mb, **values)  # type: ignore[arg-type]


def gpu(*residents: Resident, index: int = 0, total_mb: int = 24_000) -> GpuFacts:
    """A simulated-style GPU: reports everything free; berth's residents fill it."""
    return GpuFacts(index, "sim", total_mb, total_mb, residents)


CHOICES: list[tuple[str, list[GpuFacts], dict[int, int], tuple[str, ...]]] = [
    (
        "room already: nothing to stop",
        [gpu(resident("a", 10_000))],
        {0: 14_000},
        (),
    ),
    (
        "the least recently used goes first",
        [gpu(resident("new", 8_000, idle_s=120), resident("old", 8_000, idle_s=900),
             resident("mid", 8_000, idle_s=300))],
        {0: 8_000},
        ("old",),
    ),
    (
        "as many as needed, least recently used first",
        [gpu(resident("new", 8_000, idle_s=120), resident("old", 8_000, idle_s=900),
             resident("mid", 8_000, idle_s=300))],
        {0: 16_000},
        ("old", "mid"),
    ),
    (
        "never asked: by its start time",
        [gpu(resident("asked", 8_000, idle_s=300),
             resident("never", 8_000, last_request_at=None, started_at=NOW - 7200),
             resident("spare", 8_000, idle_s=100))],
        {0: 8_000},
        ("never",),
    ),
    (
        "one that the room does not depend on is kept",
        # the oldest frees 2000, not enough; the next frees all that is needed on its own
        [gpu(resident("small", 2_000, idle_s=900), resident("big", 12_000, idle_s=500),
             resident("busy", 10_000, in_flight=1))],
        {0: 12_000},
        ("big",),
    ),
    (
        "a deployment on two GPUs frees both",
        [gpu(resident("wide", 10_000), resident("x", 14_000, pinned=True), index=0),
         gpu(resident("wide", 10_000), resident("y", 14_000, pinned=True), index=1)],
        {0: 10_000, 1: 10_000},
        ("wide",),
    ),
    (
        "pinned, busy, queued, starting and young ones are passed over",
        [gpu(resident("pinned", 4_000, idle_s=5000, pinned=True),
             resident("busy", 4_000, idle_s=4000, in_flight=2),
             resident("queued", 4_000, idle_s=3000, queued=1),
             resident("starting", 4_000, idle_s=2000, starting=True),
             resident("young", 4_000, last_request_at=None, started_at=NOW - 30),
             resident("idle", 4_000, idle_s=100))],
        {0: 4_000},
        ("idle",),
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("gpus", "need", "expected"), [c[1:] for c in CHOICES], ids=[c[0] for c in CHOICES]
)
def test_the_least_recently_used_idle_deployments_make_room(
    gpus: list[GpuFacts], need: dict[int, int], expected: tuple[str, ...]
) -> None:
    chosen = choose_eviction(gpus, need, now=NOW, min_residency_s=MIN_RESIDENCY_S)
    assert isinstance(chosen, Eviction), chosen
    assert chosen.deployment_ids == expected
    assert len(chosen.reasons) == len(expected)
    for deployment_id, line in zip(expected, chosen.reasons, strict=True):
        assert line.startswith(f"stop {deployment_id} (m-{deployment_id}): ")


REFUSALS: list[tuple[str, Resident, str]] = [
    ("pinned", resident("p", 20_000, pinned=True), "p: pinned"),
    ("in flight", resident("f", 20_000, in_flight=3), "f: 3 request(s) in flight"),
    ("queued", resident("q", 20_000, queued=1), "q: 1 request(s) queued"),
    ("starting", resident("s", 20_000, starting=True), "s: still starting"),
    (
        "younger than the minimum residency",
        resident("y", 20_000, started_at=NOW - 42, last_request_at=None),
        "y: resident 42s, under the minimum residency of 1m",
    ),
]


@pytest.mark.parametrize(
    ("holder", "kept"), [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS]
)
def test_a_deployment_that_may_not_be_stopped_is_never_chosen(holder: Resident, kept: str) -> None:
    refused = choose_eviction([gpu(holder)], {0: 10_000}, now=NOW, min_residency_s=MIN_RESIDENCY_S)
    assert isinstance(refused, EvictionRefusal)
    assert refused.kept == ((holder.deployment_id, kept.split(": ", 1)[1]),)
    assert refused.message == (
        f"stopping every idle deployment would not make room (GPU 0 is short of 5.86 GiB); "
        f"kept: {kept}"
    )


def test_when_even_every_idle_one_is_not_enough_it_refuses() -> None:
    gpus = [gpu(resident("a", 5_000), resident("b", 5_000), total_mb=12_000)]
    refused = choose_eviction(gpus, {0: 13_000}, now=NOW, min_residency_s=MIN_RESIDENCY_S)
    assert isinstance(refused, EvictionRefusal)
    assert refused.kept == ()
    assert "GPU 0 is short of 10.7 GiB" in refused.message  # 11,000 MiB, for people


def test_the_choice_is_pure_and_ties_go_by_start_then_id() -> None:
    twins = [resident("b", 10_000, idle_s=600), resident("a", 10_000, idle_s=600)]
    gpus = [gpu(*twins)]
    first = choose_eviction(gpus, {0: 8_000}, now=NOW, min_residency_s=MIN_RESIDENCY_S)
    assert first == choose_eviction(gpus, {0: 8_000}, now=NOW, min_residency_s=MIN_RESIDENCY_S)
    assert isinstance(first, Eviction) and first.deployment_ids == ("a",)
    older = [replace(twins[0], started_at=NOW - 7200), twins[1]]
    chosen = choose_eviction([gpu(*older)], {0: 8_000}, now=NOW, min_residency_s=MIN_RESIDENCY_S)
    assert isinstance(chosen, Eviction) and chosen.deployment_ids == ("b",)
