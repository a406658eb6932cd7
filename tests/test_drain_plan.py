"""The drain's pure decisions (``berth.placement.drain``): what it does next about each
deployment on a draining node, and why."""

from __future__ import annotations

import pytest

from berth.placement.drain import (
    Action,
    OnNode,
    Replacement,
    after_refusal,
    drain_summary,
    next_action,
    plan_drain,
)
from berth.vocab.drains import DrainMove, MoveStep, NodeDrain
from berth.vocab.states import DeploymentState as S

NOW = 1000.0
GRACE_S = 60.0


def move(step: MoveStep, *, replacement: str | None = None, retired_at: float | None = None,
         note: str | None = None, at: float = NOW - 1) -> DrainMove:  # fmt: skip
    return DrainMove("d-old", "n-a", step, replacement, retired_at, note, at)


def on(state: S = S.READY, *, in_flight: int = 0, service: str | None = "s",
       pinned_to: str | None = None, deployment_id: str = "d-old",
       ready_elsewhere: int = 1) -> OnNode:  # fmt: skip
    return OnNode(deployment_id, "s", state, service, pinned_to, in_flight, ready_elsewhere)


def act(deployment: OnNode, found: DrainMove | None, replacement: Replacement | None = None,
        *, force: bool = False) -> Action:  # fmt: skip
    return next_action(deployment, found, replacement, node_label="gpu-a", force=force,
                       grace_s=GRACE_S, now=NOW, settle_s=2.0, retry_s=30.0,
                       again_s=10.0)  # fmt: skip


@pytest.mark.parametrize(
    ("deployment", "found", "replacement", "kind", "reason"),
    [
        (on(S.STOPPED), move("retired"), None, "done", "stopped"),
        (on(S.STOPPING), move("retired"), None, "wait", "stopping"),
        (on(), None, None, "replace", "a replacement is started elsewhere first"),
        (on(S.CRASHLOOP), None, None, "replace", "a replacement is started elsewhere first"),
        (on(), move("replacing", replacement="d-new"), Replacement("d-new", S.LOADING),
         "wait", "its replacement d-new is loading"),
        (on(), move("replacing", replacement="d-new"), Replacement("d-new", S.READY),
         "retire", "its replacement d-new is ready"),
        (on(), move("replacing", replacement="d-new"),
         Replacement("d-new", S.FAILED, "engine exited"),
         "wait", "its replacement d-new failed: engine exited; another is started in 9s"),
        (on(), move("replacing", replacement="d-new", at=NOW - 11), Replacement("d-new", None),
         "replace", "its replacement d-new is gone; another is started"),
        (on(in_flight=2), move("retired", replacement="d-new", retired_at=NOW - 10),
         Replacement("d-new", S.READY), "wait",
         "2 request(s) in flight; stopped when they finish, at the latest in 50s"),
        (on(in_flight=0), move("retired", replacement="d-new", retired_at=NOW - 10),
         Replacement("d-new", S.READY), "stop",
         "its requests in flight finished (retired 10s ago)"),
        (on(in_flight=0), move("retired", replacement="d-new", retired_at=NOW - 1),
         Replacement("d-new", S.READY), "wait",
         "0 request(s) in flight; stopped when they finish, at the latest in 59s"),
        (on(in_flight=3), move("retired", replacement="d-new", retired_at=NOW - 61),
         Replacement("d-new", S.READY), "stop",
         "the grace of 1m ran out with 3 request(s) in flight"),
        (on(in_flight=3), move("retired", replacement="d-new", retired_at=NOW - 5),
         Replacement("d-new", S.RESTARTING), "replace",
         "its replacement d-new is restarting: it serves again"),
        (on(), move("stopped"), None, "stop", "its stop did not finish: stopping it again"),
        (on(), move("left", note="fits nowhere else: x", at=NOW - 5), None,
         "leave", "fits nowhere else: x"),
        (on(), move("left", note="fits nowhere else: x", at=NOW - 31), None,
         "replace", "tried again (fits nowhere else: x)"),
        (on(pinned_to="gpu-a"), None, None, "leave",
         "pinned: service s runs only on node gpu-a; left running (--force stops it)"),
        (on(pinned_to="gpu-a"), move("left", note="pinned", at=NOW - 100), None, "leave",
         "pinned"),
        (on(pinned_to="gpu-b"), None, None, "replace",
         "a replacement is started elsewhere first"),
        (on(service=None, pinned_to=None), None, None, "replace",
         "a replacement is started elsewhere first"),
    ],
)  # fmt: skip
def test_each_step_has_its_next_action_and_reason(
    deployment: OnNode,
    found: DrainMove | None,
    replacement: Replacement | None,
    kind: str,
    reason: str,
) -> None:
    action = act(deployment, found, replacement)
    assert (action.kind, action.reason) == (kind, reason)


