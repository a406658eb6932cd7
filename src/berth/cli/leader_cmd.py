"""``berth leader status|step-down``: this leader's part in shared leadership (docs/ha.md)."""

from __future__ import annotations

import typer

from berth.cli.common import console, context, print_json
from berth.cli.context import HELP_OPTIONS
from berth.cli.leadership_lines import role_line, say_controller_when_stopped
from berth.errors import DaemonError

leader_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Shared leadership (leader_ha): this leader's role, and handing it over.",
    no_args_is_help=True,
)


@leader_app.command("status")
def leader_status(
    ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")
) -> None:
    """This leader's role (active or standby), the lease's epoch and the active's address.

    With this leader stopped and leadership shared, the controller as the database has it."""
    cli = context(ctx)
    try:
        with cli.client() as client:
            leader = client.leader()
    except DaemonError:
        say_controller_when_stopped(cli.home)
        raise
    if as_json:
        print_json(leader)
        return
    shared = "shared (leader_ha)" if leader.ha else "not shared (leader_ha is off)"
    console.print(
        f"{leader.role}, epoch {leader.epoch}, active {leader.active_address or 'none'}; "
        f"leadership {shared}; id {leader.id}; {role_line(leader)}",
        soft_wrap=True,
        markup=False,
    )


@leader_app.command("step-down")
def step_down(
    ctx: typer.Context,
    force: bool = typer.Option(
        False,
        "--force",
        help="Step down even when no other leader was seen within the lease: the cluster is "
        "then left with no active leader until one starts.",
    ),
) -> None:
    """Hand leadership over: this leader drains (/readyz 503 for drain_s while it serves on),
    the lease goes back (a standby takes new requests at its next look), this leader
    finishes what is in flight and exits (as berth daemon stop).

    Refused when no other leader noted itself in the database within the lease (the refusal
    says what it checked), unless --force.
    """
    with context(ctx).client() as client:
        accepted = client.step_down(force=force)
    if accepted.standbys:
        taker = f"a standby takes over ({', '.join(accepted.standbys)} seen within the lease)"
    else:
        taker = "no other leader was seen (--force): none is active until one starts"
    console.print(
        f"stepping down: {taker}; this leader finishes its requests and exits",
        soft_wrap=True,
        markup=False,
    )
