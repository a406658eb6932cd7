"""``berth leader status|step-down``: this leader's part in shared leadership (docs/ha.md)."""

from __future__ import annotations

import typer

from berth.cli.common import console, context, print_json
from berth.cli.context import HELP_OPTIONS

leader_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Shared leadership (leader_ha): this leader's role, and handing it over.",
    no_args_is_help=True,
)


@leader_app.command("status")
def leader_status(
    ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")
) -> None:
    """This leader's role (active or standby), the lease's epoch and the active's address."""
    with context(ctx).client() as client:
        leader = client.leader()
    if as_json:
        print_json(leader)
        return
    shared = "shared (leader_ha)" if leader.ha else "not shared (leader_ha is off)"
    console.print(
        f"{leader.role}, epoch {leader.epoch}, active {leader.active_address or 'none'}; "
        f"leadership {shared}; id {leader.id}",
        soft_wrap=True,
        markup=False,
    )


@leader_app.command("step-down")
def step_down(ctx: typer.Context) -> None:
    """Hand leadership over: the lease goes back at once (a standby takes new requests at its
    next look), this leader finishes what is in flight and exits (as berth daemon stop)."""
    with context(ctx).client() as client:
        client.step_down()
    console.print(
        "stepping down: a standby takes over; this leader finishes its requests and exits",
        markup=False,
    )
