"""The ``berth`` command line: one typer app, one module per command group."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from berth import __version__
from berth.cli import (
    adapters_cmd,
    agent_cmd,
    backup_cmd,
    bootstrap_cmd,
    ca_cmd,
    config_cmd,
    daemon_cmd,
    demo,
    deploy_cmd,
    desk_cmd,
    doctor_cmd,
    keys_cmd,
    leader_cmd,
    models_cmd,
    nodes_cmd,
    plan_cmd,
    route_cmd,
    routing_cmd,
    service_cmd,
    usage_cmd,
)
from berth.cli.common import HELP_OPTIONS, CliContext, err_console
from berth.errors import BerthError
from berth.paths import BerthHome, resolve_home

app = typer.Typer(
    context_settings=HELP_OPTIONS,
    name="berth",
    help="berth: one OpenAI-compatible endpoint in front of the engines on your GPU hosts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        print(f"berth {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    home: Path | None = typer.Option(
        None, "--home", help="berth's state folder (default: $BERTH_HOME, else ~/.berth)."
    ),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    ctx.obj = CliContext(BerthHome(resolve_home(home)))


app.add_typer(daemon_cmd.daemon_app, name="daemon")
app.add_typer(models_cmd.models_app, name="models")
app.add_typer(adapters_cmd.adapters_app, name="adapters")
app.add_typer(keys_cmd.key_app, name="key")
app.command("usage")(usage_cmd.usage)
app.add_typer(config_cmd.config_app, name="config")
app.add_typer(nodes_cmd.nodes_app, name="nodes")
app.add_typer(ca_cmd.ca_app, name="ca")
app.add_typer(agent_cmd.app, name="agent")
app.add_typer(backup_cmd.backup_app, name="backup")
app.add_typer(bootstrap_cmd.deploy_app, name="deploy")
app.add_typer(service_cmd.service_app, name="service")
app.add_typer(route_cmd.route_app, name="route")
app.add_typer(desk_cmd.desk_app, name="desk")
app.add_typer(leader_cmd.leader_app, name="leader")
app.command("status")(daemon_cmd.status)
app.command("pull")(models_cmd.pull)
app.command("run")(deploy_cmd.run)
app.command("ps")(deploy_cmd.ps)
app.command("stop")(deploy_cmd.stop)
app.command("logs")(deploy_cmd.logs)
app.command("demo")(demo.demo)
app.command("routing")(routing_cmd.routing)
app.command("plan")(plan_cmd.plan)
app.command("doctor")(doctor_cmd.doctor)


def main() -> None:
    """Entry point: run the app; a ``BerthError`` becomes one line on stderr and an exit code."""
    try:
        app()
    except BerthError as exc:
        message = str(exc)
        err_console.print("[bold red]error:[/] ", end="", markup=True)
        err_console.print(message, markup=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
