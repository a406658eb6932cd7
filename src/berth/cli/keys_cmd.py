"""``berth key create|ls|revoke``."""

from __future__ import annotations

import typer
from rich.table import Table

from berth.api import KeyIn
from berth.cli.common import HELP_OPTIONS, console, context, print_json, request_body
from berth.keys import parse_tier, validate_key_name

key_app = typer.Typer(
    context_settings=HELP_OPTIONS, help="Create, list and revoke API keys.", no_args_is_help=True
)


@key_app.command("create")
def create(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="A label for the key."),
    tier: str = typer.Option("standard", "--tier", help="admin or standard."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Create a key; its secret is shown once and never stored."""
    parse_tier(tier)  # refuse an unknown tier or an unsafe name before asking the daemon
    validate_key_name(name)
    with context(ctx).client() as client:
        record = client.create_key(request_body(KeyIn, name=name, tier=tier))
    if as_json:
        print_json(record)
        return
    console.print(f"created {record.tier} key {record.id} ({record.name})")
    console.print("secret (shown once, store it now):")
    print(record.secret)


@key_app.command("ls")
def ls(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """List keys (prefixes only; secrets are never stored)."""
    with context(ctx).client() as client:
        records = client.keys()
    if as_json:
        print_json(records)
        return
    table = Table("ID", "NAME", "TIER", "PREFIX", "CREATED", "REVOKED")
    for r in records:
        table.add_row(
            r.id,
            r.name,
            r.tier,
            r.prefix,
            r.created_at.isoformat()[:19],
            r.revoked_at.isoformat()[:19] if r.revoked_at else "",
        )
    console.print(table)


@key_app.command("revoke")
def revoke(ctx: typer.Context, key_id: str = typer.Argument(...)) -> None:
    """Revoke a key at once."""
    with context(ctx).client() as client:
        client.revoke_key(key_id)
    console.print(f"revoked {key_id}")
