"""The prefix policy's choice: the longest cached prefix, within a bound on load (pure).

Given the candidates in the order the scorer ranked them (:mod:`berth.routing.scorer`:
health, affinity, in flight, p95, a rotating tie-break) and how many of the request's
prompt blocks each one holds (:mod:`berth.routing.prefix_index`), the request goes to the
candidate with the longest match unless that one is over the load bound; then to the next
best match within the bound, or, when none within it matches, to the least loaded (the
scorer's first within the bound).

The bound is consistent hashing with bounded loads' (CHWBL, Mirrokni, Thorup and Zadimoghaddam,
"Consistent Hashing with Bounded Loads", 2018): with ``n`` healthy candidates holding
``total`` requests in flight, a candidate may take the request while its own in flight plus
this one is at most ``ceil(c x (total + 1) / n)``, ``c`` the ``prefix_load_factor`` setting
(default 1.25). No candidate is ever more than that above the mean because of a shared
prefix, however much one system prompt dominates, and the least loaded is always within it
(for ``c >= 1``), so a choice always exists.

Candidates the scorer demoted (no signals from their node yet, a recent failed attempt) stay
after the others, in the scorer's order: a cached prefix does not make a failing engine
worth trying first. The order returned is the whole retry order: a retry goes to the next.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

#: ``prefix_load_factor``'s default: how far above the mean in flight a match may pull.
DEFAULT_LOAD_FACTOR = 1.25

#: ``matched``: the longest match took it; ``overridden_by_load``: the longest match was
#: over the bound, another took it; ``no_match``: no candidate holds the prefix.
PrefixOutcome = Literal["matched", "overridden_by_load", "no_match"]
OUTCOMES: tuple[PrefixOutcome, ...] = ("matched", "overridden_by_load", "no_match")


@dataclass(frozen=True)
class PrefixCandidate:
    """One candidate as the policy sees it: its requests in flight, the prompt blocks it
    holds in a row from the first (``matched_blocks``), and whether the scorer demoted it."""

    deployment_id: str
    in_flight: int
    matched_blocks: int = 0
    demoted: bool = False


@dataclass(frozen=True)
class PrefixChoice:
    """The policy's answer.

    ``order``: deployment ids, best first (the retry order); ``chosen``: the first;
    ``matched_blocks``: the chosen one's match; ``longest_blocks``: the longest match among
    the candidates (longer than ``matched_blocks`` only when the bound overrode it);
    ``bound``: the in flight (this request included) a candidate may reach; ``reason``: why
    the chosen one, in words (for ``berth routing``).
    """

    order: tuple[str, ...]
    outcome: PrefixOutcome
    matched_blocks: int
    longest_blocks: int
    bound: int
    reason: str

    @property
    def chosen(self) -> str:
        return self.order[0]


def load_bound(loads: Sequence[int], load_factor: float) -> int:
    """The most requests in flight, this one included, a candidate may have: ``ceil(c x
    (total + 1) / n)`` over ``loads`` (one per candidate). Raises ``ValueError`` for no
    loads or a factor under 1 (the least loaded would then be over it)."""
    if not loads:
        raise ValueError("load_bound needs at least one candidate")
    if load_factor < 1:
        raise ValueError(f"the prefix load factor must be at least 1, got {load_factor}")
    # The epsilon keeps c x mean that is a whole number from rounding up on float error.
    return math.ceil(load_factor * (sum(loads) + 1) / len(loads) - 1e-9)


def choose(
    candidates: Sequence[PrefixCandidate], load_factor: float = DEFAULT_LOAD_FACTOR
) -> PrefixChoice:
    """Order ``candidates`` (given in the scorer's order) for a request (see the module
    docstring). Raises ``ValueError`` for no candidates or a factor under 1."""
    if not candidates:
        raise ValueError("choose needs at least one candidate")
    healthy = [c for c in candidates if not c.demoted] or list(candidates)
    rest = [c for c in candidates if c not in healthy]
    bound = load_bound([c.in_flight for c in healthy], load_factor)
    within = [c for c in healthy if c.in_flight + 1 <= bound]
    over = [c for c in healthy if c.in_flight + 1 > bound]
    # Stable sorts: equal matches (or loads) keep the scorer's order.
    within.sort(key=lambda c: -c.matched_blocks)
    over.sort(key=lambda c: (c.in_flight, -c.matched_blocks))
    ordered = within + over + rest
    first = ordered[0]
    longest = max(c.matched_blocks for c in healthy)
    if longest == 0:
        outcome: PrefixOutcome = "no_match"
        reason = "no deployment holds a prefix of this prompt: least loaded"
    elif first.matched_blocks == longest:
        outcome = "matched"
        reason = f"longest cached prefix ({longest} blocks), within the load bound of {bound}"
    else:
        busy = next(c for c in over if c.matched_blocks == longest)
        outcome = "overridden_by_load"
        reason = (
            f"{busy.deployment_id} holds the longest prefix ({longest} blocks) but would "
            f"have {busy.in_flight + 1} in flight with this request, over the bound of {bound} "
            f"({load_factor:g} x the mean); "
            + (
                f"next best match ({first.matched_blocks} blocks)"
                if first.matched_blocks
                else "least loaded"
            )
        )
    return PrefixChoice(
        order=tuple(c.deployment_id for c in ordered),
        outcome=outcome,
        matched_blocks=first.matched_blocks,
        longest_blocks=longest,
        bound=bound,
        reason=reason,
    )