def test_force_stops_what_cannot_move_instead_of_leaving_it() -> None:
    pinned = act(on(pinned_to="gpu-a"), None, force=True)
    assert pinned.kind == "stop"
    assert pinned.reason == "pinned: service s runs only on node gpu-a; stopped anyway (--force)"
    failed = act(on(), move("replacing", replacement="d-new"), Replacement("d-new", None),
                 force=True)  # fmt: skip
    assert failed.kind == "stop" and failed.reason.endswith("stopped anyway (--force)")
    assert after_refusal("d-1", "no GPU can take model m", force=False) == Action(
        "leave", "d-1", "fits nowhere else: no GPU can take model m"
    )
    assert after_refusal("d-1", "no GPU", force=True).kind == "stop"


def drain(*moves: DrainMove, finished: bool = False, force: bool = False) -> NodeDrain:
    return NodeDrain("n-a", NOW - 100, NOW - 50, GRACE_S, force,
                     NOW - 1 if finished else None, tuple(moves))  # fmt: skip


def test_one_replacement_at_a_time_the_least_covered_first() -> None:
    covered = on(deployment_id="d-2", ready_elsewhere=3)
    alone = on(deployment_id="d-1", ready_elsewhere=0)
    plan = plan_drain(drain(), "gpu-a", [covered, alone], {}, now=NOW)
    assert [(a.deployment_id, a.kind) for a in plan.actions] == [("d-1", "replace"),
                                                                  ("d-2", "wait")]  # fmt: skip
    assert plan.actions[1].reason == "waits its turn: one replacement at a time"
    assert not plan.finished
    # while d-1's replacement loads, d-2 waits for it
    loading = DrainMove("d-1", "n-a", "replacing", "d-9", None, None, NOW - 1)
    plan = plan_drain(drain(loading), "gpu-a", [covered, alone],
                      {"d-9": Replacement("d-9", S.LOADING)}, now=NOW)  # fmt: skip
    assert plan.actions[1] == Action(
        "wait", "d-2", "waits its turn: the replacement of d-1 (d-9) is starting first"
    )


def test_a_drain_finishes_when_only_what_it_left_remains() -> None:
    gone = DrainMove("d-1", "n-a", "stopped", "d-9", NOW - 20, None, NOW - 10)
    left = DrainMove("d-2", "n-a", "left", None, None, "pinned", NOW - 10)
    plan = plan_drain(
        drain(gone, left),
        "gpu-a",
        [on(S.STOPPED, deployment_id="d-1"), on(deployment_id="d-2", pinned_to="gpu-a")],
        {},
        now=NOW,
    )
    assert [a.kind for a in plan.actions] == ["done", "leave"]
    assert plan.finished
    assert drain_summary(drain(gone, left), plan) == "draining: 1 of 2 moved, 1 left"
    assert drain_summary(drain(gone, left, finished=True), plan) == "drained; 1 left"
    assert drain_summary(drain(gone, finished=True)) == "drained"
    cordoned = NodeDrain("n-a", NOW, None, None, False, None)
    assert drain_summary(cordoned) == "cordoned"
