"""``berth config show``."""

from __future__ import annotations

import typer
from rich.table import Table

from berth.cli.common import HELP_OPTIONS, console, context, print_json
from berth.config import Settings

config_app = typer.Typer(
    context_settings=HELP_OPTIONS, help="Inspect berth's settings.", no_args_is_help=True
)


@config_app.command("show")
def show(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """Every setting, its value and where it came from (flag, env, file, autodetect, default)."""
    home = context(ctx).home
    settings = Settings.load(home)
    if as_json:
        print_json(settings.as_json())
        return
    console.print(f"config file: {home.config_file}")
    table = Table("SETTING", "VALUE", "SOURCE")
    for row in settings.rows():
        table.add_row(row.name, row.value, row.source)
    console.print(table)
