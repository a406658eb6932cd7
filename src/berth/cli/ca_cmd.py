"""``berth ca``: the cluster CA's status, its rotation and the old root's retirement."""

from __future__ import annotations

import time

import typer

from berth.api.ca import CaStatus, RetireIn
from berth.cli.common import console, context, print_json
from berth.cli.context import HELP_OPTIONS
from berth.humanize import age

ca_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Rotate the cluster CA: status, rotate, retire the old root.",
    no_args_is_help=True,
)


def _print(status: CaStatus) -> None:
    left = age(status.not_after - time.time())
    console.print(f"ca        {status.fingerprint} (valid {left} more)", soft_wrap=True)
    if status.previous_fingerprint is None:
        console.print("rotation  none under way")
    else:
        console.print(f"old root  {status.previous_fingerprint} (still trusted)", soft_wrap=True)
    if status.old_leaf_holders:
        console.print("nodes still on an old-CA certificate (they move at their next renewal):")
        for holder in status.old_leaf_holders:
            console.print(f"  {holder.label} ({holder.node_id})")
    elif status.rotating:
        console.print("every node holds a new-CA certificate: berth ca retire may go ahead")


@ca_app.command("status")
def status(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """The CA that issues certificates, the old root during a rotation, and the nodes
    whose certificate the old CA issued."""
    with context(ctx).client() as client:
        found = client.ca_status()
    if as_json:
        print_json(found)
        return
    _print(found)


@ca_app.command("rotate")
def rotate(ctx: typer.Context) -> None:
    """Make a new CA: new certificates come from it, agents get its root at their next
    renewal (the old root stays trusted until `berth ca retire`)."""
    with context(ctx).client() as client:
        _print(client.rotate_ca())


@ca_app.command("retire")
def retire(
    ctx: typer.Context,
    force: bool = typer.Option(
        False, "--force", help="Retire even while nodes hold old-CA certificates."
    ),
) -> None:
    """Stop trusting the old root; refused while a node holds a certificate it issued."""
    with context(ctx).client() as client:
        _print(client.retire_ca(RetireIn(force=force)))
