"""What a drain does next about each deployment on its node: pure decisions with reasons.

A drain (``berth nodes drain``) moves every deployment off a cordoned node, each the same
way: a replacement is started elsewhere first, and only once it is ready does the old one
stop getting requests (it is *retired*); it is stopped when its requests in flight have
finished, or when the grace runs out.  So a service never has fewer ready replicas than
before while it happens.  :func:`plan_drain` takes plain values (the deployments on the
node, each with its recorded move and its replacement's state, the requests in flight) and
returns one :class:`Action` per deployment, in the order they are looked at; the I/O half
(:mod:`berth.deployments.drain`) carries them out and writes each step to the store
(:mod:`berth.store.drains`), so a restarted leader picks up where the last one was.

The rules for one deployment, in the order they are looked at:

1. it has ended (stopped or failed): **done**;
2. it is stopping: **wait**;
3. its move was stopped but it still runs (the stop failed): **stop** it again;
4. it is **retired** (its replacement became ready): while its replacement is still ready,
   **stop** it once nothing is in flight on it (and it has been retired at least
   ``settle_s``, so a request routed just before it was retired has started) or once the
   grace ran out; else **wait**.  A replacement that is no longer ready sends it back to
   being replaced (it serves again meanwhile);
5. it is being **replaced**: the replacement loading or restarting: **wait**; ready:
   **retire** the old one; gone or failed (a failover cancels the starts in flight):
   **replace** it again once ``again_s`` have passed since that replacement was placed
   (**wait** until then), or with ``force`` **stop** it;
6. it was **left**: tried again ``retry_s`` after (not when it is pinned);
7. otherwise it has no move yet: **pinned** to this node (its service names the node:
   ``node_label``) it is **left**, with ``force`` **stopped**; else **replace** it.

One replacement is placed at a time per drain: a second **replace** waits while another
deployment of the node has its replacement loading.  The order: deployments whose served
name has the fewest other ready deployments come first (the ones a failure would hurt most
get their second copy soonest), then by id.  A refused placement (nothing fits elsewhere)
is :func:`after_refusal`'s: **leave** it, or with ``force`` **stop** it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from berth.humanize import duration
from berth.vocab.drains import DrainMove, NodeDrain
from berth.vocab.states import RESTARTING_STATES, TERMINAL_STATES, DeploymentState

#: Seconds a retired deployment is kept after it stopped getting requests, at least, before
#: "nothing in flight" counts (a request routed to it just before holds no slot yet).
SETTLE_S = 2.0
#: Seconds before a deployment left for want of room is tried again.
RETRY_S = 30.0
#: Seconds after a replacement was placed before another is, when it failed (a failover
#: cancels the starts in flight; an engine that cannot start is not started in a loop).
AGAIN_S = 10.0

_STARTING = frozenset({DeploymentState.PENDING, DeploymentState.LOADING})


@dataclass(frozen=True)
class OnNode:
    """A deployment on the draining node: its ``state``, the name it serves, the service it
    is a replica of (``None``: deployed on its own), the node label its service is pinned
    to (``pinned_to``: the service's ``node_label``, ``None``: placed by fit), requests
    ``in_flight`` on it now, and how many ready deployments of the same name run on
    other nodes (``ready_elsewhere``)."""

    deployment_id: str
    served_model_name: str
    state: DeploymentState
    service: str | None = None
    pinned_to: str | None = None
    in_flight: int = 0
    ready_elsewhere: int = 0


@dataclass(frozen=True)
class Replacement:
    """The replacement a move started: its id and state (``None``: its record is gone), and
    why it failed, if it did."""

    deployment_id: str
    state: DeploymentState | None
    failure_reason: str | None = None


ActionKind = Literal["done", "wait", "replace", "retire", "stop", "leave"]


@dataclass(frozen=True)
class Action:
    """What to do about ``deployment_id`` now; ``reason`` for people (``berth nodes show``).

    ``done``: nothing, it is gone; ``wait``: nothing yet; ``replace``: place a replacement
    elsewhere; ``retire``: its replacement ``replacement_id`` is ready, stop routing to it;
    ``stop``: stop it now; ``leave``: record that it stays (``reason`` says why).
    """

    kind: ActionKind
    deployment_id: str
    reason: str
    replacement_id: str | None = None


@dataclass(frozen=True)
class DrainPlan:
    """One look at a drain: an action per deployment on the node, in order, and whether the
    drain has finished (nothing on the node but deployments it left)."""

    actions: tuple[Action, ...]
    finished: bool


def plan_drain(
    drain: NodeDrain,
    node_label: str,
    deployments: Sequence[OnNode],
    replacements: Mapping[str, Replacement],
    *,
    now: float,
    settle_s: float = SETTLE_S,
    retry_s: float = RETRY_S,
    again_s: float = AGAIN_S,
) -> DrainPlan:
    """The next action for each deployment of ``deployments`` (every deployment on the node
    that has not ended, and those the drain has a move for) under ``drain``; see the
    module docstring.  ``replacements`` are the replacements' states by their id; ``now``
    is epoch seconds, like the moves' times."""
    grace_s = drain.grace_s if drain.grace_s is not None else 0.0
    ordered = sorted(deployments, key=lambda d: (d.ready_elsewhere, d.deployment_id))
    actions = [
        next_action(
            d,
            drain.move(d.deployment_id),
            _replacement_of(drain.move(d.deployment_id), replacements),
            node_label=node_label,
            force=drain.force,
            grace_s=grace_s,
            now=now,
            settle_s=settle_s,
            retry_s=retry_s,
            again_s=again_s,
        )
        for d in ordered
    ]
    loading = [
        a for a in actions if a.kind == "wait" and a.replacement_id is not None and
        _loading(replacements.get(a.replacement_id))
    ]  # fmt: skip
    if loading:
        first = loading[0]
        actions = [
            Action(
                "wait",
                a.deployment_id,
                f"waits its turn: the replacement of {first.deployment_id} "
                f"({first.replacement_id}) is starting first",
            )
            if a.kind == "replace"
            else a
            for a in actions
        ]
    else:
        seen_replace = False
        ordered_actions = []
        for a in actions:
            if a.kind == "replace" and seen_replace:
                a = Action("wait", a.deployment_id, "waits its turn: one replacement at a time")
            seen_replace = seen_replace or a.kind == "replace"
            ordered_actions.append(a)
        actions = ordered_actions
    finished = all(a.kind in ("done", "leave") for a in actions)
    return DrainPlan(tuple(actions), finished)


def next_action(
    deployment: OnNode,
    move: DrainMove | None,
    replacement: Replacement | None,
    *,
    node_label: str,
    force: bool,
    grace_s: float,
    now: float,
    settle_s: float = SETTLE_S,
    retry_s: float = RETRY_S,
    again_s: float = AGAIN_S,
) -> Action:
    """The next action for one deployment (rules 1-7 of the module docstring)."""
    d = deployment.deployment_id
    if deployment.state in TERMINAL_STATES:
        return Action("done", d, f"{deployment.state}")
    if deployment.state is DeploymentState.STOPPING:
        return Action("wait", d, "stopping")
    step = move.step if move is not None else None
    if step == "stopped":
        return Action("stop", d, "its stop did not finish: stopping it again")
    if step == "retired" and move is not None:
        return _retired(deployment, move, replacement, grace_s, now, settle_s)
    if step == "replacing" and replacement is not None and move is not None:
        return _replacing(deployment, move, replacement, force, now, again_s)
    if step == "left" and move is not None:
        if _pinned(deployment, node_label) is None and now - move.updated_at >= retry_s:
            return Action("replace", d, f"tried again ({move.note or 'left'})")
        return Action("leave", d, move.note or "left")
    pinned = _pinned(deployment, node_label)
    if pinned is not None:
        if force:
            return Action("stop", d, f"{pinned}; stopped anyway (--force)")
        return Action("leave", d, f"{pinned}; left running (--force stops it)")
    return Action("replace", d, "a replacement is started elsewhere first")


def after_refusal(deployment_id: str, message: str, *, force: bool) -> Action:
    """A replacement could not be placed (``message`` is placement's refusal): leave the
    deployment where it is, or with ``force`` stop it."""
    if force:
        return Action("stop", deployment_id, f"fits nowhere else ({message}); stopped anyway "
                      "(--force)")  # fmt: skip
    return Action("leave", deployment_id, f"fits nowhere else: {message}")


def drain_summary(drain: NodeDrain, plan: DrainPlan | None = None) -> str:
    """One line for ``berth nodes ls`` and the console: ``cordoned``, ``draining`` (not looked
    at yet), ``draining: 1 of 2 moved``, ``drained``, ``drained; 1 left``."""
    if drain.drain_started_at is None:
        return "cordoned"
    moves = drain.moves
    moved = sum(1 for m in moves if m.step == "stopped")
    left = sum(1 for m in moves if m.step == "left")
    if drain.finished_at is not None:
        return f"drained; {left} left" if left else "drained"
    total = len(plan.actions) if plan is not None else len(moves)
    total = max(total, moved + left)
    if total == 0:
        return "draining"  # asked for, not looked at yet
    text = f"draining: {moved} of {total} moved"
    return f"{text}, {left} left" if left else text


def _replacement_of(
    move: DrainMove | None, replacements: Mapping[str, Replacement]
) -> Replacement | None:
    if move is None or move.replacement_id is None:
        return None
    found = replacements.get(move.replacement_id)
    return found if found is not None else Replacement(move.replacement_id, None)


def _pinned(deployment: OnNode, node_label: str) -> str | None:
    """Why the deployment can run only here (its service names this node), else ``None``."""
    if deployment.service is not None and deployment.pinned_to == node_label:
        return f"pinned: service {deployment.service} runs only on node {node_label}"
    return None


def _replacing(
    deployment: OnNode,
    move: DrainMove,
    replacement: Replacement,
    force: bool,
    now: float,
    again_s: float,
) -> Action:
    d, r = deployment.deployment_id, replacement.deployment_id
    state = replacement.state
    if state is DeploymentState.READY:
        return Action("retire", d, f"its replacement {r} is ready", r)
    if state in _STARTING or state in RESTARTING_STATES:
        return Action("wait", d, f"its replacement {r} is {state}", r)
    why = f"its replacement {r} {_ended(replacement)}"
    if force:
        return Action("stop", d, f"{why}; stopped anyway (--force)")
    wait_s = again_s - (now - move.updated_at)
    if wait_s > 0:
        return Action("wait", d, f"{why}; another is started in {duration(round(wait_s))}")
    return Action("replace", d, f"{why}; another is started")


def _retired(
    deployment: OnNode,
    move: DrainMove,
    replacement: Replacement | None,
    grace_s: float,
    now: float,
    settle_s: float,
) -> Action:
    d = deployment.deployment_id
    if replacement is None or replacement.state is not DeploymentState.READY:
        gone = _ended(replacement) if replacement is not None else "is gone"
        name = replacement.deployment_id if replacement is not None else "its replacement"
        return Action("replace", d, f"its replacement {name} {gone}: it serves again")
    retired_at = move.retired_at if move.retired_at is not None else move.updated_at
    since = now - retired_at
    if deployment.in_flight == 0 and since >= settle_s:
        return Action(
            "stop", d, f"its requests in flight finished (retired {duration(round(since))} ago)"
        )
    if since >= grace_s:
        return Action("stop", d, f"the grace of {duration(round(grace_s))} ran out with "
                      f"{deployment.in_flight} request(s) in flight")  # fmt: skip
    left_s = max(0.0, grace_s - since)
    return Action("wait", d, f"{deployment.in_flight} request(s) in flight; stopped when they "
                  f"finish, at the latest in {duration(round(left_s))}")  # fmt: skip


def _ended(replacement: Replacement) -> str:
    if replacement.state is None:
        return "is gone"
    if replacement.failure_reason:
        return f"{replacement.state}: {replacement.failure_reason}"
    return f"is {replacement.state}"


def _loading(replacement: Replacement | None) -> bool:
    return replacement is not None and replacement.state in _STARTING
